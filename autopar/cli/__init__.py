"""The `autopar` command line: `main` is the console script and `python -m autopar`.

commands (the parser, `inspect` and `plan`, error reporting, `main`), arguments (argparse types the
subcommands share, the profiler's `profile` included), inspect (the model summary `autopar inspect`
prints), data (`autopar data prepare|info`), run (`autopar run`: launch, train, resume) with what it
reads and decides: run_config (flags and YAML), run_data (which batches), run_inputs (a factory's
inputs), run_plan (load or search the plan), run_profile (`--profile`).

Only `main` is exposed here; everything else is imported from its module.
"""

from autopar.cli.commands import main

__all__ = ["main"]
