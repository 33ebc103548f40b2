"""What planning does to go fast leaves no trace: the garbage collector's settings come back as they
were, and the pipeline simulator's cached pass orders are `rank_order`'s."""

import gc
import subprocess
import sys

import pytest

from autopar.cli import main
from autopar.cost_models.pipeline import _stage_orders, rank_order

PLAN_SMALL = ["plan", "--model", "gpt", "--model-config", "layers=2,hidden=64,heads=4,vocab=100,seq_len=32",
              "--global-batch", "8", "--cluster", "dgx-h100", "--gpus", "8", "--no-probe-cache"]


@pytest.mark.parametrize("strategy, code", [("tp=2", 0), ("tp=3", 2)])  # a plan, and a bad input
def test_plan_restores_the_collector(capsys, strategy, code):
    before = gc.get_threshold(), gc.isenabled()
    assert main([*PLAN_SMALL, "--strategy", strategy]) == code
    capsys.readouterr()
    assert (gc.get_threshold(), gc.isenabled()) == before
    assert gc.get_freeze_count() == 0  # nothing left out of later collections


def test_plan_runs_with_the_collector_off(capsys, monkeypatch):
    """The plan command turns automatic collection off while it plans (and back on after)."""
    import autopar

    seen = []
    real_plan = autopar.plan

    def plan(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(autopar, "plan", plan)
    assert gc.isenabled()
    assert main(PLAN_SMALL) == 0
    capsys.readouterr()
    assert seen == [False] and gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_importing_autopar_restores_the_collector(enabled):
    code = ("import gc\n" + ("" if enabled else "gc.disable()\n")
            + "import autopar\nprint(gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(enabled)


@pytest.mark.parametrize("schedule, pp, m, vp", [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("interleaved", 2, 4, 3),
                                                  ("interleaved", 4, 8, 2)])
def test_stage_orders_are_rank_orders_with_virtual_stages(schedule, pp, m, vp):
    orders = _stage_orders(schedule, pp, m, vp)
    assert len(orders) == pp
    for rank, order in enumerate(orders):
        expected = [(kind, chunk * pp + rank, mb) for kind, chunk, mb in rank_order(schedule, rank, pp, m, vp)]
        assert list(order) == expected
    assert _stage_orders(schedule, pp, m, vp) is orders  # computed once per shape


MOE = "layers=4,hidden=128,heads=4,kv_heads=2,vocab=512,seq_len=128,moe_experts=8,moe_top_k=2"
LONG = "layers=2,hidden=64,heads=8,kv_heads=8,vocab=96,seq_len=16384"


@pytest.mark.parametrize("config, gpus, batch, fixed", [
    (MOE, 16, 32, {}),  # ep and every schedule, free
    (MOE, 16, 32, {"pp": 2, "schedule": "zbv", "zero": 1}),
    (LONG, 16, 16, {}),  # cp offered
    (LONG, 16, 16, {"cp": 4, "cp_kind": "ulysses", "tp": 2}),
    (MOE, 16, 32, {"tp": 2, "recompute_layers": (1, 1)}),  # counts as given: drafts allowed
    (MOE, 16, 32, {"recompute_layers": 1, "pp": 2}),  # a count the enumeration converts: built as before
    (MOE, 16, 32, {"dropout": 0.1, "attention": "math"}),  # another software's profile: built as before
    (MOE, 16, 32, {"vp": 0, "pp": 2}),  # a value the schema refuses: no completion
    (MOE, 16, 32, {"tp": True}),  # a value the schema would convert (True -> 1): built as before
])
def test_drafts_give_the_valid_strategies_building_each_completion_gives(zoo_trace, monkeypatch, config, gpus,
                                                                         batch, fixed):
    """`valid_strategies` through drafts (`searcher.drafts`) and through a Strategy per completion: the same
    strategies (fields set included), count and rejections, or the same error."""
    import autopar.searcher.candidates as candidates
    from autopar.capabilities import RUNTIME_CAPABILITIES
    from autopar.cluster import load_cluster
    from autopar.errors import AutoparError

    family = "gpt" if config == LONG else "llama"
    _, _, facts = zoo_trace(family, config, batch=1)
    cluster = load_cluster("dgx-h100", gpus=gpus)

    def answer():
        try:
            valid, count, rejected = candidates.valid_strategies(facts, cluster, fixed, batch, layers=4,
                                                                 supports=RUNTIME_CAPABILITIES.supports)
        except AutoparError as error:
            return str(error)
        return [(s, s.model_fields_set) for s in valid], count, rejected

    drafted = answer()
    monkeypatch.setattr(candidates, "drafts_allowed", lambda *_: False)
    assert drafted == answer()


def test_the_ilp_reads_one_index_per_graph(zoo_trace):
    """`intra_op._graph_index`: built once per graph and equal to a fresh build; a copy of the graph
    (another object) gets its own, and a graph's index goes when the graph does."""
    import gc as collector

    from autopar.searcher import intra_op

    _, graph, _ = zoo_trace("gpt", "layers=2,hidden=64,heads=4,vocab=100,seq_len=32", batch=1)
    first = intra_op._graph_index(graph)
    assert intra_op._graph_index(graph) is first
    by_name, params, consumers = first
    assert list(by_name) == [node.name for node in graph.nodes] and list(params) == [p.name for p in graph.params]
    assert all(name in intra_op.input_names(node) for name, readers in consumers.items() for node in readers)
    copy = graph.model_copy(deep=True)
    assert intra_op._graph_index(copy) is not first and intra_op._graph_index(copy) == first
    key = id(copy)
    del copy
    collector.collect()
    assert key not in intra_op._GRAPH_INDEXES


def test_the_plan_command_freezes_what_is_alive_at_exit():
    """The interpreter's last full collection skips what the plan left alive: the command registers
    `gc.freeze` to run at exit, before any handler registered before it; nothing is frozen sooner."""
    code = ("import atexit, gc\n"
            "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count() > 0))\n"
            "from autopar.cli import main\n"
            f"args = {PLAN_SMALL!r}\n"
            "assert main(args) == 0 and main(args) == 0\n"
            "print('frozen before exit', gc.get_freeze_count() > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("frozen")]
    assert lines[0] == "frozen before exit False"
    assert lines[-1] == "frozen at exit True"
