"""`TrainingLoop.loop` reads each step's loss once the next step is queued, never before, except on
the steps that log, save, stop or end the range; and a bad loss or a SIGTERM still names its step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from autopar.errors import AutoparError
from autopar.runtime.host_transfers import QueuedScalar
from autopar.runtime.training_loop import StopRequest, TrainingLoop


class _Loss:
    def __init__(self, step: int, value: float, events: list) -> None:
        self.step, self._value, self.events = step, value, events

    def value(self) -> float:
        self.events.append(("read", self.step))
        return self._value


class _Parallel:
    """Records when each step is queued and when its loss is read; `stop_at` asks to stop at a step."""

    def __init__(self, losses: dict[int, float] | None = None, stop: StopRequest | None = None,
                 stop_at: int | None = None) -> None:
        self.layout = SimpleNamespace(device=torch.device("cpu"))
        self.loss_scale = None
        self.events: list[tuple[str, int]] = []
        self.losses, self.stop, self.stop_at, self.step = losses or {}, stop, stop_at, 0

    def queued_train_step(self, batch, optimizer, max_grad_norm, *, local):
        self.step += 1
        self.events.append(("queued", self.step))
        if self.step == self.stop_at:
            self.stop.requested = True
        return _Loss(self.step, self.losses.get(self.step, 1.0), self.events)


class _Reporter:
    def __init__(self) -> None:
        self.lines, self.shown = [], []

    def say(self, line: str) -> None:
        self.lines.append(line)

    def advance(self, step: int, loss: float) -> None:
        self.shown.append(step)

    def record(self, record) -> None:
        pass


class _Saves:
    async_save = False

    def __init__(self) -> None:
        self.steps = []

    def save(self, step, parallel, optimizer, extra):
        self.steps.append(step)
        return f"step-{step}"


def _loop(parallel, steps: int = 10, log_every: int = 4, checkpointer=None, every=None) -> TrainingLoop:
    config = SimpleNamespace(log_every=log_every, steps=steps, checkpoint_every=every, max_grad_norm=0.0, cluster=None,
                             json_record=lambda: {})
    data = SimpleNamespace(next_batch=lambda: None, whole_batch=True, state_dict=lambda: {})
    plan = SimpleNamespace(predicted=None, to_json=lambda: "{}")
    loop = TrainingLoop(config, SimpleNamespace(world_size=1), parallel, None, data, checkpointer, plan,
                        tokens_per_step=8, data_name="test")
    loop._save_predicted = True  # no checkpoint cost to predict from these stand-ins
    return loop


def _read_before_next_queued(events: list) -> set[int]:
    """The steps whose loss was read before the next step was queued."""
    order = {event: index for index, event in enumerate(events)}
    return {step for kind, step in events if kind == "read"
            and order[("read", step)] < order.get(("queued", step + 1), math.inf)}


def test_each_loss_is_read_once_the_next_step_is_queued_but_on_log_steps_and_the_last():
    parallel, reporter = _Parallel(), _Reporter()
    assert _loop(parallel).loop(1, 10, StopRequest(), reporter, num_params=1, peak=None, nominal=False) == 10
    assert sorted(step for kind, step in parallel.events if kind == "read") == list(range(1, 11))
    assert _read_before_next_queued(parallel.events) == {1, 4, 8, 10}  # the first step is timed apart
    assert reporter.shown == list(range(1, 11))
    assert [line.split()[1] for line in reporter.lines if line.startswith("step ")] == ["4", "8"]


def test_a_save_step_is_read_before_it_is_saved():
    parallel, saves = _Parallel(), _Saves()
    _loop(parallel, log_every=100, checkpointer=saves, every=3).loop(1, 7, StopRequest(), _Reporter(), 1, None, False)
    assert saves.steps == [3, 6]
    assert _read_before_next_queued(parallel.events) == {1, 3, 6, 7}


@pytest.mark.parametrize("bad_step, queued_after", [(6, 7), (4, 4)])
def test_a_bad_loss_names_its_step(bad_step, queued_after):
    """Step 6's loss is read once step 7 is queued; step 4 logs, so it is read at once."""
    parallel = _Parallel({bad_step: math.nan})
    with pytest.raises(AutoparError, match=f"the loss is nan at step {bad_step}"):
        _loop(parallel).loop(1, 10, StopRequest(), _Reporter(), 1, None, False)
    assert max(step for kind, step in parallel.events if kind == "queued") == queued_after


def test_a_stop_seen_one_step_late_stops_and_saves_after_the_next_step():
    """SIGTERM during step 2: its flag is read once step 3 is queued, so the loop stops after step 3."""
    stop, saves = StopRequest(), _Saves()
    parallel = _Parallel(stop=stop, stop_at=2)
    reporter = _Reporter()
    loop = _loop(parallel, checkpointer=saves)
    assert not loop.stopped and loop.loop(1, 10, stop, reporter, 1, None, False) == 3
    assert loop.stopped and saves.steps == [3] and reporter.lines[-1].startswith("SIGTERM: stopped after step 3")
    assert max(step for kind, step in parallel.events if kind == "queued") == 3


def test_a_queued_scalar_on_the_host_is_read_when_made_and_divided():
    value = torch.tensor([6.0])
    queued = QueuedScalar(value, divisor=3)
    value.zero_()
    assert queued.value() == 2.0 and float(QueuedScalar(torch.tensor(6.0), divisor=4)) == 1.5


class _Clock:
    """A stand-in for `time.perf_counter`: each queued step advances it by its own duration, a save by 5 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _timed(monkeypatch, first_s: float = 3.0, step_s: float = 0.5):
    """A loop whose first step takes `first_s` and every later one `step_s`, on a fake clock."""
    import autopar.runtime.training_loop as training_loop

    clock = _Clock()
    monkeypatch.setattr(training_loop, "time", clock)
    parallel = _Parallel()
    queue = parallel.queued_train_step

    def timed_step(*args, **kwargs):
        clock.now += first_s if parallel.step == 0 else step_s
        return queue(*args, **kwargs)

    parallel.queued_train_step = timed_step
    return clock, parallel


def test_the_first_step_is_timed_apart_and_left_out_of_tokens_per_second(monkeypatch):
    """The launch's first step (torch.compile compiles there) is said on its own line; the log's first
    interval and the summary count the steps after it, a checkpoint's save time left out."""
    clock, parallel = _timed(monkeypatch)
    saves, reporter = _Saves(), _Reporter()
    save = saves.save

    def slow_save(*args):
        clock.now += 5.0
        return save(*args)

    saves.save = slow_save
    loop = _loop(parallel, checkpointer=saves, every=5)
    assert loop.loop(1, 10, StopRequest(), reporter, 1, None, False) == 10
    assert reporter.lines[0] == ("first step 3 s (kernels and the allocator warmed up in it, once per launch): "
                                 "the later steps' tokens/s leave it out")
    tokens = [line.split()[4] for line in reporter.lines if line.startswith("step ")]
    assert tokens == ["16", "16"]  # steps 2-4: 3 x 8 tokens in 1.5 s; steps 5-8, the save at 5 left out
    assert loop.clock.first_step_s == 3.0 and loop.clock.steady_steps == 9 and loop.clock.steady_s == 4.5
    assert loop.clock.summary(1, 10, 0.4) == ("done: steps 1-10; first step 3 s, then 500 ms a step over 9 (the plan "
                                              "predicted 400 ms: measured +25.0%)")


def test_a_resumed_or_profiled_launch_times_only_its_first_step_apart(monkeypatch):
    """Later calls of `loop` in one launch (`--profile-steps` runs it in pieces) count every step; a
    stop counts the steps trained."""
    clock, parallel = _timed(monkeypatch)
    loop = _loop(parallel)
    loop.loop(5, 5, StopRequest(), _Reporter(), 1, None, False)
    assert loop.clock.first_step_s == 3.0 and loop.clock.steady_steps == 0
    stop = StopRequest()
    parallel.stop, parallel.stop_at = stop, 3  # the third step queued here: step 7
    assert loop.loop(6, 10, stop, _Reporter(), 1, None, False) == 8  # seen one step late
    assert loop.clock.steady_steps == 3 and loop.clock.steady_s == 1.5
    assert loop.clock.summary(5, 8, None).endswith("then 500 ms a step over 3")
