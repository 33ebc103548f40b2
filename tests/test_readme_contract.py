"""The README's commands are a contract: CI must run exactly the test command it shows."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = next(c for c in _readme_commands() if c.endswith("python -m pytest"))
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_readme_main_command_pins_torch_and_runs_a_zoo_model():
    main_command = _readme_commands()[0]
    assert "pip install torch==2.13.0" in main_command
    assert "autopar inspect --model gpt3-175b" in main_command
