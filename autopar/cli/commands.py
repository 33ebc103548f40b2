"""The `autopar` command line.

Every user error becomes one line on stderr and a non-zero exit code (2 for bad input); `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Sequence

from autopar.cli.arguments import POSITIVE
from autopar.errors import AutoparError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line, not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise AutoparError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Automatic parallelization for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)

    inspect = commands.add_parser(
        "inspect", help="trace a model and report its parameters, FLOPs, layer types and memory"
    )
    _add_model_arguments(inspect)
    inspect.add_argument("--batch", type=POSITIVE, default=1, help="batch size of the traced step (default 1)")
    inspect.add_argument("--cluster", help="preset name or YAML/JSON file: also report how many GPUs the model states need")
    inspect.add_argument("--gpus", type=POSITIVE, help="size the cluster preset to this many GPUs")
    inspect.add_argument("--check-plan", metavar="PATH", help="check that a plan file belongs to this model")
    inspect.add_argument("--json", metavar="PATH", help="write the summary as JSON to PATH, or - for stdout")
    inspect.add_argument("--graph", metavar="PATH", help="write the whole op graph as JSON to PATH")
    inspect.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    inspect.set_defaults(handler=_inspect)

    from autopar.profiler.cli import add_profile_command
    from autopar.cli.data import add_data_command

    add_profile_command(commands)
    add_data_command(commands)

    plan = commands.add_parser(
        "plan", help="search the best parallel strategy (or cost a full or partial --strategy) and report it")
    _add_model_arguments(plan)
    plan.add_argument("--global-batch", type=POSITIVE, required=True, help="sequences per optimizer step")
    plan.add_argument("--cluster", required=True, help="preset name or YAML/JSON cluster file")
    plan.add_argument("--gpus", type=POSITIVE, help="size the cluster preset to this many GPUs")
    plan.add_argument("--strategy", default="", help="fixed keys, e.g. tp=8,pp=12,dp=16,microbatch=1,zero=1,"
                      "recompute=full,recompute_layers=2,schedule=1f1b,vp=1,sp=true,offload=optimizer (recompute_layers: the first "
                      "k layers of each stage recompute, k per stage as 3/2/1/0, or all; offload=optimizer: optimizer "
                      "states and its step on the CPU); keys left out are chosen by the cost model")
    plan.add_argument("--json", metavar="PATH", help="write the prediction as JSON to PATH, or - for stdout")
    plan.add_argument("--save-plan", metavar="PATH", help="write the chosen plan (the file `autopar run --plan` reads)")
    plan.add_argument("--report", metavar="PATH", help="write a self-contained HTML report (mesh, schedule, memory, "
                      "breakdown, alternatives, sharding) to PATH")
    plan.add_argument("--trace", metavar="PATH", help="write the predicted step as a Chrome/Perfetto trace (JSON) to PATH")
    plan.add_argument("--choose-compile", action="store_true",
                      help="search the plan eager and compiled, and keep the one predicted faster (what `autopar run` "
                           "does on a GPU without --compile/--no-compile); a compile key in --strategy decides instead")
    plan.add_argument("--no-ilp", action="store_true", help="skip the intra-op ILP (Megatron-style tensor parallelism)")
    plan.add_argument("--no-probe-cache", action="store_true",
                      help="run the runtime's probes of the model (pipeline capture, tp dry run) even when an "
                           "earlier plan of the same model kept their answers ($AUTOPAR_CACHE/probes)")
    plan.add_argument("--profile", metavar="DB", help="calibrate the roofline from this profile database")
    plan.add_argument("--profile-device", metavar="NAME",
                      help="which device of the database to use (default: the one matching the cluster's GPU)")
    plan.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    plan.set_defaults(handler=_plan)

    run = commands.add_parser(
        "run", help="train a model under a plan (--plan, or searched for this launch) on a token dataset")
    from autopar.cli.run_config import add_run_arguments

    add_run_arguments(run)
    run.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    run.set_defaults(handler=_run)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="zoo name (e.g. gpt3-175b, llama3-8b) or package.module:factory")
    parser.add_argument("--model-config", default=None, metavar="K=V,...", help="overrides, e.g. layers=4,hidden=256")
    parser.add_argument("--seq-len", type=POSITIVE, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="compute dtype (default bf16)")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _check_outputs(outputs: dict[str, str | None]) -> None:
    """Every output path at once, before any work: each writable as a file, no two the same file."""
    from pathlib import Path

    from autopar.io import check_output_path

    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        if not path.strip():
            raise AutoparError(f"{flag} is empty: give a file path")
        check_output_path(path, flag)
        resolved = Path(path).resolve()
        if resolved in seen:
            raise AutoparError(f"{seen[resolved]} and {flag} both name {path}: give each output its own file")
        seen[resolved] = flag


def _inspect(args: argparse.Namespace) -> int:
    import autopar
    from autopar.cli.inspect import cluster_fit, render, summarize
    from autopar.io import write_all
    from autopar.models import build_model

    _check_outputs({"--graph": args.graph, "--json": None if args.json == "-" else args.json})  # before the trace
    cluster = autopar.load_cluster(args.cluster, gpus=args.gpus) if args.cluster else None
    if cluster is None and args.gpus is not None:
        raise AutoparError("--gpus sizes a cluster: give --cluster too, e.g. --cluster dgx-h100 --gpus 64")
    spec = build_model(args.model, args.model_config)
    inputs = spec.example_inputs(args.batch, args.seq_len)
    seq_len = args.seq_len or spec.default_seq_len
    _say(f"tracing {spec.name} ({args.precision}, batch {args.batch}, seq {seq_len}) ...")
    started = time.perf_counter()
    graph = autopar.trace(spec.module, inputs, loss_fn=spec.loss_fn, precision=args.precision, name=spec.name,
                          seq_len=seq_len)
    summary = summarize(graph, time.perf_counter() - started)
    if cluster is not None:
        summary["cluster_fit"] = cluster_fit(summary, cluster)
    if args.check_plan:
        plan = autopar.load_plan(args.check_plan, model=spec.module)
        summary["plan_check"] = {"path": args.check_plan, "ok": True, "schema_version": plan.schema_version}
    texts = {}
    if args.graph:
        texts[args.graph] = graph.to_json()
    if args.json and args.json != "-":
        texts[args.json] = json.dumps(summary, indent=2)
    write_all(texts)
    if args.json == "-":
        print(json.dumps(summary, indent=2))
        return 0
    print(render(summary))
    if args.check_plan:
        print(f"\nplan {args.check_plan} matches this model (fingerprint {graph.model_fingerprint})")
    return 0


@contextlib.contextmanager
def _collecting_less():
    """Planning allocates millions of small objects (graph nodes, strategies, evaluations), few of them
    in garbage cycles, and Python's default thresholds scan them about a thousand times, full scans of
    everything alive included: 1.7 s of GPT-3 175B's plan on 1,024 GPUs. Even every 10,000 allocations
    with what was alive before left out, the scans took 0.5 s (GPT-3) and 0.7 s (Llama 3 405B) for the
    few cycles they found: the collector is off while one plan is made, which raises the command's
    peak memory from 471 to 488 MB (GPT-3) and from 561 to 584 MB (Llama 3). It is turned back on
    after, as it was, so a process that plans more than once (the tests) collects between plans.

    The interpreter's last act is one full collection, a scan of everything still alive: 0.9 s
    after GPT-3 175B's plan. Its memory goes back to the system whole at exit, so what is alive
    is frozen then (an `atexit` handler: it runs before that collection), and the scan skips it."""
    import atexit
    import gc

    atexit.unregister(gc.freeze)  # once, however many plans a process makes
    atexit.register(gc.freeze)
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan(args: argparse.Namespace) -> int:
    with _collecting_less():
        return _planned(args)


def _planned(args: argparse.Namespace) -> int:
    import autopar
    from autopar.cost_models.strategy import parse_strategy
    from autopar.models import build_model
    from autopar.probe_cache import default_probe_cache_dir
    from autopar.report import render_text

    outputs = {"--save-plan": args.save_plan, "--json": None if args.json == "-" else args.json,
               "--report": args.report, "--trace": args.trace}
    _check_outputs(outputs)  # before the (possibly long) search
    fixed = parse_strategy(args.strategy)
    cluster = autopar.load_cluster(args.cluster, gpus=args.gpus)
    autopar.check_fixed_strategy(fixed, cluster.world_size)  # before the (possibly long) trace
    if args.global_batch <= 0:
        raise AutoparError(f"--global-batch must be positive, got {args.global_batch}")
    spec = build_model(args.model, args.model_config)
    result = autopar.plan(spec.module, spec.example_inputs(1, args.seq_len), cluster=cluster,
                          global_batch=args.global_batch, strategy=fixed, loss_fn=spec.loss_fn,
                          precision=args.precision, name=spec.name, seq_len=args.seq_len or spec.default_seq_len,
                          use_ilp=not args.no_ilp, profile=args.profile, profile_device=args.profile_device,
                          progress=_say, probe_cache=None if args.no_probe_cache else default_probe_cache_dir(),
                          fork_probes=True, choose_compile=args.choose_compile)
    if result.fits and result.compile_choice is not None:
        _say(result.compile_choice.line())
    if result.fits:  # all or none; when nothing fits, none (the terminal report shows the closest plan)
        result.write(plan=args.save_plan, json_path=outputs["--json"], report=args.report, trace=args.trace)
    report = result.summary()
    if args.json == "-":
        print(json.dumps(report.model_dump(mode="json"), indent=2))
    else:
        print(render_text(report))
    if not result.fits:
        unwritten = [flag for flag, path in outputs.items() if path]
        note = f" ({', '.join(unwritten)} not written)" if unwritten else ""
        print(f"autopar: {result.no_fit_reason()}{note}", file=sys.stderr)
        return 3
    if args.report:
        _say(f"wrote report {args.report}")
    if args.trace:
        _say(f"wrote trace {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _run(args: argparse.Namespace) -> int:
    from autopar.cli.run import run_command

    return run_command(args)


# How long a torchrun worker other than rank 0 waits before it reports a bad input itself. Every rank
# usually meets the same input: rank 0 says so at once and exits, and torchrun stops the others
# (it checks its workers every 0.1 s), so the user reads one line. A rank that meets an input rank 0
# does not (or meets it much earlier) reports it after this wait, so that rank 0's line comes first
# and torchrun, stopping every worker once one has failed, cannot swallow the only message.
PEER_REPORT_DELAY_S = 5.0


def _report_error(error: AutoparError) -> None:
    """The one line of a bad input; under torchrun, said by rank 0, or by another rank after a grace
    period (no collective: a rank that never meets the error cannot make this wait)."""
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        world, rank = 1, 0
    if world > 1 and rank != 0:
        sys.stderr.flush()
        time.sleep(PEER_REPORT_DELAY_S)
    print(f"autopar: error: {error}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if not getattr(args, "command", None):
            build_parser().print_help()
            return 2
        return args.handler(args)
    except AutoparError as error:
        if debug:
            raise
        _report_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
