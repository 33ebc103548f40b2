"""The profile database: one SQLite file of measured op times and collective fits, reused across runs.

Rows are keyed by device name, dtype (the run's precision, e.g. "bf16"), torch version and
signature key. Lookups always name the device, so a profile taken on one GPU kind is never
returned for another. A file that is not ours (or not SQLite) is refused with one line and left
exactly as it was; SQLite transactions mean a crash never leaves half a row.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.io import atomic_write_text
from autopar.profiler.records import CollectiveFit, OpRecord, OpTiming

FORMAT = "autopar-profile"
SCHEMA_VERSION = 1
_OP_COLUMNS = ("device_name", "dtype", "torch_version", "signature_key", "op", "time_s", "repeats",
               "mem_alloc_delta_bytes", "mem_peak_bytes", "measured_at", "note")
_FIT_COLUMNS = ("device_name", "backend", "torch_version", "collective", "level", "group_size", "alpha_s",
                "beta_bytes_per_s", "rel_rms_error", "sizes_bytes", "times_s", "measured_at")
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS autopar_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS op_profiles (
    device_name TEXT NOT NULL, dtype TEXT NOT NULL, torch_version TEXT NOT NULL, signature_key TEXT NOT NULL,
    op TEXT NOT NULL, time_s REAL, repeats INTEGER NOT NULL, mem_alloc_delta_bytes INTEGER,
    mem_peak_bytes INTEGER, measured_at REAL NOT NULL, note TEXT,
    PRIMARY KEY (device_name, dtype, torch_version, signature_key));
CREATE TABLE IF NOT EXISTS collective_fits (
    device_name TEXT NOT NULL, backend TEXT NOT NULL, torch_version TEXT NOT NULL, collective TEXT NOT NULL,
    level TEXT NOT NULL, group_size INTEGER NOT NULL, alpha_s REAL NOT NULL, beta_bytes_per_s REAL NOT NULL,
    rel_rms_error REAL NOT NULL, sizes_bytes TEXT NOT NULL, times_s TEXT NOT NULL, measured_at REAL NOT NULL,
    PRIMARY KEY (device_name, backend, torch_version, collective, level, group_size));
INSERT OR IGNORE INTO autopar_meta VALUES ('format', '{FORMAT}'), ('schema_version', '{SCHEMA_VERSION}');
"""


def _current_torch_version() -> str:
    import torch

    return torch.__version__


def _key_of(signature: Any) -> str:
    return signature if isinstance(signature, str) else signature.key


def _check_ours(connection: sqlite3.Connection, path: Path) -> bool:
    """True for our file, False for an empty one; AutoparError for anything else."""
    try:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            return False
        if "autopar_meta" not in tables:
            raise AutoparError(f"{path} is an SQLite file but not an autopar profile database; choose another --db")
        meta = dict(connection.execute("SELECT key, value FROM autopar_meta"))
    except sqlite3.DatabaseError as error:
        raise AutoparError(
            f"{path} is not a readable profile database ({error}); move it aside or choose another --db"
        ) from None
    if meta.get("format") != FORMAT:
        raise AutoparError(f"{path} is not an autopar profile database (format {meta.get('format')!r})")
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise AutoparError(
            f"{path} has profile schema version {meta.get('schema_version')}, this autopar reads {SCHEMA_VERSION}: "
            f"re-profile into a new file"
        )
    return True


def _open_readonly(path: Path) -> sqlite3.Connection:
    try:
        return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as error:
        raise AutoparError(f"cannot open profile database {path}: {error}") from None


class ProfileDB:
    """Open (creating if needed, unless `readonly`) the profile database at `path`."""

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        if self.path.is_dir():
            raise AutoparError(f"profile database {self.path} is a directory; give a file path")
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists:  # validate read-only first, so a foreign file is never touched
            probe = _open_readonly(self.path)
            try:
                _check_ours(probe, self.path)
            finally:
                probe.close()
        elif readonly:
            raise AutoparError(f"no profile database at {self.path}: run `autopar profile --db {self.path}` first")
        else:
            directory = self.path.parent if str(self.path.parent) else Path(".")
            if not directory.is_dir():
                raise AutoparError(f"cannot create {self.path}: directory {directory} does not exist; create it first")
        if exists and not readonly and not os.access(self.path, os.W_OK):
            raise AutoparError(f"profile database {self.path} is not writable; fix its permissions or choose another --db")
        try:
            self._db = _open_readonly(self.path) if readonly else sqlite3.connect(self.path)
            if not readonly:
                with self._db:
                    self._db.executescript(_SCHEMA)
        except sqlite3.Error as error:
            raise AutoparError(f"cannot write profile database {self.path}: {error}; choose a writable location") from None

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "ProfileDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _query(self, sql: str, params: Any = ()) -> list[tuple]:
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as error:  # a file damaged after it was opened
            raise AutoparError(f"cannot read profile database {self.path}: {error}") from None

    def _write(self, sql: str, rows: list[tuple]) -> None:
        if self.readonly:
            raise AutoparError(f"profile database {self.path} was opened read-only")
        try:
            with self._db:
                self._db.executemany(sql, rows)
        except sqlite3.Error as error:
            raise AutoparError(f"cannot write profile database {self.path}: {error}") from None

    # --- operator profiles ---------------------------------------------------------------------------
    def record_op(self, device_name: str, dtype: str, timing: OpTiming, *, torch_version: str | None = None,
                  measured_at: float | None = None) -> None:
        """Store one timing (a measurement or a skip), replacing any row with the same key."""
        row = (device_name, dtype, torch_version or _current_torch_version(), timing.signature_key, timing.op,
               timing.time_s, timing.repeats, timing.mem_alloc_delta_bytes, timing.mem_peak_bytes,
               measured_at if measured_at is not None else time.time(), timing.skipped)
        self._write(f"INSERT OR REPLACE INTO op_profiles VALUES ({','.join('?' * len(_OP_COLUMNS))})", [row])

    def lookup(self, device_name: str, dtype: str, signature: Any, *, torch_version: str | None = None,
               include_skipped: bool = False) -> OpRecord | None:
        """The newest record for this device, dtype and signature (any torch version unless given)."""
        sql = "SELECT * FROM op_profiles WHERE device_name=? AND dtype=? AND signature_key=?"
        params: list[Any] = [device_name, dtype, _key_of(signature)]
        if torch_version is not None:
            sql += " AND torch_version=?"
            params.append(torch_version)
        if not include_skipped:
            sql += " AND time_s IS NOT NULL"
        rows = self._query(sql + " ORDER BY measured_at DESC LIMIT 1", params)
        return OpRecord(*rows[0]) if rows else None

    def lookup_time_s(self, device_name: str, dtype: str, signature: Any, *,
                      torch_version: str | None = None) -> float | None:
        """Median measured time in seconds, or None when this device never measured it."""
        record = self.lookup(device_name, dtype, signature, torch_version=torch_version)
        return record.time_s if record else None

    def op_records(self, device_name: str | None = None) -> list[OpRecord]:
        sql, params = "SELECT * FROM op_profiles", []
        if device_name is not None:
            sql, params = sql + " WHERE device_name=?", [device_name]
        return [OpRecord(*row) for row in self._query(sql + " ORDER BY device_name, signature_key", params)]

    def devices(self) -> list[str]:
        rows = self._query(
            "SELECT device_name FROM op_profiles UNION SELECT device_name FROM collective_fits ORDER BY 1")
        return [row[0] for row in rows]

    # --- collective fits -----------------------------------------------------------------------------
    def record_collective_fit(self, fit: CollectiveFit) -> None:
        row = asdict(fit)
        row["sizes_bytes"], row["times_s"] = json.dumps(list(fit.sizes_bytes)), json.dumps(list(fit.times_s))
        row["measured_at"] = fit.measured_at or time.time()
        self._write(f"INSERT OR REPLACE INTO collective_fits VALUES ({','.join('?' * len(_FIT_COLUMNS))})",
                    [tuple(row[c] for c in _FIT_COLUMNS)])

    def collective_fits(self, device_name: str | None = None, *, collective: str | None = None,
                        level: str | None = None) -> list[CollectiveFit]:
        clauses, params = [], []
        for column, value in (("device_name", device_name), ("collective", collective), ("level", level)):
            if value is not None:
                clauses.append(f"{column}=?")
                params.append(value)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._query(f"SELECT * FROM collective_fits{where} ORDER BY measured_at DESC", params)
        return [_fit_from_row(row) for row in rows]

    def lookup_collective(self, device_name: str, collective: str, level: str,
                          group_size: int | None = None) -> CollectiveFit | None:
        """The newest fit for this device, collective and link level (and group size, if given)."""
        fits = self.collective_fits(device_name, collective=collective, level=level)
        fits = [f for f in fits if group_size is None or f.group_size == group_size]
        return fits[0] if fits else None

    # --- merge and export ----------------------------------------------------------------------------
    def merge(self, other_path: str | os.PathLike) -> int:
        """Take rows from another profile database; returns how many rows were added or replaced.

        For the same key, a measurement beats a skip, and otherwise the newer row wins.
        """
        other_path = Path(other_path)
        if not other_path.is_file():
            raise AutoparError(f"no profile database at {other_path}")
        other = _open_readonly(other_path)
        try:
            if not _check_ours(other, other_path):
                return 0
            op_rows = list(other.execute("SELECT * FROM op_profiles"))
            fit_rows = list(other.execute("SELECT * FROM collective_fits"))
        except sqlite3.DatabaseError as error:
            raise AutoparError(f"cannot read profile database {other_path}: {error}") from None
        finally:
            other.close()
        taken = [row for row in op_rows if self._newer_op(row)]
        self._write(f"INSERT OR REPLACE INTO op_profiles VALUES ({','.join('?' * len(_OP_COLUMNS))})", taken)
        fits = [row for row in fit_rows if self._newer_fit(row)]
        self._write(f"INSERT OR REPLACE INTO collective_fits VALUES ({','.join('?' * len(_FIT_COLUMNS))})", fits)
        return len(taken) + len(fits)

    def _newer_op(self, row: tuple) -> bool:
        found = self._query(
            "SELECT time_s, measured_at FROM op_profiles WHERE device_name=? AND dtype=? AND torch_version=? "
            "AND signature_key=?", row[:4])
        if not found:
            return True
        mine = found[0]
        theirs_measured, mine_measured = row[5] is not None, mine[0] is not None
        if theirs_measured != mine_measured:
            return theirs_measured
        return row[9] > mine[1]

    def _newer_fit(self, row: tuple) -> bool:
        found = self._query(
            "SELECT measured_at FROM collective_fits WHERE device_name=? AND backend=? AND torch_version=? "
            "AND collective=? AND level=? AND group_size=?", row[:6])
        return not found or row[11] > found[0][0]

    def export_json(self, path: str | os.PathLike) -> None:
        """Write everything as one JSON document (atomically: a failed write leaves no half file)."""
        document = {
            "format": FORMAT, "schema_version": SCHEMA_VERSION,
            "op_profiles": [asdict(r) for r in self.op_records()],
            "collective_fits": [asdict(f) for f in self.collective_fits()],
        }
        atomic_write_text(path, json.dumps(document, indent=1))


def _fit_from_row(row: tuple) -> CollectiveFit:
    values = dict(zip(_FIT_COLUMNS, row))
    values["sizes_bytes"] = tuple(json.loads(values["sizes_bytes"]))
    values["times_s"] = tuple(json.loads(values["times_s"]))
    return CollectiveFit(**values)
