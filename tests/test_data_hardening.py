"""What a user hands us stays inside its directory and is refused in one line before training:
dataset indexes naming files outside, shards overwritten with ids the model cannot embed. Files we
create follow the user's umask, which is never changed; rank 0's round store listens only on the
address torchrun gave."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from autopar.errors import AutoparError
from autopar.runtime.data.loader import TokenDataset
from autopar.runtime.data.prepare import prepare_tokens

BYTES = ["--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=257,seq_len=32", "--cluster", "local",
         "--global-batch", "8", "--lr", "3e-3", "--log-every", "1"]


@pytest.fixture
def dataset(tmp_path) -> Path:
    """A byte-level dataset (vocab 257) of four shards."""
    text = tmp_path / "t.txt"
    text.write_text("hello world, the quick brown fox\n" * 400)
    prepare_tokens([str(text)], str(tmp_path / "ds"), shard_tokens=4096)
    return tmp_path / "ds"


def _index(dataset: Path) -> dict:
    return json.loads((dataset / "index.json").read_text())


def test_shard_names_in_the_index_stay_inside_the_dataset(dataset, tmp_path):
    index = _index(dataset)
    first = index["shards"][0]["file"]
    outside = tmp_path / "outside.bin"
    outside.write_bytes((dataset / first).read_bytes())  # same size: only the path can give it away
    (dataset / "link.bin").symlink_to(outside)
    for name, words in (("../outside.bin", "not a relative path inside"), (str(outside), "not a relative path inside"),
                        ("link.bin", "leads outside")):
        index["shards"][0]["file"] = name
        (dataset / "index.json").write_text(json.dumps(index))
        with pytest.raises(AutoparError, match=words) as error:
            TokenDataset(dataset)
        assert "\n" not in str(error.value) and "data prepare" in str(error.value)


def test_each_shard_records_its_largest_id_and_the_index_the_largest_of_all(dataset):
    index = _index(dataset)
    opened = TokenDataset(dataset)
    scanned = [opened.scan_max_token_id(number) for number in range(opened.num_shards)]
    assert [shard["max_token_id"] for shard in index["shards"]] == scanned and len(scanned) >= 3
    assert index["max_token_id"] == max(scanned) == 256  # each document ends with EOS


def _overwrite_with(dataset: Path, shard: int, token_id: int) -> Path:
    """Shard `shard` rewritten at the same size with `token_id` in its middle (the index is untouched)."""
    path = dataset / _index(dataset)["shards"][shard]["file"]
    tokens = np.fromfile(path, dtype="<u2")
    tokens[len(tokens) // 2] = token_id
    tokens.tofile(path)
    return path


def test_a_shard_overwritten_with_ids_beyond_the_vocabulary_is_refused_before_training(dataset, tmp_path,
                                                                                        monkeypatch):
    from autopar.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    shard = _overwrite_with(dataset, 2, 300)
    TokenDataset(dataset).check_vocab(301)  # a model that can embed id 300 is fine
    with pytest.raises(AutoparError, match=rf"shard {shard} holds token id 300, beyond the model's vocabulary of 257"):
        TokenDataset(dataset).check_vocab(257)

    metrics = tmp_path / "m.jsonl"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["run", *BYTES, "--steps", "2", "--data", str(dataset), "--metrics", str(metrics)])
    lines = [line for line in err.getvalue().splitlines() if line.startswith("autopar: error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    assert "token id 300" in lines[0] and "modified" in lines[0] and "data prepare" in lines[0]
    assert "training gpt" not in out.getvalue() and not metrics.exists()


def test_files_follow_the_umask_and_the_umask_is_never_changed(tmp_path, monkeypatch):
    import importlib

    import autopar.io

    def no_umask(*_):
        raise AssertionError("os.umask called: it changes the mask for every thread, even when set back at once")

    previous = os.umask(0o027)  # the user's umask for this test
    try:
        monkeypatch.setattr(os, "umask", no_umask)
        importlib.reload(autopar.io)  # importing it does not read the umask by setting it
        autopar.io.atomic_write_text(tmp_path / "plan.json", "{}")
        text = tmp_path / "t.txt"
        text.write_text("some text\n" * 50)
        prepare_tokens([str(text)], str(tmp_path / "ds"))
    finally:
        monkeypatch.undo()
        os.umask(previous)
    assert _mode(tmp_path / "plan.json") == 0o640
    assert _mode(tmp_path / "ds") == 0o750  # the user's umask, not a forced 0755
    assert {_mode(p) for p in (tmp_path / "ds").iterdir()} == {0o640}


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_the_round_store_listens_only_on_the_address_torchrun_gave(monkeypatch):
    from torch.distributed import TCPStore

    from autopar.runtime import launch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        agent_port = probe.getsockname()[1]
    agent = TCPStore("127.0.0.1", agent_port, world_size=2, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(agent_port))
    store = launch.round_store(0, 2)
    assert int(agent.get(launch.ANNOUNCE_KEY)) == store.port
    assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1 alone; torch's default is every interface
    other = TCPStore("localhost", store.port, world_size=2, is_master=False, timeout=timedelta(seconds=10))
    store.set("k", b"v")
    assert other.get("k") == b"v"
