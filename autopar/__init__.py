"""autopar: automatic parallelization planning for PyTorch training.

Data flows one way: model → op graph → profile → costs → search → plan → runtime.
"""

import gc
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The collector is paused while torch and autopar import: importing builds a few hundred thousand
# long-lived objects and no garbage cycles worth finding, and the full collections that growth
# triggers cost about half a second (6 of them, each scanning everything imported so far). Its
# state is restored once they have.
_collecting = gc.isenabled()
gc.disable()
try:
    from autopar import _source_tree

    _source_tree.install(Path(__file__).resolve().parent)  # before any stage is imported

    try:
        __version__ = version("autopar")
    except PackageNotFoundError:  # running from a source tree without installing
        __version__ = "0.1.0+src"

    from autopar.errors import AutoparError, CaptureError
    from autopar.graph import OpGraph, model_fingerprint, trace
    from autopar.models.hints import model_hints
    from autopar.api import PlanResult, check_fixed_strategy, load_cluster, load_plan, parallelize, plan
finally:
    if _collecting:
        gc.enable()
del _collecting

__all__ = ["__version__", "AutoparError", "CaptureError", "OpGraph", "PlanResult", "check_fixed_strategy",
           "load_cluster", "load_plan", "model_fingerprint", "model_hints", "parallelize", "plan", "trace"]
