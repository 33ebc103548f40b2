"""Pipeline stages cut wherever the plan's units sit, run by torch.distributed.pipelining schedules.

The model's forward is captured once at the micro-batch shape (`model_program`), with each module
the plan lists kept as one call, and cut into stages as the cost model cut its units
(`runtime.pipeline.split`). A stage is an `fx.GraphModule` that holds the model's own module objects under
their own paths (so parameter names, checkpoints and plan placements are the full model's, and
tensor parallelism, recompute and FSDP wrap them as they wrap the whole model) and runs the
captured code between them. Any model the capture handles can be cut, whatever nests its blocks
(`model.layers.N` inside a `LlamaModel`, an encoder and a decoder stack); what cannot be captured is
refused with the capture's reason before anything runs.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.plan_schema import MULTI_STAGE_SCHEDULES, Plan, stage_rank
from autopar.runtime.init import _strip_wrappers
from autopar.runtime.mesh import RankLayout
from autopar.runtime.model_program import ModelProgram, capture_program
from autopar.runtime.pipeline.split import ProgramSplit, StageGraph, split_program
from autopar.runtime.pipeline.zero_stage import ZeroPipelineStage

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             # the backward split into input- then weight-gradient passes (Qi et al., ICLR 2024)
             "interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
NON_LAYER_UNITS = ("pre", "post", "between.")


@dataclasses.dataclass
class PipelineCut:
    """The model cut into the plan's stages: the same on every rank (each builds all of it)."""

    program: ModelProgram
    split: ProgramSplit
    holdings: list[set[str]]  # per stage: the parameter names (as the stage names them) it holds

    def stage_module(self, reference: nn.Module, index: int, device: torch.device,
                     memo: dict | None = None) -> fx.GraphModule:
        """Stage `index` as a module holding copies of the reference's modules it runs. Stages built
        with one `memo` share the copies of what they share (a tied weight on one rank stays one)."""
        return _stage_module(reference, self.program, self.split.stages[index], device, memo)


def layer_paths(plan: Plan) -> set[str]:
    """The plan's layer units (instance paths); the other units are named "pre", "between.N", "post"."""
    return {unit for stage in plan.stages for unit in stage.units if not unit.startswith(NON_LAYER_UNITS)}


def kept_modules(plan: Plan) -> list[str]:
    """The modules the program calls as modules: layers, and the other listed modules (each owning
    weights of one unit) that contain no layer."""
    layers = layer_paths(plan)
    paths = [path for stage in plan.stages for path in stage.module_paths]
    return [p for p in dict.fromkeys(paths)
            if p in layers or not any(layer.startswith(p + ".") for layer in layers)]


def cut_pipeline(model: nn.Module, plan: Plan, example_inputs: tuple, loss_fn: Callable) -> PipelineCut:
    """Capture `model` at the micro-batch shape of `example_inputs` and cut it into the plan's stages."""
    if any(not stage.units for stage in plan.stages):
        raise AutoparError("the plan does not say which cost-model units each pipeline stage holds (made by an "
                           "older autopar): re-run `autopar plan`")
    example_inputs = _on_model_device(model, example_inputs)
    layers = layer_paths(plan)
    kept = kept_modules(plan)
    program = capture_program(model, example_inputs, {}, kept, optional={p for p in kept if p not in layers})
    if len(program.input_names) != len(example_inputs):
        raise AutoparError(f"pipeline stages feed the model its {len(example_inputs)} tensor input(s), the captured "
                           f"forward reads {len(program.input_names)}")
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    reads = _leaves_read_by(loss_fn, program, example_inputs)
    split = split_program(program, [list(stage.units) for stage in plan.stages], layers, names, reads)
    holdings = [_held_parameters(model, stage.graph) for stage in split.stages]
    _hold_unread_parameters(model, split.stages[0].graph, holdings[0], set().union(*holdings))
    return PipelineCut(program, split, holdings)


def _hold_unread_parameters(model: nn.Module, graph: fx.Graph, first: set[str], held: set[str]) -> None:
    """A parameter no op reads (a mask token kept for another task) still needs an owner for the
    optimizer, the gradient sync and checkpoints: the first stage holds it, as the cost model's first
    unit owns it. Its get_attr node has no users; the stage module keeps the attribute."""
    canonical: dict[int, str] = {}
    covered = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(param), name)
        if name in held:
            covered.add(id(param))
    unread = [name for key, name in canonical.items() if key not in covered]
    anchor = [node for node in graph.nodes if node.op == "placeholder"]
    for name in unread:
        if anchor:
            with graph.inserting_after(anchor[-1]):
                graph.get_attr(name)
        else:
            with graph.inserting_before(next(iter(graph.nodes))):
                graph.get_attr(name)
        first.add(name)


@dataclasses.dataclass(frozen=True)
class PipelineProbe:
    """What trying the cut on the model's inputs found: why it cannot be cut (or None), the settings
    its forward was captured under for training, and the output fields the loss does not read (which
    no stage carries)."""

    refusal: str | None
    training_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    dropped_outputs: tuple[str, ...] = ()


def probe_pipeline(model: nn.Module, example_inputs: tuple | None = None,
                   loss_fn: Callable | None = None) -> PipelineProbe:
    """Try the cut as stages need it (see `pipeline_refusal`); with `loss_fn`, also find the outputs
    it leaves unread."""
    if example_inputs is None:
        return PipelineProbe(None)
    blocks = repeated_blocks(model)
    if len(blocks) < 2:
        return PipelineProbe("the model has fewer than two repeated blocks to cut pipeline stages between")
    inputs = _on_model_device(model, example_inputs)
    try:
        program = capture_program(model, inputs, {}, blocks)
        read = _leaves_read_by(loss_fn, program, inputs) if loss_fn is not None else None
    except AutoparError as error:
        return PipelineProbe(str(error))
    dropped = () if read is None else tuple(path for index, path in enumerate(program.output_paths())
                                            if index not in read)
    return PipelineProbe(None, dict(program.training_settings), dropped)


def pipeline_refusal(model: nn.Module, example_inputs: tuple | None = None) -> str | None:
    """Why the model cannot be cut into pipeline stages, or None.

    With `example_inputs` (one micro-batch, any device, meta included) the forward is captured as
    stages need it, with every structurally repeated block kept as a call, so a refusal is the
    capture's own failure. Without them no attempt can be made here; `parallelize` attempts the
    cut before anything runs.
    """
    return probe_pipeline(model, example_inputs).refusal


def _on_model_device(model: nn.Module, example_inputs) -> tuple[torch.Tensor, ...]:
    """Inputs of the given shapes on the device the model's weights are on (only shapes are read:
    the capture runs on fake tensors)."""
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    return tuple(torch.zeros(x.shape, dtype=x.dtype, device=device) for x in inputs)


def repeated_blocks(model: nn.Module) -> list[str]:
    """The outermost children of one container that share a type and own parameters (a model's layers)."""
    for path, module in model.named_modules():
        children = [(f"{path}.{name}" if path else name, child) for name, child in module.named_children()
                    if any(True for _ in child.parameters())]
        kinds = {type(child) for _, child in children}
        if len(children) >= 2 and len(kinds) == 1:
            return [child_path for child_path, _ in children]
    return []


def _leaves_read_by(loss_fn: Callable, program: ModelProgram, example_inputs: tuple) -> set[int]:
    """Which output leaves `loss_fn(output, *inputs)` reads: traced on meta tensors of their shapes."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    leaves = list(output.args[0])
    metas = [_meta_like(leaf.meta.get("val")) if isinstance(leaf, fx.Node) else leaf for leaf in leaves]
    tensor_positions = [i for i, m in enumerate(metas) if isinstance(m, torch.Tensor)]
    inputs = [_meta_like(x) for x in example_inputs]

    def loss_of(*flat):
        values = list(metas)
        for position, value in zip(tensor_positions, flat):
            values[position] = value
        return loss_fn(pytree.tree_unflatten(values, program.out_spec), *flat[len(tensor_positions):])

    try:
        traced = make_fx(loss_of, tracing_mode="fake", _allow_non_fake_inputs=True)(
            *[metas[i] for i in tensor_positions], *inputs)
    except Exception as error:
        raise AutoparError(f"the loss cannot be traced on the model's output ({type(error).__name__}: {error})") \
            from error
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    return {tensor_positions[i] for i, node in enumerate(placeholders[:len(tensor_positions)]) if node.users}


def _meta_like(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def _held_parameters(model: nn.Module, graph: fx.Graph) -> set[str]:
    """Parameter names a stage holds: those of the modules it calls and those its own code reads."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    held = set()
    for node in graph.nodes:
        if node.op == "call_module":
            held.update(f"{node.target}.{name}" for name, _ in
                        model.get_submodule(node.target).named_parameters(remove_duplicate=False))
        elif node.op == "get_attr" and node.target in names:
            held.add(node.target)
    return held


def _stage_module(reference: nn.Module, program: ModelProgram, stage: StageGraph, device: torch.device,
                  memo: dict | None) -> fx.GraphModule:
    memo = {} if memo is None else memo
    graph = copy.deepcopy(stage.graph)
    _retarget_devices(graph, device)
    _contiguous_outputs(graph)
    _contiguous_input_gradients(graph)
    root: dict[str, Any] = {}
    constants: dict[str, torch.Tensor] = {}  # captured tensor constants: plain attributes, not the model's state
    non_persistent = []
    for node in graph.nodes:
        if node.op == "call_module":
            root[node.target] = copy.deepcopy(reference.get_submodule(node.target), memo)
        elif node.op == "get_attr" and node.target in program.attributes:
            captured = program.attributes[node.target]
            if isinstance(captured, torch.Tensor):
                root[node.target] = constants[node.target] = captured.to(device)
                continue
            captured = copy.deepcopy(captured)
            _retarget_devices(captured.graph, device)
            captured.recompile()
            root[node.target] = captured
        elif node.op == "get_attr":
            path, _, attr = node.target.rpartition(".")
            owner = reference.get_submodule(path) if path else reference
            root[node.target] = copy.deepcopy(getattr(owner, attr), memo)
            if attr in owner._non_persistent_buffers_set:
                non_persistent.append(node.target)
    module = fx.GraphModule(root, graph, class_name=f"PipelineStage{stage.index}")
    for name, value in constants.items():
        del module._buffers[name]
        setattr(module, name, value)
    for target in non_persistent:
        path, _, attr = target.rpartition(".")
        (module.get_submodule(path) if path else module)._non_persistent_buffers_set.add(attr)
    return module


def _contiguous_outputs(graph: fx.Graph) -> None:
    """Stage outputs leave contiguous: the schedule receives their gradients into buffers shaped
    (and strided) like them, and gloo sends and receives contiguous tensors only (a transposed
    activation crossing a cut would otherwise fail its first backward)."""
    output = next(node for node in graph.nodes if node.op == "output")

    def contiguous(value):
        if isinstance(value, fx.Node):
            with graph.inserting_before(output):
                made = graph.call_function(_contiguous_tensor, (value,))
            made.meta = dict(value.meta)
            return made
        return value

    output.args = fx.node.map_aggregate(output.args, contiguous)
    graph.lint()


def _contiguous_tensor(value):
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def _contiguous_input_gradients(graph: fx.Graph) -> None:
    """The gradients a stage sends back for its inputs leave contiguous too: autograd may hand back a
    transposed one (a key received before its transpose back), and the sender's layout is the
    receiver's buffer layout."""
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        users = list(node.users)
        with graph.inserting_after(node):
            wrapped = graph.call_function(_with_contiguous_gradient, (node,))
        wrapped.meta = dict(node.meta)
        for user in users:
            user.replace_input_with(node, wrapped)
    graph.lint()


class _ContiguousGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _with_contiguous_gradient(value):
    return _ContiguousGradient.apply(value) if isinstance(value, torch.Tensor) and value.requires_grad else value


def _retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    """Ops that create tensors were captured on the capture's device: make them on this rank's."""
    def swap(value):
        return device if isinstance(value, torch.device) else value

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)


class PipelineRunner:
    """This rank's stages under a schedule: every stage gets the micro-batch of model inputs (to
    recompute masks and positions), the first nothing else, the last the loss's target."""

    def __init__(self, schedule, input_names: list[str], is_last: bool,
                 average_once: tuple[nn.Parameter, ...] = (), num_microbatches: int = 1) -> None:
        self.schedule = schedule
        self.input_names = input_names
        self.is_last = is_last
        self.average_once = average_once  # see `build_schedule`
        self.num_microbatches = num_microbatches

    def step(self, local: torch.Tensor, losses: list) -> None:
        kwargs: dict[str, Any] = {self.input_names[0]: local}
        if self.is_last:
            kwargs.update(target=local, losses=losses)
        self.schedule.step(return_outputs=False, **kwargs)
        for param in self.average_once:
            if param.grad is not None:
                param.grad.div_(self.num_microbatches)


def build_schedule(cut: PipelineCut, stages: list[nn.Module], stage_indices: list[int], device: torch.device,
                   group: dist.ProcessGroup, schedule: str, num_microbatches: int, loss_fn,
                   scale_grads: bool = True, zero: int = 0) -> PipelineRunner:
    """`scale_grads=False`: the schedule leaves gradients summed over micro-batches (the caller averages).
    `zero` ≥ 2: stages sync and reshard their FSDP2 units per micro-batch as that ZeRO stage says."""
    num_stages = len(cut.split.stages)
    pipeline_stages = [ZeroPipelineStage(module, index, num_stages, device, group=group, zero=zero) if zero >= 2
                       else PipelineStage(module, index, num_stages, device, group=group)
                       for module, index in zip(stages, stage_indices)]
    last = cut.split.stages[-1]
    stage_loss = _loss_on_leaves(loss_fn, cut.program, last.output_slots)
    kind = SCHEDULES[schedule]
    # torch divides each stage's gradients by the micro-batch count, so a weight two of this rank's
    # stages share (zbv's V puts the tied embedding and head on rank 0) would be divided twice: the
    # runner then divides every weight once itself
    shared = _shared_between(stages)
    average_once = tuple({id(p): p for module in stages for p in module.parameters()}.values()) \
        if scale_grads and shared else ()
    scale_grads = scale_grads and not shared
    if schedule in MULTI_STAGE_SCHEDULES:
        runner = kind(pipeline_stages, n_microbatches=num_microbatches, loss_fn=stage_loss, scale_grads=scale_grads)
    else:
        if len(pipeline_stages) != 1:
            raise AutoparError(f"schedule {schedule} runs one stage per rank, the plan gives {len(pipeline_stages)}")
        runner = kind(pipeline_stages[0], n_microbatches=num_microbatches, loss_fn=stage_loss, scale_grads=scale_grads)
    return PipelineRunner(runner, cut.program.input_names, num_stages - 1 in stage_indices, average_once,
                          num_microbatches)


def retie_across_stages(modules: list[nn.Module], identities: list[dict[str, int]]) -> None:
    """Give every stage the first stage's parameter where they were built sharing one (`identities`:
    per module, name -> id of the object at build time): materializing each stage on its own gave
    each its own tensor, and a weight zbv's V puts twice on rank 0 (the tied embedding and head)
    must stay one, as in the model, to get both stages' gradients."""
    first: dict[int, nn.Parameter] = {}
    for module, built in zip(modules, identities):
        for name, key in built.items():
            param = module.get_parameter(name)
            if key not in first:
                first[key] = param
            elif param is not first[key]:
                path, _, attr = name.rpartition(".")
                setattr(module.get_submodule(path) if path else module, attr, first[key])


def _shared_between(stages: list[nn.Module]) -> bool:
    """Whether a parameter object sits in more than one of these stage modules."""
    seen: set[int] = set()
    for module in stages:
        mine = {id(p) for p in module.parameters()}
        if mine & seen:
            return True
        seen |= mine
    return False


def _loss_on_leaves(loss_fn: Callable, program: ModelProgram, slots: list[int]) -> Callable:
    """The user's loss on the model's own output type, rebuilt from the leaves the last stage returns."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    template = [None if isinstance(leaf, fx.Node) else leaf for leaf in output.args[0]]

    def stage_loss(returned, target):
        values = list(template)
        returned = returned if isinstance(returned, (tuple, list)) else (returned,)
        for slot, value in zip(slots, returned):
            values[slot] = value
        return loss_fn(pytree.tree_unflatten(values, program.out_spec), target)

    return stage_loss


def check_stage_cover(reference: nn.Module, cut: PipelineCut) -> None:
    """Every trainable parameter must live on some stage."""
    held = set().union(*cut.holdings)
    canonical: dict[int, str] = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(param), name)
    covered = {id(p) for name, p in reference.named_parameters(remove_duplicate=False) if name in held}
    missing = [name for key, name in canonical.items() if key not in covered]
    if missing:
        raise AutoparError(f"no pipeline stage runs the modules of parameters {missing[:3]}"
                           f"{' ...' if len(missing) > 3 else ''} (the forward does not read them): re-run "
                           f"`autopar plan`, or drop them from the model")


def tied_pp_ranks(reference: nn.Module, cut: PipelineCut, pp: int, schedule: str = "1f1b") -> dict[str, list[int]]:
    """Parameters held on more than one pipeline rank (under any of their names): canonical name -> those ranks."""
    canonical: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        names[name] = canonical.setdefault(id(param), name)
    ranks: dict[str, set[int]] = {}
    for index, held in enumerate(cut.holdings):
        for name in held:
            ranks.setdefault(names[name], set()).add(stage_rank(index, pp, schedule))
    return {name: sorted(found) for name, found in sorted(ranks.items()) if len(found) > 1}


def microbatch_inputs(plan: Plan, example_inputs: tuple | None) -> tuple[torch.Tensor, ...]:
    """The model's inputs at one micro-batch, on meta: from the caller, else as the plan records them."""
    rows = plan.strategy.microbatch
    if example_inputs is not None:
        inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        return tuple(torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device="meta") for x in inputs)
    if not plan.model_inputs:
        raise AutoparError("the plan does not record the model's inputs, which pipeline stages are cut for: "
                           "re-run `autopar plan`, or pass example_inputs to parallelize")
    return tuple(torch.empty((rows, *spec.shape), dtype=getattr(torch, spec.dtype), device="meta")
                 for spec in plan.model_inputs)


def tied_gradient_groups(model: nn.Module, cut: PipelineCut, layout: RankLayout, local: dict[str, nn.Parameter],
                         schedule: str = "1f1b") -> list[tuple[str, dist.ProcessGroup, list[int]]]:
    """Process groups summing the gradients of weights held on several pipeline ranks (a tied
    embedding and head, a module two stages call): one name per weight on this rank (of `local`)."""
    groups = []
    stage_size = layout.size("dp") * layout.size("tp")
    offset = layout.dp_rank * layout.size("tp") + layout.tp_rank
    first: dict[int, str] = {}
    canonical = {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    for name, pp_ranks in tied_pp_ranks(model, cut, layout.size("pp"), schedule).items():
        mine = None
        for position in range(stage_size):  # every rank creates every group, in the same order
            ranks = [r * stage_size + position for r in pp_ranks]
            group = dist.new_group(ranks)
            if position == offset and layout.pp_rank in pp_ranks:
                mine = group
        here = [n for n in local if canonical.get(_strip_wrappers(n)) == name]
        if mine is not None and here:
            groups.append((here[0], mine, pp_ranks))
    return groups
