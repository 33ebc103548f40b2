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
