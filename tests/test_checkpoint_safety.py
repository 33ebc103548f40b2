"""Loading a checkpoint never executes code it contains and never reads outside its directory;
`latest` naming a missing checkpoint and an unwritable --checkpoint-dir are refused before training.

The attack of issue #19: DCP's index `.metadata` is a pickle, so a crafted one, with the manifest's
sha256 recomputed (whoever can write the files can rewrite the manifest), ran a shell command on
`autopar run --resume`. Each crafted file here is first shown to run its command when read the way
DCP reads it, so the refusals below are tested against a payload that works.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from test_checkpoint import DATA, ONE, STEPS_BEFORE, _build, _CountingSGD, _plan, _train

BYTES = ["--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=257,seq_len=32", "--cluster", "local",
         "--global-batch", "8", "--lr", "3e-3", "--log-every", "1"]


class _RunsCommand:
    """Unpickling this runs `command` in a shell (what an attacker's pickle does)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _touch(marker: Path) -> str:
    return f"touch {marker}"


def _rehash(checkpoint: Path) -> None:
    """Recompute the manifest's sizes and sha256 for the files it lists, as the attacker would."""
    from autopar.runtime.checkpoint.files import MANIFEST, file_digests

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    files = {name: checkpoint / name for name in manifest["files"]}
    manifest["files"] = {name: file_digests(checkpoint, [path])[name] for name, path in files.items()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _set_manifest_entry(checkpoint: Path, name: str, entry: dict) -> None:
    from autopar.runtime.checkpoint.files import MANIFEST

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][name] = entry
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _metadata(checkpoint: Path):
    from autopar.runtime.checkpoint.reader import read_safe_metadata

    return read_safe_metadata(checkpoint)


@pytest.fixture(scope="module")
def world_of_one():
    yield _plan(ONE, 1)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def saved(world_of_one, tmp_path):
    """A directory with one published checkpoint (step 1) and a model and optimizer to load it into."""
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(world_of_one, "sgd")
    _train(parallel, optimizer, DATA[:1])
    Checkpointer(tmp_path / "ck").save(1, parallel, optimizer, {"step": 1})
    return tmp_path / "ck", parallel, optimizer


def _craft_indexes(checkpoint: Path, marker: Path) -> dict[str, bytes]:
    """Two crafted indexes: the payload alone, and DCP's real metadata with the payload inside it."""
    real = _metadata(checkpoint)
    real.storage_meta = _RunsCommand(_touch(marker))
    return {"payload alone": pickle.dumps(_RunsCommand(_touch(marker))), "payload inside real metadata":
            pickle.dumps(real)}


def test_a_crafted_index_with_a_recomputed_manifest_is_refused_and_runs_nothing(saved, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from autopar.errors import AutoparError
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    directory, parallel, optimizer = saved
    demo, marker = tmp_path / "demo", tmp_path / "pwned"
    demos = _craft_indexes(directory / "step-00000001", demo)
    for label, index in _craft_indexes(directory / "step-00000001", marker).items():
        crafted = tmp_path / label.replace(" ", "-")
        shutil.copytree(directory, crafted)
        (crafted / "step-00000001" / ".metadata").write_bytes(demos[label])
        try:
            FileSystemReader(crafted / "step-00000001").read_metadata()  # DCP's own reader
        except Exception:  # noqa: BLE001 - it runs the command, then fails on the value the command returned
            pass
        assert demo.exists(), f"{label}: the payload does not work, so this test would prove nothing"
        demo.unlink()

        (crafted / "step-00000001" / ".metadata").write_bytes(index)
        _rehash(crafted / "step-00000001")
        for source in ("latest", crafted / "step-00000001"):
            with pytest.raises(AutoparError) as error:
                Checkpointer(crafted).load(source, parallel, optimizer)
            message = str(error.value)
            assert "\n" not in message and "refusing checkpoint" in message and "nothing in it was run" in message
            assert "system" in message, message  # names the global it refused
            assert not marker.exists(), label


def test_a_crafted_non_tensor_value_is_refused_and_runs_nothing(world_of_one, tmp_path):
    """DCP loads non-tensor state (here an optimizer's Python counter) with torch.load(weights_only=False)."""
    from autopar.errors import AutoparError
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, _ = _build(world_of_one, "sgd")
    optimizer = _CountingSGD(parallel.parameters(), lr=0.05, momentum=0.9)
    _train(parallel, optimizer, DATA[:STEPS_BEFORE])
    Checkpointer(tmp_path / "ck").save(STEPS_BEFORE, parallel, optimizer, {})
    checkpoint = tmp_path / "ck" / "step-00000003"
    marker, demo = tmp_path / "pwned", tmp_path / "demo"

    def payload(target: Path) -> bytes:
        buffer = io.BytesIO()
        torch.save(_RunsCommand(_touch(target)), buffer)
        return buffer.getvalue()

    torch.load(io.BytesIO(payload(demo)), weights_only=False)  # what DCP's default planner does with it
    assert demo.exists(), "the payload does not work, so this test would prove nothing"

    metadata = _metadata(checkpoint)
    index, info = next((index, info) for index, info in metadata.storage_data.items() if index.fqn.endswith(".updates"))
    data_file = checkpoint / info.relative_path
    evil = payload(marker)
    info.offset, info.length = data_file.stat().st_size, len(evil)
    with open(data_file, "ab") as stream:
        stream.write(evil)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(checkpoint)

    other, _ = _build(world_of_one, "sgd")
    other_optimizer = _CountingSGD(other.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(AutoparError) as error:
        Checkpointer(tmp_path / "ck").load("latest", other, other_optimizer)
    assert "\n" not in str(error.value) and "refusing a non-tensor value" in str(error.value), str(error.value)
    assert not marker.exists()


def test_paths_in_the_manifest_and_the_index_stay_inside_the_checkpoint(saved, tmp_path):
    from autopar.errors import AutoparError
    from autopar.runtime.checkpoint.checkpointer import Checkpointer, CheckpointError, verify_checkpoint

    directory, parallel, optimizer = saved
    checkpoint = directory / "step-00000001"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret" * 10)
    entry = {"bytes": outside.stat().st_size, "sha256": "0" * 64}
    shutil.copytree(checkpoint, tmp_path / "pristine")
    cases = {"../../outside.bin": "not a relative path inside", str(outside): "not a relative path inside",
             "link.bin": "leads outside"}
    (checkpoint / "link.bin").symlink_to(outside)
    for name, words in cases.items():
        _set_manifest_entry(checkpoint, name, entry)
        with pytest.raises(CheckpointError, match=words) as error:
            verify_checkpoint(checkpoint)
        assert "\n" not in str(error.value) and "refusing to read outside" in str(error.value)
        with pytest.raises(CheckpointError, match=words):
            Checkpointer(directory).load(1, parallel, optimizer)
        shutil.copy(tmp_path / "pristine" / "manifest.json", checkpoint / "manifest.json")

    metadata = _metadata(checkpoint)  # the index's storage records name files too
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.bin"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(checkpoint)
    with pytest.raises(AutoparError, match=r"points at '\.\./\.\./outside\.bin', not a file of the checkpoint"):
        Checkpointer(directory).load(1, parallel, optimizer)


def test_latest_is_a_checkpoint_name_of_its_directory_and_step_symlinks_are_not_followed(saved, tmp_path):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer, CheckpointError

    directory, parallel, optimizer = saved
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(directory, elsewhere)
    for pointer in ("../elsewhere/step-00000001", str(elsewhere / "step-00000001"), "step-1/../../x"):
        (directory / "latest").write_text(pointer + "\n")
        with pytest.raises(CheckpointError, match="not a checkpoint of") as error:
            Checkpointer(directory).load("latest", parallel, optimizer)
        assert "\n" not in str(error.value)
    (directory / "latest").unlink()
    (directory / "latest").symlink_to(elsewhere / "latest")
    with pytest.raises(CheckpointError, match="is a symlink"):
        Checkpointer(directory).load("latest", parallel, optimizer)
    (directory / "latest").unlink()

    (directory / "step-00000009").symlink_to(elsewhere / "step-00000001")  # a newer step, outside the directory
    assert [info.step for info in Checkpointer(directory).list()] == [1]
    assert Checkpointer(directory).load("latest", parallel, optimizer) == {"step": 1}


def test_latest_naming_a_missing_checkpoint_with_nothing_else_is_an_error(saved):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer, CheckpointError

    directory, parallel, optimizer = saved
    shutil.rmtree(directory / "step-00000001")
    checkpointer = Checkpointer(directory)
    assert checkpointer.list() == [] and not checkpointer.is_empty()
    with pytest.raises(CheckpointError, match=r"latest names step-00000001, which is missing") as error:
        checkpointer.load("latest", parallel, optimizer)
    assert "--resume none" in str(error.value) and error.value.path == directory / "latest"


# ---- through the CLI ------------------------------------------------------------------------------
@pytest.fixture
def cli(monkeypatch):
    from contextlib import redirect_stderr, redirect_stdout

    from autopar.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def run(argv: list[str]) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        had_group = dist.is_initialized()  # the world of one above, when its tests ran first
        with redirect_stdout(out), redirect_stderr(err):
            code = main(argv)
        assert dist.is_initialized() == had_group  # a group the run made is gone, one it found is kept
        return code, out.getvalue(), err.getvalue()

    return run


def _refused(result: tuple[int, str, str], *words: str) -> str:
    code, out, err = result
    lines = [line for line in err.splitlines() if line.startswith("autopar: error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "training gpt" not in out, out  # refused before training
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_cli_resume_of_a_crafted_checkpoint_is_one_line_and_runs_nothing(cli, tmp_path):
    directory, marker, metrics = tmp_path / "ck", tmp_path / "pwned", tmp_path / "m.jsonl"
    code, _, err = cli(["run", *BYTES, "--steps", "1", "--checkpoint-dir", str(directory)])
    assert code == 0, err
    checkpoint = directory / "step-00000001"
    (checkpoint / ".metadata").write_bytes(_craft_indexes(checkpoint, marker)["payload inside real metadata"])
    _rehash(checkpoint)
    for resume in ("auto", str(checkpoint)):
        _refused(cli(["run", *BYTES, "--steps", "2", "--checkpoint-dir", str(directory), "--resume", resume,
                      "--metrics", str(metrics)]), "refusing checkpoint", "nothing in it was run")
        assert not marker.exists() and not metrics.exists()


def test_cli_refuses_a_dangling_latest_and_an_unwritable_checkpoint_dir_before_training(cli, tmp_path):
    directory, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    directory.mkdir()
    (directory / "latest").write_text("step-00000005\n")
    _refused(cli(["run", *BYTES, "--steps", "2", "--checkpoint-dir", str(directory), "--metrics", str(metrics)]),
             "latest names step-00000005", "--resume none")
    assert not metrics.exists() and sorted(p.name for p in directory.iterdir()) == ["latest"]

    a_file = tmp_path / "file"
    a_file.write_text("")
    unwritable = [(a_file / "ck", "is not a directory")]
    if sys.platform.startswith("linux") and Path("/sys").is_dir():
        unwritable.append((Path("/sys/autopar-checkpoints"), "cannot create checkpoint directory"))  # sysfs: even root
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        unwritable.append((locked, "cannot write checkpoints in"))
    for path, words in unwritable:
        _refused(cli(["run", *BYTES, "--steps", "2", "--checkpoint-dir", str(path), "--metrics", str(metrics)]),
                 words, "--checkpoint-dir")
        assert not metrics.exists()
        assert not path.exists() or path == tmp_path / "locked"  # nothing created, no probe left
