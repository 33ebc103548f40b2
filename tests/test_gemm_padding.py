"""Misaligned linear layers of a user's model computed at an aligned width (issue #29): which layers,
that the loss and gradients are the model's own, that the runtime pads exactly where the cost model
prices it, and the price in closed form."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar.capabilities import gemm_padding_problem
from autopar.cost_models.compute import (DEFAULT_EFFICIENCY, MISALIGNED_GEMM_FACTOR, op_time_s,
                                         padding_copy_bytes)
from autopar.cost_models.backward_memory import padding_transient_bytes
from autopar.cost_models.facts import model_facts
from autopar.graph import trace
from autopar.graph.paddable import paddable_linears
from autopar.models import build_model
from autopar.plan_schema import Strategy
from autopar.runtime.gemm_padding import PaddedLinear, apply_gemm_padding

VOCAB = 2051  # misaligned and wide: padded to 2,176
CONFIG = f"layers=2,hidden=64,heads=4,vocab={VOCAB},seq_len=16,vocab_multiple=1"
ONE = Strategy(dp=1, tp=1, pp=1, microbatch=2, num_microbatches=1)


class Hooked(nn.Linear):
    pass


def test_only_plain_wide_misaligned_linears_with_aligned_inputs_are_padded():
    model = nn.ModuleDict({
        "head": nn.Linear(64, 2051), "aligned": nn.Linear(64, 2048), "narrow": nn.Linear(64, 1001),
        "odd_input": nn.Linear(63, 2051), "subclass": Hooked(64, 2051), "hooked": nn.Linear(64, 2051)})
    model["hooked"].register_forward_hook(lambda *args: None)
    assert paddable_linears(model) == {"head": (2051, 2176)}


def _pair(seed: int = 0):
    plain = build_model("gpt", CONFIG, device="cpu", seed=seed).module
    padded = copy.deepcopy(plain)
    assert apply_gemm_padding(padded, ONE, "bf16") == "head 2,051 -> 2,176 (outputs sliced back)"
    assert type(padded.head) is PaddedLinear and type(plain.head) is nn.Linear
    return plain, padded


@pytest.mark.parametrize("autocast", [False, True])
def test_padding_leaves_the_loss_and_gradients_unchanged(autocast):
    plain, padded = _pair()
    assert padded.state_dict().keys() == plain.state_dict().keys()  # checkpoints are the model's
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, padded):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids)
        assert logits.shape[-1] == VOCAB
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        losses.append(loss)
    # fp32: the same products up to summation order; bf16: both round the same inputs to bf16
    tolerance = dict(rtol=1e-2, atol=1e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[0], losses[1], **tolerance)
    for (name, p), q in zip(plain.named_parameters(), padded.parameters()):
        assert p.shape == q.shape, name
        torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=name)


def test_a_tied_head_keeps_its_tie_and_its_gradient():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32)
    plain = transformers.GPT2LMHeadModel(config).eval()  # no dropout: the two runs compare
    padded = copy.deepcopy(plain)
    assert "lm_head 2,051 -> 2,176" in apply_gemm_padding(padded, ONE, "bf16")
    assert padded.lm_head.weight is padded.transformer.wte.weight
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    for model in (plain, padded):
        model(ids, labels=ids, use_cache=False).loss.backward()
    torch.testing.assert_close(plain.transformer.wte.weight.grad, padded.transformer.wte.weight.grad,
                               rtol=1e-5, atol=1e-6)


def test_where_the_runtime_pads():
    assert gemm_padding_problem(ONE, "bf16") is None
    assert gemm_padding_problem(ONE, "fp32") == "not a 16-bit precision"
    assert gemm_padding_problem(ONE.model_copy(update={"tp": 2}), "bf16") == "tensor parallel shards"
    assert "pipeline stages" in gemm_padding_problem(ONE.model_copy(update={"pp": 2}), "bf16")
    plain = build_model("gpt", CONFIG).module
    assert apply_gemm_padding(copy.deepcopy(plain), ONE, "fp32") == "not applied (not a 16-bit precision)"
    aligned = build_model("gpt", "layers=2,hidden=64,heads=4,vocab=2051,seq_len=16").module  # the zoo pads itself
    assert apply_gemm_padding(aligned, ONE, "bf16") == "none needed"


@pytest.fixture(scope="module")
def facts():
    spec = build_model("gpt", CONFIG)
    graph = trace(spec.module, spec.example_inputs(2), loss_fn=spec.loss_fn, precision="bf16")
    assert graph.padded_linears == paddable_linears(spec.module) == {"head": (VOCAB, 2176)}
    return model_facts(graph, heads=4, vocab=VOCAB)


@pytest.fixture(scope="module")
def wide_facts():
    """The same head on a 512-wide model: at enough tokens its GEMMs are compute-bound, where the
    fallback kernel costs time (at width 64 they are bound by memory either way, and padding only
    adds its copies)."""
    spec = build_model("gpt", CONFIG.replace("hidden=64", "hidden=512"))
    graph = trace(spec.module, spec.example_inputs(2), loss_fn=spec.loss_fn, precision="bf16")
    return model_facts(graph, heads=4, vocab=VOCAB)


def _head_products(facts):
    post = next(u for u in facts.units if u.name == "post")
    assert post.padded_gemms
    products = [op for op in post.ops if op.gemm is not None and op.gemm.padding is not None]
    forward = next(op for op in products if op.phase == "forward")
    weight = next(op for op in products if op.phase == "backward" and op.weight_gradient)
    data = next(op for op in products if op.phase == "backward" and not op.weight_gradient)
    return forward, data, weight


def test_padded_products_are_priced_aligned_plus_their_copies(facts):
    forward, data, weight = _head_products(facts)
    gpu = autopar.load_cluster("dgx-h100", gpus=1).gpu
    padded = dataclasses.replace(DEFAULT_EFFICIENCY, padded_gemms=True)
    tokens = 4 * 16  # batch 4 of 16 positions
    assert padding_copy_bytes(forward, forward.gemm.at(4, 1)) == 8 * 2176 * 64  # the fp32 weight, read and written
    assert padding_copy_bytes(data, data.gemm.at(4, 1)) == 4 * 2176 * tokens  # the bf16 output gradient
    assert padding_copy_bytes(weight, weight.gemm.at(4, 1)) == 0  # reuses it
    from autopar.cost_models.compute import gemm_efficiency

    bandwidth = gpu.hbm_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.memory
    for op in (forward, data, weight):
        dims = op.gemm.at(4, 1)
        efficiency = gemm_efficiency(dims, DEFAULT_EFFICIENCY.matmul_for(gpu),
                                     DEFAULT_EFFICIENCY.gemm_half_dim_for(gpu, "bf16"))
        compute = op.flops * 4 / (gpu.peak_flops_per_s("bf16") * efficiency)
        memory = (op.activation_bytes * 4 + op.weight_bytes) / bandwidth
        copies = padding_copy_bytes(op, dims) / bandwidth
        launch = DEFAULT_EFFICIENCY.launch_overhead_s
        # eager: the fallback kernel's fraction; padded: aligned, after its copies (kernels of their own)
        assert op_time_s(op, gpu, "bf16", batch=4, tp=1, sp=False) == pytest.approx(
            max(compute / MISALIGNED_GEMM_FACTOR, memory) + launch, rel=1e-12)
        assert op_time_s(op, gpu, "bf16", batch=4, tp=1, sp=False, efficiency=padded) == pytest.approx(
            max(compute, memory) + copies + launch, rel=1e-12)
        # compiled without the runtime's padding: inductor pads the operands, at the same copies; an fp32
        # product is priced without copies, as eager prices it without the misaligned fraction
        compiled = dataclasses.replace(DEFAULT_EFFICIENCY, compiled=True)
        assert op_time_s(op, gpu, "bf16", batch=4, tp=1, sp=False, efficiency=compiled) == pytest.approx(
            max(compute, memory) + copies + launch, rel=1e-12)
        assert op_time_s(op, gpu, "fp32", batch=4, tp=1, sp=False, efficiency=compiled) == \
            op_time_s(op, gpu, "fp32", batch=4, tp=1, sp=False)
    assert padding_copy_bytes(forward, forward.gemm.at(4, 1)) > 0  # the check above charged copies
    # a tp shard of the layer: the copies are counted for the whole layer, so none is charged to a shard
    compiled = dataclasses.replace(DEFAULT_EFFICIENCY, compiled=True)
    assert all(op.tp_sharded for op in (forward, data, weight))  # the head splits over tp
    for op in (forward, data, weight):
        if op.tp_sharded:
            unmarked = dataclasses.replace(op, gemm=dataclasses.replace(op.gemm, padding=None))
            assert op_time_s(op, gpu, "bf16", batch=4, tp=2, sp=False, efficiency=compiled) == \
                op_time_s(unmarked, gpu, "bf16", batch=4, tp=2, sp=False, efficiency=compiled)


def test_plans_price_padding_where_the_runtime_pads_it(facts, wide_facts):
    cluster = autopar.load_cluster("dgx-h100", gpus=2)
    from autopar.cost_models.evaluate import evaluate

    assert padding_transient_bytes(facts, ONE) == 2 * 2176 * 2 * 16  # the widest padded output gradient
    assert padding_transient_bytes(facts, ONE.model_copy(update={"tp": 2})) == 0
    many = ONE.model_copy(update={"microbatch": 256})  # 4,096 tokens: the head's GEMMs compute-bound
    wide = evaluate(wide_facts, cluster, many, 256)
    unpadded = dataclasses.replace(wide_facts, units=tuple(dataclasses.replace(u, padded_gemms=False)
                                                           for u in wide_facts.units))
    assert wide.step_time_s < evaluate(unpadded, cluster, many, 256).step_time_s


def test_the_padded_copy_of_the_head_s_gradient_does_not_add_to_the_loss_s_gradients(facts):
    """The head's backward peaks at the loss's gradients or at the padded copy beside the 16-bit gradient
    it copies, whichever is larger (`backward_memory.head_gradient_bytes`): eager, two fp32 logits-sized
    gradients (8 B a logit) against 2 + 2·2176/2051 B; compiled whole, one bf16 gradient (2 B) against
    the copy written in its place (2·2176/2051 B)."""
    from autopar.cost_models.backward_memory import head_gradient_bytes, loss_gradient_bytes

    logits = 2 * 16 * VOCAB  # micro-batch 2, seq 16
    copy = 2 * 2176 * 2 * 16
    assert padding_transient_bytes(facts, ONE) == copy
    assert loss_gradient_bytes(facts, ONE) == 8 * logits
    assert head_gradient_bytes(facts, ONE) == 8 * logits  # eager: the fp32 gradients are the larger
    compiled = ONE.model_copy(update={"compile": True})
    assert loss_gradient_bytes(facts, compiled) == 2 * logits
    assert head_gradient_bytes(facts, compiled) == copy  # not 2·logits + copy
    off = ONE.model_copy(update={"gemm_padding": False})
    assert head_gradient_bytes(facts, off) == loss_gradient_bytes(facts, off) == 8 * logits


def test_the_runtime_pads_the_plans_layers_and_trains_alike(one_process_group, monkeypatch):
    """A bf16 plan at tp = pp = 1 runs the head padded, says so, and trains as the unpadded run."""
    from autopar.runtime import gemm_padding
    from autopar.runtime.parallelize import parallelize

    spec = build_model("gpt", CONFIG)
    result = autopar.plan(spec.module, spec.example_inputs(1), cluster=autopar.load_cluster("dgx-h100", gpus=1),
                          global_batch=4, loss_fn=spec.loss_fn, precision="bf16", name="gpt", seq_len=16,
                          strategy={"dp": 1, "tp": 1, "pp": 1, "zero": 0, "microbatch": 4})
    data = [torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def run():
        parallel = parallelize(spec.module, result.plan, loss_fn=spec.loss_fn, seed=0, precision="bf16")
        optimizer = parallel.build_optimizer(1e-2)
        return parallel, [parallel.train_step(batch, optimizer, max_grad_norm=1.0) for batch in data]

    parallel, padded = run()
    assert parallel.optimizations["GEMM padding"] == "head 2,051 -> 2,176 (outputs sliced back)"
    assert type(parallel.modules[0].head) is PaddedLinear
    monkeypatch.setattr(gemm_padding, "paddable_linears", lambda model: {})
    parallel, plain = run()
    assert parallel.optimizations["GEMM padding"] == "none needed"
    torch.testing.assert_close(torch.tensor(padded), torch.tensor(plain), rtol=1e-2, atol=0)


def test_gemm_padding_false_prices_the_fallback_as_a_what_if(facts, wide_facts):
    """`--strategy gemm_padding=false` prices software that runs the layer at its own width (plain
    PyTorch, autopar before it padded); the runtime refuses to run it."""
    from autopar.capabilities import Capabilities
    from autopar.cost_models.evaluate import evaluate
    from autopar.cost_models.strategy import parse_strategy

    off = ONE.model_copy(update=parse_strategy("gemm_padding=false"))
    assert not off.gemm_padding and gemm_padding_problem(off, "bf16") == "gemm_padding=false"
    cluster = autopar.load_cluster("dgx-h100", gpus=1)
    many = {"microbatch": 256}  # 4,096 tokens: the head's GEMMs compute-bound
    assert evaluate(wide_facts, cluster, off.model_copy(update=many), 256).step_time_s > \
        evaluate(wide_facts, cluster, ONE.model_copy(update=many), 256).step_time_s
    assert padding_transient_bytes(facts, off) == 0
    assert "gemm_padding=False prices a run of other software" in Capabilities().supports(off)
