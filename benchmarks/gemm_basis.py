"""What the GEMM shape term's half-dimension should scale with, tried on both kinds of data we hold.

    python benchmarks/gemm_basis.py [--bases ridge,peak,absolute,flat]   # ~3 min a basis on 2 cores

Why: the shape term (`cost_models.compute`) halves a GEMM's efficiency at a dimension of
`gemm_half_ridges` × a per-GPU size. Until the ninth session it was on, with that size the GPU's
ridge point (peak FLOP/s over HBM bytes/s): the H200, with more bandwidth, got a smaller
half-dimension than the H100 and its GEMMs were priced 10% faster; timed, the same GEMM took the
same time on both (`benchmarks/gemm_kernels.py`). The committed model is now `flat`. The bases
tried, each scaled to equal the ridge point on the H100 (295 FLOP/B), so that the constants compare:
- `ridge`: peak / HBM bandwidth (the term until the ninth session);
- `peak`: the dense peak alone (the H200 equals the H100; the A100's is 0.32 of the H100's);
- `absolute`: one size for every GPU;
- `flat`: no shape term at all (what the H200's kernels show, `gemm_shapes.py --report`), and one
  GEMM efficiency for every GPU fitted in its place (committed).

For each basis: the constant fitted on the 41 published runs, their leave-one-family-out MAPE
(`benchmarks/validate_published.py`'s protocol, the per-kernel time held at the committed one), and
the GPU rows (`benchmarks/gpu_rows.py`) priced at that basis and constant. A shape basis prices at
each GPU's own GEMM ceiling. The term is swapped in for this process only (`use`, `restore`): an
experiment, not a setting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_rows  # noqa: E402
import validate_published as published  # noqa: E402
from published_runs import load_runs  # noqa: E402

import autopar.cost_models.compute as compute  # noqa: E402

H100_PEAK_FLOPS, H100_BANDWIDTH = 989e12, 3350e9
H100_RIDGE = H100_PEAK_FLOPS / H100_BANDWIDTH
COMMITTED = compute.ridge_point
BASES = {
    "ridge": COMMITTED,
    "peak": lambda gpu, dtype: gpu.peak_flops_per_s(dtype) / H100_PEAK_FLOPS * H100_RIDGE,
    "absolute": lambda gpu, dtype: H100_RIDGE,
}


COMMITTED_FIELDS = {name: getattr(compute.DEFAULT_EFFICIENCY, name) for name in ("matmul", "gemm_half_ridges")}


def use(basis: str, constant: float) -> None:
    """Price with `basis` at `constant`, in this process only: a shape basis's `gemm_half_ridges`
    over the GPU's own GEMM ceiling; `flat`: no shape term, every GEMM at efficiency `constant`.
    The default efficiency is set in place (everything that prices reads that one instance); the
    per-kernel time stays the committed one. `restore()` puts the committed term back."""
    efficiency = compute.DEFAULT_EFFICIENCY
    if basis == "flat":
        compute.ridge_point = COMMITTED
        fields = {"matmul": constant, "gemm_half_ridges": 0.0}
    else:
        base = BASES[basis]
        compute.ridge_point = base
        fields = {"matmul": 0.0, "gemm_half_ridges": constant}
    for name, value in fields.items():
        object.__setattr__(efficiency, name, value)


def restore() -> None:
    compute.ridge_point = COMMITTED
    for name, value in COMMITTED_FIELDS.items():
        object.__setattr__(compute.DEFAULT_EFFICIENCY, name, value)


def published_fit(runs, basis: str) -> tuple[float, float, dict[str, float]]:
    """(constant fitted on all rows, leave-one-family-out MAPE, that MAPE per family) for `basis`,
    the per-kernel time held at the committed one."""
    published._PRICED.clear()
    committed_fitted = published.FITTED
    name = "matmul" if basis == "flat" else "gemm_half_ridges"
    published.FITTED = {"matmul": (0.4, 0.95)} if basis == "flat" else {"gemm_half_ridges": (0.05, 8.0)}
    use(basis, COMMITTED_FIELDS["matmul"] if basis == "flat" else 1.0)  # the ridge function; the fit sets the constant
    base = compute.DEFAULT_EFFICIENCY
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            held_out = published.cross_validate(runs, dataclasses.replace(base))
    finally:
        published.FITTED = committed_fitted
    first = printed.getvalue().splitlines()[0]  # "fit on all 41 rows: gemm_half_ridges=1.709 (...)"
    constant = float(first.split(f"{name}=")[1].split()[0].rstrip(","))
    families: dict[str, list[float]] = {}
    for run in runs:
        families.setdefault(run.family, []).append(abs(held_out[run.id]))
    per_family = {family: sum(errors) / len(errors) for family, errors in families.items()}
    return constant, sum(abs(e) for e in held_out.values()) / len(held_out), per_family


def gpu_row_errors() -> list[tuple[str, str, float]]:
    """(file, case, predicted/measured - 1) for every GPU row priced at the current basis."""
    errors = []
    for path in gpu_rows.DEFAULT_ROWS:
        if not path.exists():
            continue
        for row in gpu_rows.rows_of(path):
            if row.get("status", "ok") != "ok" or "offload" in row["case"]:  # offload: its host's rates
                continue
            predicted, _ = gpu_rows.predict(row)
            errors.append((path.name, row["case"], predicted / row["measured_s"] - 1))
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bases", default="ridge,peak,absolute,flat")
    args = parser.parse_args()
    rows = [row for path in (published.DEFAULT_RUNS, published.MORE_RUNS) for row in load_runs(str(path))[1]]
    with contextlib.redirect_stdout(io.StringIO()):
        runs = [run for run in published.traced_runs(rows) if not run.row.get("out_of_scope")]
    try:
        for basis in args.bases.split(","):
            report(basis, runs)
    finally:
        restore()
        published._PRICED.clear()
    return 0


def report(basis: str, runs) -> None:
    """One basis: its fit on the published runs, then the GPU rows priced at that fit."""
    constant, lofo, per_family = published_fit(runs, basis)
    use(basis, constant)
    errors = gpu_row_errors()
    print(f"{basis:9s} constant {constant:.3g}: published leave-one-family-out MAPE {lofo:.2%} ("
          + ", ".join(f"{family} {error:.1%}" for family, error in sorted(per_family.items())) + ")")
    spans = []
    for gpu in ("h100", "h200"):
        mine = [error for name, _, error in errors if name.startswith(gpu)]
        if mine:
            spans.append(f"{gpu.upper()} {min(mine):+.1%} to {max(mine):+.1%}")
    print(f"{'':9s} GPU rows at that constant (offload left out): {', '.join(spans) or 'none found'}; within 10%: "
          f"{sum(abs(e) <= 0.10 for _, _, e in errors)} of {len(errors)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
