"""Find `autopar.profiler`, `autopar.cost_models`, `autopar.searcher`, `autopar.runtime` in a checkout.

The repository keeps these stages as top-level folders beside `autopar/` (the layout our users
set), while what is installed nests them under `autopar` (pyproject's `package-dir`), so that
nothing generic lands at the top of site-packages and a user's own `profiler.py` or `runtime.py`
cannot shadow them. A wheel holds them inside `autopar/`; an editable install maps them with
setuptools' own finder. Running straight from a checkout (`python -m autopar`, `python -m pytest`
from the repository root, even beside another install) finds `autopar/` first, which has no such
subfolders: this finder maps the four names to the folders beside it. It goes first on the meta
path, so the stages always come from the checkout whose `autopar/` was imported (not from an
editable install of another checkout), and it is installed only when the folder above `autopar/`
is this project's checkout (its pyproject.toml names the distribution), never from site-packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

STAGES = ("profiler", "cost_models", "searcher", "runtime")


class _StageFolders(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "autopar" or name not in STAGES:
            return None
        init = self.root / name / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def install(package_dir: Path) -> None:
    """Map the stage folders of the checkout holding `package_dir` (no-op outside a checkout)."""
    root = package_dir.parent
    manifest = root / "pyproject.toml"
    try:
        is_checkout = manifest.is_file() and 'name = "autopar"' in manifest.read_text(encoding="utf-8")
    except OSError:
        is_checkout = False
    if is_checkout and not any(isinstance(f, _StageFolders) for f in sys.meta_path):
        sys.meta_path.insert(0, _StageFolders(root))
