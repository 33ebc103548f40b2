"""Tensor and sequence parallelism from the plan's per-parameter placements (Megatron-style blocks).

What the runtime realizes, per module:
- a Linear whose weight is S(0) over tp is column parallel, S(1) row parallel, R replicated;
- an Embedding whose weight is S(0) is vocabulary parallel (its output all-reduced, or
  reduce-scattered over the sequence under sp), S(1) splits the hidden size, R is replicated;
- a module whose direct Linear children are column and row parallel is a tensor-parallel block:
  its input is made a DTensor once, so the backward all-reduce (Megatron's f) happens once per block,
  not once per column-parallel projection;
- under sp, norms (every other module owning weights) run on sequence shards with replicated
  weights, and a block's input is all-gathered on entry;
- the head (the last column-parallel Linear whose output leaves the model) keeps logits sharded
  over the vocabulary, and the loss runs under `loss_parallel`.
`check_tp_placements` says which plans this cannot realize; the searcher asks it first.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel, parallelize_module

from autopar.capabilities import RUNTIME_CAPABILITIES, Capabilities, TpBlock, TpRules
from autopar.errors import AutoparError
from autopar.plan_schema import parse_placements
from autopar.runtime.tensor_parallel.autocast import (LowPrecisionInput, LowPrecisionPartialOutput, ProjectionsOnly,
                                                      autocast_dtype, block_inputs_checked)
from autopar.runtime.tensor_parallel.regather import KeepShard


def tp_placement(plan_placement: str) -> str:
    """The tp-axis part of a plan placement over (dp, tp): "RS(0)" -> "S(0)"."""
    kind, dim = parse_placements(plan_placement)[-1]
    return kind if dim is None else f"{kind}({dim})"


def default_head_path(model: nn.Module) -> str | None:
    """The Linear that produces the logits: the last Linear in module order."""
    linears = [path for path, module in model.named_modules() if isinstance(module, nn.Linear)]
    return linears[-1] if linears else None


def static_capabilities(model: nn.Module) -> Capabilities:
    """The runtime's capability table for `model` as the module rules decide it, without dry runs: the
    placement check bound to it, and what it cannot run at all (`realization.capabilities_for` adds
    the dry runs)."""
    from autopar.runtime.pipeline.schedule import pipeline_refusal

    return dataclasses.replace(RUNTIME_CAPABILITIES,
                               check_placements=lambda placements: check_tp_placements(model, placements, sp=False),
                               tensor_parallel_refusal=tensor_parallel_refusal(model),
                               sequence_parallel_refusal=sequence_parallel_refusal(model),
                               pipeline_refusal=pipeline_refusal(model),
                               tp_rules=tp_rules(model))


def plan_refusal(model: nn.Module, plan) -> str | None:
    """Why this runtime cannot run `plan` on `model` (checked before any collective), or None.

    The module rules' static refusal (a 2-D weight outside nn.Linear and nn.Embedding) stands for
    placements not known yet; a plan names its own, so it is checked on those instead: such a weight
    kept replicated runs (a position table added to the stream). A plan realizing tp with DTensor
    was dry-run by the search for this model, and runs without sequence parallelism and pipeline
    stages."""
    s = plan.strategy
    table = static_capabilities(model)
    if s.tp > 1:
        table = dataclasses.replace(table, tensor_parallel_refusal=None)
        if plan.tp_realization == "dtensor":
            if s.sp or s.pp > 1:
                return ("the dtensor realization of tensor parallelism runs without sequence parallelism and "
                        "pipeline stages")
        else:
            placements = {name: tp_placement(text) for name, text in plan.param_placements.items()}
            reason = check_tp_placements(model, placements, s.sp)
            if reason is not None:
                return reason
    return table.supports(s)


def tp_rules(model: nn.Module) -> TpRules:
    """What `check_tp_placements` (sp=False, as ILP placements run) accepts, as data for the searcher.

    Read as `_styles` reads the model: Linear weights R, S(0) or S(1) as their block allows (the
    head R or S(0)), biases following their weight, Embedding weights R, S(0) or S(1), anything
    else R. A block's direct Linear children (head excluded) run column-parallel inputs first and
    row-parallel outputs last: the last registered is taken as the block's output projection (as
    q/k/v/o and fc1/fc2 are registered), so one split per block is offered; a Linear alone in its
    module cannot form a block and stays R.
    """
    head = default_head_path(model)
    blocks, roles = [], {}  # Linear path -> the placement its block gives it when sharded
    for path, module in model.named_modules():
        children = [child for child in _linear_children(path, module) if child != head]
        if len(children) >= 2:
            blocks.append(TpBlock(tuple(f"{c}.weight" for c in children[:-1]), (f"{children[-1]}.weight",)))
            roles.update({**{c: "S(0)" for c in children[:-1]}, children[-1]: "S(1)"})
    by_param: dict[int, tuple[str, ...]] = {}  # allowed placements, intersected over every module holding it
    bias_follows = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for attr, param in module._parameters.items():
            if param is None:
                continue
            if isinstance(module, nn.Linear) and attr in ("weight", "bias"):
                sharded = "S(0)" if path == head else roles.get(path)
                if attr == "bias":
                    sharded = "S(0)" if sharded == "S(0)" else None
                    bias_follows[prefix + attr] = prefix + "weight"
                allowed = ("R",) if sharded is None else ("R", sharded)
            elif isinstance(module, nn.Embedding) and attr == "weight":
                allowed = ("R", "S(0)", "S(1)")
            else:
                allowed = ("R",)
            known = by_param.get(id(param), allowed)
            by_param[id(param)] = tuple(p for p in known if p in allowed)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    allowed = {name: by_param.get(key, ("R",)) for key, names in aliases.items() for name in names}
    return TpRules(allowed=allowed, bias_follows=bias_follows, blocks=tuple(blocks),
                   tied=tuple(tuple(names) for names in aliases.values() if len(names) > 1))


def sequence_parallel_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot run sequence parallelism under the module rules, or None: a module with
    children that owns parameters itself (a bare position table or start token beside the embedding)
    reads them with the stream, whose sequence shards they would have to follow, which the rules do
    not arrange. A leaf module's own weights run on the shards (SequenceParallel): a norm's, or a
    table of exactly the sequence's length added to the stream (the dry run refuses other reads)."""
    for path, module in model.named_modules():
        own = _own_beside_children(module)
        if own:
            where = f"{path}.{own[0]}" if path else own[0]
            return (f"sequence parallelism does not run on this model: {where} is a parameter of "
                    f"{type(module).__name__}, beside its submodules, which the rules cannot give the stream's "
                    f"sequence shards (hold it in a module of its own, or keep sp=false)")
    return None


def _own_beside_children(module: nn.Module) -> list[str]:
    """The parameters a module owns beside children that hold parameters (not a tied alias of theirs);
    Linear and Embedding modules run as projections and lookups whatever they hold."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return []
    held = {id(p) for child in module.children() for p in child.parameters()}
    if not held:
        return []
    return [attr for attr, param in module._parameters.items() if param is not None and id(param) not in held]


def tensor_parallel_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot run tensor parallelism here, or None.

    The cost model shards every 2-D weight a matmul reads; the runtime shards only nn.Linear and
    nn.Embedding weights, so a module with another 2-D weight (e.g. GPT-2's Conv1D, whose weight is
    stored (in, out)) would be planned sharded but could not run so. This is the refusal while
    placements are unknown; known placements are checked as they are (`check_tp_placements`: such a
    weight kept replicated runs), by the dry runs and by `plan_refusal`.
    """
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        for attr, param in module._parameters.items():
            if param is not None and param.dim() == 2:
                return (f"the runtime shards only nn.Linear and nn.Embedding weights for tensor parallelism; "
                        f"{path + '.' if path else ''}{attr} belongs to a {type(module).__name__} (given an example "
                        f"input and the loss, capabilities_for dry-runs tensor parallelism through DTensor instead)")
    return None


def check_tp_placements(model: nn.Module, placements: dict[str, str], sp: bool) -> str | None:
    """None when every parameter's tp placement is one this runtime executes, else the first reason.

    `placements` maps parameter names (any alias of a tied weight) to their tp placement ("R",
    "S(0)", ...); names missing are replicated.
    """
    head = default_head_path(model)
    try:
        _styles(model, placements, sp, head_path=head)
        head_weight = _canonical_placements(model, placements).get(f"{head}.weight") if head else None
    except AutoparError as error:
        return str(error)
    if head_weight not in (None, "R", "S(0)"):
        # A row-parallel head would read its replicated input as a hidden shard (and the loss expects
        # logits whole or sharded over the vocabulary): it fails at the first step, so refuse it here.
        return (f"{head}.weight is {head_weight} over tp but the head ({head}) runs replicated (R) or "
                f"vocabulary-parallel (S(0)) only")
    return None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, placements: dict[str, str], sp: bool,
                          head_path: str | None, vocab_parallel_loss: bool = True, realization: str = "modules",
                          shard_layers: tuple[str, ...] | None = None) -> None:
    """Shard `model` in place over `tp_mesh`; `head_path` names the Linear producing the logits.

    With `vocab_parallel_loss` the logits stay sharded over the vocabulary (the loss must run under
    `loss_parallel`); without, they are all-gathered (pipeline stages pass plain tensors). Under sp
    with `vocab_parallel_loss`, the sequence-sharded residual stream stays DTensors, so a forward that
    reads its global shape (Hugging Face's positions and causal mask, from the embedding output)
    sees the whole sequence; stages hand on local shards instead.

    `realization="dtensor"` realizes the placements with DTensor through the model's forward instead
    (`runtime.tensor_parallel.dtensor`: no head, no blocks, no sp; logits sharded over the vocabulary stay so).

    `shard_layers` (`sp_inputs=regathered`): the layers (module paths) whose blocks keep their input's
    sequence shard for backward under sp and gather it again there (`runtime.tensor_parallel.regather`);
    None: every block keeps its gathered input.
    """
    if realization == "dtensor":
        from autopar.runtime.tensor_parallel.dtensor import apply_dtensor_tensor_parallel

        if sp:
            raise AutoparError("the dtensor realization of tensor parallelism runs without sequence parallelism: "
                               "re-run `autopar plan`")
        apply_dtensor_tensor_parallel(model, tp_mesh, placements, vocab_parallel_logits=vocab_parallel_loss)
        return
    styles = _styles(model, placements, sp, head_path=head_path, vocab_parallel_loss=vocab_parallel_loss,
                     shard_layers=shard_layers)
    tied = _tied_groups(model)
    if styles:
        parallelize_module(model, tp_mesh, styles)
    for names in tied:  # parallelize_module replaces parameters: re-tie the aliases to the first
        first_module, first_attr = _resolve(model, names[0])
        for other in names[1:]:
            module, attr = _resolve(model, other)
            setattr(module, attr, getattr(first_module, first_attr))


def _styles(model: nn.Module, placements: dict[str, str], sp: bool, head_path: str | None = None,
            vocab_parallel_loss: bool = True, shard_layers: tuple[str, ...] | None = None) -> dict:
    styles: dict = {}
    dtensor_stream = sp and vocab_parallel_loss  # see apply_tensor_parallel
    canonical = _canonical_placements(model, placements)
    kinds: dict[str, str] = {}  # module path -> "col" | "row" | "rep"
    for path, module in model.named_modules():
        if module is None:
            continue
        own = {attr: canonical.get(f"{path}.{attr}" if path else attr, "R")
               for attr, p in module._parameters.items() if p is not None}
        sharded = {attr: value for attr, value in own.items() if value != "R"}
        if isinstance(module, nn.Linear):
            weight = own.get("weight", "R")
            bias = own.get("bias")
            if weight == "R":
                _all_replicated(path, own)
                kinds[path] = "rep"
            elif weight == "S(0)":
                if bias not in (None, "S(0)"):
                    raise AutoparError(f"{path}.bias is {bias} but its column-parallel weight needs it S(0)")
                kinds[path] = "col"
                if path == head_path:
                    styles[path] = LowPrecisionInput(ColwiseParallel(
                        input_layouts=Shard(1) if sp else Replicate(),
                        output_layouts=Shard(-1) if vocab_parallel_loss else Replicate(),
                        use_local_output=not vocab_parallel_loss))
                else:
                    styles[path] = ColwiseParallel()
            elif weight == "S(1)":
                if bias not in (None, "R"):
                    raise AutoparError(f"{path}.bias is {bias} but a row-parallel Linear adds a replicated bias")
                kinds[path] = "row"
                styles[path] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate(),
                                               use_local_output=not dtensor_stream)
            else:
                raise AutoparError(f"{path}.weight placement {weight} over tp is not executable: use R, S(0) or S(1)")
        elif isinstance(module, nn.Embedding):
            weight = own.get("weight", "R")
            if weight == "S(0)":
                styles[path] = LowPrecisionPartialOutput(RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(_sequence_dim(path)) if sp else Replicate(),
                    use_local_output=not dtensor_stream))
            elif weight == "S(1)":
                if sp:
                    raise AutoparError(f"{path}: a hidden-sharded embedding (S(1)) with sequence parallelism is not "
                                       f"executable: shard it S(0) or keep it R")
                styles[path] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            elif weight != "R":
                raise AutoparError(f"{path}.weight placement {weight} over tp is not executable: use R, S(0) or S(1)")
        elif sharded:
            attr, value = next(iter(sharded.items()))
            raise AutoparError(f"{path}.{attr} is {value} over tp, but the runtime shards only Linear and "
                               f"Embedding parameters: keep it R")
        elif own and sp:
            # Norms (and any module with its own weights) run on sequence shards: their weights
            # become replicated DTensors, so their gradients are summed over tp. A module with children
            # (`sequence_parallel_refusal`) is refused before this.
            if _own_beside_children(module):
                raise AutoparError(sequence_parallel_refusal(model))
            # pipeline stages hand on local shards: a table added to the stream must give one back
            styles[path] = SequenceParallel(use_local_output=not dtensor_stream)
    for path, module in model.named_modules():
        children = _linear_children(path, module)
        child_kinds = {kinds.get(c) for c in children if c != head_path}
        if "col" in child_kinds or "row" in child_kinds:
            if child_kinds - {"col", "row"} or "col" not in child_kinds or "row" not in child_kinds:
                described = ", ".join(f"{c}={kinds.get(c)}" for c in children)
                raise AutoparError(
                    f"module {path!r} mixes tensor-parallel linears the runtime cannot chain ({described}): a block "
                    f"needs column-parallel inputs and a row-parallel output, or all replicated"
                )
            order = [kinds.get(c) for c in children if c != head_path]
            if order.index("row") < max(i for i, kind in enumerate(order) if kind == "col"):
                # Registration order stands for call order (true of q/k/v/o and fc1/fc2 blocks): a
                # row-parallel linear before a column-parallel one would run on a shard it never got.
                described = ", ".join(f"{c}={kinds.get(c)}" for c in children)
                raise AutoparError(
                    f"module {path!r} has a row-parallel linear before a column-parallel one ({described}): a block "
                    f"runs column-parallel inputs first and its row-parallel output last"
                )
            keep_shard = any(path == layer or path.startswith(f"{layer}.") for layer in shard_layers or ())
            columns = [c for c in children if kinds.get(c) == "col" and c != head_path]
            if len(columns) == 1 and _other_layers(module, children):
                # A residual block holding its MLP's two linears beside its norms (and attention): its own
                # input feeds those, so the one column-parallel linear's input is the block input instead
                # (the same tensor where the module's input feeds only that linear).
                styles[columns[0]] = _Chained(_BlockInput(sp, columns[0], keep_shard), styles[columns[0]])
            else:
                styles[path] = _BlockInput(sp, path, keep_shard)
    return styles


def _other_layers(module: nn.Module, linear_children: list[str]) -> list[str]:
    """A module's direct children with parameters that are not its Linear children (norms, attention)."""
    linears = {path.rpartition(".")[2] for path in linear_children}
    return [name for name, child in module.named_children()
            if name not in linears and any(True for _ in child.parameters())]


class _Chained(ParallelStyle):
    """Several styles on one module, applied in order (their input hooks run in that order)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            style.src_data_rank = self.src_data_rank
            module = style._apply(module, device_mesh)
        return module


class _BlockInput(ParallelStyle):
    """A block's activation input (first positional or `hidden_states`) becomes one replicated DTensor.

    Its backward is one all-reduce (or reduce-scatter under sp) of the summed gradients of all the
    block's column-parallel projections, as in Megatron-LM; other inputs (rope tables, masks) pass as they are.
    Under autocast it is cast to the low precision first (runtime/tensor_parallel/autocast.py), and only the block's
    linear projections may read it.
    """

    def __init__(self, sp: bool, path: str = "", keep_shard: bool = False) -> None:
        super().__init__()
        self.sp = sp
        self.path = path
        self.keep_shard = sp and keep_shard  # `runtime.tensor_parallel.regather`

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = Shard(1) if self.sp else Replicate()
        checks: list[ProjectionsOnly | None] = []  # one per forward running, entered before it, left after
        kept: list[KeepShard | None] = []  # likewise, under `keep_shard`

        def convert(x):
            low = autocast_dtype(x)
            if low is not None:
                x = x.to(low)
            shard = x  # as handed to the block (and cast): what `keep_shard` keeps
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (layout,), run_check=False)
            x = x.redistribute(device_mesh, (Replicate(),))
            if self.keep_shard:
                hooks = KeepShard(shard, x, device_mesh, dim=1) if torch.is_grad_enabled() else None
                if hooks is not None:
                    hooks.__enter__()
                kept.append(hooks)
            # Only the dry run checks (training and compiled blocks rely on the dry run the plan was searched
            # with), and only then is the stack touched: a compiled block under activation checkpointing
            # may not mutate state from outside the checkpoint (dynamo refuses and runs the block eagerly).
            if block_inputs_checked():
                check = ProjectionsOnly(x, self.path) if low is not None else None
                if check is not None:
                    check.__enter__()
                checks.append(check)
            return x

        def leave(_module, _args, _kwargs, _output):
            check = checks.pop() if checks and block_inputs_checked() else None
            if check is not None:
                check.__exit__(None, None, None)
            hooks = kept.pop() if kept else None
            if hooks is not None:
                hooks.__exit__(None, None, None)

        def hook(_module, args, kwargs):
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}
            raise AutoparError(f"tensor-parallel block {type(_module).__name__} got no positional or "
                               f"hidden_states input to shard")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)
        return module


def _linear_children(path: str, module: nn.Module) -> list[str]:
    """Paths of a module's direct Linear children in registration order (which stands for call order)."""
    return [f"{path}.{name}" if path else name for name, child in module.named_children()
            if isinstance(child, nn.Linear)]


def _sequence_dim(path: str) -> int:
    """Position tables are looked up by a 1-D index: their output's sequence dimension is 0."""
    return 0 if "pos" in path.rsplit(".", 1)[-1] else 1


def _all_replicated(path: str, own: dict[str, str]) -> None:
    for attr, value in own.items():
        if value != "R":
            raise AutoparError(f"{path}.{attr} is {value} over tp but {path} runs replicated: keep it R")


def _canonical_placements(model: nn.Module, placements: dict[str, str]) -> dict[str, str]:
    """Placements under every alias of a tied parameter, checked to agree."""
    by_param: dict[int, str] = {}
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    result: dict[str, str] = {}
    for key, aliases in names.items():
        given = {placements[n] for n in aliases if n in placements}
        if len(given) > 1:
            raise AutoparError(f"tied parameter {' = '.join(aliases)} has different placements {sorted(given)}")
        by_param[key] = given.pop() if given else "R"
        for alias in aliases:
            result[alias] = by_param[key]
    return result


def _tied_groups(model: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _resolve(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr
