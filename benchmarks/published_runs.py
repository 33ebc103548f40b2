"""Published measured runs as the cost model sees them: the model each row trained, the cluster,
the strategy and implementation profile it ran with, and its measured step time under the row's
FLOP accounting. Read from the row's own fields; where a row is silent, the rule used is stated
here and printed with the results (`assumptions`).

Row fields read: layers, hidden, heads, seq_len, global_batch, micro_batch, tp, pp, dp, vp,
zero_stage, recompute, precision, n_gpus, gpu, measured_tflops_per_gpu, iteration_time_s,
tokens_per_s_per_gpu, flops_accounting, params_b, notes, source; optional overrides: vocab,
tied, attention, dropout, dp_overlap, tp_overlap, zero3_fetch, sp, family, inter_node (a LinkSpec's fields over
the preset's network), flops_formula ("megatron-lm-2024":
Megatron-LM's logged count, `counted_flops`).

`published_runs_supplement.json` (beside this file) completes or corrects rows by id from other
cited sources (the authors' launch scripts, the code that computed the published figure); every
row it touches lists the fields it set and their source (`supplemented`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.cluster import ClusterSpec, load_cluster
from autopar.cost_models.facts import ModelFacts, model_facts
from autopar.graph import OpGraph, trace
from autopar.models import build_model

DEFAULT_VOCAB = 51200  # GPT-2's padded vocabulary, Megatron-LM's default for its GPT runs
SUPPLEMENT = Path(__file__).resolve().parent / "published_runs_supplement.json"
MEGATRON_2024 = "megatron-lm-2024"


@dataclass
class PublishedRun:
    row: dict[str, Any]
    family: str
    vocab: int
    tied: bool
    precision: str
    cluster: ClusterSpec
    fixed: dict[str, Any]  # the `--strategy` keys this run fixes (parallel layout and implementation)
    accounting: str  # "measured time" | "hardware FLOPs (Megatron SC'21 Eq. 3)" | "model FLOPs (6N + 12lhs)"
    assumptions: list[str] = field(default_factory=list)
    supplemented: list[str] = field(default_factory=list)  # fields set from SUPPLEMENT, with their source
    facts: ModelFacts | None = None
    graph: OpGraph | None = None
    num_params: int = 0

    @property
    def id(self) -> str:
        return self.row["id"]

    def strategy_text(self) -> str:
        return ",".join(f"{key}={_text(value)}" for key, value in self.fixed.items())

    def measured_step_time_s(self) -> float:
        """Seconds per optimizer step, from what the row measured under its accounting."""
        r = self.row
        if r.get("iteration_time_s"):
            return float(r["iteration_time_s"])
        tokens = r["global_batch"] * r["seq_len"]
        if r.get("tokens_per_s_per_gpu"):
            return tokens / (r["tokens_per_s_per_gpu"] * r["n_gpus"])
        return self.counted_flops() / (r["measured_tflops_per_gpu"] * 1e12 * r["n_gpus"])

    def counted_flops(self) -> float:
        """FLOPs per step as the row's accounting counts them."""
        r = self.row
        b, s, l, h = r["global_batch"], r["seq_len"], r["layers"], r["hidden"]
        if self.accounting.startswith("hardware"):
            # Narayanan et al. SC'21, Eq. 3: forward, backward and the recompute forward.
            return 96 * b * s * l * h**2 * (1 + s / (6 * h) + self.vocab / (16 * l * h))
        if self.accounting.startswith("Megatron-LM"):
            # megatron/training/training.py num_floating_point_operations (2024) for a GPT with
            # multi-head attention and a 4h MLP: the dense GEMMs, full-square attention, and the
            # logit GEMM once (no input-embedding term), no recompute.
            return 72 * b * s * l * h**2 + 12 * b * s**2 * l * h + 6 * b * s * h * self.vocab
        # model FLOPs as the file's `about` states them: 6·N per token (N: every parameter,
        # embeddings included) plus attention's 12·l·h·s per token, no recompute.
        return (6 * self.num_params + 12 * l * h * s) * b * s


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_runs(path: str | Path, supplement: str | Path | None = SUPPLEMENT) -> tuple[str, list[dict[str, Any]]]:
    """The file's rows, each completed from `supplement` where it has an entry for the row's id."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    extra = {} if supplement is None else {
        entry["id"]: entry for entry in json.loads(Path(supplement).read_text(encoding="utf-8"))["overrides"]}
    return data.get("about", ""), [_supplemented(row, extra.get(row["id"])) for row in data["runs"]]


def _supplemented(row: dict[str, Any], entry: dict[str, Any] | None) -> dict[str, Any]:
    if entry is None:
        return row
    fields = {key: value for key, value in entry.items() if key not in ("id", "source")}
    note = f"{', '.join(f'{key}={value}' for key, value in fields.items())} ({entry['source'][:60]}...)"
    return {**row, **fields, "_supplemented": [*row.get("_supplemented", []), note]}


def family_of(row: dict[str, Any]) -> str:
    """Which publication a row belongs to: the `family` field, or its id without the model size."""
    return row.get("family") or re.sub(r"-[0-9.]+[bm]$", "", row["id"])


def _year(row: dict[str, Any]) -> int | None:
    years = [int(y) for y in re.findall(r"\b(20[0-9]{2})\b", str(row.get("source", "")))]
    return max(years) if years else None


def _mentions(row: dict[str, Any], *words: str) -> bool:
    text = " ".join(str(row.get(key) or "") for key in ("notes", "flops_accounting", "source")).lower()
    return any(word.lower() in text for word in words)


def _cluster_preset(gpu: str) -> str | None:
    text = gpu.upper()
    if "A100" in text:
        return "dgx-a100-40gb" if "40GB" in text or "40 GB" in text else "dgx-a100-80gb"
    if "H200" in text:
        return "dgx-h200"
    if "H100" in text:
        return "dgx-h100"
    return None


def _vocab(row: dict[str, Any], notes: list[str]) -> int:
    if row.get("vocab"):
        return int(row["vocab"])
    match = re.search(r"vocab(?:ulary)?(?: size)?[^0-9]{0,12}([0-9][0-9,]{2,})", str(row.get("notes", "")), re.I)
    if match:
        return int(match.group(1).replace(",", ""))
    notes.append(f"vocabulary {DEFAULT_VOCAB:,} (not given)")
    return DEFAULT_VOCAB


def _tied(row: dict[str, Any], vocab: int, notes: list[str]) -> bool:
    """Given, or whichever of tied/untied embeddings lands nearer the published parameter count."""
    if row.get("tied") is not None:
        return bool(row["tied"])
    l, h, s = row["layers"], row["hidden"], row["seq_len"]
    body = 12 * l * h * h + 13 * l * h + vocab * h + s * h
    if not row.get("params_b"):
        return True
    published = row["params_b"] * 1e9
    tied = abs(body - published) <= abs(body + vocab * h - published)
    if not tied:
        notes.append("untied embeddings (nearer the published parameter count)")
    return tied


def _accounting(row: dict[str, Any]) -> str:
    if row.get("iteration_time_s") or row.get("tokens_per_s_per_gpu"):
        return "measured time"
    if row.get("flops_formula") == MEGATRON_2024:
        return "Megatron-LM 2024 logged FLOPs (72Bslh^2 + 12Bs^2lh + 6BshV, no recompute)"
    text = str(row.get("flops_accounting", "")) + " " + str(row.get("recompute") or "")
    if "96*B*s*l*h^2" in text.replace(" ", "") or "recompute forward" in text or "closer to HFU" in text:
        return "hardware FLOPs (Megatron SC'21 Eq. 3, recompute counted)"
    return "model FLOPs (6N + 12lhs per token, no recompute)"


def _recompute(row: dict[str, Any]) -> dict[str, Any]:
    text = str(row.get("recompute") or "").lower()
    if text.startswith("full"):
        return {"recompute": "full", "recompute_layers": "all"}  # every layer, as published
    if text.startswith("selective"):
        return {"recompute": "selective", "recompute_layers": "all"}
    return {"recompute": "none"}


def _profile(row: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The implementation knobs (`cost_models.implementation`): the row's own, else its era's."""
    year = _year(row)
    early = year is not None and year <= 2021
    profile: dict[str, Any] = {}
    profile["attention"] = row.get("attention") or ("math" if early else "fused")
    dropout = row.get("dropout")
    profile["dropout"] = float(dropout) if dropout is not None else (0.1 if early else 0.0)
    if row.get("dp_overlap") is not None:
        profile["dp_overlap"] = bool(row["dp_overlap"])
    else:
        profile["dp_overlap"] = _mentions(row, "overlap-grad-reduce") or not early
    if row.get("zero3_fetch"):
        profile["zero3_fetch"] = row["zero3_fetch"]
    tp_overlap = row.get("tp_overlap")
    profile["tp_overlap"] = bool(tp_overlap) if tp_overlap is not None else (
        _mentions(row, "tp-comm-overlap") and row["tp"] > 1)
    # The published software holds 16-bit model weights (no per-micro-batch casts). Megatron-LM adds
    # each micro-batch's gradient into an fp32 main gradient inside the weight-gradient GEMM
    # (gradient-accumulation fusion); its 2021 scripts did it in a hook, a pass left unpriced here.
    # The ZeRO-3 rows (DeepSpeed) run one micro-batch per step. So none of the runtime's
    # per-micro-batch weight passes apply (`cost_models.weight_passes`).
    profile["weight_passes"] = bool(row.get("weight_passes", False))
    # Megatron-LM keeps a sequence-parallel projection's input shard and gathers it again in backward
    profile["sp_inputs"] = row.get("sp_inputs", "shards")
    # apex's FusedAdam, the clip's multi-tensor scale a pass of its own (`cost_models.optimizer`)
    profile["optimizer_impl"] = row.get("optimizer_impl", "apex")
    if row.get("attention") is None:
        notes.append(f"attention {profile['attention']} ({'before' if early else 'after'} FlashAttention, 2022)")
    if dropout is None:
        notes.append(f"dropout {profile['dropout']} ({'Megatron-LM 2021 scripts' if early else 'not stated: none'})")
    return profile


def published_run(row: dict[str, Any]) -> PublishedRun | str:
    """The run as the cost model prices it, or the reason it cannot be priced."""
    preset = _cluster_preset(str(row.get("gpu", "")))
    if preset is None:
        return f"GPU {row.get('gpu')!r} has no cluster preset"
    notes: list[str] = []
    vocab = _vocab(row, notes)
    tied = _tied(row, vocab, notes)
    precision = "fp16" if "fp16" in str(row.get("precision", "")).lower() else "bf16"
    profile = _profile(row, notes)
    sp = row.get("sp")
    if sp is None:
        sp = row["tp"] > 1 and (profile["tp_overlap"] or _mentions(row, "sequence parallel"))
    zero = row.get("zero_stage")
    if zero is None:
        zero = 1 if _mentions(row, "overlap-param-gather", "distributed optimizer") else 0
    fixed: dict[str, Any] = {"dp": row["dp"], "tp": row["tp"], "pp": row["pp"], "zero": int(zero), "sp": bool(sp),
                             **_recompute(row)}
    if row.get("micro_batch"):
        fixed["microbatch"] = int(row["micro_batch"])
    if row.get("vp"):  # vp 1 with pp > 1: the plain 1F1B schedule, as published
        vp = int(row["vp"])
        fixed["vp"], fixed["schedule"] = vp, "interleaved" if vp > 1 else "1f1b"
    fixed.update(profile)
    cluster = load_cluster(preset, gpus=row["n_gpus"])
    if row.get("inter_node"):  # the row's own network, over the preset's (a measured or line-rate figure)
        link = {**cluster.inter_node.model_dump(), **row["inter_node"], "name": f"{row['id']} network",
                "source": "the published row"}
        cluster = ClusterSpec.model_validate({**cluster.model_dump(), "inter_node": link})
        notes.append(f"network {link['bandwidth_bytes_per_s'] * link['efficiency'] / 1e9:g} GB/s per GPU between nodes")
    return PublishedRun(row=row, family=family_of(row), vocab=vocab, tied=tied, precision=precision, cluster=cluster,
                        fixed=fixed, accounting=_accounting(row), assumptions=notes,
                        supplemented=list(row.get("_supplemented", [])))


_TRACED: dict[tuple, tuple] = {}  # rows of one model share its trace (a 175B trace takes ~15 s)


def trace_run(run: PublishedRun) -> PublishedRun:
    """Build the GPT the row trained on the meta device and condense its graph (fused attention,
    no dropout: the profile prices what the run had instead)."""
    r = run.row
    config = {"layers": r["layers"], "hidden": r["hidden"], "heads": r["heads"], "vocab": run.vocab,
              "seq_len": r["seq_len"], "tie_embeddings": run.tied}
    key = (*sorted(config.items()), run.precision)
    if key not in _TRACED:
        spec = build_model("gpt", config)
        graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision=run.precision, name=run.id)
        _TRACED[key] = (graph, model_facts(graph, heads=r["heads"], vocab=run.vocab))
    run.graph, run.facts = _TRACED[key]
    run.num_params = run.graph.num_params
    return run
