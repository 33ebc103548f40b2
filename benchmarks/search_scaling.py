"""Search time on the 2-core CPU machine: model × cluster → seconds, ILP size, chosen plan.

Goals (issue #5): gpt3-175b on 1,024 A100-80GB ≤ 30 s; llama3-70b on 512 H100 ≤ 30 s; a 1T GPT on
3,072 A100 ≤ 60 s; gpt2-124m on 8 GPUs ≤ 5 s. Capture time is printed separately (search only
counts the search); wall is all of `autopar.plan` (trace, the runtime's probes, search), the time
`autopar plan` takes less its import, the model's construction and the output (issue #30: gpt3-175b on
1,024 A100 ≤ 15 s, llama3-405b on 8,192 H100 ≤ 30 s, both for the whole command). The
probes run every time here (no probe cache): `autopar plan` keeps their answers for a second plan.

    python benchmarks/search_scaling.py [--no-ilp] [--only gpt2-124m,...]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import autopar
from autopar.models import build_model

CASES = [
    # (label, model, overrides, cluster, gpus, global batch, seq)
    ("gpt2-124m", "gpt2-124m", None, "dgx-h100", 8, 64, 1024),
    ("gpt3-175b", "gpt3-175b", None, "dgx-a100-80gb", 1024, 1536, 2048),
    ("llama3-70b", "llama3-70b", None, "dgx-h100", 512, 1024, 4096),
    ("llama3-405b", "llama3-405b", None, "dgx-h100", 8192, 2048, 8192),
    ("gpt-1t", "gpt", "layers=128,hidden=25600,heads=160,vocab=51200,seq_len=2048", "dgx-a100-80gb", 3072, 3072, 2048),
    # nothing fits one GPU without optimizer offload (issue #20): the search runs twice
    ("gpt3-13b-1", "gpt3-13b", None, "dgx-h100", 1, 8, 2048),
    # a mixture of experts (issue #20): expert parallelism is searched with dp, pp and recompute
    ("mixtral-8x7b", "mixtral-8x7b", None, "dgx-h100", 64, 512, 4096),
    # a million-token sequence (issue #20): context parallelism is offered and splits it across nodes
    ("llama3-8b-1m", "llama3-8b", "seq_len=1048576", "dgx-h100", 64, 64, 1048576),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-ilp", action="store_true")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; ILP {'off' if args.no_ilp else 'on'}")
    print(f"{'model':<11} {'cluster':<22} {'wall s':>6} {'capture s':>9} {'search s':>8} {'ILP vars':>8} {'refused':>7}  "
          f"chosen plan")
    for label, model, overrides, cluster_name, gpus, batch, seq in CASES:
        if args.only and label not in args.only.split(","):
            continue
        spec = build_model(model, overrides)
        cluster = autopar.load_cluster(cluster_name, gpus=gpus)
        started = time.perf_counter()
        # as `autopar plan` searches: the public API, with the runtime's capability table for this model
        planned = autopar.plan(spec.module, spec.example_inputs(1, seq), cluster=cluster, global_batch=batch,
                               loss_fn=spec.loss_fn, precision="bf16", name=label, use_ilp=not args.no_ilp)
        result = planned.search
        wall = time.perf_counter() - started
        captured = wall - result.search_s  # capture, facts and the runtime's probes
        chosen = result.best or result.ranked[0]
        s = chosen.strategy
        plan = (f"dp={s.dp} tp={s.tp} pp={s.pp} mb={s.microbatch} {s.schedule}"
                + (f" v={s.vp}" if s.vp > 1 else "") + f" zero={s.zero} rc={s.recompute}"
            + ("" if s.recompute_layers is None else "[" + "/".join(map(str, s.recompute_layers)) + "]")
            + f" sp={s.sp}" + (f" sp_inputs={s.sp_inputs}" if s.sp and s.sp_inputs != "gathered" else "")
            + (f" offload={s.offload}" if s.offload != "none" else "")
            + (f" ep={s.ep}" if s.ep > 1 else "") + (f" cp={s.cp} {s.cp_kind}" if s.cp > 1 else "") + ": "
                f"{chosen.evaluation.step_time_s:.2f} s/step, MFU {chosen.evaluation.mfu:.1%}"
                + ("" if chosen.evaluation.fits else " (does not fit)"))
        print(f"{label:<11} {f'{gpus} × {cluster.gpu.name}':<22} {wall:>6.1f} {captured:>9.1f} {result.search_s:>8.1f} "
              f"{result.ilp_variables:>8} {result.ilp_refused:>7}  {plan}", flush=True)


if __name__ == "__main__":
    main()
