"""The report model: what `autopar plan` found, typed, as every renderer reads it.

Built once from the search result (`autopar.report.build`); the terminal text, HTML page, SVG
drawings, schedule timeline and Perfetto trace read its attributes only, so they cannot disagree.
`--json` writes `model_dump(mode="json")`, and `Report.from_json` loads such a file back to render
it again: loading parses data and never runs code. Fields added since the first `--json` files
have defaults, so older files still load.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from autopar.errors import AutoparError
from autopar.plan_schema import Plan, Strategy
from autopar.validation import condense_validation_error, one_line

REPORT_VERSION = 1
MEMORY_PARTS = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "margin")
BREAKDOWN_PARTS = ("compute", "recompute", "exposed_communication", "bubble", "optimizer")
OFFLOAD_PARTS = ("offload_transfer", "cpu_optimizer")  # listed only when the plan offloads
# Row-major, tp innermost: the runtime's order (runtime/mesh.py); a report's mesh has "cp" only when cp > 1.
MESH_ORDER = ("pp", "dp", "cp", "tp")


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClusterInfo(_Part):
    name: str
    gpu: str
    world_size: int
    gpus_per_node: int
    num_nodes: int


class MfuBasis(_Part):
    """What MFU is relative to: one GPU's dense peak for the compute dtype, and where it comes from."""

    gpu: str
    dtype: str
    peak_tflops: float
    source: str = ""  # datasheet, cluster file, or "nominal placeholder ..."
    nominal: bool = False  # the peak is a placeholder, not a datasheet figure or a measurement


class MemoryParts(_Part):
    """One pipeline rank's predicted memory per GPU, bytes."""

    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    buffers: float
    margin: float

    @property
    def total_bytes(self) -> float:
        return sum(getattr(self, part) for part in MEMORY_PARTS)


class Breakdown(_Part):
    """The critical pipeline rank's step, seconds."""

    compute: float
    recompute: float
    exposed_communication: float
    bubble: float
    optimizer: float
    # offload=optimizer: the PCIe copies not hidden behind the passes, and the CPU's Adam step
    offload_transfer: float = 0.0
    cpu_optimizer: float = 0.0
    # ep > 1: the MoE dispatch and combine all-to-alls, exposed inside the passes
    expert_all_to_all: float = 0.0
    # cp > 1: the attention exchange (ring K/V p2p, ulysses all-to-all) not hidden behind attention
    context_exchange: float = 0.0

    def parts(self) -> list[tuple[str, float]]:
        offloaded = self.offload_transfer or self.cpu_optimizer
        experts = ("expert_all_to_all",) if self.expert_all_to_all else ()
        context = ("context_exchange",) if self.context_exchange else ()
        return [(part, getattr(self, part)) for part in BREAKDOWN_PARTS + experts + context
                + (OFFLOAD_PARTS if offloaded else ())]

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.parts())


class Predicted(_Part):
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    peak_memory_bytes_per_stage: list[float]  # per pipeline rank (the --json name predates virtual stages)
    memory_breakdown_bytes: list[MemoryParts]  # per pipeline rank
    breakdown: Breakdown
    compute_s_per_stage: list[float] = []  # per pipeline rank: one step's compute, no communication
    memory_headroom_bytes: float = 0.0  # left free beyond the capacity a plan may use (cluster memory_headroom)
    # offload=optimizer: the fullest node's host memory and what a plan may place there (0: no offload)
    host_memory_bytes: float = 0.0
    host_capacity_bytes: float = 0.0


class StageRow(_Part):
    """One (virtual) stage; times are one micro-batch's passes on one GPU, communication inside included."""

    index: int
    rank: int  # pipeline rank: stage i runs on rank i mod pp (zbv: `plan_schema.stage_rank`)
    units: list[str]
    forward_s: float
    backward_s: float
    backward_weight_s: float = 0.0  # the weight-gradient part of backward_s (zero-bubble schedules' W)
    recomputed_layers: int = 0
    layers: int | None = None  # repeated layers among its units (what recompute counts count)


class EvaluationReport(_Part):
    """A strategy and its prediction: the chosen plan, or a runner-up."""

    strategy: Strategy
    fits: bool
    predicted: Predicted
    stages: list[StageRow]


class WhyNotRow(_Part):
    """An alternative a user may expect, and why it loses (see autopar.searcher.why_not)."""

    label: str
    strategy: Strategy | None
    reason: str
    slowdown: float | None = None  # its time per token over the chosen plan's
    fits: bool | None = None
    peak_memory_bytes: float | None = None
    global_batch: int | None = None  # priced at this batch, the asked one having no such strategy

    @property
    def is_runner_up(self) -> bool:
        return "runner-up" in self.label.split(" / ")


class LinkInfo(_Part):
    name: str
    bandwidth_bytes_per_s: float


class MeshLinks(_Part):
    intra_node: LinkInfo | None = None
    inter_node: LinkInfo | None = None


class MeshAxisInfo(_Part):
    """A mesh axis's groups, described by size and stride so that 1,024 GPUs stay small."""

    size: int
    stride: int
    groups: int
    nodes_per_group: int
    within_node: bool
    link: str  # the link its groups talk over, "none" for size 1
    first_group: list[int]


class MeshInfo(_Part):
    """Where each mesh axis's groups sit on the cluster."""

    order: list[str]
    world_size: int
    gpus_per_node: int
    num_nodes: int
    links: MeshLinks
    axes: dict[str, MeshAxisInfo]

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group along `axis` (vary that axis's coordinate, keep the others)."""
        info = self.axes[axis]
        base = rank - ((rank // info.stride) % info.size) * info.stride
        return [base + k * info.stride for k in range(info.size)]

    def coordinates(self, rank: int) -> dict[str, int]:
        """A rank's (pp, dp, [cp,] tp) coordinates in the row-major mesh."""
        return {axis: (rank // self.axes[axis].stride) % self.axes[axis].size for axis in self.order}


class PipelineInfo(_Part):
    """The schedule's inputs and results, enough to redraw it (`autopar.report.timeline`)."""

    schedule: str
    pp: int
    vp: int
    num_microbatches: int
    p2p_s: float
    makespan_s: float
    rank_busy_s: list[float]
    rank_end_s: list[float]
    critical_rank: int
    exposed_sync_s: list[float]  # per rank, after its last backward
    optimizer_s: list[float]
    offload_transfer_s: list[float] = []  # per rank, offload=optimizer: PCIe copies exposed before the CPU step


class ShardingRow(_Part):
    """Placements of one module, or of a run of repeated layers with identical placements."""

    modules: str  # "layers.0–11"
    prefix: str
    first: int | None
    last: int | None
    count: int
    params: dict[str, str]  # parameter (within the module) → placements, one per mesh axis
    axes: list[str]


class CompileChoiceInfo(_Part):
    """Compile on or off, chosen by the predictions (`searcher.compile_choice`): each way's fastest step,
    None where that way found no plan (`refusal` says why)."""
    compiled: bool
    eager_step_time_s: float | None
    compiled_step_time_s: float | None
    refusal: str | None = None
    line: str


class SearchStats(_Part):
    candidates: int
    seconds: float
    ilp_variables: int = 0
    ilp_solve_s: float = 0.0
    ilp_budgeted: int = 0
    rejected: dict[str, int] = {}
    compile_choice: CompileChoiceInfo | None = None  # `plan(..., choose_compile=True)`: both searches, totalled


class CheckpointCost(_Part):
    """Saving one checkpoint of this plan (cost_models/checkpoint.py), and how often Young/Daly would
    save one. A checkpoint holds fp32 weights and AdamW's two moments, 12 bytes per parameter, each
    tensor written once and spread over the ranks that hold a copy (as DCP writes it)."""

    checkpoint_bytes: float  # the whole checkpoint
    bytes_per_rank: list[float]  # one per pipeline rank: what each of its GPUs writes
    busiest_node_bytes: float
    node_storage_write_bytes_per_s: float
    hash_bytes_per_s: float  # sha256 on one thread, measured on the machine that planned
    save_time_s: float
    failures_per_gpu_hour: float
    mtbf_s: float  # the job's, at that rate over its GPUs
    interval_s: float  # Young/Daly's compute time between checkpoints
    checkpoint_every: int  # the interval in steps of the plan's predicted step time
    leaves_out: str = ""  # what the prediction does not price


class Report(EvaluationReport):
    """Everything `autopar plan` reports; the `--json` output."""

    report_version: int = REPORT_VERSION
    model: str
    precision: str | None = None
    cluster: ClusterInfo
    global_batch: int
    seq_len: int | None
    fixed: dict[str, bool | int | float | str | list[int]] = {}  # the --strategy keys; the rest were chosen
    capacity_bytes: float
    mfu_basis: MfuBasis | None = None
    search: SearchStats | None = None
    alternatives: list[EvaluationReport] = []  # runners-up, best first
    why_not: list[WhyNotRow] = []
    mesh: MeshInfo
    pipeline: PipelineInfo | None = None
    plan: Plan | None = None  # None when nothing fits
    sharding: list[ShardingRow] | None = None
    checkpoint: CheckpointCost | None = None  # None in reports saved before it was added

    @classmethod
    def from_json(cls, text: str, source: str = "report") -> Report:
        """A `--json` file's text back into the model; one line naming the problem when it is not one."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as error:
            raise AutoparError(f"{source} is not an autopar plan report (`autopar plan --json`): "
                               f"{condense_validation_error(error)}; write it again with `autopar plan --json`") from None


def load_report(path: str | Path) -> Report:
    """A saved `autopar plan --json` file, checked against the model."""
    path = Path(path)
    if not path.is_file():
        raise AutoparError(f"report {path} {'is a directory' if path.is_dir() else 'not found'}; "
                           f"write one with `autopar plan ... --json {path}`")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise AutoparError(f"cannot read report {path}: {one_line(str(error))}; check the file") from None
    return Report.from_json(text, source=str(path))
