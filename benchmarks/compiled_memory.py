"""What a stage compiled whole keeps for backward, against what the cost model counts (issue #29, the
memory of a compiled step; measured on CPU, no GPU needed). The source of `cost_models/compiled_stage.py`.

    python benchmarks/compiled_memory.py [--model gpt3-1.3b] [--model-config ...] [--batch 8] [--seq-len 2048]
    python benchmarks/compiled_memory.py --model llama --model-config layers=16,hidden=2048,heads=16,kv_heads=8,vocab=128256 --batch 4

The zoo model with its loss goes through AOT autograd as torch.compile runs it (inductor's
decompositions), on fake tensors under bf16 autocast on CPU, with two partitioners: the default one
and the min-cut rematerialization that inductor uses (it recomputes cheap ops in backward rather than
save their outputs). The forward graph's outputs beyond the loss are what backward reads; autocast's
16-bit weight copies among them are counted apart (the memory model counts them with the weights).
The model is built with two and then three layers: the difference is one layer's share, the rest is
the embedding, the final norm, the head and the loss. Each is printed beside the cost model's traced
activations for the same part (`unit_activation_bytes`, recompute none).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 2**30


def saved_bytes(model: str, config: str, batch: int, seq_len: int, partition,
                precision: str = "bf16") -> tuple[int, int]:
    """(activations, weight copies): bytes of the tensors the compiled forward hands to backward."""
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.models import build_model

    found = {"activations": 0, "weights": 0}
    with FakeTensorMode():
        spec = build_model(model, config, device="cpu")
        named = dict(spec.module.named_parameters()) | dict(spec.module.named_buffers())

        def forward_loss(*tensors):
            *states, x = tensors
            logits = torch.func.functional_call(spec.module, dict(zip(named, states)), (x,))
            return spec.loss_fn(logits, x)

        def forward_compiler(graph_module, _inputs):
            nodes = list(graph_module.graph.nodes)
            states = set([node for node in nodes if node.op == "placeholder"][:len(named)])
            output = next(node for node in nodes if node.op == "output").args[0]
            for node in output[1:]:
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    kind = "weights" if _of_a_weight(node, states) else "activations"
                    found[kind] += value.numel() * value.element_size()
            return graph_module

        compiled = aot_function(forward_loss, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                                partition_fn=partition, decompositions=select_decomp_table())
        tokens = torch.randint(0, spec.config.vocab, (batch, seq_len))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            compiled(*named.values(), tokens)
    return found["activations"], found["weights"]


def _of_a_weight(node, states) -> bool:
    """Whether a saved tensor is a weight's copy: a cast or view chain from a parameter input."""
    while node.op == "call_function" and node.args and hasattr(node.args[0], "op"):
        if "convert_element_type" not in str(node.target) and "_to_copy" not in str(node.target) \
                and not any(view in str(node.target) for view in ("permute", ".t.", "transpose", "view")):
            return False
        node = node.args[0]
    return node in states


def traced_bytes(model: str, config: str, batch: int, seq_len: int, precision: str = "bf16") -> tuple[float, float]:
    """(one layer, the rest): the cost model's activation bytes, recompute none."""
    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.stage_costs import unit_activation_bytes
    from autopar.graph import trace
    from autopar.models import build_model

    spec = build_model(model, config)
    graph = trace(spec.module, spec.example_inputs(1, seq_len), loss_fn=spec.loss_fn, precision=precision,
                  seq_len=seq_len)
    facts = model_facts(graph, heads=spec.config.heads, kv_heads=spec.config.kv_heads,
                        vocab=spec.config.padded_vocab)
    sizes = {unit.name: unit_activation_bytes(unit, batch, 1, False, "none") for unit in facts.units}
    layer = next(size for unit, size in zip(facts.units, sizes.values()) if unit.layer_type is not None)
    return layer, sum(sizes.values()) - layer * sum(1 for unit in facts.units if unit.layer_type is not None)


def measure(model: str, config: str | None, batch: int, seq_len: int,
            precision: str = "bf16") -> dict[str, dict[str, float]]:
    """Per partitioner: one layer's saved bytes and the rest's (two and three layers apart), with the
    weight copies of one layer; and the cost model's traced bytes for the same parts."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    configs = [",".join(filter(None, [config, f"layers={layers}", f"seq_len={seq_len}"])) for layers in (2, 3)]
    layer, rest = traced_bytes(model, configs[0], batch, seq_len, precision)
    result = {"traced": {"layer": layer, "rest": rest}}
    for name, partition in (("default", default_partition), ("min-cut", min_cut_rematerialization_partition)):
        (two, two_copies), (three, three_copies) = (saved_bytes(model, text, batch, seq_len, partition, precision)
                                                    for text in configs)
        result[name] = {"layer": three - two, "rest": two - 2 * (three - two), "layer_copies": three_copies - two_copies}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt3-1.3b", help="a zoo model (GPT or Llama family)")
    parser.add_argument("--model-config", default=None, help="overrides, as --model-config takes them")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: autocast over fp32 weights, as the runtime runs it; fp32: no autocast")
    args = parser.parse_args(argv)
    from autopar.cost_models.compiled_stage import COMPILED_ACTIVATION_FACTOR, COMPILED_FP32_ACTIVATION_FACTOR

    started = time.perf_counter()
    result = measure(args.model, args.model_config, args.batch, args.seq_len, args.precision)
    traced = result["traced"]
    print(f"{args.model} ({args.model_config or 'zoo config'}), micro-batch {args.batch} x {args.seq_len}, "
          f"{'bf16 autocast' if args.precision == 'bf16' else 'fp32'} on CPU, fake tensors "
          f"({time.perf_counter() - started:.0f} s)")
    print(f"  cost model (trace, recompute none): a layer {traced['layer'] / GiB:.3f} GiB, "
          f"the rest {traced['rest'] / GiB:.3f} GiB")
    for name in ("default", "min-cut"):
        part = result[name]
        print(f"  {name} partition: a layer {part['layer'] / GiB:.3f} GiB ({part['layer'] / traced['layer']:.3f} "
              f"of the traced; weight copies {part['layer_copies'] / GiB:.3f} GiB apart), the rest "
              f"{part['rest'] / GiB:.3f} GiB")
    factor = COMPILED_ACTIVATION_FACTOR if args.precision == "bf16" else COMPILED_FP32_ACTIVATION_FACTOR
    print(f"  committed factor for {args.precision}: {factor} (the largest layer ratio measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
