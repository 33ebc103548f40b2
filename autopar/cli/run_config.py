"""The run configuration of `autopar run`: one pydantic model, from a YAML file and flags.

The model holds every default, so a YAML file, the flags and the copy saved in each checkpoint
mean the same thing. Flags override the file; a flag left out keeps the file's value (argparse
records only the flags given, see `add_run_arguments`).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autopar.errors import AutoparError


class RunConfig(BaseModel):
    """What one `autopar run` does; saved with each checkpoint as what reproduces the run."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())

    model: str
    steps: int
    plan: str | None = None
    model_overrides: str | None = Field(default=None, alias="model_config")  # "K=V,...": pydantic owns `model_config`
    cluster: str | None = None
    strategy: str = ""
    seq_len: int | None = None
    global_batch: int | None = None
    precision: Literal["bf16", "fp16", "fp32"] | None = None
    lr: float = 3e-4
    seed: int = 0
    data: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: str = "auto"
    keep_last: int = 3
    async_checkpoint: bool = False
    max_grad_norm: float = 1.0
    log_every: int = 10
    metrics: str | None = None
    tensorboard: str | None = None
    progress: bool | None = None  # None: a bar when stderr is a terminal
    profile_steps: int = 0
    profile_dir: str = "autopar-profile"
    report: str | None = None
    dry_run: bool = False
    # torch.compile the stage or its blocks (runtime/compile.py); None: on a GPU, a searched plan compiles
    # where the cost model predicts it faster (`run_plan.search_plan`), and eager elsewhere
    compile: bool | None = None

    def json_record(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def check(self) -> None:
        """The refusals that need no model, data or process group: one line each, before anything runs."""
        if self.steps < 1:
            raise AutoparError(f"--steps must be at least 1, got {self.steps}")
        for flag in ("model", "plan", "cluster", "data", "checkpoint_dir", "resume", "metrics", "tensorboard",
                     "profile_dir", "report"):
            value = getattr(self, flag)
            if value is not None and not value.strip():
                raise AutoparError(f"--{flag.replace('_', '-')} is empty: give a value or leave the setting out")
        if self.seq_len is not None and self.seq_len < 1:
            raise AutoparError(f"--seq-len must be at least 1, got {self.seq_len} (leave it out for the model's "
                               f"default)")
        if self.seed < 0:
            raise AutoparError(f"--seed must be 0 or more, got {self.seed}")
        if self.global_batch is not None and self.global_batch < 1:
            raise AutoparError(f"--global-batch must be positive, got {self.global_batch}")
        if self.log_every < 1:
            raise AutoparError(f"--log-every must be at least 1, got {self.log_every}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise AutoparError(f"--lr must be a positive number, got {self.lr}")
        if not (self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm)):
            raise AutoparError(f"--max-grad-norm must be 0 (no clipping) or positive, got {self.max_grad_norm}")
        if self.checkpoint_every is not None:
            if self.checkpoint_dir is None:
                raise AutoparError("--checkpoint-every needs --checkpoint-dir DIR (where to save them)")
            if self.checkpoint_every < 1:
                raise AutoparError(f"--checkpoint-every must be at least 1 step, got {self.checkpoint_every}")
        if self.keep_last < 1:
            raise AutoparError(f"--keep-last {self.keep_last} would delete the checkpoint just written: give 1 or more")
        if self.async_checkpoint and self.checkpoint_dir is None:
            raise AutoparError("--async-checkpoint needs --checkpoint-dir DIR (where to save)")
        if self.resume not in ("auto", "none") and not Path(self.resume).exists():
            raise AutoparError(f"--resume {self.resume}: no such checkpoint; give auto, none or a checkpoint "
                               f"directory (e.g. CKPT_DIR/step-00000100)")
        if self.checkpoint_dir is not None and Path(self.checkpoint_dir).exists() \
                and not Path(self.checkpoint_dir).is_dir():
            raise AutoparError(f"--checkpoint-dir {self.checkpoint_dir} is a file: give a directory")
        if self.checkpoint_dir is not None and not self.dry_run:  # found now, not at the first save
            from autopar.runtime.checkpoint.checkpointer import check_writable_directory

            check_writable_directory(self.checkpoint_dir)
        if self.profile_steps < 0:
            raise AutoparError(f"--profile-steps must be 0 (off) or positive, got {self.profile_steps}")
        if self.profile_steps >= self.steps:
            raise AutoparError(f"--profile-steps {self.profile_steps} needs more --steps than that (the first step "
                               f"warms up and is not measured): raise --steps above {self.profile_steps}")
        self.check_outputs()

    def check_outputs(self) -> None:
        """Every output path, before anything is written: a file where a file goes, a directory (or one
        that can be made) where a directory goes, and no two outputs on one path. Nothing is created here."""
        from autopar.io import check_output_path

        if self.metrics:
            check_output_path(self.metrics, "--metrics")
        if self.report:  # appended to: it must exist (check_profile_outputs says how to make it)
            check_output_path(self.report, "--report")
        directories = [("--tensorboard", self.tensorboard), ("--checkpoint-dir", self.checkpoint_dir)]
        if self.profile_steps:
            directories.append(("--profile-dir", self.profile_dir))
        for flag, path in directories:
            if path:
                _check_output_directory(path, flag)
        named = [(flag, path) for flag, path in [("--metrics", self.metrics), ("--report", self.report), *directories]
                 if path]
        seen: dict[Path, str] = {}
        for flag, path in named:
            resolved = Path(path).resolve()
            if resolved in seen:
                raise AutoparError(f"{seen[resolved]} and {flag} both name {path}: give each output its own path")
            seen[resolved] = flag


def _check_output_directory(path: str, flag: str) -> None:
    """A directory an output goes to: an existing writable directory, or one whose nearest existing
    parent is a writable directory (it is created when first written)."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise AutoparError(f"{flag} {directory} is a file: give a directory")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise AutoparError(f"cannot create {flag} {directory}: {existing} is a file, not a directory; choose "
                           f"another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AutoparError(f"cannot write {flag} {directory}: {existing} is not writable; choose another path")


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """`autopar run`'s flags. None has a default here (argparse.SUPPRESS): RunConfig holds them, and a
    flag not given leaves the --config file's value in place."""
    run.add_argument("--config", metavar="run.yaml",
                     help="YAML file of run settings (keys: the flags' names with _ for -); flags override it")
    run.add_argument("--plan", metavar="PATH", help="plan file from `autopar plan --save-plan`; "
                     "give --model/--model-config of the model it was made for")
    run.add_argument("--model", help="zoo name (e.g. gpt, llama, gpt2-124m) or package.module:factory; required, "
                     "here or in --config")
    run.add_argument("--model-config", metavar="K=V,...", help="overrides, e.g. layers=4,hidden=256")
    run.add_argument("--cluster", help="preset name or YAML/JSON cluster file to search a plan for the running "
                     "world size (WORLD_SIZE, default 1) when no --plan is given")
    run.add_argument("--strategy", help="fixed keys for the search (e.g. dp=2,tp=2); with --plan, "
                     "checked against the plan")
    run.add_argument("--steps", type=int, help="optimizer steps to train; required, here or in --config")
    run.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    run.add_argument("--global-batch", type=int, help="samples per optimizer step (default with --plan: the plan's)")
    run.add_argument("--precision", choices=["bf16", "fp16", "fp32"],
                     help="compute dtype (default bf16 on CUDA, fp32 on CPU; fp16 trains under a dynamic loss "
                          "scale)")
    run.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-4)")
    run.add_argument("--seed", type=int, help="seed of the initial weights and the data order (default 0)")
    run.add_argument("--data", metavar="DIR",
                     help="dataset from `autopar data prepare` (default: the embedded Python-stdlib corpus, byte-level, "
                     "vocab 257; `synthetic`: the old random-walk token stream)")
    run.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (and a final one at the end)")
    run.add_argument("--checkpoint-every", type=int, metavar="K",
                     help="save a checkpoint every K steps (needs --checkpoint-dir)")
    run.add_argument("--resume", metavar="auto|PATH|none",
                     help="auto (default): continue from the latest good checkpoint in --checkpoint-dir, if any; "
                     "PATH: from that checkpoint; none: start fresh")
    run.add_argument("--keep-last", type=int, metavar="N", help="checkpoints kept (default 3)")
    run.add_argument("--async-checkpoint", action="store_true",
                     help="write checkpoints in the background while training continues")
    run.add_argument("--max-grad-norm", type=float, help="clip the global gradient norm (0: off; default 1)")
    run.add_argument("--log-every", type=int, help="log every K steps (default 10)")
    run.add_argument("--metrics", metavar="PATH", help="write one JSON line per logged step to PATH")
    run.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files to DIR (rank 0)")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction,
                     help="a progress bar on rank 0 (default: when stderr is a terminal)")
    run.add_argument("--profile-steps", type=int, metavar="N",
                     help="after the first step, record N steps with torch.profiler and print predicted vs measured")
    run.add_argument("--profile-dir", metavar="DIR",
                     help="where --profile-steps writes each rank's trace (default ./autopar-profile)")
    run.add_argument("--report", metavar="PATH",
                     help="with --profile-steps: append the comparison to this `autopar plan --report` page")
    run.add_argument("--dry-run", action="store_true", help="print the plan and its prediction, train nothing")
    run.add_argument("--compile", action=argparse.BooleanOptionalAction,
                     help="torch.compile the model (faster steps after a one-time compile; default: on a GPU, "
                     "when the searched plan predicts it faster)")
    for action in run._actions:  # set_defaults would store the SUPPRESS marker itself as a value
        if action.dest != "help":
            action.default = argparse.SUPPRESS


def run_config(args: argparse.Namespace) -> RunConfig:
    """The --config file's settings, overridden by the flags given."""
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None)
    if config_path:
        values.update(_read_yaml(config_path))
    given = {key: value for key, value in vars(args).items()
             if key not in ("config", "command", "handler", "debug")}
    values.update(given)
    for required in ("model", "steps"):
        if values.get(required) is None:
            flag = "--" + required.replace("_", "-")
            raise AutoparError(f"{flag} is required: give it as a flag or as `{required}:` in a --config file")
    try:
        return RunConfig.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        source = f" in {config_path}" if config_path and key in _read_yaml(config_path) else ""
        raise AutoparError(f"run setting {key!r}{source}: {first['msg']} (got {first.get('input')!r})") from None


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as error:
        raise AutoparError(f"cannot read --config {path}: {error.strerror}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise AutoparError(f"--config {path} is not valid YAML{where}: fix the file") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise AutoparError(f"--config {path} must be a mapping of settings (key: value), not {type(loaded).__name__}")
    normalized = {str(key).replace("-", "_"): value for key, value in loaded.items()}
    unknown = sorted(set(normalized) - set(RunConfig.model_fields) - {"model_config"})
    if unknown:
        known = ", ".join(sorted({*RunConfig.model_fields, "model_config"} - {"model_overrides"}))
        raise AutoparError(f"--config {path}: unknown setting(s) {', '.join(unknown)}; known: {known}")
    return normalized
