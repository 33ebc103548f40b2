"""The runtime's answers `autopar.plan` needs before it searches: what tensor, pipeline and context
parallelism can run on this model (`tensor_parallel_probe`, or `capabilities` asking it at once;
`pipeline_probe`, `model_context_refusal`).

The costly ones (a tp dry run, the pipeline capture) are asked of shallow twins of a deep model
(`autopar.graph.twin`) and `remember`ed on disk (`autopar.probe_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

from autopar.cluster import ClusterSpec
from autopar.graph import OpGraph, trace
from autopar.graph.capture import TwinGraphs
from autopar.probe_cache import ProbeCache


def capabilities(model: nn.Module, example_inputs: Any, loss_fn, precision: str, graph: OpGraph, facts,
                  cluster: ClusterSpec, fixed: dict[str, Any], remember: Remember | None = None,
                  twins: TwinGraphs | None = None):
    """What the runtime can execute for this model. Tensor parallelism is decided by dry runs of the
    planned placements (runtime.tensor_parallel.realization) when a dry run is possible (one input tensor, a loss):
    DTensor through the model's own forward runs what the module rules refuse or what breaks on
    their local shards, priced from what it sends. One probe comes first, the Megatron layout at
    tp=2: when the module rules run it and send what their analytic ledger prices (in every precision:
    under autocast they send the low precision, runtime/tensor_parallel/autocast.py), the search keeps the static
    rules instead of dry-running every layout (seconds each: 5 s → 135 s for gpt3-13b on 64 GPUs).
    A head that reads one token (ViT's classifier) sends less than that ledger says; such a model is
    priced from dry runs. The probe's answer is `remember`ed (`autopar.probe_cache`). `twins`: the
    capture's graphs of shallow twins (`capture.TwinGraphs`), so a twin asked is not traced again."""
    probe = tensor_parallel_probe(model, example_inputs, loss_fn, precision, graph, facts, cluster, fixed, twins)
    if probe.ask is None:
        return probe.chosen(None)
    remember = remember or (lambda _kind, compute, **_arguments: compute())
    return probe.chosen(remember(TP_PROBE, probe.ask, **probe.arguments))


TP_PROBE = "tp-module-rules"  # the probe cache's name for `TensorParallelProbe.ask`'s answer


@dataclass(frozen=True)
class TensorParallelProbe:
    """The two capability tables `capabilities` chooses between, and the question that chooses:
    `ask()` is whether the module rules run the Megatron layout at tp=2 and send what they price
    (None: nothing to ask, the answer is known). `arguments`: what the answer depends on beyond
    the model (the probe cache's key). Split out so the question can be asked in a forked child
    (`autopar.api.plan`) while this process searches."""

    table: Any  # the module rules' static table
    dry: Any  # priced from dry runs; None when no dry run is possible
    ask: Callable[[], bool] | None
    arguments: dict[str, Any]

    def chosen(self, rules_run_as_priced: bool | None) -> Any:
        """The table for this answer of `ask` (None where nothing is asked)."""
        if self.dry is None or rules_run_as_priced:
            return self.table
        return self.dry


def tensor_parallel_probe(model: nn.Module, example_inputs: Any, loss_fn, precision: str, graph: OpGraph, facts,
                          cluster: ClusterSpec, fixed: dict[str, Any],
                          twins: TwinGraphs | None = None) -> TensorParallelProbe:
    """The question `capabilities` asks of this model, unasked (`TensorParallelProbe`)."""
    from autopar.cost_models.facts import model_facts
    from autopar.graph.twin import twin_answer
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.tp_placements import module_rules_refusal, planned_tp_placements

    table = capabilities_for(model)
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tp_possible = cluster.world_size > 1 and fixed.get("tp", 2) > 1
    if not tp_possible or loss_fn is None or len(inputs) != 1 or not hasattr(inputs[0], "shape"):
        return TensorParallelProbe(table, None, None, {})
    dry = capabilities_for(model, inputs[0], loss_fn, precision)
    if module_rules_refusal(table, graph, facts) is not None:
        return TensorParallelProbe(dry, None, None, {})

    def run_as_priced(asked: nn.Module) -> bool:
        """The probe on `asked`: the model, or a shallow twin of it (traced here)."""
        asked_graph, asked_facts, asked_table = graph, facts, table
        if asked is not model:
            asked_graph = (twins.graph(asked) if twins is not None else None) or trace(
                asked, example_inputs, loss_fn=loss_fn, precision=precision, name=graph.model_name,
                seq_len=graph.seq_len)
            asked_facts = model_facts(asked_graph, heads=facts.heads, kv_heads=facts.kv_heads, vocab=facts.vocab)
            asked_table = capabilities_for(asked)
        asked_dry = dry if asked is model else capabilities_for(asked, inputs[0], loss_fn, precision)
        probe = asked_dry.tp_realization(planned_tp_placements({}, asked_graph, asked_facts, 2), 2, False, 1)
        return probe.name == "modules" and probe.placements is None and _priced_as_sent(
            probe, asked_graph, asked_facts, cluster, asked_table)

    arguments = dict(precision=precision, seq_len=graph.seq_len, heads=facts.heads, kv_heads=facts.kv_heads,
                     vocab=facts.vocab, cluster=_two_gpus(cluster).model_dump(mode="json"))
    return TensorParallelProbe(table, dry, lambda: bool(twin_answer(model, run_as_priced)), arguments)


Remember = Callable[..., Any]  # remember(kind, compute, **arguments): compute()'s answer, perhaps stored


def remembering(cache: str | Path | ProbeCache | None, model: nn.Module, example_inputs: Any,
                loss_fn) -> Remembering:
    """`remember` over `cache` (None: computes every time), keyed by the model (`probe_cache.model_key`)."""
    from autopar.probe_cache import model_key

    if cache is None:
        return Remembering(None, None)
    return Remembering(cache if isinstance(cache, ProbeCache) else ProbeCache(cache),
                       model_key(model, example_inputs, loss_fn))


class Remembering:
    """A `Remember` over one model's entries of a probe cache (none: computes every time), which
    can also say whether an answer is stored without computing it."""

    def __init__(self, store: ProbeCache | None, base: str | None) -> None:
        self.store, self.base = store, base

    def __call__(self, kind: str, compute: Callable[[], Any], **arguments: Any) -> Any:
        if self.store is None:
            return compute()
        return self.store.answer(kind, self._key(arguments), compute)

    def knows(self, kind: str, **arguments: Any) -> bool:
        """Whether `kind`'s answer for these arguments is stored (a call would not compute it)."""
        return self.store is not None and self.store.stored(kind, self._key(arguments))

    def _key(self, arguments: dict[str, Any]) -> str | None:
        from autopar.probe_cache import probe_key

        return probe_key(self.base, **arguments)


def pipeline_probe(model: nn.Module, example_inputs: Any, loss_fn, remember: Remember,
                   answer: Callable[[], dict[str, Any]] | None = None):
    """`probe_pipeline`'s answer (its capture of the whole forward), remembered as plain data; asked of
    shallow twins (`autopar.graph.twin`) when the stages would be cut between the blocks of the stack
    the twins shorten. `answer`: computes `pipeline_answer` for this model (a forked child's, say)."""
    from autopar.runtime.pipeline.schedule import PipelineProbe

    found = remember("pipeline", answer or (lambda: pipeline_answer(model, example_inputs, loss_fn)))
    return PipelineProbe(found["refusal"], dict(found["training_settings"]), tuple(found["dropped_outputs"]))


def pipeline_answer(model: nn.Module, example_inputs: Any, loss_fn) -> dict[str, Any]:
    """What `pipeline_probe` remembers, computed: the refusal, training settings and dropped outputs."""
    from autopar.graph.twin import twin_answer
    from autopar.runtime.pipeline.schedule import probe_pipeline

    probe = twin_answer(model, lambda asked: probe_pipeline(asked, example_inputs, loss_fn)) \
        if _pipeline_cuts_block_stack(model) else probe_pipeline(model, example_inputs, loss_fn)
    return {"refusal": probe.refusal, "training_settings": dict(probe.training_settings),
            "dropped_outputs": list(probe.dropped_outputs)}


def _pipeline_cuts_block_stack(model: nn.Module) -> bool:
    """Whether the blocks pipeline stages are cut between are the children of `twin.block_stack`."""
    from autopar.graph.twin import block_stack
    from autopar.runtime.pipeline.schedule import repeated_blocks

    found, blocks = block_stack(model), repeated_blocks(model)
    return found is not None and len(blocks) == len(found[1]) \
        and all(block.rpartition(".")[0] == found[0] for block in blocks)


def model_context_refusal(model: nn.Module, loss_fn) -> str | None:
    """What the runtime's context parallelism refuses in this model whatever the strategy (its class,
    dropout, loss: `runtime.context_parallel.context_parallel_problem` at cp=2), so the search never
    offers a cp plan that `autopar run` would refuse."""
    from autopar.plan_schema import Strategy
    from autopar.runtime.context_parallel import context_parallel_problem

    probe = Strategy(dp=1, tp=1, pp=1, cp=2, microbatch=1, num_microbatches=1)
    return context_parallel_problem(model, probe, None, loss_fn)


def _priced_as_sent(probe, graph: OpGraph, facts, cluster: ClusterSpec, table) -> bool:
    """Whether the module rules' analytic ledger for one micro-batch at tp=2 is what the probe sent."""
    from autopar.searcher.search import search
    from autopar.searcher.tp_placements import same_tp_ledger

    # offload fixed: a model too large for two GPUs must not start the search's offload pass (its
    # ledger is all this asks for, and the best candidate or the closest one carries it)
    two = dict(dp=1, tp=2, pp=1, sp=False, zero=0, microbatch=1, recompute="none", offload="none")
    result = search(graph, facts, _two_gpus(cluster), 1, fixed=two, use_ilp=False, capabilities=table)
    candidate = result.best or (result.ranked[0] if result.ranked else None)
    return candidate is not None and same_tp_ledger(candidate, probe, facts)


def _two_gpus(cluster: ClusterSpec) -> ClusterSpec:
    from autopar.cluster import size_cluster

    return size_cluster(cluster, 2)
