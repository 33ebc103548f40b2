"""The README's commands are a contract: CI must run exactly the full test command it shows."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK = "python -m pytest"  # the default set (pyproject's addopts: -m 'not slow')
FULL = 'python -m pytest -m "slow or not slow"'  # every test


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def _full_command():
    full = [c for c in _readme_commands() if c.endswith(f" && {FULL}")]
    assert len(full) == 1, full
    return full[0]


def test_ci_runs_the_readme_full_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _full_command() in ci_lines


def test_readme_quick_test_command_is_the_full_one_on_the_default_set():
    full = _full_command()
    quick = [c for c in _readme_commands() if c.endswith(f" && {QUICK}")]
    assert quick == [full[: -len(FULL)] + QUICK]


def test_readme_main_command_pins_torch_and_runs_a_zoo_model():
    main_command = _readme_commands()[0]
    assert "pip install torch==2.13.0" in main_command
    assert "autopar inspect --model gpt3-175b" in main_command
