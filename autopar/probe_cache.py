"""The planning probes' answers kept on disk, so planning one model again does not run them again.

Before it searches, `autopar.plan` tries the runtime on the model: the pipeline cut (a torch.export
capture of the whole forward, `runtime.pipeline.schedule.probe_pipeline`) and, where the module
rules apply, one tensor-parallel dry run at tp=2 (`planning_probes.tensor_parallel_probe`). On gpt3-175b's 96 layers
each took as long as the trace itself. Each answer is a function of what the key below digests,
so a later plan of the same model reads it instead (one small JSON file per answer).

The key digests: the model's architecture (`model_fingerprint`: module classes, parameter names
and shapes), its parameters' dtypes and devices, every module's training flag, plain settings
(numbers, strings, dataclass or Hugging Face configs; other objects by their type only) and
hooks, the source files of its module classes and of the loss, the input shapes and dtypes,
the probe's own arguments (precision, the model facts' heads and vocabulary, the cluster), and
the versions of Python, torch, transformers and autopar's own source. A model whose source
cannot be read, or a loss that is not a plain function, is not cached. What no key can see (a
global flag the forward reads, a monkeypatched library) is why a caller can turn it off:
`autopar plan --no-probe-cache`, `autopar.plan(..., probe_cache=None)`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

PROBES_FOLDER = "probes"
FORMAT = 1  # bump when what an entry holds changes


def default_probe_cache_dir() -> Path:
    """$AUTOPAR_PROBE_CACHE, else $AUTOPAR_CACHE/probes, else ~/.cache/autopar/probes (beside the
    data corpus's cache)."""
    if os.environ.get("AUTOPAR_PROBE_CACHE"):
        return Path(os.environ["AUTOPAR_PROBE_CACHE"])
    return Path(os.environ.get("AUTOPAR_CACHE") or Path.home() / ".cache" / "autopar") / PROBES_FOLDER


class ProbeCache:
    """Answers by key in one folder; `hits` and `runs` count what one process read and computed."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.hits = 0
        self.runs = 0

    def answer(self, kind: str, key: str | None, compute: Callable[[], Any]) -> Any:
        """The stored answer of `kind` under `key`, else `compute()` stored (JSON data only). A key
        of None (nothing to key the model by) always computes and stores nothing."""
        path = self.directory / f"{kind}-{key}.json" if key is not None else None
        found = self._read(path, kind)
        if found is not None:
            self.hits += 1
            return found[0]
        self.runs += 1
        value = compute()
        if path is not None:
            self._store(path, {"format": FORMAT, "kind": kind, "answer": value})
        return value

    def stored(self, kind: str, key: str | None) -> bool:
        """Whether `answer(kind, key, ...)` would read its answer rather than compute it."""
        return key is not None and self._read(self.directory / f"{kind}-{key}.json", kind) is not None

    @staticmethod
    def _read(path: Path | None, kind: str) -> tuple[Any] | None:
        """(the stored answer,) or None: no entry, or one unreadable or damaged (computed again and
        rewritten)."""
        if path is None or not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry.get("format") == FORMAT and entry.get("kind") == kind:
                return (entry["answer"],)
        except (OSError, ValueError, KeyError):
            pass
        return None

    def _store(self, path: Path, entry: dict) -> None:
        """Written whole or not at all (a rename), so a concurrent reader never sees half an entry;
        a folder that cannot be written only costs the next plan the probe."""
        try:
            text = json.dumps(entry, sort_keys=True)
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".probe-", suffix=".json")
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(temporary, path)
        except (OSError, TypeError, ValueError):
            return


def model_key(model: nn.Module, example_inputs: Any, loss_fn: Callable | None) -> str | None:
    """The digest of the model, its inputs and loss, and the versions (the module docstring), or
    None when the model or the loss cannot be keyed."""
    from autopar.graph.capture import model_fingerprint

    parts: list[Any] = [FORMAT, model_fingerprint(model), _versions(), _inputs(example_inputs)]
    sources: set[str] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        parts.append((path, module.training, _settings(module), _hooks(module)))
        for cls in type(module).__mro__:
            if cls in (nn.Module, object) or cls.__module__.startswith("torch."):
                continue
            source = _source_file(cls)
            if source is None:
                return None
            sources.add(source)
    parts.append([(name, str(p.dtype), p.device.type, p.requires_grad)
                  for name, p in model.named_parameters(remove_duplicate=False)])
    parts.append([(name, str(b.dtype), b.device.type, tuple(b.shape)) for name, b in model.named_buffers()])
    if loss_fn is not None:
        function = loss_fn.__func__ if inspect.ismethod(loss_fn) else loss_fn  # a model's own loss method
        if not inspect.isfunction(function) or _source_file(function) is None:
            return None
        parts.append((function.__module__, function.__qualname__, _settings_of(function.__defaults__),
                      _settings_of(getattr(loss_fn, "__self__", None))))
        sources.add(_source_file(function))
    parts.append([(source, _file_digest(source)) for source in sorted(sources)])
    return _digest(parts)


def probe_key(base: str | None, **arguments: Any) -> str | None:
    """One probe's key: the model's (`model_key`) with the probe's own arguments."""
    return None if base is None else _digest([base, _settings_of(arguments)])


def _digest(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _inputs(example_inputs: Any) -> Any:
    if isinstance(example_inputs, torch.Tensor):
        return ["tensor", tuple(example_inputs.shape), str(example_inputs.dtype)]
    if isinstance(example_inputs, (tuple, list)):
        return [_inputs(x) for x in example_inputs]
    if isinstance(example_inputs, dict):
        return {str(k): _inputs(v) for k, v in example_inputs.items()}
    return _settings_of(example_inputs)


def _settings(module: nn.Module) -> dict[str, Any]:
    """A module's own plain attributes (its parameters, buffers and children are keyed apart)."""
    return {name: _settings_of(value) for name, value in sorted(vars(module).items())
            if not name.startswith("_") and name != "training"}


def _settings_of(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, enum.Enum)):
        return str(value)
    if depth > 6:
        return type(value).__qualname__
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [_settings_of(v, depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): _settings_of(v, depth + 1) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return ["tensor", tuple(value.shape), str(value.dtype)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__qualname__, {f.name: _settings_of(getattr(value, f.name), depth + 1)
                                           for f in dataclasses.fields(value)}]
    if callable(getattr(value, "to_dict", None)):  # a Hugging Face config
        try:
            return [type(value).__qualname__, _settings_of(value.to_dict(), depth + 1)]
        except Exception:  # noqa: BLE001 - a to_dict of another library: keyed by its type only
            pass
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    if isinstance(value, functools.partial):
        return [_settings_of(value.func, depth + 1), _settings_of(value.args, depth + 1),
                _settings_of(value.keywords, depth + 1)]
    return type(value).__qualname__


def _hooks(module: nn.Module) -> list[str]:
    hooks = []
    for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                 "_state_dict_hooks", "_load_state_dict_pre_hooks"):
        hooks.extend(f"{name}:{_settings_of(hook)}" for hook in getattr(module, name, {}).values())
    return hooks


def _source_file(obj: Any) -> str | None:
    try:
        path = inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None
    return path if path and os.path.isfile(path) else None


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[str, ...]:
    """Python, torch, transformers (when imported) and a digest of autopar's own source files."""
    folders = {Path(__file__).resolve().parent}  # autopar/ itself
    for stage in ("runtime", "cost_models", "searcher", "profiler"):
        module = sys.modules.get(f"autopar.{stage}")
        if module is None:
            import importlib

            module = importlib.import_module(f"autopar.{stage}")
        folders.update(Path(p) for p in module.__path__)
    digest = hashlib.sha256()
    for folder in sorted(folders):
        for path in sorted(folder.rglob("*.py")):
            digest.update(f"{folder.name}/{path.relative_to(folder)}".encode())
            digest.update(path.read_bytes())
    transformers = sys.modules.get("transformers")
    return (sys.version.split()[0], torch.__version__, getattr(transformers, "__version__", "-"),
            digest.hexdigest()[:16])
