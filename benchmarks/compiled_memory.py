"""What a compiled block keeps for backward, against what the cost model counts (issue #29, the memory
of a compiled step; measured on CPU, no GPU needed).

    python benchmarks/compiled_memory.py [--model gpt3-1.3b] [--batch 8] [--seq-len 2048]

One block of the zoo model goes through AOT autograd as torch.compile runs it, under bf16 autocast
on CPU, with two partitioners: the default one (what eager autograd saves) and the min-cut
rematerialization that inductor uses (it recomputes cheap elementwise ops in backward rather than
save their outputs). The forward graph's outputs beyond the block's own are what backward reads:
their bytes are printed beside the cost model's activation bytes for the same layer (`unit_activation_bytes`,
recompute none). On the H200 (benchmarks/gpu_runs/h200-2026-11-27-7f4beee.json) GPT-1.3B at micro-batch 8
allocated 56.6 GiB eager and 47.5 GiB compiled (whole stage with its loss): this separates the
blocks' share of that saving from the loss's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 2**30


def saved_bytes(block: torch.nn.Module, hidden: torch.Tensor, partition) -> tuple[int, int]:
    """(activations, weight copies): bytes of the tensors the forward graph hands to backward under
    `partition`, those shaped like one of the block's weights (autocast's 16-bit copies, which the
    memory model counts with the parameters) apart."""
    from torch._functorch.aot_autograd import aot_module

    shapes = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape)[::-1] for p in block.parameters()}
    found = {"activations": 0, "weights": 0}

    def forward_compiler(graph_module, _inputs):
        output = next(node for node in graph_module.graph.nodes if node.op == "output").args[0]
        for node in output[1:]:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                kind = "weights" if tuple(value.shape) in shapes else "activations"
                found[kind] += value.numel() * value.element_size()
        return graph_module

    compiled = aot_module(block, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm, partition_fn=partition)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(hidden)
    return found["activations"], found["weights"]


def main(argv: list[str] | None = None) -> int:
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.stage_costs import unit_activation_bytes
    from autopar.graph import trace
    from autopar.models import build_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt3-1.3b", help="a zoo GPT: its blocks take the hidden states alone")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    config = f"layers=2,seq_len={args.seq_len}"  # two blocks (one would not be a repeated layer), real on the CPU
    spec = build_model(args.model, config, device="cpu")
    graph = trace(spec.module, spec.example_inputs(1, args.seq_len), loss_fn=spec.loss_fn, precision="bf16")
    facts = model_facts(graph, heads=spec.config.heads, vocab=spec.config.padded_vocab)
    layer = next(unit for unit in facts.units if unit.layer_type is not None and unit.name.count(".") == 1)
    modelled = unit_activation_bytes(layer, args.batch, 1, False, "none")
    block = dict(spec.module.named_modules())[layer.name]
    import inspect

    if len(inspect.signature(block.forward).parameters) != 1:
        parser.error(f"{args.model}'s blocks take more than the hidden states ({type(block).__name__}): use a zoo GPT")
    print(f"{args.model}, one block ({layer.name}), micro-batch {args.batch} x {args.seq_len}, bf16 autocast on CPU")
    print(f"  cost model (trace, recompute none): {modelled / GiB:6.3f} GiB")
    with FakeTensorMode(allow_non_fake_inputs=True):
        hidden = torch.randn(args.batch, args.seq_len, spec.config.hidden, requires_grad=True)
        for name, partition in (("default partition (eager's saved tensors)", default_partition),
                                ("min-cut partition (inductor's)", min_cut_rematerialization_partition)):
            started = time.perf_counter()
            size, weights = saved_bytes(block, hidden, partition)
            print(f"  {name}: {size / GiB:6.3f} GiB ({size / modelled:.2f} of the model's; weight copies "
                  f"{weights / GiB:.3f} GiB apart; {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
