"""The bytes a training step's vector ops move under autocast, against the 16-bit step the trace models.

    python benchmarks/autocast_bytes.py [--model gpt3-1.3b --config ... --batch 8 --seq-len 2048]

The cost model prices vector ops (elementwise, norms, reductions, the loss) at the bytes of the graph
traced in the compute dtype: a step whose weights and activations are all 16-bit. autopar's runtime
without ZeRO runs autocast over fp32 weights (`runtime.precision`). There the residual stream, the
norms and the loss stay fp32, and each linear's input is cast apart. So the same ops move more
bytes, which is the vector-op error the README's seventh-session section describes.

This script runs one step of a zoo model both ways on fake CPU tensors and counts, op by op, the
bytes each op reads and writes (its tensor arguments and results; views move none):
- the trace's step: the model in bf16, no autocast;
- the runtime's step: fp32 weights under `torch.autocast("cpu", torch.bfloat16)`.
GEMMs and attention are left out: their FLOPs price them. So are the weight casts and their
gradients' casts back, which `cost_models/weight_passes.py` prices. It prints bytes per op class
both ways, and the ratio of the totals: the factor vector ops move under autocast.

CPU autocast casts the same ops as CUDA's for the zoo's models. The norms' inputs are fp32 there
(the residual stream), so a norm runs in fp32 under either; attention is one fused op, and the
loss is fp32 under both.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The GPU rows' models (`benchmarks/gpu_suite.py`): GPT-1.3B, and its Llama of 1.5B
MODELS = {"gpt3-1.3b": None, "llama": "layers=16,hidden=2048,heads=16,kv_heads=8,vocab=128256,seq_len=2048"}
PRICED_APART = ("mm", "addmm", "bmm", "baddbmm", "linear", "scaled_dot_product", "attention")
# ops that relabel or allocate without moving data
METADATA_ONLY = {"_unsafe_view", "detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided",
                 "new_empty", "new_empty_strided"}


class Bytes(TorchDispatchMode):
    """Bytes read and written per op packet, vector ops only (see the module docstring)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weights = {id(w) for w in weights}
        self.weight_shapes = {tuple(w.shape) for w in weights}
        self.moved: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket.__name__
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if (not results or func.is_view or packet in METADATA_ONLY  # a query (prim.device) or a relabel
                or any(marker in packet for marker in PRICED_APART) or self._weight_cast(func, args, out)):
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)] + results
        self.moved[packet] += sum(t.numel() * t.element_size() for t in tensors)
        return out

    def _weight_cast(self, func, args, out) -> bool:
        """Autocast's cast of a weight, or of a weight's gradient back to fp32 (priced as weight passes)."""
        if func is not torch.ops.aten._to_copy.default:
            return False
        source = args[0]
        return id(source) in self.weights or (tuple(source.shape) in self.weight_shapes
                                              and source.dtype == torch.bfloat16 and out.dtype == torch.float32)


def step_bytes(model_name: str, config: str, batch: int, seq_len: int, autocast: bool) -> dict[str, float]:
    """One forward and backward on fake CPU tensors: vector-op bytes per op packet."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.models import build_model

    default = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.float32 if autocast else torch.bfloat16)  # the weights' dtype
        try:
            spec = build_model(model_name, config, device="cpu", seed=0)
        finally:
            torch.set_default_dtype(default)
        model = spec.module
        (tokens,) = spec.example_inputs(batch, seq_len, device="cpu")
        weights = list(model.parameters())
        counting = Bytes(weights)
        region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
        with counting:
            with region:
                loss = spec.loss_fn(model(tokens), tokens)
            loss.backward()
    return dict(counting.moved)


def compare(model_name: str, config: str, batch: int, seq_len: int) -> tuple[dict, dict, float]:
    traced = step_bytes(model_name, config, batch, seq_len, autocast=False)
    runtime = step_bytes(model_name, config, batch, seq_len, autocast=True)
    return traced, runtime, sum(runtime.values()) / sum(traced.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help=f"a zoo model (default: {', '.join(MODELS)})")
    parser.add_argument("--config", help="model overrides")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    for name in args.model or list(MODELS):
        config = args.config or MODELS.get(name)
        traced, runtime, ratio = compare(name, config, args.batch, args.seq_len)
        print(f"{name} ({config}), batch {args.batch} x {args.seq_len}: vector ops move {ratio:.2f}x the "
              f"16-bit step's bytes under autocast ({sum(runtime.values()) / 2**20:.1f} against "
              f"{sum(traced.values()) / 2**20:.1f} MiB)")
        print(f"  {'op':40} {'16-bit MiB':>10} {'autocast MiB':>12} {'ratio':>6}")
        for packet in sorted(set(traced) | set(runtime), key=lambda p: -runtime.get(p, 0.0)):
            before, after = traced.get(packet, 0.0), runtime.get(packet, 0.0)
            ratio_text = f"{after / before:6.2f}" if before else "   new"
            print(f"  {packet:40} {before / 2**20:10.2f} {after / 2**20:12.2f} {ratio_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
