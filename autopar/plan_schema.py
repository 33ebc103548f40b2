"""The plan: what the searcher decides and the runtime executes, as versioned JSON.

A plan is checked on load against its schema version and the model it was made for, so a stale
or foreign plan fails with one line instead of mis-sharding a run.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from autopar.errors import AutoparError
from autopar.io import atomic_write_text
from autopar.validation import condense_validation_error, one_line

PLAN_SCHEMA_VERSION = 1
# The runtime's device mesh, row-major (runtime/mesh.py); a plan lists "cp" only when cp > 1.
MESH_ORDER = ("pp", "dp", "cp", "tp")

_PLACEMENT = re.compile(r"R|P|S\((\d+)\)")


def parse_placements(text: str) -> list[tuple[str, int | None]]:
    """DTensor-style placements, one per mesh axis: "S(0)R" -> [("S", 0), ("R", None)].

    S(d) shards tensor dim d over the axis, R replicates, P holds partial sums awaiting a reduce.
    """
    placements: list[tuple[str, int | None]] = []
    position = 0
    while position < len(text):
        match = _PLACEMENT.match(text, position)
        if match is None:
            raise AutoparError(
                f"malformed placement string {text!r} at character {position + 1}: expected R, P or S(<dim>) "
                f"per mesh axis, e.g. 'S(0)R'"
            )
        dim = match.group(1)
        placements.append((match.group(0)[0], int(dim) if dim is not None else None))
        position = match.end()
    if not placements:
        raise AutoparError("empty placement string: give one of R, P or S(<dim>) per mesh axis, e.g. 'S(0)R'")
    return placements


def _valid_placements(text: str) -> str:
    try:
        parse_placements(text)
    except AutoparError as error:
        raise ValueError(str(error)) from None
    return text


Placements = Annotated[str, AfterValidator(_valid_placements)]


class _Record(BaseModel):
    """Plan parts are values: frozen, and unknown fields are errors (a newer plan is a new version)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class MeshAxis(_Record):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    size: int = Field(gt=0)


class StagePlan(_Record):
    """One pipeline stage: which modules it runs and on which ranks."""

    index: int = Field(ge=0)
    module_paths: list[str]
    # The cost model's units on this stage, in order: layer instance paths, and "pre", "between.N",
    # "post" for the code before, between and after the layers (pipeline stages run that code where
    # the cost model placed it, so what crosses each cut is what was costed).
    units: list[str] = []
    device_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    mesh_shape: dict[str, Annotated[int, Field(gt=0)]]

    @model_validator(mode="after")
    def _mesh_covers_devices(self) -> StagePlan:
        if len(set(self.device_ids)) != len(self.device_ids):
            raise ValueError(f"stage {self.index} lists a device id twice: {self.device_ids}")
        if math.prod(self.mesh_shape.values()) != len(self.device_ids):
            raise ValueError(
                f"stage {self.index} mesh_shape {self.mesh_shape} holds {math.prod(self.mesh_shape.values())} "
                f"devices but device_ids lists {len(self.device_ids)}"
            )
        return self


class Strategy(_Record):
    """The knobs the searcher turns; the runtime reads nothing else to set up parallelism."""

    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    sp: bool = False
    zero: int = Field(default=0, ge=0, le=3)
    recompute: Literal["none", "selective", "full"] = "none"
    microbatch: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    # interleaved_zb and zbv split each backward into its input-gradient and weight-gradient passes
    # (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): interleaved_zb keeps interleaved's
    # loop placement (vp ≥ 1), zbv runs 2 stages per rank in a V (`stage_rank`), so it needs vp = 2.
    schedule: Literal["gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv"] = "1f1b"
    vp: int = Field(default=1, ge=1)
    # Per stage (pp·vp, in stage order): how many of its first layers recompute with `recompute`;
    # the rest keep their activations. None: every layer does. Fewer recomputed layers trade
    # memory for time layer by layer (Megatron-LM's --recompute-num-layers, per stage here).
    recompute_layers: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    # How the step is implemented, as far as its cost goes (`cost_models.implementation`). The
    # defaults are autopar's runtime, which runs nothing else; other values price a run of other
    # software as it ran (a published configuration), and the runtime refuses them.
    attention: Literal["fused", "math"] = "fused"  # math: scores materialized, as before FlashAttention
    dropout: float = Field(default=0.0, ge=0, lt=1)  # Megatron-LM's dropout sites, priced on a graph without them
    dp_overlap: bool = True  # data-parallel gradient reduction and ZeRO gathers overlapped with compute
    tp_overlap: bool = False  # tensor-parallel collectives overlapped with GEMMs (needs sp)
    optimizer_state: Literal["fp32", "bf16"] = "fp32"  # Adam moments' precision (master weights stay fp32)
    # ZeRO-3's weight gathers: "unit", one per FSDP unit and use, prefetched (FSDP2, the runtime);
    # "parameter", one synchronous all-gather per parameter tensor and use (DeepSpeed 0.3, 2021).
    zero3_fetch: Literal["unit", "parameter"] = "unit"
    # The optimizer step's kernels: "fused", torch's fused AdamW (the runtime's, on CUDA), or "foreach",
    # torch's default (its multi-tensor passes; `cost_models.optimizer`). Added with schema version
    # 1's plans loading as "fused".
    # "apex": one fused kernel like torch's, with the clip's scaling a pass of its own before it (apex's
    # FusedAdam and multi-tensor scale, as Megatron-LM and DeepSpeed run them; a what-if).
    optimizer_impl: Literal["fused", "foreach", "apex"] = "fused"
    # Misaligned linear layers computed at an aligned width (`autopar.graph.paddable`,
    # `runtime/gemm_padding.py`, where `capabilities.gemm_padding_problem` allows): the runtime's;
    # false prices software that does not pad them. Plans made before it load as true.
    gemm_padding: bool = True
    # Per micro-batch passes over the weights outside the GEMMs (`cost_models.weight_passes`):
    # autocast's casts and the gradient accumulation into .grad, as the runtime runs them; false
    # prices 16-bit model weights with the accumulation fused into the weight-gradient GEMM
    # (Megatron-LM). Plans made before it load as true.
    weight_passes: bool = True
    # What a column-parallel projection keeps of its input under sequence parallelism: "gathered", the
    # whole gathered tensor, as the runtime's DTensor projections keep it (measured: `tests/test_tp_memory.py`);
    # "regathered", the runtime keeping the sequence shard in the blocks it does not recompute and
    # gathering it again when backward reaches them (`runtime.tensor_parallel.regather`; one more
    # all-gather per block and micro-batch); "shards", the shard, gathered again in backward overlapped
    # with the input gradient, as Megatron-LM keeps it (Korthikanti et al. 2022, §4.2.2). The runtime
    # runs "gathered" and "regathered". Plans made before it load as "gathered".
    sp_inputs: Literal["gathered", "regathered", "shards"] = "gathered"
    # torch.compile: the whole stage with its loss where `capabilities.whole_stage_problem` allows,
    # else each block (`runtime.compile`); priced as fused elementwise kernels (`cost_models.compute`).
    # A runtime choice, not another software's profile: `autopar run --compile` fixes it.
    compile: bool = False
    # Where the optimizer lives: "optimizer" keeps each rank's shard of the fp32 master weights, the
    # Adam moments and the reduced gradients in host memory and steps them on the CPU (FSDP2's
    # CPUOffloadPolicy, ZeRO-Offload's split); the device keeps the compute-precision weights and
    # gradients. Added with schema version 1's plans loading as "none".
    offload: Literal["none", "optimizer"] = "none"
    # Expert parallelism: each MoE layer's experts sharded over groups of `ep` consecutive dp ranks
    # (ep divides dp: the ranks are dp's, as Megatron-LM and DeepSpeed-MoE share them), tokens sent to
    # their experts by all-to-all (`cost_models.experts`, `runtime.expert_parallel`). An expert
    # parameter's dp placement is S(0): its experts split over its ep group (over all of dp when
    # ep = dp; the dp/ep groups replicate them, or under ZeRO shard their states). Added with schema
    # version 1's plans loading as 1.
    ep: int = Field(default=1, ge=1)
    # Context parallelism: each sequence split over `cp` ranks (its own mesh axis, between dp and tp:
    # world = pp x dp x cp x tp), attention exchanging keys and values around a ring of the cp ranks
    # ("ring": p2p overlapped with per-chunk attention, causal chunks load-balanced) or re-sharding
    # sequence to heads by all-to-all ("ulysses"). The cp ranks hold the same weights: gradients
    # and ZeRO shards span dp x cp. Added with schema version 1's plans loading as 1 / "ring".
    cp: int = Field(default=1, ge=1)
    cp_kind: Literal["ring", "ulysses"] = "ring"

    @model_validator(mode="after")
    def _consistent(self) -> Strategy:
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} shares dp's ranks: it must divide dp={self.dp}")
        if self.recompute_layers is not None:
            if self.recompute == "none":
                raise ValueError("recompute_layers needs recompute 'selective' or 'full', not 'none'")
            if len(self.recompute_layers) != self.pp * self.vp:
                raise ValueError(f"recompute_layers lists {len(self.recompute_layers)} stages but pp x vp = "
                                 f"{self.pp * self.vp}")
        if self.vp > 1 and self.schedule not in MULTI_STAGE_SCHEDULES:
            raise ValueError(f"vp={self.vp} virtual stages need schedule 'interleaved', 'interleaved_zb' or 'zbv', "
                             f"not '{self.schedule}'")
        if self.schedule == "zbv" and self.vp != 2:
            raise ValueError(f"schedule zbv runs exactly 2 stages per rank (V placement): it needs vp=2, not {self.vp}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallel (sp) splits along the tp group: it needs tp > 1")
        if self.cp == 1 and self.cp_kind != "ring":
            raise ValueError(f"cp_kind '{self.cp_kind}' needs cp > 1")
        if self.tp_overlap and not self.sp:
            raise ValueError("tp_overlap overlaps sequence-parallel collectives with GEMMs: it needs sp=true")
        return self


class ModelInput(_Record):
    """One tensor the model's forward takes, per sample (the batch dimension left out)."""

    shape: list[Annotated[int, Field(ge=0)]]
    dtype: str


class CollectiveRecord(_Record):
    """Collectives of one kind over one mesh axis in a step (see cost_models.collectives)."""

    axis: str  # pp | dp | tp | world
    kind: str  # all_reduce | all_gather | reduce_scatter | send | recv | ...
    calls: int = Field(ge=0)
    bytes: int = Field(ge=0)


class PredictedMetrics(_Record):
    """What the cost model expects, kept so a run can be compared with its prediction."""

    step_time_s: float = Field(gt=0)
    tokens_per_s: float = Field(ge=0)
    tflops_per_gpu: float = Field(ge=0)
    mfu: float = Field(ge=0, le=1)
    peak_memory_bytes: list[Annotated[int, Field(ge=0)]]  # one per pipeline rank (virtual stages share it)
    breakdown: dict[str, Annotated[float, Field(ge=0)]] = {}  # seconds: compute, exposed_communication, ...
    # One per pipeline rank: seconds per step computing (forward, backward, recompute, optimizer), no communication.
    compute_s: list[Annotated[float, Field(ge=0)]] = []
    # One list per pipeline rank: what a training step sends (gradient clipping on).
    collectives: list[list[CollectiveRecord]] = []


def _iso_timestamp(text: str) -> str:
    try:
        datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not an ISO 8601 timestamp: {text!r}") from None
    return text


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _autopar_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autopar")
    except PackageNotFoundError:
        return "0.1.0+src"


class Provenance(_Record):
    """Which model, cluster and autopar made the plan: what `load_plan` checks it against."""

    model_name: str
    model_fingerprint: str = Field(min_length=1)
    cluster_name: str
    world_size: int = Field(gt=0)
    autopar_version: str = Field(default_factory=_autopar_version)
    created_at: Annotated[str, AfterValidator(_iso_timestamp)] = Field(default_factory=_now)


class PipelineCapture(_Record):
    """How the forward was captured for pipeline stages (pp > 1): the settings training turned off
    (a Hugging Face model's `use_cache`: its KV cache is never built) and the output fields the loss
    does not read, which no stage sends on."""

    training_settings: dict[str, bool | int | float | str | None] = {}
    dropped_outputs: list[str] = []


class Plan(_Record):
    schema_version: int = PLAN_SCHEMA_VERSION
    mesh: list[MeshAxis] = Field(min_length=1)
    strategy: Strategy
    stages: list[StagePlan]
    param_placements: dict[str, Placements] = {}
    op_placements: dict[str, Placements] = {}
    recompute_modules: list[str] = []
    # The model's tensor inputs as planned (pipeline stages capture the forward at this shape).
    model_inputs: list[ModelInput] = []
    # How the runtime realizes the tp placements: "modules" (Megatron-style module rules) or "dtensor"
    # (DTensor through the model's own forward); the search costed this one (`autopar.capabilities`).
    tp_realization: Literal["modules", "dtensor"] = "modules"
    # pp > 1 only: how the searcher's probe captured the forward for stages (the runtime captures it so).
    pipeline_capture: PipelineCapture | None = None
    predicted: PredictedMetrics | None = None
    provenance: Provenance

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        sizes = {axis.name: axis.size for axis in self.mesh}
        shape = " x ".join(f"{axis.name}={axis.size}" for axis in self.mesh)
        world_size = self.provenance.world_size
        if len(sizes) != len(self.mesh):
            raise ValueError(f"mesh {shape} names an axis twice")
        if math.prod(sizes.values()) != world_size:
            raise ValueError(
                f"mesh {shape} holds {math.prod(sizes.values())} devices but the world size is {world_size}: "
                f"the mesh must cover every device exactly once"
            )
        order = [axis.name for axis in self.mesh]
        if any(name not in MESH_ORDER for name in order) or order != [a for a in MESH_ORDER if a in order]:
            raise ValueError(f"mesh {shape}: the axes are pp, dp, cp and tp, in that order (row-major, tp innermost), "
                             f"each at most once")
        for knob in ("dp", "cp", "tp", "pp"):
            if sizes.get(knob, 1) != getattr(self.strategy, knob):
                raise ValueError(f"mesh axis {knob}={sizes.get(knob, 1)} but strategy.{knob}={getattr(self.strategy, knob)}")
        expected_stages = self.strategy.pp * self.strategy.vp
        if len(self.stages) != expected_stages:
            raise ValueError(f"stages lists {len(self.stages)} but pp x vp = {expected_stages} are needed")
        for position, stage in enumerate(self.stages):
            if stage.index != position:
                raise ValueError(f"stage at position {position} has index {stage.index}: stages must be in order")
            unknown = sorted(set(stage.mesh_shape) - set(sizes))
            if unknown:
                raise ValueError(f"stage {position} mesh_shape names axes {unknown} that the mesh lacks")
            if max(stage.device_ids) >= world_size:
                raise ValueError(f"stage {position} uses device {max(stage.device_ids)} of a world of {world_size}")
            stage_shape = {name: size for name, size in sizes.items() if name != "pp"}
            if stage.mesh_shape != stage_shape:
                raise ValueError(f"stage {position} mesh_shape {stage.mesh_shape} is not the mesh without pp "
                                 f"({stage_shape})")
        _check_stage_devices(self.stages, self.strategy.pp, world_size, self.strategy.schedule)
        _check_stage_modules(self.stages, self.recompute_modules)
        _check_schedule(self.strategy)
        # A parameter lives on one stage, so placements cover a stage's sub-mesh: every axis but pp.
        stage_axes = [axis.name for axis in self.mesh if axis.name != "pp"]
        for field in ("param_placements", "op_placements"):
            for key, text in getattr(self, field).items():
                if len(parse_placements(text)) != len(stage_axes):
                    raise ValueError(
                        f"{field}[{key}] = {text!r} has {len(parse_placements(text))} placements but a stage's "
                        f"mesh has {len(stage_axes)} axes ({', '.join(stage_axes)}): give one per axis"
                    )
        counts = self.strategy.recompute_layers
        if counts is not None:  # what was costed per stage is what the runtime recomputes
            recomputed = set(self.recompute_modules)
            for stage, count in zip(self.stages, counts):
                listed = sum(1 for path in stage.module_paths if path in recomputed)
                if listed != count:
                    raise ValueError(f"stage {stage.index} recomputes {listed} of its modules but "
                                     f"strategy.recompute_layers gives it {count}")
        if self.predicted is not None:
            for field, values in (("peak_memory_bytes", self.predicted.peak_memory_bytes),
                                  ("compute_s", self.predicted.compute_s),
                                  ("collectives", self.predicted.collectives)):
                if len(values) != self.strategy.pp and (values or field == "peak_memory_bytes"):
                    raise ValueError(f"predicted.{field} has {len(values)} entries; give one per pipeline rank "
                                     f"(pp={self.strategy.pp})")
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)


MULTI_STAGE_SCHEDULES = ("interleaved", "interleaved_zb", "zbv")
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", "zbv")  # backward split into input- and weight-gradient passes


def stage_rank(index: int, pp: int, schedule: str) -> int:
    """The pipeline rank running virtual stage `index`. Loop placement: stage i on rank i mod pp. zbv's
    V placement: chunk c = i // pp runs down the ranks when even and back up when odd (Qi et al., ICLR
    2024, §6), so rank r holds stages r and 2pp-1-r, and the first and last stage share rank 0."""
    chunk, position = divmod(index, pp)
    if schedule == "zbv" and chunk % 2:
        return pp - 1 - position
    return position


def rank_stage_indices(pp: int, stages: int, schedule: str) -> list[list[int]]:
    """Per pipeline rank, the virtual stages it runs, in stage order (`stage_rank` inverted)."""
    held: list[list[int]] = [[] for _ in range(pp)]
    for index in range(stages):
        held[stage_rank(index, pp, schedule)].append(index)
    return held


def _check_stage_devices(stages: list[StagePlan], pp: int, world_size: int, schedule: str = "1f1b") -> None:
    """Stage i runs on pipeline rank `stage_rank(i)` (i mod pp but under zbv), and pipeline rank r owns
    the r-th contiguous block of the (pp, dp, cp, tp) row-major mesh: no device runs two pipeline
    ranks, none is left idle."""
    block = world_size // pp
    owner: dict[int, int] = {}
    for stage in stages:
        rank = stage_rank(stage.index, pp, schedule)
        for device in stage.device_ids:
            if owner.setdefault(device, rank) != rank:
                raise ValueError(f"device {device} runs stages of pipeline ranks {owner[device]} and {rank} (stage "
                                 f"{stage.index}): each device belongs to one pipeline rank")
        expected = list(range(rank * block, (rank + 1) * block))
        if sorted(stage.device_ids) != expected:
            raise ValueError(f"stage {stage.index} runs on devices {stage.device_ids}, but pipeline rank {rank} "
                             f"(placement of schedule {schedule}, pp={pp}) owns devices {expected} of the pp x dp x cp x "
                             f"tp mesh")


def _check_stage_modules(stages: list[StagePlan], recompute_modules: list[str]) -> None:
    """Each module runs in one stage: listed once, and never inside (or around) another stage's module."""
    where: dict[str, int] = {}
    for stage in stages:
        for path in stage.module_paths:
            if not path:
                raise ValueError(f"stage {stage.index} lists an empty module path")
            if where.setdefault(path, stage.index) != stage.index:
                raise ValueError(f"module {path!r} is listed in stage {where[path]} and stage {stage.index}: "
                                 f"each module runs in one stage")
    for path, index in where.items():
        parent = path.rpartition(".")[0]
        while parent:
            if where.get(parent, index) != index:
                raise ValueError(f"module {path!r} (stage {index}) lies inside module {parent!r} "
                                 f"(stage {where[parent]}): each module runs in one stage")
            parent = parent.rpartition(".")[0]
    for path in recompute_modules:
        if not any(path == listed or path.startswith(f"{listed}.") for listed in where):
            raise ValueError(f"recompute_modules names {path!r}, which no stage runs")
    if len(set(recompute_modules)) != len(recompute_modules):
        raise ValueError("recompute_modules lists a module twice")


def _check_schedule(strategy: Strategy) -> None:
    """What torch's pipeline schedules need of the micro-batch count (as the searcher plans it)."""
    s = strategy
    if s.pp > 1 and s.schedule in ("1f1b", "interleaved", *ZERO_BUBBLE_SCHEDULES) and s.num_microbatches < s.pp:
        raise ValueError(f"schedule {s.schedule} needs at least pp={s.pp} micro-batches, the plan has "
                         f"{s.num_microbatches}")
    if s.pp > 1 and s.schedule in ("interleaved", "interleaved_zb") and s.num_microbatches % s.pp:
        raise ValueError(f"schedule {s.schedule} needs the micro-batch count ({s.num_microbatches}) divisible by "
                         f"pp={s.pp}")


def save_plan(plan: Plan, path: str | Path) -> None:
    """Serialize first, then write atomically: a crash leaves the old plan or the new, never half."""
    atomic_write_text(path, plan.to_json())


def load_plan(path: str | Path, expected_fingerprint: str | None = None) -> Plan:
    """Read a plan, refusing other schema versions, plans inconsistent in themselves and plans made for
    another model. Checked against the model itself (its fingerprint, and everything the runtime would
    otherwise refuse only once the process group is up): `autopar.plan_checks.load_plan_for_model`,
    which `autopar.load_plan(path, model=...)` calls; the schema does not know the runtime's rules."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise AutoparError(f"plan file {path} {what}; run `autopar plan` to create one or check the path")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise AutoparError(
            f"plan file {path} is not valid JSON: {error.msg} at line {error.lineno}; re-run `autopar plan` to regenerate it"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise AutoparError(f"cannot read plan file {path}: {one_line(str(error))}; check the file") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise AutoparError(f"plan file {path} has no schema_version: it is not an autopar plan; check the path")
    if data["schema_version"] != PLAN_SCHEMA_VERSION:
        raise AutoparError(
            f"plan file {path} has schema version {data['schema_version']!r}, this autopar reads version "
            f"{PLAN_SCHEMA_VERSION}: re-run `autopar plan` to regenerate it"
        )
    try:
        plan = Plan.model_validate(data)
    except ValidationError as error:
        raise AutoparError(
            f"plan file {path} is invalid: {condense_validation_error(error)}; re-run `autopar plan` to regenerate it"
        ) from None
    found = plan.provenance.model_fingerprint
    if expected_fingerprint is not None and found != expected_fingerprint:
        raise AutoparError(
            f"plan {path} was made for model fingerprint {found} ({plan.provenance.model_name}), this model is "
            f"{expected_fingerprint}: re-run `autopar plan` for this model"
        )
    return plan


def diff_plans(a: Plan, b: Plan, max_lines_per_section: int = 20) -> list[str]:
    """What changed from plan `a` to plan `b`, one readable line each; empty when they agree."""
    lines: list[str] = []
    mesh = [" x ".join(f"{axis.name}={axis.size}" for axis in plan.mesh) for plan in (a, b)]
    if mesh[0] != mesh[1]:
        lines.append(f"mesh: {mesh[0]} -> {mesh[1]}")
    lines += _diff_mapping("strategy.", a.strategy.model_dump(), b.strategy.model_dump())
    if len(a.stages) != len(b.stages):
        lines.append(f"stages: {len(a.stages)} -> {len(b.stages)}")
    for old, new in zip(a.stages, b.stages):
        for field in ("module_paths", "device_ids", "mesh_shape"):
            before, after = getattr(old, field), getattr(new, field)
            if before != after:
                lines.append(f"stage {old.index} {field}: {_short(before)} -> {_short(after)}")
    for field in ("param_placements", "op_placements"):
        changes = _diff_mapping(f"{field}[", getattr(a, field), getattr(b, field), close="]")
        lines += _capped(changes, field, max_lines_per_section)
    if a.recompute_modules != b.recompute_modules:
        added = [m for m in b.recompute_modules if m not in a.recompute_modules]
        removed = [m for m in a.recompute_modules if m not in b.recompute_modules]
        lines.append(f"recompute_modules: added {_short(added)}, removed {_short(removed)}")
    predicted = [plan.predicted.model_dump() if plan.predicted else {} for plan in (a, b)]
    lines += _diff_mapping("predicted.", *predicted)
    provenance = [plan.provenance.model_dump(exclude={"created_at"}) for plan in (a, b)]
    lines += _diff_mapping("provenance.", *provenance)
    if a.schema_version != b.schema_version:
        lines.append(f"schema_version: {a.schema_version} -> {b.schema_version}")
    return lines


def _diff_mapping(prefix: str, a: dict[str, Any], b: dict[str, Any], close: str = "") -> list[str]:
    lines = []
    for key in list(a) + [key for key in b if key not in a]:
        if key not in b:
            lines.append(f"{prefix}{key}{close}: {_short(a[key])} -> (absent)")
        elif key not in a:
            lines.append(f"{prefix}{key}{close}: (absent) -> {_short(b[key])}")
        elif a[key] != b[key]:
            lines.append(f"{prefix}{key}{close}: {_short(a[key])} -> {_short(b[key])}")
    return lines


def _capped(lines: list[str], what: str, limit: int) -> list[str]:
    if len(lines) <= limit:
        return lines
    return lines[:limit] + [f"... and {len(lines) - limit} more {what} changes"]


def _short(value: Any, max_items: int = 4) -> str:
    """Long module lists shown by their ends, so a diff line stays readable."""
    if isinstance(value, list) and len(value) > max_items:
        return f"[{', '.join(map(str, value[:2]))}, ... {len(value) - 3} more ..., {value[-1]}]"
    return one_line(str(value), max_chars=120)
