"""Collective latency and bandwidth on the running process group, fitted to the α-β model.

Run under torchrun (NCCL on GPUs, gloo on CPU). For each link level the world allows — inside a
node, across nodes (one rank per node), and the whole world when it spans both — every group of
that level runs each collective at once over a range of message sizes; the slowest rank's median
time is kept, and α (latency, s) and β (bandwidth, bytes/s) are fitted by least squares to
    all_reduce                             t = 2(n-1)·α + 2(n-1)/n · S/β
    all_gather, reduce_scatter, all_to_all t = (n-1)·α + (n-1)/n · S/β
    broadcast                              t = (n-1)·α + S/β
    send_recv                              t = α + S/β
with S the full logical buffer in bytes (the gathered / reduced size), the convention of
`cost_models.communication`. Ranks are assumed node-major (torchrun's order).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
from scipy.optimize import nnls

from autopar.errors import AutoparError
from autopar.profiler.records import CollectiveFit

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
LEVELS = ("intra_node", "inter_node", "all")
KiB, MiB, GiB = 2**10, 2**20, 2**30
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- the model and its fit ---------------------------------------------------------------------------
def cost_coefficients(collective: str, n: int) -> tuple[float, float]:
    """(c_α, c_β) with t = c_α·α + c_β·S/β for a ring over `n` ranks."""
    if collective == "send_recv":
        return 1.0, 1.0
    if n < 2:
        raise ValueError(f"{collective} over {n} rank moves nothing")
    if collective == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    if collective == "broadcast":
        return float(n - 1), 1.0
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def fit_alpha_beta(collective: str, n: int, sizes_bytes: Sequence[float], times_s: Sequence[float]
                   ) -> tuple[float, float, float]:
    """(α seconds, β bytes/s, relative RMS error) by non-negative least squares on relative error.

    Rows are divided by the measured time so small messages (which fix α) weigh as much as large
    ones (which fix β); non-negativity keeps a noisy fit from reporting a negative latency.
    """
    sizes, times = np.asarray(sizes_bytes, dtype=float), np.asarray(times_s, dtype=float)
    if len(sizes) < 2 or len(np.unique(sizes)) < 2:
        raise ValueError("an α-β fit needs at least two distinct message sizes")
    if np.any(times <= 0):
        raise ValueError("measured times must be positive")
    c_alpha, c_beta = cost_coefficients(collective, n)
    design = np.column_stack([np.full(len(sizes), c_alpha), c_beta * sizes])
    solution, _ = nnls(design / times[:, None], np.ones(len(sizes)))
    alpha, inverse_beta = float(solution[0]), float(solution[1])
    beta = 1.0 / inverse_beta if inverse_beta > 0 else math.inf
    errors = (design @ solution - times) / times
    return alpha, beta, float(np.sqrt(np.mean(errors**2)))


def default_sizes(min_bytes: int = KiB, max_bytes: int = GiB, factor: int = 2) -> list[int]:
    """Message sizes from `min_bytes` to `max_bytes`, each `factor` times the last."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise AutoparError(f"bad message size range {min_bytes}..{max_bytes} (factor {factor})")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# --- the process group -------------------------------------------------------------------------------
def require_torchrun_env() -> None:
    """Collectives need every rank: without torchrun's variables there is no group to join."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    missing = [name for name in _TORCHRUN_ENV if not os.environ.get(name)]
    if missing:
        raise AutoparError(
            f"collective profiling runs under torchrun ({', '.join(missing)} not set): "
            f"e.g. torchrun --nproc-per-node 8 -m autopar profile --collectives --db PATH"
        )


def group_layouts(world: int, per_node: int) -> dict[str, list[list[int]]]:
    """The groups of each link level over node-major ranks; a level is left out where the world has
    no such link (one node: no inter_node; one rank per node: no intra_node)."""
    if per_node < 1 or world % per_node:
        per_node = world  # an uneven layout: treat the world as one node
    nodes = world // per_node
    layouts: dict[str, list[list[int]]] = {}
    if per_node >= 2:
        layouts["intra_node"] = [[node * per_node + i for i in range(per_node)] for node in range(nodes)]
    if nodes >= 2:
        layouts["inter_node"] = [[node * per_node + i for node in range(nodes)] for i in range(per_node)]
    if nodes >= 2 and per_node >= 2:
        layouts["all"] = [list(range(world))]
    return layouts


def _start(backend: str | None) -> tuple[Any, bool]:
    """(device, whether we initialized the group) for the current or a new process group."""
    import torch
    import torch.distributed as dist

    require_torchrun_env()
    created = False
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        created = True
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device()), created
    return torch.device("cpu"), created


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(collective: str, ranks: list[int], group: Any, numel: int, device: Any) -> Callable[[], None]:
    """One call of `collective` on this rank's group, on a buffer of `numel` floats (S = numel·4)."""
    import torch
    import torch.distributed as dist

    n, me = len(ranks), dist.get_rank()
    full = torch.rand(numel, device=device) + 0.5  # random, never zero
    part = full[: numel // n].clone()
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if collective == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, part, group=group)
    if collective == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, full, group=group)
    if collective == "all_to_all":
        received = torch.empty_like(full)
        return lambda: dist.all_to_all_single(received, full, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(full, src=ranks[0], group=group)
    if collective == "send_recv":  # ping-pong between the group's first and last rank, halved later
        first, last = ranks[0], ranks[-1]
        if me == first:
            return lambda: (dist.send(full, last), dist.recv(full, last))
        if me == last:
            return lambda: (dist.recv(full, first), dist.send(full, first))
        return lambda: None
    raise AutoparError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


def _median_time_s(run: Callable[[], None], group: Any, device: Any, warmup: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        run()
    _sync(device)
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # start together
    times = []
    for _ in range(max(repeats, 1)):
        started = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def profile_collectives(
    sizes_bytes: Sequence[int] | None = None, *, collectives: Sequence[str] = COLLECTIVES,
    levels: Sequence[str] | None = None, warmup: int = 2, repeats: int = 5, backend: str | None = None,
    db: Any = None, progress: Callable[[str], None] | None = None,
) -> list[CollectiveFit]:
    """Measure and fit every collective on every available link level; every rank must call this.

    Sizes default to 1 KiB..1 GiB on GPUs and 1 KiB..16 MiB on gloo. Every rank returns the same
    fits (times are reduced to the slowest rank); rank 0 stores them in `db` when given.
    """
    import torch
    import torch.distributed as dist

    from autopar.profiler.operators import device_name

    unknown = [c for c in collectives if c not in COLLECTIVES]
    if unknown:
        raise AutoparError(f"unknown collective(s) {', '.join(unknown)}; choose from {', '.join(COLLECTIVES)}")
    device, _ = _start(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise AutoparError("collective profiling needs at least 2 processes: torchrun --nproc-per-node 2 or more")
    if sizes_bytes is None:
        sizes_bytes = default_sizes(KiB, GiB if device.type == "cuda" else 16 * MiB)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    layouts = group_layouts(world, per_node)
    chosen = [level for level in (levels or LEVELS) if level in layouts]
    name = device_name(str(device)) if device.type == "cuda" else device_name("cpu")
    fits = []
    for level in chosen:
        groups = [(ranks, dist.new_group(ranks)) for ranks in layouts[level]]  # same order on every rank
        ranks, group = next((r, g) for r, g in groups if rank in r)
        n = len(ranks)
        for collective in collectives:
            used, medians = [], []
            for size in sizes_bytes:
                numel = max(n, math.ceil(size / 4 / n) * n)
                run = _runner(collective, ranks, group, numel, device)
                elapsed = _median_time_s(run, group, device, warmup, repeats)
                medians.append(elapsed / 2 if collective == "send_recv" else elapsed)
                used.append(numel * 4)
                del run
            slowest = torch.tensor(medians, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times = [float(t) for t in slowest.cpu()]
            group_size = 2 if collective == "send_recv" else n
            alpha, beta, error = fit_alpha_beta(collective, group_size, used, times)
            fit = CollectiveFit(
                device_name=name, backend=dist.get_backend(), torch_version=torch.__version__,
                collective=collective, level=level, group_size=group_size, alpha_s=alpha, beta_bytes_per_s=beta,
                rel_rms_error=error, sizes_bytes=tuple(used), times_s=tuple(times), measured_at=time.time(),
            )
            fits.append(fit)
            if rank == 0 and db is not None:
                db.record_collective_fit(fit)
            if rank == 0 and progress is not None:
                progress(f"{level} {collective} (n={group_size}): alpha {alpha * 1e6:.1f} us, "
                         f"beta {beta / 1e9:.2f} GB/s, fit error {error:.1%}")
    return fits


def finish() -> None:
    """Tear down a process group this module started (the CLI calls it on the way out)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
