"""A dry run of planned tensor-parallel placements: one rank's training step on fake tensors.

Before anything runs, the planned realization of tp (the module rules of `runtime.tensor_parallel.module_rules`,
or DTensor through the model's forward, `runtime.tensor_parallel.dtensor`) is applied to a copy of the model
whose tensors are fake (shapes and dtypes, no storage), on a fake process group of the tp size
(no communication), and two micro-batches run forward and backward with the loss, then the
step's gradient synchronization. It answers two questions:
- does it run? If not, the first line of the error is the reason the searcher refuses the
  placements (before any process trains, never a crash mid-step);
- what does it send? Every collective (kind, bytes, phase, the innermost module running it) is
  recorded where the runtime's own counter records it (`runtime.collectives`), so the plan is
  priced from what the runtime will execute (`cost_models.placed_collectives.dry_run_units`).
Layers the plan may recompute run under full recompute: what their recomputation resends is
recorded apart, per layer ("recompute").

One tp rank is enough: tensor parallelism is SPMD, every tp rank sends the same collectives.
A default process group that is live (`autopar run` under torchrun searches its plan there) is
left alone: the dry run then runs in a subprocess. Dry runs are cached by the caller
(`runtime.tensor_parallel.module_rules.TensorParallelPlanner`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.capabilities import TpCollective
from autopar.graph.capture import quiet_fake_tensor_logs
from autopar.runtime.tensor_parallel.autocast import checking_block_inputs

MODULES, DTENSOR = "modules", "dtensor"
SUBPROCESS_TIMEOUT_S = 600


@dataclass(frozen=True)
class DryRun:
    """What one tp rank sends in one micro-batch (forward, backward, recompute) and once per step."""

    reason: str | None  # None: it ran
    collectives: tuple[TpCollective, ...] = ()
    failed_module: str | None = None  # the innermost module running when it failed ("" the root)

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class DryRunSpec:
    """Everything but the model: what to realize and how large a micro-batch is."""

    tp: int
    placements: tuple[tuple[str, str], ...]  # (parameter, "R" | "S(d)") pairs, sorted
    realization: str  # MODULES | DTENSOR
    microbatch: int
    sp: bool = False  # sequence parallelism (MODULES only)
    precision: str = "fp32"
    head_path: str | None = None  # the module rules' head (MODULES only)
    vocab_parallel_loss: bool = False  # logits stay sharded over the vocabulary into the loss
    recompute: tuple[str, ...] = ()  # layers recomputed
    recompute_policy: str = "full"


def dry_run(model: nn.Module, example_input: torch.Tensor, loss_fn: Callable, spec: DryRunSpec) -> DryRun:
    """Run `spec` on fake tensors; in a subprocess when a default process group is live, or will be
    (a process torchrun started): some state of the fake group (rank 0) outlives it, and the real tp
    shards made afterwards on rank 1 had rank 0's mesh coordinate (tests/test_run_experience.py's
    torchrun tp=2 run, which searches its plan first, caught it)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if dist.is_available() and (dist.is_initialized() or launched):
        return _in_subprocess(model, example_input, loss_fn, spec)
    return _here(model, example_input, loss_fn, spec)


def _here(model: nn.Module, example_input: torch.Tensor, loss_fn: Callable, spec: DryRunSpec) -> DryRun:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    module = _meta_copy(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec.tp)
    try:
        mesh = init_device_mesh("cpu", (spec.tp,), mesh_dim_names=("tp",))
        phase = _Phase()
        try:
            with _strided_shard_offsets_on_real_tensors(), quiet_fake_tensor_logs():
                return _step(module, example_input, loss_fn, spec, mesh, FakeTensorMode(allow_non_fake_inputs=True),
                             phase)
        except Exception as error:  # any failure of the model's code under this sharding is the answer
            return DryRun(reason=_one_line(error), failed_module=phase.failed_at())
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _strided_shard_offsets_on_real_tensors():
    """DTensor computes a strided shard's offsets (placements it derives when a sharded fused
    projection is split) with `arange(...).tolist()` on integer sizes alone; under FakeTensorMode
    that arange would be fake and `.tolist()` data-dependent. Run that arithmetic on real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard.local_shard_size_and_offset

    def real(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    _StridedShard.local_shard_size_and_offset = real
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


def _step(module, example_input, loss_fn, spec: DryRunSpec, mesh, fake_mode, phase: "_Phase") -> DryRun:
    from autopar.runtime.recompute import apply_recompute

    placements = dict(spec.placements)
    if spec.realization == DTENSOR:
        from autopar.runtime.tensor_parallel.dtensor import apply_dtensor_tensor_parallel

        apply_dtensor_tensor_parallel(module, mesh, placements, spec.vocab_parallel_loss)
    else:
        from autopar.runtime.tensor_parallel.module_rules import apply_tensor_parallel

        apply_tensor_parallel(module, mesh, placements, sp=spec.sp, head_path=spec.head_path,
                              vocab_parallel_loss=spec.vocab_parallel_loss)
    for path in spec.recompute:
        _mark_recompute(module.get_submodule(path), path, phase)
    apply_recompute(module, list(spec.recompute), spec.recompute_policy if spec.recompute else "none")
    with fake_mode, checking_block_inputs():
        _fake_storage(module)
        x = torch.zeros((spec.microbatch, *example_input.shape[1:]), dtype=example_input.dtype, device="cpu")
        return _run(module, x, loss_fn, spec, phase)


def _run(module, x, loss_fn, spec: DryRunSpec, phase: "_Phase") -> DryRun:
    from autopar.runtime.parallelize import _match_gradient_placements, _sum_partial_gradients
    from autopar.runtime.precision import autocast
    from torch.distributed.tensor.parallel import loss_parallel

    context: Callable = contextlib.nullcontext
    if spec.realization == DTENSOR:
        from autopar.runtime.tensor_parallel.dtensor import step_context as context
    loss_context = loss_parallel if spec.vocab_parallel_loss else contextlib.nullcontext
    counter = _RecordingCounter({frozenset(range(spec.tp)): "tp"}, phase)
    per_microbatch: list[list[TpCollective]] = []
    with counter, phase.tracker, phase.forward_stack(module):
        for _ in range(2):  # the second micro-batch accumulates into the first's gradients
            start = len(counter.records)
            with loss_context(), context():
                phase.name = "forward"
                with autocast(spec.precision, torch.device("cpu"), fsdp=False):
                    loss = loss_fn(module(x), x)
                phase.name = "backward"
                (loss / 2).backward()
            per_microbatch.append(counter.records[start:])
        phase.name = "step"
        start = len(counter.records)
        params = list({id(p): p for p in module.parameters()}.values())
        _sum_partial_gradients(params)
        for param in params:
            _match_gradient_placements(param)
        step = counter.records[start:]
    first, second = (Counter(records) for records in per_microbatch)
    if first != second:
        return DryRun(reason="the dry run sent different collectives in the second micro-batch than in the first "
                             "(gradient accumulation changes placements)")
    return DryRun(reason=None, collectives=tuple(per_microbatch[0]) + tuple(step))


class _Phase:
    """Which part of the step is running, and the innermost module running it."""

    def __init__(self) -> None:
        from torch.distributed._tools.mod_tracker import ModTracker

        self.name = "forward"
        self.recomputing: list[str] = []
        self.tracker = ModTracker()
        self.stack: list[str] = []  # modules whose forward began and has not returned (kept on an error)

    @contextlib.contextmanager
    def forward_stack(self, root: nn.Module):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        names = {id(module): path for path, module in reversed(list(root.named_modules(remove_duplicate=False)))}

        def enter(module, _args):
            if id(module) in names:
                self.stack.append(names[id(module)])

        def leave(module, _args, _output):
            if id(module) in names and self.stack:
                self.stack.pop()

        handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def failed_at(self) -> str:
        """Where an error stopped the step: the innermost forward it left unfinished, else as `module`."""
        return self.stack[-1] if self.stack else self.module()

    def module(self) -> str:
        if self.recomputing:
            return self.recomputing[-1]
        innermost = max(self.tracker.parents, key=lambda name: (name != "Global", name.count(".")))
        return innermost.partition(".")[2] if "." in innermost else ""

    def current(self) -> str:
        return "recompute" if self.recomputing else self.name


class _RecordingCounter:
    """`runtime.collectives.CollectiveCounter`, each collective also kept with its phase and module."""

    def __new__(cls, axes, phase: _Phase):
        from autopar.runtime.collectives import CollectiveCounter, CollectiveCounts

        records: list[TpCollective] = []

        class Recording(CollectiveCounts):
            def add(self, axis: str, kind: str, num_bytes: int) -> None:
                super().add(axis, kind, num_bytes)
                records.append(TpCollective(phase.current(), kind, int(num_bytes), phase.module()))

        counter = CollectiveCounter(axes)
        counter.counts = Recording()
        counter.records = records
        return counter


def _mark_recompute(module: nn.Module, path: str, phase: _Phase) -> None:
    """Calls of `module`'s forward after its first in a micro-batch are recomputation (checkpoint
    calls the original forward again in backward): mark them, so their collectives count apart."""
    original = module.forward

    def forward(*args, **kwargs):
        again = phase.name == "backward"
        if again:
            phase.recomputing.append(path)
        try:
            return original(*args, **kwargs)
        finally:
            if again:
                phase.recomputing.pop()

    module.forward = forward


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers live on meta (ties kept)."""
    memo: dict[int, object] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in memo:
            meta = tensor.detach().to("meta")
            memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _fake_storage(module: nn.Module) -> None:
    """Meta tensors become fake CPU tensors (under the active FakeTensorMode); ties kept."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    module.to_empty(device="cpu")
    for names in groups.values():
        first = module.get_parameter(names[0])
        for name in names[1:]:
            path, _, attr = name.rpartition(".")
            setattr(module.get_submodule(path) if path else module, attr, first)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first[:300]}"


# --- in a subprocess, when this process has a live default group --------------------------------

def _in_subprocess(model: nn.Module, example_input: torch.Tensor, loss_fn: Callable, spec: DryRunSpec) -> DryRun:
    with tempfile.TemporaryDirectory(prefix="autopar-dry-run-") as folder:
        payload, result = Path(folder, "payload.pt"), Path(folder, "result.json")
        try:
            torch.save(dict(model=_meta_copy(model), example=example_input.detach().to("meta"), loss_fn=loss_fn,
                            spec=spec), payload)
        except Exception as error:
            return DryRun(reason=f"the tp dry run could not hand this model to a subprocess ({_one_line(error)})")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        done = subprocess.run([sys.executable, "-m", "autopar.runtime.tensor_parallel.dry_run", str(payload), str(result)],
                              env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        if done.returncode != 0 or not result.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return DryRun(reason=f"the tp dry run's subprocess failed ({last[:300]})")
        data = json.loads(result.read_text())
        return DryRun(reason=data["reason"], collectives=tuple(TpCollective(**c) for c in data["collectives"]),
                      failed_module=data["failed_module"])


def _main(payload: str, result: str) -> None:
    # Our own file, written by the parent a moment ago (it holds the user's model classes by reference).
    data = torch.load(payload, weights_only=False)
    outcome = _here(data["model"], data["example"], data["loss_fn"], data["spec"])
    Path(result).write_text(json.dumps(dict(reason=outcome.reason, failed_module=outcome.failed_module,
                                            collectives=[asdict(c) for c in outcome.collectives])))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
