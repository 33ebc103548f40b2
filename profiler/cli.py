"""`autopar profile`: fill the profile database with op timings, or with collective fits under torchrun.

Only argparse and autopar's error type are imported here, so registering the command costs the
rest of the CLI nothing; torch and the model zoo load when the command runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from autopar.errors import AutoparError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise AutoparError(f"{what} must be comma-separated integers, e.g. 1,2,4; got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise AutoparError(f"{what} must be positive integers, e.g. 1,2,4; got {text!r}")
    return values


def parse_bytes(text: str) -> int:
    """'1K', '64MiB', '1G', '4096' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise AutoparError(f"cannot read a byte size from {text!r}: use e.g. 1K, 64M, 1G")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit])


def add_profile_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `profile` on autopar's subcommands."""
    from autopar.cli.arguments import NON_NEGATIVE, POSITIVE

    profile = subparsers.add_parser(
        "profile", help="measure op times (and, under torchrun, collectives) into a profile database")
    profile.add_argument("--db", required=True, metavar="PATH", help="profile database (SQLite), created if missing")
    profile.add_argument("--model", help="zoo name (e.g. gpt3-1.3b) or package.module:factory")
    profile.add_argument("--model-config", default=None, metavar="K=V,...", help="overrides, e.g. layers=4,hidden=256")
    profile.add_argument("--seq-len", type=POSITIVE, default=None, help="sequence length (default: the model's)")
    profile.add_argument("--batch", type=POSITIVE, default=1, help="batch size of the traced step (default 1)")
    profile.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="compute dtype (default bf16)")
    profile.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to measure (default cuda)")
    profile.add_argument("--tp", default="1,2,4,8", help="tensor-parallel degrees whose sharded shapes to profile")
    profile.add_argument("--microbatches", default="1,2,4", help="micro-batch sizes whose shapes to profile")
    profile.add_argument("--max-ops", type=NON_NEGATIVE, default=None, metavar="N", help="measure at most N signatures this run")
    profile.add_argument("--repeats", type=POSITIVE, default=10, help="timed runs per op; the median is kept (default 10)")
    profile.add_argument("--warmup", type=NON_NEGATIVE, default=3, help="untimed runs before timing (default 3)")
    profile.add_argument("--force", action="store_true", help="re-measure signatures the database already has")
    profile.add_argument("--collectives", action="store_true", help="profile collectives instead (run under torchrun)")
    profile.add_argument("--min-bytes", default="1K", help="smallest collective message (default 1K)")
    profile.add_argument("--max-bytes", default=None, help="largest collective message (default 1G on GPU, 16M on gloo)")
    profile.add_argument("--collective-ops", default=None, metavar="NAMES",
                         help="collectives to run, comma-separated (default: all six)")
    profile.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    profile.set_defaults(handler=run_profile)
    return profile


def run_profile(args: argparse.Namespace) -> int:
    if args.collectives:
        return _profile_collectives(args)
    if not args.model:
        raise AutoparError("give --model to profile its ops, or --collectives (under torchrun) for communication")
    return _profile_ops(args)


def _profile_ops(args: argparse.Namespace) -> int:
    tp_degrees = parse_int_list(args.tp, "--tp")
    microbatches = parse_int_list(args.microbatches, "--microbatches")
    if args.max_ops is not None and args.max_ops < 0:
        raise AutoparError(f"--max-ops must be 0 or more, got {args.max_ops}")
    if args.repeats < 1 or args.warmup < 0:
        raise AutoparError("--repeats must be at least 1 and --warmup at least 0")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda but this machine has no usable CUDA GPU; use --device cpu or run on a GPU")
    from autopar.graph import trace
    from autopar.models import build_model
    from autopar.profiler.database import ProfileDB
    from autopar.profiler.graph_profile import profile_graph
    from autopar.profiler.operators import stderr_progress

    check_database_path(args.db)  # a bad path fails fast, and nothing is created before the model traces
    spec = build_model(args.model, args.model_config)
    inputs = spec.example_inputs(args.batch, args.seq_len)
    seq_len = args.seq_len or spec.default_seq_len
    print(f"tracing {spec.name} ({args.precision}, batch {args.batch}, seq {seq_len}) ...", file=sys.stderr, flush=True)
    graph = trace(spec.module, inputs, loss_fn=spec.loss_fn, precision=args.precision, name=spec.name,
                  seq_len=seq_len)
    with ProfileDB(args.db) as db:
        summary = profile_graph(
            graph, db, args.device, tp_degrees=tp_degrees, microbatches=microbatches, max_ops=args.max_ops,
            warmup=args.warmup, repeats=args.repeats, force=args.force, progress=stderr_progress(20),
        )
    print(f"device: {summary.device_name} ({summary.dtype})")
    print(f"graph: {summary.nodes} nodes, {summary.graph_signatures} distinct signatures, "
          f"{summary.total_signatures} with sharded variants")
    print(f"measured {summary.measured}, reused {summary.reused}, skipped {sum(summary.skipped.values())}, "
          f"left for a later run {summary.not_run} in {summary.elapsed_s:.1f} s")
    for reason, count in sorted(summary.skipped.items()):
        print(f"  skipped {count}: {reason}")
    print(f"profile database: {args.db}")
    return 0


def _profile_collectives(args: argparse.Namespace) -> int:
    from autopar.profiler.collectives import COLLECTIVES, default_sizes, finish, profile_collectives, require_torchrun_env

    ops = tuple(o.strip() for o in args.collective_ops.split(",")) if args.collective_ops is not None else COLLECTIVES
    unknown = [op for op in ops if op not in COLLECTIVES]
    if unknown or not ops:
        raise AutoparError(f"--collective-ops {args.collective_ops!r}: unknown collective(s) "
                           f"{', '.join(map(repr, unknown))}; choose from {', '.join(COLLECTIVES)}")
    import torch

    from autopar.profiler.database import ProfileDB

    gpu = torch.cuda.is_available()
    max_bytes = parse_bytes(args.max_bytes) if args.max_bytes else (2**30 if gpu else 16 * 2**20)
    min_bytes = parse_bytes(args.min_bytes)
    if min_bytes < 1 or max_bytes < min_bytes:
        raise AutoparError(f"message sizes --min-bytes {args.min_bytes} to --max-bytes {args.max_bytes or max_bytes}: "
                           f"give at least one byte, and a maximum no smaller than the minimum")
    sizes = default_sizes(min_bytes, max_bytes)
    require_torchrun_env()  # before touching the database or torch.distributed
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        check_database_path(args.db)
    try:  # the fits are stored once all are measured: a run that fails leaves the database as it was
        fits = profile_collectives(sizes, collectives=ops, warmup=args.warmup, repeats=args.repeats,
                                   progress=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        finish()
    if rank == 0:
        with ProfileDB(args.db) as db:
            for fit in fits:
                db.record_collective_fit(fit)
        print(f"stored {len(fits)} collective fits in {args.db}")
    return 0


def check_database_path(path: str) -> None:
    """Refuse, before any work and without creating anything, a --db that cannot be written: an
    existing file must be an autopar profile database, a new one needs a writable directory."""
    from pathlib import Path

    from autopar.io import check_output_path
    from autopar.profiler.database import ProfileDB

    if not path.strip():
        raise AutoparError("--db is empty: give the path of a profile database (created if missing)")
    target = Path(path)
    if target.is_file() and target.stat().st_size > 0:
        ProfileDB(target, readonly=True).close()  # validates it is ours, reading only
    check_output_path(target, "profile database")
