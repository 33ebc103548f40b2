"""autopar: automatic parallelization planning for PyTorch training.

Data flows one way: model → op graph → profile → costs → search → plan → runtime.
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from autopar import _source_tree

_source_tree.install(Path(__file__).resolve().parent)  # before any stage is imported

try:
    __version__ = version("autopar")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.1.0+src"

from autopar.errors import AutoparError, CaptureError
from autopar.graph import OpGraph, model_fingerprint, trace



def parallelize(model, plan, **kwargs):
    """Shard `model` as `plan` says on the running process group (see runtime.parallelize)."""
    from autopar.runtime.parallelize import parallelize as _parallelize  # torch.distributed only when asked for

    return _parallelize(model, plan, **kwargs)


__all__ = ["__version__", "AutoparError", "CaptureError", "OpGraph", "trace", "model_fingerprint", "parallelize"]
