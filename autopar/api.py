"""The public Python API: what the CLI, the tests and the benchmarks all call.

    result = autopar.plan(model, example_inputs, cluster="dgx-h100", global_batch=64)
    result.plan            # the chosen Plan (None when nothing fits)
    result.save("plan.json"); result.write_report("plan.html"); result.write_trace("plan.trace.json")

`plan` runs the whole chain, model → op graph → facts → the runtime's capabilities for this model →
search → plan, so there is one copy of it. Every argument is plain data or an `nn.Module`, and the
result holds plain data (the plan is a pydantic model you can save, diff and load).
"""

from __future__ import annotations

import json
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch import nn

from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError, CaptureError
from autopar.graph import OpGraph, trace
from autopar.graph.capture import TwinGraphs, trace_with_twins
from autopar.models.hints import model_hints
from autopar.plan_schema import PipelineCapture, Plan
from autopar import planning_probes
from autopar.probe_cache import ProbeCache

Progress = Callable[[str], None]


def load_cluster(name_or_file: str | Path, *, gpus: int | None = None) -> ClusterSpec:
    """A cluster preset (`dgx-h100`, `local`, ...) or a YAML/JSON file, sized to `gpus` if given."""
    from autopar.cluster import load_cluster as _load

    return _load(str(name_or_file), gpus=gpus)


def load_plan(path: str | Path, *, model: nn.Module | None = None) -> Plan:
    """A plan file; with `model`, checked to belong to it (its fingerprint) and to be one the runtime
    can execute for it."""
    if model is None:
        from autopar.plan_schema import load_plan as _load

        return _load(str(path))
    from autopar.plan_checks import load_plan_for_model

    return load_plan_for_model(str(path), model)


def check_fixed_strategy(strategy: dict[str, Any], world_size: int) -> None:
    """Fixed dp/tp/pp degrees must fit the world size: checked before any (possibly long) trace."""
    from autopar.cost_models.strategy import check_fixed_degrees

    check_fixed_degrees(strategy, world_size)


@dataclass
class PlanResult:
    """What `plan` found: the plan, its prediction, the runners-up and why-not rows."""

    plan: Plan | None  # the fastest plan that fits; None when none does
    search: Any  # searcher.search.SearchResult
    graph: OpGraph
    cluster: ClusterSpec
    global_batch: int
    seq_len: int | None
    fixed: dict[str, Any]
    facts: Any = field(repr=False, default=None)
    capabilities: Any = field(repr=False, default=None)  # what the runtime can execute for this model
    notes: list[str] = field(default_factory=list)  # what the user should know about how it was planned
    _summary: Any = field(repr=False, default=None)  # the Report, built on first use

    @property
    def fits(self) -> bool:
        return self.search.best is not None

    @property
    def chosen(self):
        """The chosen candidate, or the closest one when nothing fits."""
        return self.search.best or self.search.ranked[0]

    @property
    def prediction(self):
        """The chosen (or closest) strategy's evaluation: step time, memory, breakdown."""
        return self.chosen.evaluation

    @property
    def runners_up(self) -> list:
        return [c.evaluation for c in self.search.ranked if c is not self.chosen]

    @property
    def compile_choice(self):
        """Under `plan(..., choose_compile=True)`: eager and compiled compared
        (`searcher.compile_choice.CompileChoice`); None otherwise."""
        return self.search.compile_choice

    @property
    def why_not(self) -> list:
        return list(self.search.why_not)

    def summary(self):
        """The report model (`autopar.report.Report`) every renderer reads; `--json` is its
        `model_dump(mode="json")`."""
        from autopar.report import build_report

        if self._summary is None:
            self._summary = build_report(self.search, model=self.graph.model_name, cluster=self.cluster,
                                         global_batch=self.global_batch, seq_len=self.seq_len, fixed=self.fixed,
                                         precision=self.graph.precision, plan=self.plan)
        return self._summary

    def no_fit_reason(self) -> str | None:
        """When nothing fits: how far off the closest plan is and what could help (never what is set)."""
        if self.fits:
            return None
        from autopar.cost_models.memory import state_bytes_per_param

        closest = self.prediction
        per = state_bytes_per_param(self.facts.precision)
        states = self.facts.num_params * (per.weight + per.gradient + per.optimizer)
        needed = -(-int(states) // int(closest.capacity_bytes))
        fixed = self.fixed
        helps = [f"add GPUs (≥ {needed} for the model states alone)"]  # the searcher already tried every free key
        if fixed.get("recompute", "full") != "full" or "recompute_layers" in fixed:
            helps.append("let recompute be chosen (or recompute=full)")
        if fixed.get("zero", 3) < 3:
            helps.append(f"a zero stage above {fixed['zero']}")
        if fixed.get("microbatch", 1) > 1:
            helps.append(f"a micro-batch below {fixed['microbatch']}")
        if any(key in fixed for key in ("dp", "tp", "pp")):
            helps.append("let dp/tp/pp be chosen")
        if seq := self.seq_len:
            helps.append(f"a sequence shorter than {seq}")
        if fixed.get("offload") == "none":
            helps.append("leave offload free (or offload=optimizer) to keep optimizer states in host memory")
        cause = f" (fixed: {', '.join(f'{k}={v}' for k, v in fixed.items())})" if fixed else ""
        reason = (f"no plan fits in {closest.capacity_bytes / 2**30:.1f} GiB per GPU (the closest needs "
                  f"{closest.peak_memory_bytes / 2**30:.1f} GiB)")
        offloaded = self.search.with_offload or (closest if closest.strategy.offload != "none" else None)
        if offloaded is not None:
            short = [f"{offloaded.peak_memory_bytes / 2**30:.1f} GiB per GPU"] \
                if offloaded.peak_memory_bytes > offloaded.capacity_bytes else []
            if not offloaded.fits_host:
                short.append(f"{offloaded.host_memory_bytes / 2**30:.1f} GiB of host memory per node (of "
                             f"{offloaded.host_capacity_bytes / 2**30:.1f} GiB usable)")
            reason += f", and even with optimizer states offloaded to the CPU it needs {' and '.join(short)}"
        return f"{reason}{cause}: {'; or '.join(helps)}"

    def save(self, path: str | Path) -> None:
        """Write the plan file `autopar run --plan` reads."""
        self.write(plan=path)

    def write_report(self, path: str | Path) -> None:
        """A self-contained HTML report (mesh, schedule, memory, breakdown, alternatives, sharding)."""
        self.write(report=path)

    def write_trace(self, path: str | Path) -> None:
        """The predicted step as a Chrome/Perfetto trace (JSON)."""
        self.write(trace=path)

    def write(self, *, plan: str | Path | None = None, json_path: str | Path | None = None,
              report: str | Path | None = None, trace: str | Path | None = None) -> None:
        """Write any of the outputs, all or none: every text is rendered and every path checked first."""
        from autopar.io import write_all

        texts: dict[str, str] = {}
        if plan is not None:
            if self.plan is None:
                raise AutoparError(f"no plan fits, so there is no plan to write to {plan}: {self.no_fit_reason()}")
            texts[str(plan)] = self.plan.to_json()
        summary = self.summary() if (json_path or report or trace) else None
        if json_path is not None:
            texts[str(json_path)] = json.dumps(summary.model_dump(mode="json"), indent=2)
        if report is not None:
            from autopar.report import render_html

            texts[str(report)] = render_html(summary)
        if trace is not None:
            from autopar.report import render_trace

            texts[str(trace)] = render_trace(summary)
        write_all(texts)


def plan(
    model: nn.Module,
    example_inputs: Any,
    *,
    cluster: ClusterSpec | str,
    global_batch: int,
    strategy: dict[str, Any] | str | None = None,
    loss_fn: Callable | None = None,
    precision: str = "bf16",
    name: str | None = None,
    seq_len: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    vocab: int | None = None,
    use_ilp: bool = True,
    profile: str | Path | None = None,
    profile_device: str | None = None,
    progress: Progress | None = None,
    probe_cache: str | Path | ProbeCache | None = None,
    fork_probes: bool = False,
    choose_compile: bool = False,
) -> PlanResult:
    """Search the best parallel plan for training `model` on `cluster`.

    `example_inputs`: one sample's inputs (batch 1; a tensor, tuple, or dict of keyword inputs), on any
    device, meta included. `strategy` fixes keys as `--strategy` does ("tp=8,pp=2" or a dict); the
    searcher chooses the rest. `heads`/`kv_heads`/`vocab` default to the model's config
    (`model_hints`). `profile`: a profile database calibrating the roofline. Nothing is trained and
    the model is not modified. `probe_cache`: a folder (or `ProbeCache`) keeping the answers of the
    runtime's probes of this model (`autopar.probe_cache`), so planning it again skips them; None
    runs them every time. `fork_probes`: the pipeline probe runs in a forked child beside the trace,
    and the tp probe in another beside the search (`autopar.forked`: the same plan, sooner where a
    core is free). `choose_compile`: unless `strategy` sets `compile`, search eager and compiled over
    the one trace and keep the plan predicted faster (`PlanResult.compile_choice` says on what
    numbers), as `autopar run` does on a GPU.
    """
    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.strategy import parse_strategy
    from autopar.searcher.plan_builder import build_plan
    from autopar.searcher.search import search

    say = progress or (lambda _message: None)
    fixed = parse_strategy(strategy) if isinstance(strategy, str) or strategy is None else dict(strategy)
    if isinstance(cluster, (str, Path)):
        cluster = load_cluster(cluster)
    check_fixed_strategy(fixed, cluster.world_size)
    if global_batch <= 0:
        raise AutoparError(f"global batch must be positive, got {global_batch}")
    hints = model_hints(model)
    heads = heads if heads is not None else hints["heads"]
    kv_heads = kv_heads if kv_heads is not None else hints["kv_heads"]
    vocab = vocab if vocab is not None else hints["vocab"]
    name = name or type(model).__name__
    say(f"tracing {name} ({precision}" + (f", seq {seq_len}" if seq_len else "") + ") ...")
    asks_pipeline = cluster.world_size > 1 and fixed.get("pp") != 1  # from a training-mode capture, below
    forked = _forked_pipeline_answer(model, example_inputs, loss_fn) if fork_probes and asks_pipeline else None
    started = time.perf_counter()
    graph, fallback, twins = _capture(model, example_inputs, loss_fn=loss_fn, precision=precision, name=name,
                                      seq_len=seq_len)
    if fallback:
        say(f"note: {fallback}")
    say(f"searching {cluster.world_size} GPUs ({len(graph.nodes):,} ops traced in "
        f"{time.perf_counter() - started:.1f} s) ...")
    facts = model_facts(graph, heads=heads, kv_heads=kv_heads, vocab=vocab)
    efficiency = _calibration(profile, profile_device, graph, cluster, say,
                              lambda batch: _capture(model, _batched(example_inputs, batch), loss_fn=loss_fn,
                                                     precision=precision, name=name, seq_len=seq_len)[0],
                              seq_len) if profile else None
    remember = planning_probes.remembering(probe_cache, model, example_inputs, loss_fn)
    tp_probe = planning_probes.tensor_parallel_probe(model, example_inputs, loss_fn, precision, graph, facts,
                                                     cluster, fixed, twins)
    probe = None
    if asks_pipeline and not fallback:  # the cut tried on these inputs
        probe = planning_probes.pipeline_probe(model, example_inputs, loss_fn, remember,
                                               forked.result if forked is not None else None)
    if forked is not None:
        forked.cancel()  # unasked (an eval-mode capture, a remembered answer): stopped; else already done

    def searched(tp_table):
        capabilities = _completed_capabilities(tp_table, probe, facts, model, loss_fn, fallback)
        return capabilities, search(graph, facts, cluster, global_batch, fixed=fixed, use_ilp=use_ilp,
                                    capabilities=capabilities, progress=progress, choose_compile=choose_compile,
                                    **({"efficiency": efficiency} if efficiency else {}))

    capabilities, result = _searched_with_tp_answer(tp_probe, remember, fork_probes, searched)
    chosen = build_plan(result.best, graph, facts, cluster) if result.best else None
    if chosen is not None and chosen.strategy.pp > 1 and probe is not None:
        chosen = chosen.model_copy(update={"pipeline_capture": PipelineCapture(
            training_settings=probe.training_settings, dropped_outputs=list(probe.dropped_outputs))})
    notes = [fallback] if fallback else []
    capture = chosen.pipeline_capture if chosen is not None else None
    if capture is not None and (capture.training_settings or capture.dropped_outputs):
        notes.append(_pipeline_capture_note(capture))
        say(f"note: {notes[-1]}")
    return PlanResult(plan=chosen, search=result, graph=graph, cluster=cluster, global_batch=global_batch,
                      seq_len=seq_len, fixed=fixed, facts=facts, capabilities=capabilities, notes=notes)


def _searched_with_tp_answer(tp_probe, remember, fork: bool, searched: Callable[[Any], tuple[Any, Any]]):
    """`searched(table)` for the table the tp probe's answer chooses (`planning_probes.TensorParallelProbe`).
    With `fork`, an answer not remembered is asked in a forked child while this process searches on
    the answer most models give (the module rules run as priced); a different answer searches again
    with it, so the result (or error) is the serial one either way. Where no child can be forked
    (`forked.can_fork`), it is asked here first, as without `fork`."""
    from autopar.forked import Forked, can_fork

    if tp_probe.ask is None:
        return searched(tp_probe.chosen(None))
    if not fork or not can_fork() or remember.knows(planning_probes.TP_PROBE, **tp_probe.arguments):
        return searched(tp_probe.chosen(remember(planning_probes.TP_PROBE, tp_probe.ask, **tp_probe.arguments)))
    asking = Forked(tp_probe.ask)
    try:
        found = searched(tp_probe.chosen(True))
    except Exception:  # the serial plan raises this only when the answer is the one guessed
        if remember(planning_probes.TP_PROBE, asking.result, **tp_probe.arguments):
            raise
        return searched(tp_probe.chosen(False))
    if remember(planning_probes.TP_PROBE, asking.result, **tp_probe.arguments):
        return found
    return searched(tp_probe.chosen(False))


def _completed_capabilities(tp_table, pipeline, facts, model: nn.Module, loss_fn, fallback: str | None):
    """The capabilities the search gets: the tensor-parallel table chosen, with the pipeline probe's
    refusal (`pipeline`: None when not asked) and the expert- and context-parallel refusals; a graph
    captured in eval mode (`fallback`) refuses tensor and pipeline parallelism."""
    from autopar.cost_models.context import context_parallel_refusal
    from autopar.cost_models.experts import expert_parallel_refusal

    found = tp_table
    if pipeline is not None:
        found = dataclasses.replace(found, pipeline_refusal=pipeline.refusal)
    found = dataclasses.replace(found, expert_parallel_refusal=expert_parallel_refusal(facts.experts),
                                context_parallel_refusal=context_parallel_refusal(facts.attention, bool(facts.experts))
                                or planning_probes.model_context_refusal(model, loss_fn))
    if fallback:
        refusal = "tensor and pipeline parallelism need the training step's op graph, which could not be captured"
        found = dataclasses.replace(found, tensor_parallel_refusal=refusal, pipeline_refusal=refusal)
    return found


def _forked_pipeline_answer(model: nn.Module, example_inputs: Any, loss_fn):
    """`planning_probes.pipeline_answer`, computed in a forked child from now on (`autopar.forked`)."""
    from autopar.forked import Forked

    return Forked(lambda: planning_probes.pipeline_answer(model, example_inputs, loss_fn))


def _pipeline_capture_note(capture: PipelineCapture) -> str:
    """One line on what pipeline stages leave out of the forward for training."""
    parts = [f"{name}={value}" for name, value in capture.training_settings.items()]
    text = "pipeline stages capture the forward" + (f" with {', '.join(parts)}" if parts else "")
    if capture.dropped_outputs:
        text += f"; outputs the loss does not read are not carried: {', '.join(capture.dropped_outputs)}"
    return text


def _capture(model: nn.Module, example_inputs: Any, **options) -> tuple[OpGraph, str | None, TwinGraphs | None]:
    """The training step's op graph; when the model's own code cannot be traced in training mode (a
    data-dependent branch such as LayerDrop's coin flip), the eval-mode step's, with a note: that
    graph runs every layer without dropout, so it prices an upper bound of the step's work, and
    only module-level data parallelism and ZeRO are planned from it. Third: the graphs of the
    model's shallow twins from the training-mode capture (`capture.TwinGraphs`), or None."""
    try:
        graph, twins = trace_with_twins(model, example_inputs, **options)
        return graph, None, twins
    except CaptureError as error:
        training = {module: module.training for module in model.modules()}
        if not error.in_model_code or not any(training.values()):
            raise
        reason = str(error)
        model.eval()
        try:
            graph = trace(model, example_inputs, **options)
        except CaptureError:
            raise error from None
        finally:
            for module, mode in training.items():
                module.training = mode
    return graph, (f"{reason}; planned from its eval-mode step instead (dropout and layer drop off, every layer "
                   f"runs): data parallelism and ZeRO only, no tensor or pipeline parallelism"), None


def _calibration(path: str | Path, device: str | None, graph: OpGraph, cluster: ClusterSpec, say: Progress,
                 trace_at: Callable[[int], OpGraph] | None = None, seq_len: int | None = None):
    """The roofline calibrated on the ops the profile holds; the graph is traced again at the batch the
    profile was recorded at (`profiled_batch`) when that is not one sample, for calibration only."""
    from autopar.cost_models.calibration import calibrate_from_database, profiled_batch
    from autopar.profiler.database import ProfileDB

    with ProfileDB(str(path), readonly=True) as db:
        devices = db.devices()
        name = device or _matching_device(devices, cluster.gpu.name)
        if name not in devices:
            raise AutoparError(
                f"profile database {path} has no device {name!r} (it has: {', '.join(devices) or 'none'}): "
                f"pass --profile-device with one of those, profiled on the cluster's GPU kind"
            )
        batch = profiled_batch([record.signature_key for record in db.op_records(name)], seq_len)
        if batch and batch > 1 and trace_at is not None:
            say(f"tracing at batch {batch}, the profile's, to calibrate ...")
            graph = trace_at(batch)
        calibration = calibrate_from_database(graph, db, cluster.gpu, name)
    measured = ", ".join(f"{k} from {n} ops" for k, n in calibration.samples.items() if n) or "nothing measured"
    say(f"roofline calibrated on {name}: {measured}")
    return calibration.efficiency


def _batched(example_inputs: Any, batch: int) -> Any:
    """`example_inputs` (one sample) with every tensor's leading dimension `batch` (meta: shapes only)."""
    import torch
    from torch.utils import _pytree as pytree

    def grow(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 1:
            return torch.zeros((batch, *value.shape[1:]), dtype=value.dtype, device="meta")
        return value

    return pytree.tree_map(grow, example_inputs)


def _matching_device(devices: list[str], gpu_name: str) -> str:
    """A profile is used only for the GPU kind it was measured on: match the kind's model name."""
    kind = gpu_name.split("-")[0].lower()  # "H100-SXM5-80GB" → "h100"
    matches = [d for d in devices if kind in d.lower()]
    if len(matches) != 1:
        raise AutoparError(
            f"cannot tell which device of the profile database is a {gpu_name} (it has: {', '.join(devices) or 'none'}): "
            f"pass --profile-device"
        )
    return matches[0]


def parallelize(model: nn.Module, plan: Plan, **kwargs):
    """Shard `model` as `plan` says on the running process group (see autopar.runtime.parallelize)."""
    from autopar.runtime.parallelize import parallelize as _parallelize  # torch.distributed only when asked for

    return _parallelize(model, plan, **kwargs)
