"""Deterministic initialization that does not depend on the sharding.

Each module's own tensors are drawn from a generator seeded by (seed, module path), one module at
a time on the CPU, and each rank keeps only its local shard. So a rank never holds more than one
module's full tensors, and every plan — and the single-process reference — starts from the same
weights for a seed (what parity needs).
"""

from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.errors import AutoparError


def module_seed(seed: int, path: str) -> int:
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class InitSource:
    """The full value of any of a model's parameters or buffers, by its canonical name.

    `reference` is the unsharded model (on meta, or with real values the user gave): canonical names
    are its own (a tied weight keeps the name under which it is first found).
    """

    def __init__(self, reference: nn.Module, seed: int) -> None:
        self.reference = reference
        self.seed = seed
        self.rule = getattr(reference, "init_module_", None)
        self.owner: dict[str, tuple[str, nn.Module, str, bool]] = {}  # name -> (module path, module, attr, is_param)
        for path, module in reference.named_modules():
            for attr, tensor in list(module._parameters.items()) + list(module._buffers.items()):
                if tensor is None:
                    continue
                name = f"{path}.{attr}" if path else attr
                is_param = attr in module._parameters
                self.owner.setdefault(name, (path, module, attr, is_param))
        self.alias: dict[str, str] = {}  # any name -> canonical name
        seen: dict[int, str] = {}
        for name, param in reference.named_parameters(remove_duplicate=False):
            self.alias[name] = seen.setdefault(id(param), name)
        self._cache: tuple[str, dict[str, torch.Tensor]] | None = None

    def canonical(self, name: str) -> str:
        return self.alias.get(name, name)

    def full_value(self, name: str) -> torch.Tensor:
        path, module, attr, is_param = self.owner[self.canonical(name)]
        tensor = getattr(module, attr)
        if not tensor.is_meta:  # the user gave real values: they are the source of truth
            return tensor.detach().to("cpu")
        if self._cache is None or self._cache[0] != path:
            self._cache = (path, self._initialize(path, module))
        return self._cache[1][attr]

    def _initialize(self, path: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """Materialize one module's own tensors on the CPU with its init rule, under its own seed."""
        clone = copy.copy(module)  # shallow: children are shared, own tensors replaced below
        clone._parameters = {k: None if v is None else nn.Parameter(torch.empty(v.shape, dtype=v.dtype),
                                                                    requires_grad=v.requires_grad)
                             for k, v in module._parameters.items()}
        clone._buffers = {k: None if v is None else torch.empty(v.shape, dtype=v.dtype)
                          for k, v in module._buffers.items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(self.seed, path))
            if self.rule is not None:
                self.rule(path, clone)
            elif callable(getattr(module, "reset_parameters", None)) and not module._buffers:
                clone.reset_parameters()
            else:
                where = path or type(module).__name__
                raise AutoparError(
                    f"cannot initialize module {where!r} ({type(module).__name__}) from the meta device: it has no "
                    f"reset_parameters(); pass a model with real weights, or give the root an "
                    f"init_module_(path, module) method"
                )
        values = {k: v.detach() for k, v in list(clone._parameters.items()) + list(clone._buffers.items())
                  if v is not None}
        return values


def materialize(module: nn.Module, source: InitSource, device: torch.device,
                parameter_device: torch.device | None = None,
                row_slices: dict[str, tuple[int, int]] | None = None) -> None:
    """Give every parameter and buffer of `module` (sharded or not) its local values on `device`.

    `module` may be a pipeline stage of `source.reference` with DTensor parameters; names are
    looked up in the reference, so stages and shards agree with the unsharded model.
    `parameter_device`: where parameters live when not on `device` (the host, under FSDP2's CPU
    offload); buffers stay on `device`, where the forward reads them. `row_slices`: plain tensors
    holding rows [start, stop) of the full one, by name (expert parallelism's experts).
    """
    if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        tied = _alias_groups(module)
        module.to_empty(device=parameter_device or device)
        if parameter_device is not None and parameter_device != device:
            for sub in module.modules():
                for name, buffer in sub._buffers.items():
                    if buffer is not None:
                        sub._buffers[name] = buffer.to(device)
        for names in tied:  # to_empty gives each alias its own tensor: tie them again
            first = module.get_parameter(names[0])
            for name in names[1:]:
                path, _, attr = name.rpartition(".")
                setattr(module.get_submodule(path) if path else module, attr, first)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters(remove_duplicate=False)) + \
                list(module.named_buffers(remove_duplicate=False)):
            canonical = source.canonical(_strip_wrappers(name))
            if canonical not in source.owner:
                raise AutoparError(f"parameter {name!r} is not in the model the plan was made for: re-run `autopar plan`")
            full = source.full_value(canonical)
            if row_slices and _strip_wrappers(name) in row_slices:
                start, stop = row_slices[_strip_wrappers(name)]
                full = full[start:stop]
            if isinstance(tensor, DTensor):
                local = distribute_tensor(full.to(tensor.dtype), tensor.device_mesh, tensor.placements,
                                          src_data_rank=None).to_local()
                tensor.to_local().copy_(local)
            else:
                tensor.copy_(full.to(tensor.dtype))


def _alias_groups(module: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _strip_wrappers(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
