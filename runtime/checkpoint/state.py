"""What a checkpoint holds, under names that do not depend on the plan.

Keys are `model.<canonical name>` and `optim.<canonical name>.<state key>`: the names of the
unsharded model, with a tied weight under its first name (a pipeline stage may hold only the
head's alias). Values are this rank's tensors as they run (DTensor or plain), so DCP writes each
rank's shards and reshards on load into whatever placements the loading plan gives. We build this
dict ourselves rather than with `get_model_state_dict`/`get_optimizer_state_dict` because those key
a stage's tied alias by its local name (`head.weight`), so a pp=2 checkpoint and a pp=1 one would
disagree on names, and they take one module where an interleaved rank holds several.

Also here: the optimizer's param-group hyperparameters and every rank's random generators, as JSON.
"""

from __future__ import annotations

import base64
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.errors import AutoparError
from autopar.runtime.checkpoint.reader import SafeFileSystemReader, SafeLoadPlanner, read_safe_metadata
from autopar.runtime.optimizer import step_context

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optim."


@dataclass
class StateEntries:
    """DCP keys and this rank's values, plus further local tensors that must take the same value
    (aliases of a tied weight held by two of this rank's stage modules)."""

    values: dict[str, object] = field(default_factory=dict)
    copies: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, key: str, value: object) -> None:
        if key in self.values:
            if isinstance(value, torch.Tensor):
                self.copies.setdefault(key, []).append(value)
            return
        self.values[key] = value

    def propagate_copies(self) -> None:
        """After a load, give the other aliases the value loaded into the first."""
        with torch.no_grad():
            for key, tensors in self.copies.items():
                for tensor in tensors:
                    _local(tensor).copy_(_local(self.values[key]))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _strip_wrappers(name: str) -> str:
    """Names as in the unwrapped model (activation-checkpoint and compile wrappers add a level)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def canonical_parameters(parallel) -> dict[str, list[nn.Parameter]]:
    """This rank's parameters by canonical name; a name has several when two stage modules on this
    rank each hold an alias of one tied weight."""
    result: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module in parallel.modules:
        for name, param in module.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = _strip_wrappers(name)
            result.setdefault(parallel.canonical.get(name, name), []).append(param)
    return result


def persistent_buffers(parallel) -> dict[str, list[torch.Tensor]]:
    result: dict[str, list[torch.Tensor]] = {}
    for module in parallel.modules:
        for path, sub in module.named_modules():
            for attr, buffer in sub._buffers.items():
                if buffer is None or attr in sub._non_persistent_buffers_set:
                    continue
                name = _strip_wrappers(f"{path}.{attr}" if path else attr)
                result.setdefault(name, []).append(buffer)
    return result


def model_entries(parallel) -> StateEntries:
    entries = StateEntries()
    for group in (canonical_parameters(parallel), persistent_buffers(parallel)):
        for name, tensors in group.items():
            for tensor in tensors:
                entries.add(MODEL_PREFIX + name, tensor.detach())
    return entries


def parameter_names(parallel, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) for every parameter the optimizer updates."""
    by_id = {id(p): name for name, params in canonical_parameters(parallel).items() for p in params}
    named = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise AutoparError("the optimizer updates a tensor that is not a parameter of the parallel model: "
                                   "build it over `parallel.parameters()`")
            named.append((by_id[id(param)], param))
    return named


def optimizer_entries(parallel, optimizer: torch.optim.Optimizer) -> StateEntries:
    entries = StateEntries()
    for name, param in parameter_names(parallel, optimizer):
        for key, value in optimizer.state.get(param, {}).items():
            entries.add(f"{OPTIMIZER_PREFIX}{name}.{key}", value.detach() if isinstance(value, torch.Tensor) else value)
    return entries


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the lazily made state of every parameter that has none, so a load has tensors of the
    right placement to fill. One step with zero gradients at lr 0 and weight decay 0 (restored
    after): the weights do not move, and the state's values are overwritten by the load anyway."""
    fresh = [p for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    if not fresh:
        return
    saved_gradients = {id(p): p.grad for group in optimizer.param_groups for p in group["params"]}
    saved_hyperparameters = []
    for group in optimizer.param_groups:
        saved_hyperparameters.append({key: group[key] for key in ("lr", "weight_decay") if key in group})
        for key in ("lr", "weight_decay"):
            if key in group:
                group[key] = torch.zeros_like(group[key]) if isinstance(group[key], torch.Tensor) else 0.0
        for param in group["params"]:
            param.grad = None
    for param in fresh:
        param.grad = torch.zeros_like(param)
    try:
        with torch.no_grad(), step_context([p for group in optimizer.param_groups for p in group["params"]]):
            optimizer.step()
    finally:
        for group, saved in zip(optimizer.param_groups, saved_hyperparameters):
            group.update(saved)
            for param in group["params"]:
                param.grad = saved_gradients[id(param)]


def drop_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Forget materialized state of parameters the checkpoint holds none for (they had no gradient yet)."""
    for param in params:
        optimizer.state.pop(param, None)


def _json_value(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return _SKIP


_SKIP = object()


def param_group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every group's settings but its parameters (lr, betas, weight decay, initial_lr, ...), as JSON."""
    groups = []
    for group in optimizer.param_groups:
        values = {key: _json_value(value) for key, value in group.items() if key != "params"}
        groups.append({key: value for key, value in values.items() if value is not _SKIP})
    return groups


def apply_param_group_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict], where: str) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise AutoparError(f"checkpoint {where} has {len(saved)} optimizer parameter groups, this optimizer has "
                           f"{len(optimizer.param_groups)}: build the optimizer with the groups it was saved with")
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple) and isinstance(value, list):
                group[key] = tuple(value)
            else:
                group[key] = value


def rng_state() -> dict:
    """This process's generators (torch CPU, CUDA when present, python `random`, numpy) as JSON."""
    version, internal, gauss = random.getstate()
    state = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "python": [version, list(internal), gauss], "cuda": None, "numpy": None}
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy
    except ImportError:
        return state
    kind, keys, position, has_gauss, cached = numpy.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(position), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()

    torch.set_rng_state(tensor(state["torch_cpu"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensor(text) for text in state["cuda"]])
    if state.get("numpy") is not None:
        try:
            import numpy
        except ImportError:
            return
        kind, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))


def _copies(tensor: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks hold the same copy of this rank's `tensor` (DCP writes it once among them):
    a DTensor's replicated mesh axes; a plain tensor is held by every rank of the stage."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return stage_ranks
    mesh = tensor.device_mesh
    return math.prod(mesh.size(axis) for axis, placement in enumerate(placements) if placement.is_replicate())


def expected_write_bytes(parallel, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes this rank is expected to write in a checkpoint of `parallel` and `optimizer`: each local
    tensor's bytes over the number of ranks holding the same copy. Before the first step an Adam or
    AdamW has no state yet; it is counted as it will be, two tensors like each parameter."""
    stage_ranks = parallel.layout.size("dp") * parallel.layout.size("tp")
    values = list(model_entries(parallel).values.values())
    if optimizer is not None:
        state = optimizer_entries(parallel, optimizer).values
        if state:
            values += list(state.values())
        elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            values += [param for _, param in parameter_names(parallel, optimizer)] * 2  # exp_avg, exp_avg_sq
    total = 0.0
    for value in values:
        if isinstance(value, torch.Tensor):
            local = _local(value)
            total += local.numel() * local.element_size() / _copies(value, stage_ranks)
    return round(total)


def load_into(path: Path, record: dict, parallel, optimizer: torch.optim.Optimizer | None,
              process_group: dist.ProcessGroup | None) -> str | None:
    """Load this rank's share of checkpoint `path` (a collective over `process_group`).

    Returns the problem as one line instead of raising, so that ranks agree before anyone raises:
    checks run before DCP's collective, so a mismatch found by one rank cannot hang the others.
    """
    try:
        return _load_into(path, record, parallel, optimizer, process_group)
    except AutoparError as error:
        return str(error)


def _load_into(path: Path, record: dict, parallel, optimizer, process_group) -> str | None:
    metadata = read_safe_metadata(path).state_dict_metadata  # never unpickles anything but DCP's records
    saved_names, model_names = set(record["parameters"]), set(parallel.canonical.values())
    if saved_names != model_names:
        missing, unexpected = sorted(model_names - saved_names), sorted(saved_names - model_names)
        return (f"checkpoint {path} is of another model: it lacks parameters {missing[:3]} and holds "
                f"{unexpected[:3]} this model does not have: load a checkpoint of this model")
    entries = model_entries(parallel)
    params: list[tuple[str, nn.Parameter]] = []
    stateless: list[nn.Parameter] = []  # the checkpoint holds no optimizer state for them: they keep none
    if optimizer is not None:
        if record.get("optimizer") is None:
            return f"checkpoint {path} holds no optimizer state: load it without an optimizer"
        if record["optimizer"] != type(optimizer).__name__:
            return (f"checkpoint {path} holds {record['optimizer']} state, this optimizer is "
                    f"{type(optimizer).__name__}: load with the optimizer it was saved with, or without one")
        materialize_optimizer_state(optimizer)
        params = parameter_names(parallel, optimizer)
        for name, param in params:
            keys = [f"{OPTIMIZER_PREFIX}{name}.{key}" for key in optimizer.state.get(param, {})]
            if keys and not any(key in metadata for key in keys):
                stateless.append(param)
                continue
            for key in keys:
                value = optimizer.state[param][key.rpartition(".")[2]]
                entries.add(key, value.detach() if isinstance(value, torch.Tensor) else value)
    for key, value in entries.values.items():
        saved = metadata.get(key)
        if saved is None:
            return f"checkpoint {path} has no entry {key}: load a checkpoint of this model and optimizer"
        if isinstance(value, torch.Tensor):
            if not isinstance(saved, TensorStorageMetadata) or tuple(saved.size) != tuple(value.shape):
                shape = tuple(saved.size) if isinstance(saved, TensorStorageMetadata) else "an object"
                return (f"checkpoint {path} holds {key} with shape {shape}, this model's is "
                        f"{tuple(value.shape)}: load a checkpoint of this model")
    try:
        dcp.load(entries.values, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                 process_group=process_group, no_dist=not dist.is_initialized())
    except CheckpointException as failure:  # every rank gets every rank's failures: report a refusal as one line
        refusals = [cause for cause, _ in getattr(failure, "failures", {}).values() if isinstance(cause, AutoparError)]
        if refusals:
            return f"checkpoint {path}: {refusals[0]}"
        raise
    entries.propagate_copies()
    if optimizer is not None:
        drop_state(optimizer, stateless)
        for name, param in params:  # objects (not tensors) come back as new values in the dict
            for key in list(optimizer.state.get(param, {})):
                value = entries.values.get(f"{OPTIMIZER_PREFIX}{name}.{key}")
                if value is not None and not isinstance(value, torch.Tensor):
                    optimizer.state[param][key] = value
        apply_param_group_hyperparameters(optimizer, record["param_groups"], str(path))
    return None
