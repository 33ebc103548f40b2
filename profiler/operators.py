"""Time one operator signature on a real device: random inputs, warm-up, median of repeats.

Each graph node (forward or backward) is one ATen call, so each is timed by itself: no autograd.
Fused attention is the exception: it is timed through SDPA, forward and backward, so that the kernel
timed is the one SDPA picks on this device, which the runtime runs, not the one the trace names.
GPU times come from CUDA events around the launch; CPU times from `time.perf_counter`. Inputs are
random and never zero (zeros can hit fast paths real data never takes). A signature is skipped,
with its reason, when its tensors would not fit the device, when it runs out of memory anyway,
when its non-tensor arguments cannot be rebuilt, or when the device has no kernel for it.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from autopar.profiler.records import OpTiming
from autopar.profiler.signatures import OpSignature

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "uint64": torch.uint64, "bool": torch.bool,
}
# The CPU LayerNorm keeps mean and rstd in the input dtype where CUDA (and the IR) use float32.
_CPU_STATS_IN_INPUT_DTYPE = {"aten.native_layer_norm_backward.default": (2, 3)}
# Fused attention is timed as the runtime runs it: through SDPA, which picks the kernel for the
# device, dtype and shape. The trace names one kernel (flash, where tracing ran), while SDPA on the
# H200 under torch 2.11 runs cuDNN's, twice as fast in step (the af063d4 diagnosis: 25.2 ms a step
# against the flash ops' 50.4 ms in the op profile). Value: where q sits among the signature's inputs.
# Only the two kernels traces name (`autopar.graph.kernels`): their signatures record is_causal and
# the efficient kernel's bias; others would be timed without their mask.
_FUSED_ATTENTION = {
    packet + suffix: (1 if suffix else 0)
    for packet in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")
    for suffix in ("", "_backward")
}
# On a GPU, a short spin queued before a timed backward's start event: the host launches the
# backward while it runs, so its launch latency stays outside the time (the queue is otherwise
# drained once the untimed forward ends).
_LAUNCH_COVER_CYCLES = 200_000
FALLBACK_SCALAR = 2  # a required `Scalar` (mul.Scalar's factor, pow's exponent): its value does not change the work


class Unsynthesizable(Exception):
    """The signature's call cannot be rebuilt; the message is the skip reason."""


def resolve_op(name: str) -> Any:
    """"aten.mm.default" -> torch.ops.aten.mm.default."""
    parts = name.split(".")
    if len(parts) < 3:
        raise Unsynthesizable(f"not an op overload name: {name!r}")
    target: Any = torch.ops
    try:
        for part in parts:
            target = getattr(target, part)
    except (AttributeError, RuntimeError):
        raise Unsynthesizable(f"no such op in this torch build: {name}") from None
    if not hasattr(target, "_schema"):
        raise Unsynthesizable(f"not an op overload: {name}")
    return target


def device_name(device: str = "cpu") -> str:
    """The name profiles are keyed by: the GPU's marketing name, or 'cpu:<processor model>'."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu:{model}"


def memory_budget_bytes(device: str) -> int:
    """How much a single op may use: 90% of free GPU memory, or half the available RAM."""
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * 0.9)
    try:
        with open("/proc/meminfo", encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // 2


# --- building a call ---------------------------------------------------------------------------------
def _random_tensor(shape: tuple[int, ...], dtype_name: str, device: str, int_bound: int) -> torch.Tensor:
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise Unsynthesizable(f"cannot synthesize a {dtype_name} tensor")
    if dtype.is_floating_point:  # uniform in [0.5, 1.5): random, never zero, safe for log/rsqrt
        return torch.empty(shape, dtype=dtype, device=device).uniform_(0.5, 1.5)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device).bool()
    if dtype == torch.uint64:
        return torch.randint(0, 2**31, shape, dtype=torch.int64, device=device).to(dtype)
    return torch.randint(0, max(int_bound, 1), shape, dtype=dtype, device=device)


def _int_bound(sig: OpSignature) -> int:
    """Index tensors must stay in range of what they index."""
    name = sig.packet
    if name == "embedding":
        return sig.inputs[0].shape[0]
    if name == "embedding_dense_backward":
        return sig.outputs[0].shape[0]
    if name.startswith("nll_loss"):
        logits = next(m for m in sig.inputs if m.dtype.startswith(("float", "bfloat")) and m.shape)
        return logits.shape[-1]
    dims = [s for m in (*sig.inputs, *sig.outputs) if m.dtype.startswith(("float", "bfloat")) for s in m.shape]
    return min(dims) if dims else 2


def _bind(schema: Any, tensors: list[torch.Tensor], scalars: dict[str, Any], pointwise: bool) -> tuple[list, dict]:
    """Lay tensors and scalars out along the op's schema; optional tensor slots take a tensor only
    while more tensors remain than required slots after them (the IR drops Nones). A pointwise op
    short of a tensor was called with a Python number (`x + eps`): it gets one."""
    args_schema = list(schema.arguments)
    required_after = [0] * (len(args_schema) + 1)
    for i in range(len(args_schema) - 1, -1, -1):
        argument = args_schema[i]
        needs = str(argument.type) == "Tensor" and argument.name not in scalars
        required_after[i] = required_after[i + 1] + int(needs)
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    remaining = list(tensors)
    by_name = False  # once a defaulted positional argument is left out, the rest go by name
    for i, argument in enumerate(args_schema):
        kind = str(argument.type)
        if argument.name in scalars:
            value = scalars[argument.name]
        elif kind == "Tensor" and not remaining and pointwise:
            value = FALLBACK_SCALAR
        elif kind == "Tensor":
            if not remaining:
                raise Unsynthesizable(f"fewer tensors than the schema needs ({argument.name})")
            value = remaining.pop(0)
        elif kind == "Optional[Tensor]":
            value = remaining.pop(0) if len(remaining) > required_after[i + 1] else None
        elif kind in ("List[Tensor]", "List[Optional[Tensor]]"):
            take = max(len(remaining) - required_after[i + 1], 0)
            value, remaining = remaining[:take], remaining[take:]
        elif argument.has_default_value():
            by_name = True
            continue
        elif kind in ("Scalar", "number"):
            value = FALLBACK_SCALAR
        else:
            raise Unsynthesizable(f"cannot rebuild the {kind} argument '{argument.name}' (the IR does not record it)")
        if argument.kwarg_only or by_name:
            keywords[argument.name] = value
        else:
            positional.append(value)
    if remaining:
        raise Unsynthesizable(f"{len(remaining)} more tensors than the schema takes")
    return positional, keywords


def _scalar_value(value: Any) -> Any:
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if isinstance(value, tuple):
        return list(value)
    return value


def build_call(sig: OpSignature, device: str) -> tuple[Callable[[], Any], int, Callable[[], Any] | None]:
    """A zero-argument function that runs the op once on fresh inputs, the inputs' bytes, and what
    to run untimed before each timed call (None: nothing)."""
    if sig.packet in _FUSED_ATTENTION:
        return _attention_call(sig, device)
    op_name, inputs, scalars = sig.op, list(sig.inputs), sig.scalar_dict()
    op = resolve_op(op_name)
    names = {a.name for a in op._schema.arguments}
    values = {k: _scalar_value(v) for k, v in scalars.items() if k in names}
    bound = _int_bound(sig)
    tensors = [_random_tensor(m.shape, m.dtype, device, bound) for m in inputs]
    if not str(device).startswith("cuda"):
        for index in _CPU_STATS_IN_INPUT_DTYPE.get(op_name, ()):
            tensors[index] = tensors[index].to(tensors[0].dtype)
    args, kwargs = _bind(op._schema, tensors, values, torch.Tag.pointwise in getattr(op, "tags", ()))
    return (lambda: op(*args, **kwargs)), sum(t.numel() * t.element_size() for t in tensors), None


def _attention_call(sig: OpSignature, device: str) -> tuple[Callable[[], Any], int, Callable[[], Any] | None]:
    """A fused attention signature, forward or backward, as SDPA runs it in training. The forward
    runs on inputs that require gradients (the kernel then keeps its log-sum-exp, as in a step);
    the backward's forward runs untimed before each timed call, and the gradients are returned,
    not accumulated into `.grad` (no accumulation kernels in the time)."""
    q_at = _FUSED_ATTENTION[sig.packet]
    scalars = sig.scalar_dict()
    metas = sig.inputs[q_at:q_at + 3]
    if len(metas) < 3:
        raise Unsynthesizable(f"{sig.packet} without query, key and value")
    query, key, value = (_random_tensor(m.shape, m.dtype, device, 2).requires_grad_() for m in metas)
    mask = None  # the efficient kernel's bias follows v unless the trace recorded it as None
    if "efficient" in sig.packet and "attn_bias" not in scalars and len(sig.inputs) > q_at + 3:
        bias = sig.inputs[q_at + 3]
        mask = _random_tensor(bias.shape, bias.dtype, device, 2)
    options = {"attn_mask": mask, "dropout_p": float(scalars.get("dropout_p") or 0.0),
               "is_causal": bool(scalars.get("is_causal", False)), "scale": scalars.get("scale"),
               "enable_gqa": query.shape[-3] != key.shape[-3]}
    inputs = (query, key, value)
    size = sum(t.numel() * t.element_size() for t in inputs)

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(*inputs, **options)

    if q_at == 0:
        return forward, size, None
    grad = torch.rand_like(forward().detach()).add_(0.5)
    state: dict[str, Any] = {}

    def prepare():
        state["out"] = forward()

    return (lambda: torch.autograd.grad(state.pop("out"), inputs, grad)), size + grad.numel() * grad.element_size(), prepare


# --- timing ------------------------------------------------------------------------------------------
def _is_oom(error: BaseException) -> bool:
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error)
    return "out of memory" in text or "can't allocate memory" in text or "DefaultCPUAllocator" in text


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text[:limit]}"


def time_op(
    sig: OpSignature, device: str = "cpu", *, warmup: int = 3, repeats: int = 10,
    memory_limit_bytes: int | None = None,
) -> OpTiming:
    """Median time of `repeats` runs after `warmup` runs; never raises for a bad signature."""
    skipped = lambda reason: OpTiming(sig.key, sig.op, None, 0, skipped=reason)  # noqa: E731
    budget = memory_limit_bytes if memory_limit_bytes is not None else memory_budget_bytes(device)
    needed = sig.tensor_bytes
    if needed > budget:
        return skipped(f"too large for {device}: needs ~{needed / 2**30:.2f} GiB, budget {budget / 2**30:.2f} GiB")
    cuda = str(device).startswith("cuda")
    try:
        run, _, prepare = build_call(sig, device)
        alloc_delta = peak = None
        if cuda and prepare is None:  # a backward frees what its forward saved: no output delta to read
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            result = run()
            torch.cuda.synchronize(device)
            alloc_delta = torch.cuda.memory_allocated(device) - base
            peak = torch.cuda.max_memory_allocated(device) - base
            del result
        times = _timed_runs(run, cuda, device, warmup, repeats, prepare)
    except Unsynthesizable as error:
        return skipped(f"inputs cannot be synthesized: {error}")
    except Exception as error:  # an op that fails on this device is a skip, not a crash
        if cuda:
            torch.cuda.empty_cache()
        if _is_oom(error):
            return skipped(f"out of memory on {device}: {_first_line(error, 80)}")
        return skipped(f"failed on {device}: {_first_line(error)}")
    return OpTiming(sig.key, sig.op, statistics.median(times), len(times), alloc_delta, peak)


def _timed_runs(run: Callable[[], Any], cuda: bool, device: str, warmup: int, repeats: int,
                prepare: Callable[[], Any] | None = None) -> list[float]:
    """`prepare` runs before each call, outside its time (on a GPU: queued before its start event)."""
    covered = prepare is not None
    prepare = prepare or (lambda: None)
    for _ in range(warmup):
        prepare()
        run()
    repeats = max(repeats, 1)
    if not cuda:
        times = []
        for _ in range(repeats):
            prepare()
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize(device)
    for start, end in events:
        prepare()
        if covered:
            torch.cuda._sleep(_LAUNCH_COVER_CYCLES)
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


ProgressFn = Callable[[int, int, OpTiming], None]


def stderr_progress(every: int = 10, stream: Any = None) -> ProgressFn:
    """A progress callback: one line per `every` signatures, and one for the last."""
    def report(done: int, total: int, timing: OpTiming) -> None:
        if done % every and done != total:
            return
        last = f"{timing.time_s * 1e3:.3f} ms" if timing.measured else f"skipped: {timing.skipped}"
        print(f"profiled {done}/{total} ops (last {timing.op}: {last})", file=stream or sys.stderr, flush=True)

    return report


def profile_signatures(
    signatures: Sequence[OpSignature] | Iterable[OpSignature], device: str = "cpu", *, warmup: int = 3,
    repeats: int = 10, memory_limit_bytes: int | None = None, progress: ProgressFn | None = None,
    on_result: Callable[[OpSignature, OpTiming], None] | None = None,
) -> list[OpTiming]:
    """Time each signature; `on_result` sees each result as it comes (to store it at once)."""
    signatures = list(signatures)
    results = []
    for done, sig in enumerate(signatures, 1):
        timing = time_op(sig, device, warmup=warmup, repeats=repeats, memory_limit_bytes=memory_limit_bytes)
        results.append(timing)
        if on_result is not None:
            on_result(sig, timing)
        if progress is not None:
            progress(done, len(signatures), timing)
    return results
