"""The training loop `autopar run` drives a `ParallelModel` with, and what it reports: log lines, a
progress bar, JSONL metrics, TensorBoard events, checkpoints, and a clean stop on SIGTERM.

The loop trains on any batch source: `next_batch()` returns a tensor, the whole global batch when
the source's `whole_batch` is true (every rank draws the same one) or else this dp rank's rows alone
(a loader that reads no other rank's); `state_dict()`/`load_state_dict()` save and restore its position.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError

GiB = 2**30


class StopRequest:
    """SIGTERM sets a flag; the loop finishes its step, saves a checkpoint and returns (exit 0).
    Python delivers signals on the main thread only, so elsewhere (a test's thread) nothing is installed."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc_info) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)


class Reporter:
    """Rank 0's outputs: log lines (through the bar when there is one), JSONL metrics, TensorBoard."""

    def __init__(self, config, rank: int, first_step: int) -> None:
        self.active = rank == 0
        self.bar = self.metrics = self.board = None
        if not self.active:
            return
        try:
            show_bar = config.progress if config.progress is not None else sys.stderr.isatty()
            if show_bar:
                from tqdm import tqdm

                self.bar = tqdm(total=config.steps, initial=first_step - 1, unit="step", dynamic_ncols=True,
                                file=sys.stderr, desc="training")
            if config.metrics:
                self.metrics = MetricsFile(config.metrics, keep_through_step=first_step - 1 if first_step > 1 else None)
            if config.tensorboard:
                self.board = _tensorboard_writer(config.tensorboard, purge_step=first_step if first_step > 1 else None)
        except BaseException:
            self.close()
            raise

    def say(self, line: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def advance(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(1)

    def record(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        if self.board is not None:
            step = record["step"]
            for key in ("loss", "tokens_per_s", "mfu", "mfu_as_planned", "peak_memory_bytes"):
                if record.get(key) is not None:
                    self.board.add_scalar(f"train/{key}", record[key], step)
            self.board.flush()

    def close(self) -> None:
        for thing in (self.bar, self.metrics, self.board):
            if thing is not None:
                thing.close()
        self.bar = self.metrics = self.board = None


def _tensorboard_writer(directory: str, purge_step: int | None):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise AutoparError("--tensorboard needs the tensorboardX package: pip install tensorboardX") from None
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AutoparError(f"cannot create --tensorboard {directory}: {error.strerror}") from None
    # purge_step: a resumed run hides the events a crashed run wrote after its last checkpoint
    return SummaryWriter(logdir=directory, purge_step=purge_step)


def planned_flops_per_token(plan) -> float | None:
    """The model FLOPs per token a plan's predicted MFU counts (its traced forward and backward,
    recompute not counted), read back from its prediction; None for a plan without one. 6N leaves
    attention out, so a run's MFU in 6N and the plan's differ for the same step time (about 17%
    for GPT-1.3B at sequence 2048); MFU "as planned" is comparable with the plan's."""
    predicted = plan.predicted if plan is not None else None
    if predicted is None or not predicted.tokens_per_s:
        return None
    s = plan.strategy
    return predicted.tflops_per_gpu * 1e12 * (s.dp * s.cp * s.tp * s.pp) / predicted.tokens_per_s


@dataclasses.dataclass
class StepClock:
    """The launch's first step timed apart from the rest: torch.compile compiles there, kernels are
    autotuned and the allocator grows, once. The steps after it, checkpoint saves left out, are the
    step time a plan predicts; the log's tokens/s and the run's summary count those."""

    first_step_s: float | None = None
    steady_s: float = 0.0
    steady_steps: int = 0

    def summary(self, first_step: int, last_step: int, predicted_step_s: float | None) -> str:
        """One line for the end of the run; `predicted_step_s`: the plan's, where it was priced for the
        hardware this run is on."""
        text = f"done: steps {first_step}-{last_step}"
        if self.first_step_s is not None:
            text += f"; first step {self.first_step_s:.3g} s"
        if self.steady_steps:
            step_s = self.steady_s / self.steady_steps
            text += f", then {step_s * 1e3:.4g} ms a step over {self.steady_steps}"
            if predicted_step_s:
                text += (f" (the plan predicted {predicted_step_s * 1e3:.4g} ms: measured "
                         f"{step_s / predicted_step_s - 1:+.1%})")
        return text


class TrainingLoop:
    """The steps, their measurements and the checkpoints; one per `autopar run`."""

    def __init__(self, config, env, parallel, optimizer, data, checkpointer, plan, tokens_per_step: int,
                 data_name: str) -> None:
        self.config, self.env, self.parallel, self.optimizer = config, env, parallel, optimizer
        self.data, self.checkpointer, self.plan = data, checkpointer, plan
        self.tokens_per_step, self.data_name = tokens_per_step, data_name
        self.save_prediction = None
        self._save_predicted = False
        self.stopped = False  # a SIGTERM on any rank stopped the last `loop` (every rank agrees)
        self.clock = StepClock()

    def step(self):
        """One optimizer step of `ParallelModel.queued_train_step` on the next batch; its mean loss, queued."""
        batch = self.data.next_batch()
        return self.parallel.queued_train_step(batch, self.optimizer, self.config.max_grad_norm,
                                               local=not self.data.whole_batch)

    def predict_checkpoint_cost(self, reporter: Reporter) -> None:
        """Once, before the first step (a collective): the checkpoint's predicted save time and the
        interval Young/Daly suggests, printed by rank 0."""
        if self.checkpointer is None or self._save_predicted:
            return
        from autopar.runtime.checkpoint.cost import predict_save

        self._save_predicted = True
        self.save_prediction = predict_save(self.parallel, self.optimizer, self.config.cluster)
        if self.save_prediction is not None:
            step_time_s = self.plan.predicted.step_time_s if self.plan.predicted is not None else None
            reporter.say(f"checkpoint cost: {self.save_prediction.describe()}; "
                         f"{self.save_prediction.interval_text(step_time_s)}")

    def save(self, step: int, reporter: Reporter) -> float:
        """Save a checkpoint at `step`; returns the seconds it held the loop."""
        extra = {"step": step, "data": self.data.state_dict(), "data_name": self.data_name,
                 "plan": self.plan.to_json(), "config": self.config.json_record(),
                 "world_size": self.env.world_size}
        started = time.perf_counter()
        path = self.checkpointer.save(step, self.parallel, self.optimizer, extra)
        measured_s = time.perf_counter() - started
        self.clock.steady_s -= measured_s  # not a training step's time
        beside = "" if self.save_prediction is None else f" (predicted {self.save_prediction.save_time_s:.3g} s)"
        if self.checkpointer.async_save:
            reporter.say(f"saving checkpoint {path}: staged in {measured_s:.3g} s, written in the background{beside}")
        else:
            reporter.say(f"saved checkpoint {path} in {measured_s:.3g} s{beside}")
        return measured_s

    def _first_step_timed(self, started: float, device, reporter: Reporter) -> float:
        """Time the launch's first step (its loss already read) and say so; returns when the steps
        after it start."""
        import torch

        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        self.clock.first_step_s = now - started
        compiled = getattr(self.parallel, "optimizations", {}).get("compile", "off") != "off"
        why = "torch.compile compiled the model in it" if compiled else "kernels and the allocator warmed up in it"
        reporter.say(f"first step {self.clock.first_step_s:.3g} s ({why}, once per launch): the later steps' "
                     f"tokens/s leave it out")
        return now

    def stop_requested(self, stop: StopRequest, device):
        """Whether any rank got SIGTERM, queued (one scalar all-reduce): every rank reads the same flag
        at the same step, so all stop after the same step."""
        import torch

        from autopar.runtime.host_transfers import QueuedScalar

        value = 1.0 if stop.requested else 0.0
        if self.env.world_size == 1:
            return QueuedScalar(torch.tensor(value))
        import torch.distributed as dist

        flag = torch.full((1,), value, device=device)  # a fill kernel: a copy from the host would wait for the device
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return QueuedScalar(flag)

    def peak_memory_bytes(self, device) -> int:
        """The largest peak of any rank (CUDA only; 0 elsewhere)."""
        if device.type != "cuda":
            return 0
        import torch
        import torch.distributed as dist

        value = torch.tensor([torch.cuda.max_memory_allocated(device)], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def log(self, step: int, loss: float, tokens_per_s: float, reporter: Reporter, num_params: int,
            peak: float | None, nominal: bool) -> None:
        """One log line and metrics record: the step's loss, tokens/s over the interval, MFU, peak memory."""
        device = self.parallel.layout.device
        cuda = device.type == "cuda"
        peak_memory = self.peak_memory_bytes(device)
        mfu = 6 * num_params * tokens_per_s / peak if peak else None
        planned_flops = planned_flops_per_token(self.plan)
        as_planned = planned_flops * tokens_per_s / peak if peak and planned_flops else None
        memory = f"  peak memory {peak_memory / GiB:.2f} GiB" if cuda else ""
        shown = "n/a" if mfu is None else f"{mfu:.1%}" + (" (nominal)" if nominal else "")
        if as_planned is not None:
            shown += f", as planned {as_planned:.1%}"
        scale = self.parallel.loss_scale  # fp16: where the scale is, and the steps it skipped
        scaled = f"  loss scale {scale.scale:g} ({scale.skipped_steps} steps skipped)" if scale else ""
        reporter.say(f"step {step:>6}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s  MFU {shown}{memory}{scaled}")
        reporter.record({"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "mfu": mfu,
                         "mfu_as_planned": as_planned, "mfu_nominal": nominal,
                         "peak_memory_bytes": peak_memory, "data": self.data_name,
                         **({"loss_scale": scale.scale, "skipped_steps": scale.skipped_steps} if scale else {})})

    def loop(self, first_step: int, last_step: int, stop: StopRequest, reporter: Reporter, num_params: int,
             peak: float | None, nominal: bool) -> int:
        """Train steps first_step..last_step; returns the last step trained (earlier on SIGTERM).

        Each step's loss and stop flag are read once the next step is queued (`runtime/host_transfers.py`),
        so the device never waits for the host between steps; a step that logs, saves, stops or ends the
        range is read at once. Every rank reads the same steps, so all agree on when to stop."""
        import torch

        config = self.config
        device = self.parallel.layout.device
        cuda = device.type == "cuda"
        every = config.checkpoint_every
        self.predict_checkpoint_cost(reporter)
        started = steady_started = time.perf_counter()
        interval_steps = steady_steps = 0
        unread: list[tuple[int, Any, Any]] = []  # (step, its loss, its stop flag), queued
        state = {"loss": math.nan, "stopping": False}
        for step in range(first_step, last_step + 1):
            unread.append((step, self.step(), self.stop_requested(stop, device)))
            interval_steps += 1
            first = self.clock.first_step_s is None  # the launch's first step: timed apart, read at once
            _read(unread, state, reporter, keep=0 if first else 1)  # else the step before this one
            if first:
                steady_started = self._first_step_timed(started, device, reporter)
            logs = step % config.log_every == 0
            due = step == config.steps or state["stopping"] or (every is not None and step % every == 0)
            if logs or due or step == last_step:
                _read(unread, state, reporter, keep=0)
                due = due or state["stopping"]
            if logs:
                if cuda:
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - started
                tokens_per_s = self.tokens_per_step * interval_steps / elapsed if elapsed > 0 else 0.0
                self.log(step, state["loss"], tokens_per_s, reporter, num_params, peak, nominal)
            if self.checkpointer is not None and due:
                started += self.save(step, reporter)  # tokens/s leave the save out
            steady_steps += not first
            if state["stopping"] or step == last_step:
                if cuda:
                    torch.cuda.synchronize(device)
                self.clock.steady_s += time.perf_counter() - steady_started
                self.clock.steady_steps += steady_steps
            if state["stopping"]:
                saved = "checkpoint saved" if self.checkpointer is not None else "no --checkpoint-dir, nothing saved"
                reporter.say(f"SIGTERM: stopped after step {step} ({saved})")
                self.stopped = True
                return step
            if logs or first:  # the next interval starts after any save, and after the first step
                started = time.perf_counter()
                interval_steps = 0
        return last_step


def _read(unread: list, state: dict, reporter: Reporter, keep: int) -> None:
    """Read the queued steps but the last `keep`: each loss checked and shown, the stop flags or-ed."""
    while len(unread) > keep:
        step, loss, flag = unread.pop(0)
        value = loss.value()
        if not math.isfinite(value):
            raise AutoparError(f"the loss is {value} at step {step}: lower --lr, set --max-grad-norm, or use "
                               f"--precision fp32/bf16", exit_code=1)
        reporter.advance(step, value)
        state["loss"] = value
        state["stopping"] = state["stopping"] or flag.value() > 0


class MetricsFile:
    """JSONL, one complete line per write (a single write call each), so a crash never leaves half a line."""

    def __init__(self, path: str, keep_through_step: int | None = None) -> None:
        kept = _records_through(path, keep_through_step) if keep_through_step is not None else b""
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            if kept:
                os.write(self.fd, kept)
        except OSError as error:
            raise AutoparError(f"cannot write {path}: {error.strerror}; choose a writable location") from None
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode()
        try:
            written = os.write(self.fd, line)
        except OSError as error:
            raise AutoparError(f"cannot write {self.path}: {error.strerror}; check free space", exit_code=1) from None
        if written != len(line):
            raise AutoparError(f"short write to {self.path}: check free space", exit_code=1)

    def close(self) -> None:
        os.close(self.fd)


def _records_through(path: str, last_step: int) -> bytes:
    """A resumed run's metrics continue the file: the lines up to the checkpoint's step are kept,
    those after it (the steps the resumed run trains again) dropped."""
    try:
        lines = Path(path).read_bytes().splitlines(keepends=True)
    except OSError:
        return b""
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return b"".join(kept)
