"""`autopar.forked`: a computation in a forked child gives the answer (or the error) computing it here
gives, and the plan command's probes in children (the pipeline probe beside the trace, the tp probe
beside a search on its likely answer) plan what the serial probes plan."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

import pytest
import torch

import autopar
from autopar.forked import Forked
from autopar.models import build_model
from test_probe_cache import CalledTwice  # its first block runs again after the last: pp refused

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked only on Linux")


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_answer_comes_from_the_child():
    here = os.getpid()
    forked = Forked(lambda: (os.getpid(), [1, "two", {"three": 3.0}]))
    pid = forked._pid
    child, value = forked.result()
    assert pid is not None and child == pid != here  # computed over there
    assert value == [1, "two", {"three": 3.0}]
    assert _reaped(pid)


def test_an_error_in_the_child_is_met_here():
    calls = []

    def compute():
        calls.append(os.getpid())
        raise ValueError("the probe's own error")

    forked = Forked(compute)
    with pytest.raises(ValueError, match="the probe's own error"):
        forked.result()
    assert calls == [os.getpid()]  # computed again here (the child's call is in the child's memory)


def test_a_child_that_dies_is_computed_here():
    here = os.getpid()
    forked = Forked(lambda: os.getpid() if os.getpid() == here else os._exit(3))
    assert forked.result() == here


def test_a_cancelled_child_is_stopped_and_reaped():
    forked = Forked(lambda: time.sleep(60))
    pid = forked._pid
    started = time.perf_counter()
    forked.cancel()
    assert time.perf_counter() - started < 5 and _reaped(pid)
    forked.cancel()  # twice: nothing left to do


def test_a_dropped_child_is_stopped_and_reaped():
    forked = Forked(lambda: time.sleep(60))
    pid = forked._pid
    del forked  # an error between the fork and `result` drops it
    assert _reaped(pid)


def test_with_another_thread_alive_it_computes_here():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        forked = Forked(os.getpid)
        assert forked._pid is None and forked.result() == os.getpid()
    finally:
        stop.set()
        other.join()


def _chosen(result) -> dict:
    plan = result.plan.model_dump(mode="json")
    plan["provenance"].pop("created_at")
    return plan


def _zoo(config: str):
    spec = build_model("gpt", config)
    return spec.module, spec.example_inputs(1), spec.loss_fn


@pytest.mark.parametrize("model, refused", [
    (lambda: _zoo("layers=2,hidden=32,heads=4,vocab=96,seq_len=16"), False),  # the probe cuts the model
    (lambda: _zoo("layers=8,hidden=32,heads=4,vocab=96,seq_len=16"), False),  # ... asking shallow twins
    (lambda: (CalledTwice(), (torch.zeros(1, 8),), lambda output, _x: output.pow(2).mean()), True),
])
def test_the_plan_is_the_same_with_the_pipeline_probe_forked(model, refused, monkeypatch):
    import autopar.forked as forked
    import autopar.planning_probes as probes

    children, answered_here = [], []
    real_init, real_answer = forked.Forked.__init__, probes.pipeline_answer

    def counted(self, compute):
        real_init(self, compute)
        children.append(self._pid)

    def answer(*args):
        answered_here.append(os.getpid())  # a child's call is kept in the child's memory
        return real_answer(*args)

    monkeypatch.setattr(forked.Forked, "__init__", counted)
    monkeypatch.setattr(probes, "pipeline_answer", answer)
    module, inputs, loss_fn = model()
    results = []
    for fork in (False, True):
        results.append(autopar.plan(module, inputs, loss_fn=loss_fn, global_batch=8,
                                    cluster=autopar.load_cluster("dgx-h100", gpus=4), use_ilp=False, fork_probes=fork))
        assert len(answered_here) == 1  # the serial plan asked here; the forked one took the child's answer
    assert children and children[0] is not None  # the second plan forked its pipeline probe first
    serial, parallel = results
    assert parallel.capabilities.pipeline_refusal == serial.capabilities.pipeline_refusal
    assert bool(serial.capabilities.pipeline_refusal) == refused
    assert _chosen(parallel) == _chosen(serial)
    assert [c.evaluation.strategy for c in parallel.search.ranked] == [c.evaluation.strategy for c in serial.search.ranked]
    assert parallel.search.why_not == serial.search.why_not


def _tp_probe_counted(monkeypatch, answer=None):
    """Counts the tp probe's questions asked in this process (a child's are kept in the child's
    memory); `answer`: what the probe answers instead of its dry runs."""
    import autopar.planning_probes as probes

    asked_here = []
    real = probes.tensor_parallel_probe

    def counted(*args, **kwargs):
        found = real(*args, **kwargs)
        if found.ask is None:
            return found
        ask = found.ask if answer is None else (lambda: answer)
        return dataclasses.replace(found, ask=lambda: asked_here.append(os.getpid()) or ask())

    monkeypatch.setattr(probes, "tensor_parallel_probe", counted)
    return asked_here


@pytest.mark.parametrize("answer", [None, False])  # the probe's own answer (the rules run as priced); the other
def test_the_plan_is_the_same_with_the_tp_probe_forked(answer, monkeypatch, tmp_path):
    """The tp probe asked in a child while the search runs on the likely answer: the same plan, ranking
    and capabilities as the serial probe's; an answer other than the likely one searches again with
    it. The answer is remembered as the serial one is, and a remembered answer forks nothing."""
    import autopar.forked as forked
    import autopar.searcher.search as search_module
    from autopar.probe_cache import ProbeCache

    asked_here = _tp_probe_counted(monkeypatch, answer)
    children = []
    real_init = forked.Forked.__init__
    monkeypatch.setattr(forked.Forked, "__init__", lambda self, compute: real_init(self, compute)
                        or children.append(self._pid))
    cache = ProbeCache(tmp_path)
    searches = []
    real_search = search_module.search
    monkeypatch.setattr(search_module, "search", lambda *a, **k: searches.append(k.get("fixed")) or real_search(*a, **k))
    module, inputs, loss_fn = _zoo("layers=2,hidden=32,heads=4,vocab=96,seq_len=16")
    options = dict(loss_fn=loss_fn, global_batch=8, cluster=autopar.load_cluster("dgx-h100", gpus=4), use_ilp=False,
                   strategy="pp=1")  # no pipeline probe: the tp probe's child alone
    serial = autopar.plan(module, inputs, **options)
    assert len(asked_here) == 1 and asked_here[0] == os.getpid()
    plans = len([fixed for fixed in searches if fixed == {"pp": 1}])
    assert plans == 1  # the plan's own search (the probe's ledger check searches tp=2 alone)
    parallel = autopar.plan(module, inputs, fork_probes=True, probe_cache=cache, **options)
    assert len(asked_here) == 1 and len(children) == 1 and children[0] is not None  # asked in a child
    assert (cache.runs, cache.hits) == (1, 0) and len(list(tmp_path.glob("tp-module-rules-*.json"))) == 1
    assert len([fixed for fixed in searches if fixed == {"pp": 1}]) == plans + (1 if answer is None else 2)
    for capabilities in (serial.capabilities, parallel.capabilities):  # the same table chosen
        assert (capabilities.tp_realization is None) == (answer is None)  # the static rules, or dry runs
    assert _chosen(parallel) == _chosen(serial)
    assert [c.evaluation.strategy for c in parallel.search.ranked] == [c.evaluation.strategy for c in serial.search.ranked]
    assert parallel.search.why_not == serial.search.why_not
    again = autopar.plan(module, inputs, fork_probes=True, probe_cache=cache, **options)
    assert len(asked_here) == 1 and len(children) == 1  # remembered: nothing asked, nothing forked
    assert (cache.runs, cache.hits) == (1, 1) and _chosen(again) == _chosen(serial)


def test_a_search_that_fails_on_the_guessed_answer_is_searched_again_on_the_childs(monkeypatch):
    """The search on the guessed answer raising is the serial plan's error only when the child answers
    as guessed; otherwise the plan is the serial one."""
    import autopar.api as api

    _tp_probe_counted(monkeypatch, False)
    module, inputs, loss_fn = _zoo("layers=2,hidden=32,heads=4,vocab=96,seq_len=16")
    options = dict(loss_fn=loss_fn, global_batch=8, cluster=autopar.load_cluster("dgx-h100", gpus=4), use_ilp=False,
                   strategy="pp=1")
    serial = autopar.plan(module, inputs, **options)
    real = api._completed_capabilities
    guessed = []

    def failing_on_the_static_table(tp_table, *rest):
        if tp_table.tp_realization is None:  # the module rules' static table: the guess
            guessed.append(tp_table)
            raise api.AutoparError("no strategy on the guessed table")
        return real(tp_table, *rest)

    monkeypatch.setattr(api, "_completed_capabilities", failing_on_the_static_table)
    parallel = autopar.plan(module, inputs, fork_probes=True, **options)
    assert len(guessed) == 1 and _chosen(parallel) == _chosen(serial)


def test_without_a_child_the_tp_probe_is_asked_before_the_search(monkeypatch):
    """Where no child can be forked, the probe is asked first (one search), as without fork_probes."""
    import autopar.forked as forked
    import autopar.searcher.search as search_module

    asked_here = _tp_probe_counted(monkeypatch, False)
    monkeypatch.setattr(forked, "can_fork", lambda: False)
    searches = []
    real_search = search_module.search
    monkeypatch.setattr(search_module, "search", lambda *a, **k: searches.append(k.get("fixed")) or real_search(*a, **k))
    module, inputs, loss_fn = _zoo("layers=2,hidden=32,heads=4,vocab=96,seq_len=16")
    autopar.plan(module, inputs, loss_fn=loss_fn, global_batch=8, cluster=autopar.load_cluster("dgx-h100", gpus=4),
                 use_ilp=False, strategy="pp=1", fork_probes=True)
    assert asked_here == [os.getpid()] and searches.count({"pp": 1}) == 1
