"""Capture one training step (forward, loss, backward) as an ATen-level op graph on fake tensors.

How: `make_fx` traces a function that runs the model functionally on meta parameters and calls
`torch.autograd.grad`, so the graph holds forward and backward ops and no memory is allocated.
Module hooks tag forward ops with the module that issued them; prehooks on the autograd graph tag
each backward op with the module of the forward op it differentiates (matched by autograd
sequence number), which is what AOTAutograd does to carry module stacks into backward graphs.

Attention: on the meta device PyTorch would decompose `scaled_dot_product_attention` into the
math path (bmm + softmax, saving the T×T scores). GPUs run a fused kernel, so while tracing we
route it to the fused flash (no mask) or memory-efficient (with mask) ATen op, whose FLOP formulas
and saved tensors are what a GPU step really has (`autopar.graph.kernels`, which also puts in the
GPU's dropout and any-precision grouped GEMM).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import hashlib
import logging
from typing import Any, Callable

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call
from torch.utils._pytree import tree_flatten

from autopar.errors import CaptureError
from autopar.graph.attention import AttentionCall, AttentionRecorder
from autopar.graph.convert import convert_nodes, tensor_meta
from autopar.graph.ir import OpGraph, OpNode, ParamInfo, StepMemory, TensorMeta
from autopar.graph.kernels import GpuKernels
from autopar.graph.layers import detect_layer_types
from autopar.graph.moe import find_moe_layers
from autopar.graph.paddable import paddable_linears
from autopar.graph.repeats import TracedTwin, traced_twin

logger = logging.getLogger(__name__)
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def trace(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    precision: str = "fp32",
    name: str | None = None,
    seq_len: int | None = None,
    attention: str = "fused",
    expand_repeats: bool = True,
) -> OpGraph:
    """Trace `model` on `example_inputs` (a tensor, a tuple, or a dict of keyword inputs).

    `loss_fn(output, *inputs)` gives the scalar to differentiate; by default the mean of the
    model's first floating output. Parameters and inputs are replaced by meta tensors of the
    compute dtype of `precision`: the model itself is not modified and may live on any device.
    `attention="math"` keeps attention unfused (scores materialized), as software without a fused
    attention kernel runs it; the default is the fused kernel a GPU runs.
    `expand_repeats`: a deep stack of identical blocks is traced at a few blocks and expanded to its
    depth where that provably gives the full trace (`autopar.graph.repeats`); False traces every block.
    """
    return trace_with_twins(model, example_inputs, loss_fn=loss_fn, precision=precision, name=name, seq_len=seq_len,
                            attention=attention, expand_repeats=expand_repeats)[0]


def trace_with_twins(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    precision: str = "fp32",
    name: str | None = None,
    seq_len: int | None = None,
    attention: str = "fused",
    expand_repeats: bool = True,
) -> tuple[OpGraph, TwinGraphs | None]:
    """`trace`'s graph, and when it was expanded from a traced twin (`autopar.graph.repeats`), the
    graphs of the model's shallow twins (`TwinGraphs`) from that same twin, so that probes asked of
    them need no trace of their own; None when every block was traced."""
    if attention not in ("fused", "math"):
        raise CaptureError(f"unknown attention {attention!r}: use 'fused' or 'math'")
    if precision not in PRECISIONS:
        raise CaptureError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    name = name or type(model).__name__
    args, kwargs = _split_inputs(example_inputs)
    if not any(p.requires_grad for p in model.parameters()):
        raise CaptureError(f"model {name} has no trainable parameters: nothing to parallelize for training")

    def trace_step(module: nn.Module) -> StepTrace:
        return _trace_step(module, args, kwargs, loss_fn=loss_fn, dtype=dtype, name=name, attention=attention)

    with _gc_paused():
        twin = None
        if expand_repeats:
            twin, reason = traced_twin(model, trace_step, lambda module, traced: _graph(
                module, traced, precision=precision, dtype=dtype, name=name, seq_len=seq_len))
            if twin is None:
                logger.debug("tracing every block of %s: %s", name, reason)
        graph = _graph(model, twin.full if twin is not None else trace_step(model), precision=precision,
                       dtype=dtype, name=name, seq_len=seq_len)
    twins = TwinGraphs(model, twin, dict(precision=precision, dtype=dtype, name=name, seq_len=seq_len)) \
        if twin is not None else None
    return graph, twins


class TwinGraphs:
    """The graphs of `twin.shallow_twin(model, depth)`, each the capture's traced twin (blocks 0, 1 and
    N-1) expanded to `depth` blocks: what tracing the shallow twin gives, on the grounds the model's
    own graph stands on (its blocks trace alike, checked by `repeats.expanded_step`). `graph` answers
    None for a module that is not such a twin of `model` (then trace it)."""

    def __init__(self, model: nn.Module, traced: TracedTwin, options: dict[str, Any]) -> None:
        self.model, self.traced, self.options = model, traced, options

    def graph(self, twin: nn.Module) -> OpGraph | None:
        """`twin`'s graph when `twin` is `model` with its block stack cut to its first blocks, else None."""
        depth = _cut_depth(self.model, twin, self.traced.path)
        if depth is None or not 2 <= depth < self.traced.depth:
            return None
        return _graph(twin, self.traced.at_depth(depth), **self.options)


def _cut_depth(model: nn.Module, twin: nn.Module, path: str) -> int | None:
    """How many blocks `twin` keeps when it is `model` with the stack at `path` cut to its first ones
    (the same modules everywhere else), else None."""
    try:
        stack, short = model.get_submodule(path), twin.get_submodule(path)
    except AttributeError:
        return None
    blocks, kept = list(stack._modules.items()), list(short._modules.items())
    if type(short) is not type(stack) or kept != blocks[:len(kept)]:
        return None
    ours = {name: module for name, module in model.named_modules() if not _under(name, path)}
    theirs = {name: module for name, module in twin.named_modules() if not _under(name, path)}
    if ours.keys() != theirs.keys() or any(
            theirs[name] is not module and not _on_path(name, path) for name, module in ours.items()):
        return None
    return len(kept)


def _under(name: str, path: str) -> bool:
    return name.startswith(f"{path}.") if path else bool(name)


def _on_path(name: str, path: str) -> bool:
    """Whether module `name` is the stack at `path` or one of its ancestors (the twin copies those)."""
    return not name or path == name or path.startswith(f"{name}.")


@contextlib.contextmanager
def _gc_paused():
    """Tracing allocates hundreds of thousands of small objects (fx nodes, fake tensors, OpNodes), which
    set off Python's cyclic collector again and again over a heap that keeps growing: a third of the
    capture's time. Pausing it while tracing changes nothing traced; what is left is collected later."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclasses.dataclass
class StepTrace:
    """What tracing one training step yields; the rest of an OpGraph follows from the model."""

    nodes: list[OpNode]
    attention_calls: list[AttentionCall]
    inputs: list[TensorMeta]
    batch: int
    seq_len: int | None  # of the token-id input, if any


def _trace_step(model: nn.Module, args: tuple, kwargs: dict, *, loss_fn, dtype: torch.dtype, name: str,
                attention: str) -> StepTrace:
    params, _ = _meta_parameters(model, dtype)
    buffers = {n: _to_meta(b, dtype) for n, b in model.named_buffers()}
    meta_args = [_to_meta(a, dtype) if isinstance(a, torch.Tensor) else a for a in args]
    meta_kwargs = {k: _to_meta(v, dtype) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    trainable = [n for n, p in params.items() if p.requires_grad]

    tags = _ModuleTagger(model)
    attention_calls = AttentionRecorder(model, tags.current_path)
    param_names, buffer_names = list(params), list(buffers)
    tensor_arg_positions = [i for i, a in enumerate(meta_args) if isinstance(a, torch.Tensor)]
    # Keyword tensors are graph inputs too: closed over, they would stay meta, not fake, and fail.
    tensor_kwarg_keys = [k for k, v in meta_kwargs.items() if isinstance(v, torch.Tensor)]
    input_count = len(tensor_arg_positions)

    def step(*flat: torch.Tensor):
        p = dict(zip(param_names, flat[: len(param_names)]))
        b = dict(zip(buffer_names, flat[len(param_names): len(param_names) + len(buffer_names)]))
        inputs = flat[len(param_names) + len(buffer_names):]
        call_args, call_kwargs = list(meta_args), dict(meta_kwargs)
        for slot, value in zip(tensor_arg_positions, inputs[:input_count]):
            call_args[slot] = value
        call_kwargs.update(zip(tensor_kwarg_keys, inputs[input_count:]))
        with GpuKernels(attention, attention_calls):
            output = functional_call(model, (p, b), tuple(call_args), call_kwargs)
        tags.set_module("")
        loss = loss_fn(output, *call_args) if loss_fn is not None else _default_loss(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise CaptureError(f"the loss of {name} is not a scalar tensor: pass loss_fn returning one")
        tags.tag_backward(loss)
        grads = torch.autograd.grad(loss, [p[n] for n in trainable], allow_unused=True)
        return loss, [g for g in grads if g is not None]

    flat_inputs = (
        list(params.values()) + list(buffers.values())
        + [meta_args[i] for i in tensor_arg_positions] + [meta_kwargs[k] for k in tensor_kwarg_keys]
    )
    with tags, fx_traceback.preserve_node_meta(), quiet_fake_tensor_logs():
        try:
            # Tensors a model builds from data while tracing (torch.tensor([]) seeding a KV cache)
            # are plain meta tensors, not fake ones: accept them, they become graph constants.
            graph_module = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat_inputs)
        except CaptureError:
            raise
        except Exception as error:  # any failure inside user code or torch: name where it happened
            where = tags.current_path()
            owner = model.get_submodule(where) if where else model
            raise _in_model_code(CaptureError(_capture_failure(name, error, where, type(owner).__name__))) from error
    _refuse_data_dependent_shapes(graph_module.graph, model, name)

    placeholder_names = (
        [f"param:{n}" for n in param_names]
        + [f"buffer:{n}" for n in buffer_names]
        + [f"input:{i}" for i in tensor_arg_positions]
        + [f"input:{k}" for k in tensor_kwarg_keys]
    )
    return StepTrace(
        nodes=convert_nodes(graph_module.graph, placeholder_names, tags.module_for_seq),
        attention_calls=attention_calls.calls(),
        inputs=[tensor_meta(t) for t in flat_inputs[len(param_names) + len(buffer_names):]],
        batch=_batch_of(meta_args, meta_kwargs),
        seq_len=_seq_of(meta_args, meta_kwargs),
    )


def _graph(model: nn.Module, step: StepTrace, *, precision: str, dtype: torch.dtype, name: str,
           seq_len: int | None) -> OpGraph:
    """The OpGraph of `model` from its traced step: parameters, layer types, memory and MoE facts."""
    params, infos = _meta_parameters(model, dtype)
    seq = seq_len if seq_len is not None else step.seq_len
    return OpGraph(
        model_name=name,
        model_fingerprint=model_fingerprint(model),
        precision=precision,
        batch=step.batch,
        seq_len=seq,
        inputs=step.inputs,
        nodes=step.nodes,
        params=infos,
        layer_types=detect_layer_types(model, step.nodes),
        step_memory=_step_memory(params, dtype),
        torch_version=torch.__version__,
        moe_layers=find_moe_layers(model, seq),
        attention_calls=step.attention_calls,
        padded_linears=paddable_linears(model),
    )


def model_fingerprint(model: nn.Module) -> str:
    """Identity of a model's architecture: module classes, parameter names and shapes (not dtype)."""
    digest = hashlib.sha256()
    for path, module in model.named_modules():
        digest.update(f"{path}:{type(module).__qualname__};".encode())
    for path, param in model.named_parameters(remove_duplicate=False):
        digest.update(f"{path}:{tuple(param.shape)};".encode())
    return digest.hexdigest()[:16]


# --- tracing helpers ---------------------------------------------------------------------------
class _ModuleTagger:
    """Tags graph nodes with the module path that issued them, forward and backward."""

    def __init__(self, model: nn.Module) -> None:
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.stack: list[str] = []
        self.seq_marks: list[int] = []  # autograd sequence number at each module enter/exit
        self.seq_paths: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self) -> "_ModuleTagger":
        self.handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._exit),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        fx_traceback.current_meta.pop("custom", None)

    def current_path(self) -> str:
        return self.stack[-1] if self.stack else ""

    def set_module(self, path: str) -> None:
        self.seq_marks.append(torch.autograd._get_sequence_nr())
        self.seq_paths.append(path)
        fx_traceback.current_meta["custom"] = {"module": path}

    def _enter(self, module: nn.Module, args: Any) -> None:
        path = self.paths.get(id(module))
        if path is not None:
            self.stack.append(path)
            self.set_module(path)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.paths.get(id(module)) is not None and self.stack:
            self.stack.pop()
            self.set_module(self.current_path())

    def module_for_seq(self, seq: int) -> str:
        index = bisect.bisect_right(self.seq_marks, seq) - 1
        return self.seq_paths[index] if index >= 0 else ""

    def tag_backward(self, loss: torch.Tensor) -> None:
        """Before each grad_fn runs, tag the ops it emits with its forward op's module."""
        seen: set[int] = set()
        frontier = [loss.grad_fn]
        while frontier:
            fn = frontier.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            fn.register_prehook(self._backward_prehook(self.module_for_seq(fn._sequence_nr())))
            frontier.extend(next_fn for next_fn, _ in fn.next_functions)

    @staticmethod
    def _backward_prehook(path: str):
        def prehook(grad_outputs: Any) -> None:
            fx_traceback.current_meta["custom"] = {"module": path}

        return prehook


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise CaptureError(
        f"example inputs must be a tensor, a tuple of them or a dict of keyword inputs, got {type(example_inputs).__name__}"
    )


def _to_meta(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    target = dtype if tensor.is_floating_point() else tensor.dtype
    return torch.empty(tensor.shape, dtype=target, device="meta")


def _meta_parameters(model: nn.Module, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[ParamInfo]]:
    params: dict[str, torch.Tensor] = {}
    infos: dict[int, ParamInfo] = {}
    for path, param in model.named_parameters(remove_duplicate=False):
        if id(param) in infos:  # tied weight: one parameter, several names
            infos[id(param)].aliases.append(path)
            continue
        meta = _to_meta(param, dtype).requires_grad_(param.requires_grad)
        params[path] = meta
        infos[id(param)] = ParamInfo(
            name=path, shape=tuple(param.shape), dtype=str(meta.dtype).removeprefix("torch."),
            numel=param.numel(), module_path=path.rpartition(".")[0], trainable=param.requires_grad,
        )
    return params, list(infos.values())


def _default_loss(output: Any) -> torch.Tensor:
    if isinstance(output, dict) or hasattr(output, "keys"):  # dict or Hugging Face ModelOutput
        if output.get("loss") is not None:
            return output["loss"]
        output = list(output.values())
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            return leaf.float().mean()
    raise CaptureError("the model returned no floating tensor that depends on its parameters: pass loss_fn")


@contextlib.contextmanager
def quiet_fake_tensor_logs():
    """Fake-tensor kernels log a traceback before raising, even when the caller catches the error
    (DTensor trying a layout); capture and the tp dry run report their errors once, themselves.
    DTensor's warning that a CPU mesh runs a shard-to-shard all-to-all as all-gather + chunk is
    silenced too: the dry run's fake mesh is a CPU one whatever the target (its ledger records the
    all-gather gloo runs; on NCCL that redistribution is an all-to-all, not yet checked on a GPU)."""
    loggers = [logging.getLogger(name) for name in
               ("torch._subclasses.fake_tensor", "torch.distributed.tensor._collective_utils")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _refuse_data_dependent_shapes(graph: torch.fx.Graph, model: nn.Module, name: str) -> None:
    """A shape that depends on tensor values (`x[x > 0]`, `nonzero`) traces, but has no size to cost."""
    for node in graph.nodes:
        for value in tree_flatten(node.meta.get("val"))[0]:
            if isinstance(value, torch.Tensor) and not all(isinstance(s, int) for s in value.shape):
                where = (node.meta.get("custom") or {}).get("module", "")
                owner = model.get_submodule(where) if where else model
                error = DataDependentShape(f"the output shape of {node.target} depends on tensor values")
                raise _in_model_code(CaptureError(_capture_failure(name, error, where, type(owner).__name__)))


def _in_model_code(error: CaptureError) -> CaptureError:
    error.in_model_code = True
    return error


class DataDependentShape(Exception):
    """Named in the message, so the user reads what went wrong rather than a torch internal."""


def _capture_failure(name: str, error: Exception, path: str, class_name: str) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    detail = " ".join(lines[0].split()) if lines else ""  # torch appends pages of debugging advice
    if len(detail) > 300:
        detail = detail[:300] + "…"
    if isinstance(error, DataDependentShape) or "data-dependent" in detail:
        detail += (
            " (Python control flow or shapes that depend on tensor values, e.g. `if x.sum() > 0`, "
            ".tolist(), boolean-mask indexing, cannot be traced on shapes alone)"
        )
    where = f"in module '{path}' ({class_name}.forward)" if path else f"in {class_name}.forward (top level)"
    return f"cannot trace {name} {where}: {type(error).__name__}: {detail}"


def _batch_of(args: list, kwargs: dict) -> int:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def _seq_of(args: list, kwargs: dict) -> int | None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
            return int(value.shape[1])  # token ids: (batch, seq)
    return None


def _step_memory(params: dict[str, torch.Tensor], dtype: torch.dtype) -> StepMemory:
    """Adam with mixed precision holds fp32 master weights and two fp32 moments per trainable
    parameter: 12 bytes beyond the 2-byte weight and gradient (Rajbhandari et al., ZeRO, SC'20, §3.1).
    """
    element = torch.empty((), dtype=dtype).element_size()
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in params.values())
    master = 4 * trainable if dtype != torch.float32 else 0
    return StepMemory(
        param_bytes=total,
        grad_bytes=element * trainable,
        optimizer_state_bytes=8 * trainable + master,
        master_weight_bytes=master,
    )
