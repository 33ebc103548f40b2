"""One installed package: the stages import as autopar.*, from a wheel, an editable install or a checkout,
and nothing a user keeps in the working directory can shadow them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"profiler": "autopar.profiler", "cost_models": "autopar.cost_models", "searcher": "autopar.searcher",
          "runtime": "autopar.runtime"}
TINY = ["--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=96,seq_len=16"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def test_every_package_folder_is_installed():
    """pyproject lists packages by hand (package-dir maps them): a new folder must be listed too."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapped = {name: folder for name, folder in config["package-dir"].items()}
    found = set()
    for name, folder in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]))
    assert found == listed, f"pyproject packages differ from the folders: {sorted(found ^ listed)}"
    assert {mapped[name] for name in STAGES.values()} == set(STAGES)


def test_no_stage_imports_as_a_top_level_name():
    """Every import of a stage goes through autopar (a top-level `runtime` would be PyPI's or the user's)."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts or "build" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from") and words[1].split(".")[0] in STAGES:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_cli_runs_beside_a_users_profiler_and_runtime_modules(tmp_path):
    for name in ("profiler.py", "runtime.py", "searcher.py", "cost_models.py"):
        (tmp_path / name).write_text("raise SystemExit('the user module was imported')\n")
    done = subprocess.run([sys.executable, "-m", "autopar", "inspect", *TINY], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "GPTBlock × 2" in done.stdout


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory) -> Path:
    """A non-editable install of this checkout (the wheel's layout), without dependencies."""
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("source") / "autopar"  # setuptools builds in the tree: not in ours
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-compile", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return target


def test_wheel_nests_the_stages_under_autopar(wheel_install):
    assert sorted(p.name for p in wheel_install.iterdir() if p.is_dir() and p.name not in ("bin", "__pycache__") and not p.name.endswith("-info")) == ["autopar"]
    for folder in STAGES:
        assert (wheel_install / "autopar" / folder / "__init__.py").is_file()


def test_wheel_install_plans_from_the_repository_root(wheel_install):
    """As the console script runs (no working directory on sys.path: `python -P`), from the repo root:
    the wheel's own stages are used, not the checkout's folders beside it."""
    code = ("import sys, autopar.runtime, autopar.cli; print(autopar.runtime.__file__, file=sys.stderr); "
            f"sys.exit(autopar.cli.main({['plan', *TINY, '--cluster', 'dgx-h100', '--gpus', '2', '--global-batch', '4']!r}))")
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, env=_env(PYTHONPATH=str(wheel_install)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert str(wheel_install / "autopar" / "runtime") in done.stderr
    assert "step time" in done.stdout
