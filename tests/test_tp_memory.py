"""What a tensor-parallel rank keeps for backward, measured on two gloo ranks, against the cost model.

Each tensor autograd saves during one step's forward is counted once by its storage (parameters left
out) and charged to the layer running when it was saved. With sequence parallelism the runtime's
column-parallel projections keep the input they gather whole: the model counts it so
(`OpFacts.gathered_bytes`), where Megatron-LM's layout, which keeps the shard, undercounts it."""

from __future__ import annotations

import pytest
import torch

from parity_harness import make_plan, run_plans

CONFIG = dict(layers=3, hidden=64, heads=4, vocab=128, seq_len=32)
MICROBATCH = 2


def saved_per_layer(job: dict) -> dict[str, int]:
    """This rank's bytes saved for backward in one forward, per layer (`layers.N`) and the rest."""
    from torch.distributed.tensor import DTensor

    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    spec = build_model("gpt", job["overrides"])
    parallel = parallelize(spec.module, Plan.from_json(job["plan"]), loss_fn=spec.loss_fn, seed=0)
    module = parallel.modules[0]

    def storage(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.untyped_storage()

    parameters = {storage(p).data_ptr() for p in module.parameters()}
    running, seen, saved = ["other"], set(), {}
    for name, child in module.named_modules():
        if name.startswith("layers.") and name.count(".") == 1:
            child.register_forward_pre_hook(lambda m, args, name=name: running.__setitem__(0, name))
            child.register_forward_hook(lambda m, args, out: running.__setitem__(0, "other"))

    def pack(tensor):
        held = storage(tensor)
        if held.data_ptr() not in parameters and held.data_ptr() not in seen:
            seen.add(held.data_ptr())
            saved[running[0]] = saved.get(running[0], 0) + held.nbytes()
        return tensor

    batch = torch.randint(0, CONFIG["vocab"], (MICROBATCH, CONFIG["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        parallel.forward_backward(parallel.local_batch(batch))
    return saved


class _Alive:
    """Storages made during forward, by the layer running, and which of them outlive it into backward.

    Saved-tensor hooks see nothing a block's own hooks take (`sp_inputs=regathered` swaps its gathered
    input for the shard there), so this counts what stays allocated instead: every op's outputs
    (DTensors by their local tensors) are watched by their storage, and when backward's first op runs,
    the bytes still alive are summed per layer. Autocast's 16-bit copies of the weights are left out:
    the model prices them with the weights (`cost_models.memory`), not with a layer's activations."""

    def __init__(self, running: list[str], parameters: set[int]) -> None:
        self.running, self.parameters, self.watched, self.alive = running, parameters, {}, None
        self.weight_copies: set[int] = set()  # storages of autocast's weight copies (and their views)

    def mode(self):
        import weakref

        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                backward = torch._C._current_autograd_node() is not None
                if backward and tracker.alive is None:
                    tracker.alive = {}
                    for ref, size, layer in tracker.watched.values():
                        if ref() is not None:
                            tracker.alive[layer] = tracker.alive.get(layer, 0) + size
                out = func(*args, **(kwargs or {}))
                weight_copy = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) and (
                    (args[0]._local_tensor if isinstance(args[0], DTensor) else args[0]).untyped_storage()._cdata
                    in tracker.parameters)
                if not backward:
                    for leaf in tree_leaves(out):
                        if isinstance(leaf, torch.Tensor):
                            local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
                            held = local.untyped_storage()
                            if weight_copy:
                                tracker.weight_copies.add(held._cdata)
                            if held._cdata in tracker.weight_copies:
                                continue
                            known = tracker.watched.get(held._cdata)
                            # a storage freed in forward may leave its address to a new one
                            if (known is None or known[0]() is None) and held._cdata not in tracker.parameters:
                                tracker.watched[held._cdata] = (weakref.ref(held), held.nbytes(), tracker.running[0])
                return out

        return Mode()


def alive_per_layer(job: dict) -> dict[str, int]:
    """This rank's bytes made in each layer's forward and still allocated when backward starts (`job`'s
    precision: fp32 unless it says)."""
    from torch.distributed.tensor import DTensor

    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    if job.get("family") == "gptj":
        model, loss_fn, layers = gptj(), gptj_loss, "transformer.h."
    else:
        spec = build_model("gpt", job["overrides"])
        model, loss_fn, layers = spec.module, spec.loss_fn, "layers."
    parallel = parallelize(model, Plan.from_json(job["plan"]), loss_fn=loss_fn, seed=0,
                           precision=job.get("precision", "fp32"))
    module = parallel.modules[0]
    running = ["other"]
    for name, child in module.named_modules():
        if name.startswith(layers) and name.count(".") == layers.count("."):
            child.register_forward_pre_hook(lambda m, args, name=name: running.__setitem__(0, name))
            child.register_forward_hook(lambda m, args, out: running.__setitem__(0, "other"))
    parameters = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage()._cdata for p in module.parameters()}
    tracker = _Alive(running, parameters)
    batch = torch.randint(0, CONFIG["vocab"], (MICROBATCH, CONFIG["seq_len"]), generator=torch.Generator().manual_seed(0))
    local = parallel.local_batch(batch)
    with tracker.mode():
        parallel.forward_backward(local)
    return tracker.alive


def gptj() -> torch.nn.Module:
    """A tiny Hugging Face GPT-J: a parallel block, whose one norm feeds attention and MLP alike."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTJConfig(vocab_size=CONFIG["vocab"], n_embd=CONFIG["hidden"], n_head=CONFIG["heads"],
                                     rotary_dim=4, n_layer=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False, attn_implementation="eager", bos_token_id=0,
                                     eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.GPTJForCausalLM(config)


def gptj_loss(output, ids: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


@pytest.fixture(scope="module")
def alive():
    """Per layer, bytes alive into backward, keeping gathered inputs and keeping shards (tp = 2, sp)."""
    plans = {inputs: make_plan("gpt", CONFIG, dict(dp=1, tp=2, pp=1, sp=True, zero=0, recompute="none",
                                                    microbatch=MICROBATCH, sp_inputs=inputs), world=2,
                               global_batch=MICROBATCH)
             for inputs in ("gathered", "regathered")}
    jobs = [dict(plan=plan.to_json(), overrides=CONFIG) for plan in plans.values()]
    results = run_plans(2, jobs, runner=alive_per_layer)
    return {inputs: (plan, ranks) for (inputs, plan), ranks in zip(plans.items(), results)}


def test_kept_shards_are_what_the_model_counts(alive):
    """Keeping the sequence shards (`sp_inputs=regathered`) keeps each layer's counted bytes, which are
    the gathered plan's less (tp − 1)/tp of the gathered norm outputs. The gathered plan, measured the
    same way, checks the instrument against the saved-tensor count above."""
    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.stage_costs import unit_gathered_bytes, unit_kept_bytes
    from autopar.graph import trace
    from autopar.models import build_model

    spec = build_model("gpt", CONFIG)
    facts = model_facts(trace(spec.module, spec.example_inputs(MICROBATCH), loss_fn=spec.loss_fn, precision="fp32"))
    layers = [facts.units[i] for i in facts.layer_units]
    for inputs, (plan, ranks) in alive.items():
        for rank, kept in enumerate(ranks):
            for layer in layers:
                counted = unit_kept_bytes(layer, plan.strategy, "none")[0]
                assert kept[layer.name] == pytest.approx(counted, rel=0.01), (inputs, rank, layer.name)
    gathered, regathered = alive["gathered"][1][0], alive["regathered"][1][0]
    for layer in layers:
        saved = unit_gathered_bytes(layer, MICROBATCH) / 2  # of each whole gathered input, the other rank's half
        assert saved > 0
        assert gathered[layer.name] - regathered[layer.name] == pytest.approx(saved, rel=0.01), layer.name


@pytest.fixture(scope="module")
def measured():
    plans = {sp: make_plan("gpt", CONFIG, dict(dp=1, tp=2, pp=1, sp=sp, zero=0, recompute="none",
                                                microbatch=MICROBATCH), world=2, global_batch=MICROBATCH)
             for sp in (False, True)}
    jobs = [dict(plan=plan.to_json(), overrides=CONFIG) for plan in plans.values()]
    results = run_plans(2, jobs, runner=saved_per_layer)
    return {sp: (plan, ranks) for (sp, plan), ranks in zip(plans.items(), results)}


@pytest.mark.parametrize("sp", [False, True])
def test_each_layer_keeps_what_the_model_counts(measured, sp):
    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.stage_costs import unit_kept_bytes
    from autopar.graph import trace
    from autopar.models import build_model

    plan, ranks = measured[sp]
    spec = build_model("gpt", CONFIG)
    facts = model_facts(trace(spec.module, spec.example_inputs(MICROBATCH), loss_fn=spec.loss_fn, precision="fp32"))
    layers = [facts.units[i] for i in facts.layer_units]
    for rank, saved in enumerate(ranks):
        for layer in layers:
            counted = unit_kept_bytes(layer, plan.strategy, "none")[0]
            assert saved[layer.name] == pytest.approx(counted, rel=0.01), (sp, rank, layer.name)
            if sp:  # Megatron-LM's shards: the gathered norm outputs half of what they are, at tp = 2
                shards = unit_kept_bytes(layer, plan.strategy.model_copy(update={"sp_inputs": "shards"}), "none")[0]
                assert saved[layer.name] > 1.05 * shards


def test_a_block_input_is_gathered_once_and_cast_once(gpt_256):
    """Under autocast the runtime casts a block's input to 16 bits once, then gathers it once for all of
    its column-parallel projections (q, k and v read one tensor): one 16-bit copy is counted whole."""
    _, graph, facts = gpt_256
    layer = facts.units[facts.layer_units[0]]
    norms = [op for op in layer.forward_ops if op.gathered_bytes]
    assert len(norms) == 2  # the attention's input and the MLP's: each norm's output
    for op in norms:
        assert op.autocast_gathered_bytes == pytest.approx(op.gathered_bytes)  # 16 bits, one copy, like the trace
    attention_norm = norms[0]
    assert attention_norm.autocast_saved_bytes >= 3 * attention_norm.autocast_gathered_bytes  # q, k, v's copies


def test_selective_recompute_rebuilds_a_second_gathered_copy_past_one_sequence(gpt_256):
    """Recomputing a layer cuts the gather it saved into sequences again (a chunk and a cat the policy
    does not save): with more than one sequence per rank, a second whole copy is held while the layer is
    differentiated; with one, the gather is the copy."""
    from autopar.cost_models.stage_costs import unit_activation_bytes, unit_gathered_bytes, unit_kept_bytes
    from autopar.plan_schema import Strategy

    _, _, facts = gpt_256
    layer = facts.units[facts.layer_units[0]]
    for batch in (1, 2):
        s = Strategy(dp=1, tp=2, pp=1, sp=True, microbatch=batch, num_microbatches=1, recompute="selective")
        _, transient = unit_kept_bytes(layer, s, "selective")
        rebuilt = unit_activation_bytes(layer, batch, 2, True, "none") - unit_activation_bytes(
            layer, batch, 2, True, "selective_saved")
        second = unit_gathered_bytes(layer, batch) if batch > 1 else 0.0
        assert unit_gathered_bytes(layer, batch) > 0
        assert transient == pytest.approx(rebuilt + second)


class _Block(torch.nn.Module):
    """A column- then row-parallel block; `scale_in_place` changes its gathered input before fc1 reads it."""

    def __init__(self, scale_in_place: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.scale_in_place = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), scale_in_place

    def forward(self, x):
        if self.scale_in_place:
            x.mul_(3.0)
        return self.fc2(torch.relu(self.fc1(x)))


def in_place_gradients(job: dict) -> dict:
    """fc1's weight gradient on this rank, the block input's shard changed in place inside the block
    (its gathered copy) or after it (the shard itself); an error's message where backward raises one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.tensor_parallel.module_rules import apply_tensor_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    block = _Block(job["where"] == "inside")
    placements = {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)", "fc2.bias": "R"}
    apply_tensor_parallel(block, init_device_mesh("cpu", (world,)), placements, sp=True, head_path=None,
                          vocab_parallel_loss=False, shard_layers=job["shard_layers"])
    inputs = torch.randn(2, 4 * world, 8, generator=torch.Generator().manual_seed(1))
    leaf = inputs.chunk(world, dim=1)[rank].clone().requires_grad_()
    shard = leaf * 2
    out = block(shard)
    if job["where"] == "after":
        shard.add_(100.0)
    loss = (out.to_local() if hasattr(out, "to_local") else out).pow(2).sum()
    try:
        loss.backward()
    except RuntimeError as error:
        return {"error": str(error)}
    return {"grad": block.fc1.weight.grad.to_local().clone()}


def test_kept_shards_refuse_what_was_changed_in_place():
    """Saved-tensor hooks bypass autograd's check for tensors changed in place: a gathered input changed
    inside the block is kept as it is (the gradients are those of keeping it), and a shard changed after
    the block fails backward with autograd's message, never with wrong gradients."""
    jobs = [dict(where=where, shard_layers=layers) for where in ("inside", "after") for layers in (None, ("",))]
    results = run_plans(2, jobs, runner=in_place_gradients)
    inside_gathered, inside_kept, after_gathered, after_kept = results
    for gathered, kept in zip(inside_gathered, inside_kept):
        torch.testing.assert_close(kept["grad"], gathered["grad"])
    for gathered, kept in zip(after_gathered, after_kept):
        assert "grad" in gathered
        assert "modified by an inplace operation" in kept["error"]


def _bf16_plan(strategy: dict, world: int):
    return make_plan("gpt", CONFIG, {**strategy, "zero": 0, "recompute": "none", "microbatch": MICROBATCH}, world,
                     MICROBATCH, precision="bf16")


def test_under_autocast_a_layer_keeps_at_most_what_the_model_counts():
    """bf16 autocast (on the CPU), weights' copies left out: one rank keeps what the model counts alone,
    and at tp = 2 with and without sequence parallelism, gathered or regathered: the module rules cast
    a block's input once for all its projections (`OpFacts.gathered_readers`, `casts_once`). Counted a
    cast per projection, as a DTensor realization or an unknown one is priced, it is over by up to a
    fifth, never under."""
    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.stage_costs import unit_kept_bytes
    from autopar.graph import trace
    from autopar.models import build_model

    spec = build_model("gpt", CONFIG)
    facts = model_facts(trace(spec.module, spec.example_inputs(MICROBATCH), loss_fn=spec.loss_fn, precision="bf16"))
    layers = [facts.units[i] for i in facts.layer_units]
    single = _bf16_plan({"dp": 1, "tp": 1, "pp": 1}, 1)
    (alone,), = run_plans(1, [dict(plan=single.to_json(), overrides=CONFIG, precision="bf16")], runner=alive_per_layer)
    for layer in layers:
        assert alone[layer.name] == pytest.approx(unit_kept_bytes(layer, single.strategy, "none", autocast=True)[0],
                                                  rel=0.01), layer.name
    plans = [_bf16_plan({"dp": 1, "tp": 2, "pp": 1, "sp": sp, **({"sp_inputs": inputs} if sp else {})}, 2)
             for sp, inputs in ((False, None), (True, "gathered"), (True, "regathered"))]
    results = run_plans(2, [dict(plan=plan.to_json(), overrides=CONFIG, precision="bf16") for plan in plans],
                        runner=alive_per_layer)
    for plan, ranks in zip(plans, results):
        for kept in ranks:
            for layer in layers:
                counted = unit_kept_bytes(layer, plan.strategy, "none", autocast=True, casts_once=True)[0]
                assert counted == pytest.approx(kept[layer.name], rel=0.01), (plan.strategy.sp_inputs, layer.name)
                each = unit_kept_bytes(layer, plan.strategy, "none", autocast=True, casts_once=False)[0]
                if plan.strategy.sp:  # sp runs the module rules only: counted once either way
                    assert each == counted
                else:
                    assert kept[layer.name] * 1.05 < each <= 1.2 * kept[layer.name], layer.name


@pytest.mark.parametrize("family, realization", [("gpt", "modules"), ("bert", "dtensor")])
def test_the_search_counts_one_cast_only_where_the_module_rules_run(family, realization):
    """At tp = 2 without sp under bf16 autocast, the zoo GPT runs the module rules: its plan counts each
    block's input cast once, and a cast per projection would add exactly the copies they leave out.
    Hugging Face BERT (separate query, key and value projections) runs through DTensor, which casts per
    projection: counted so."""
    import autopar
    from autopar.cost_models.collectives import head_vocab
    from autopar.cost_models.evaluate import evaluate
    from autopar.cost_models.stage_costs import unit_kept_bytes

    strategy = dict(dp=1, tp=2, pp=1, sp=False, zero=0, recompute="none", microbatch=MICROBATCH)
    if family == "gpt":
        from autopar.models import build_model

        spec = build_model("gpt", CONFIG)
        module, example, loss_fn = spec.module, spec.example_inputs(1), spec.loss_fn
        hints = dict(seq_len=CONFIG["seq_len"], heads=CONFIG["heads"], vocab=spec.config.padded_vocab)
    else:
        from hf_families import SEQ, build, example_input, loss_for, vocab_of

        module, example, loss_fn = build(family), (example_input(family),), loss_for(family)
        hints = dict(seq_len=SEQ, heads=4, vocab=vocab_of(family))
    result = autopar.plan(module, example, cluster=autopar.load_cluster("dgx-h100", gpus=2), global_batch=MICROBATCH,
                          strategy=strategy, loss_fn=loss_fn, precision="bf16", name=family, use_ilp=False, **hints)
    assert result.plan.tp_realization == realization
    chosen = result.chosen.evaluation
    assert chosen.autocast_activations and chosen.block_casts_once == (realization == "modules")
    stages = [list(units) for units in result.chosen.stages]
    vocab = head_vocab(result.facts, chosen.strategy) if realization == "modules" else None

    def activations(tp_realization):
        return evaluate(result.facts, result.cluster, chosen.strategy, MICROBATCH, stages=stages, vocab=vocab,
                        tp_realization=tp_realization).memory[0].activations

    assert activations(realization) == pytest.approx(chosen.memory[0].activations)
    layers = [unit for units in stages for unit in units if unit.layer_type is not None]
    extra = sum(unit_kept_bytes(u, chosen.strategy, "none", autocast=True)[0]
                - unit_kept_bytes(u, chosen.strategy, "none", autocast=True, casts_once=True)[0] for u in layers)
    assert extra > 0  # q, k and v read one norm's output
    difference = activations(None) - chosen.memory[0].activations
    assert difference == pytest.approx(extra if realization == "modules" else 0.0, abs=1.0)


def test_a_parallel_block_keeps_one_cast_per_module_reading_its_norm():
    """GPT-J's one norm feeds attention's q, k, v and the MLP's input projection: the module rules cast
    it once per module, two copies (a review found them counted as one). Measured under bf16 autocast
    on one process and on two gloo ranks at tp = 2: the model counts GPT-J's layer over by a sharded
    part at tp = 1 (its attention), which halves at tp = 2, and nothing else: counting one copy, or
    four, would miss that by one 16-bit copy of the norm's output, or add two. (With sp GPT-J's dry
    run fails, so the search offers it none.)"""
    import autopar
    from autopar.cost_models.stage_costs import unit_kept_bytes

    over = {}
    for tp in (1, 2):
        result = autopar.plan(gptj(), (torch.zeros(1, CONFIG["seq_len"], dtype=torch.long, device="meta"),),
                              cluster=autopar.load_cluster("dgx-h100", gpus=tp), global_batch=MICROBATCH,
                              strategy=dict(dp=1, tp=tp, pp=1, zero=0, recompute="none", microbatch=MICROBATCH),
                              loss_fn=gptj_loss, precision="bf16", name="gptj", seq_len=CONFIG["seq_len"],
                              heads=CONFIG["heads"], vocab=CONFIG["vocab"], use_ilp=False)
        assert tp == 1 or result.plan.tp_realization == "modules"
        layers = [unit for unit in result.facts.units if unit.layer_type is not None]
        norm = next(op for op in layers[0].forward_ops if op.gathered_readers)
        assert (norm.gathered_readers, norm.gathered_blocks) == (4, 2)
        (ranks,) = run_plans(tp, [dict(plan=result.plan.to_json(), family="gptj", precision="bf16")],
                             runner=alive_per_layer)
        over[tp] = [unit_kept_bytes(layer, result.plan.strategy, "none", autocast=True, casts_once=True)[0]
                    - kept[layer.name] for kept in ranks for layer in layers]
    copy = MICROBATCH * CONFIG["seq_len"] * CONFIG["hidden"] * 2
    assert min(over[1]) > 2 * copy  # the sharded part the model over-counts on one process
    for difference in over[2]:
        assert difference == pytest.approx(over[1][0] / 2, rel=0.01)


def test_what_a_module_reads_beside_its_input_is_cast_per_projection():
    """A cross-attention block's q reads the decoder stream, which the module rules cast once for
    the module, and its k and v read the encoder's output, which each casts for itself: counted so
    (`OpFacts.gathered_blocks`, a review's finding), per reading module, never one copy for all."""
    from autopar.cost_models.facts import model_facts
    from autopar.graph import trace

    class CrossBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))
            self.o = torch.nn.Linear(16, 16)

        def forward(self, x, memory):
            scores = self.q(x) @ self.k(memory).transpose(1, 2)
            return self.o(scores.softmax(-1) @ self.v(memory))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.LayerNorm(16)
            self.decoder = torch.nn.LayerNorm(16)
            self.blocks = torch.nn.ModuleList(CrossBlock() for _ in range(2))

        def forward(self, x):
            memory, h = self.encoder(x), self.decoder(x)
            for block in self.blocks:
                h = h + block(h, memory)
            return h

    graph = trace(Model(), (torch.randn(2, 4, 16),), loss_fn=lambda out, x: out.pow(2).mean(), precision="bf16")
    ops = {op.name: op for unit in model_facts(graph).units for op in unit.forward_ops if op.gathered_readers}
    encoder = next(op for name, op in ops.items() if op.gathered_readers == 4)  # k and v of both blocks
    assert encoder.gathered_blocks == 4
    decoder = [op for op in ops.values() if op.gathered_readers == 1]  # each block's q: its own input
    assert decoder and all(op.gathered_blocks == 1 for op in decoder)
