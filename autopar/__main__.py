"""`python -m autopar` is the same CLI as `autopar` (torchrun launches it this way)."""

from autopar.cli import main

raise SystemExit(main())
