"""The token data pipeline: prepare (bytes and tokenizer files), the memory-mapped dataset, the
dp-aware loader and its resumable state, the default corpus, and one clear line for each bad input."""

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import autopar.runtime.data.prepare as data_prepare
from autopar.cli import main
from autopar.errors import AutoparError
from autopar.runtime.data.corpus import default_corpus
from autopar.runtime.data.loader import TokenDataset, TokenLoader
from autopar.runtime.data.prepare import prepare_tokens

EOS = 256


def _write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _documents(dataset: TokenDataset) -> list[str]:
    """Split the byte-level stream on EOS and decode each document."""
    stream = dataset.read(0, dataset.num_tokens).tolist()
    documents, current = [], []
    for token in stream:
        if token == EOS:
            documents.append(bytes(current).decode())
            current = []
        else:
            current.append(token)
    assert not current  # every document ends with EOS
    return documents


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture
def corpus(tmp_path):
    """A directory of text, Markdown, JSONL and one binary file (skipped)."""
    root = tmp_path / "corpus"
    _write(root / "a.txt", "hello world\n")
    _write(root / "sub" / "b.md", "# Titel\nÜber 漢字 ✓\n")
    _write(root / "c.jsonl", json.dumps({"text": "first record", "id": 1}) + "\n\n"
           + json.dumps({"text": ""}) + "\n" + json.dumps({"text": "second ✓"}) + "\n")
    _write(root / "blob.bin", b"\x00\x01\x02binary")
    _write(root / ".hidden" / "x.txt", "never read")
    return root


@pytest.fixture
def dataset_100(tmp_path):
    """A byte-level dataset of exactly 100 documents of 9 bytes + EOS = 1,000 tokens, shards of 64 tokens."""
    text = tmp_path / "docs.jsonl"
    _write(text, "".join(json.dumps({"text": f"doc {i:05d}"}) + "\n" for i in range(100)))
    prepare_tokens([str(text)], str(tmp_path / "ds100"), shard_tokens=64)
    return TokenDataset(tmp_path / "ds100")


def test_prepare_text_and_jsonl_bytes_round_trip(corpus, tmp_path):
    out = tmp_path / "ds"
    summary = prepare_tokens([str(corpus)], str(out), shard_tokens=7)
    expected = ["hello world\n", "first record", "second ✓", "# Titel\nÜber 漢字 ✓\n"]  # sorted paths, empty skipped
    assert summary.num_documents == 4 and summary.num_files == 3 and summary.skipped_files == 1
    assert summary.num_tokens == sum(len(d.encode()) + 1 for d in expected)
    assert summary.dtype == "uint16" and summary.vocab_size == 257 and summary.eos_id == EOS
    dataset = TokenDataset(out)
    assert _documents(dataset) == expected
    assert dataset.max_token_id() == EOS and dataset.num_tokens == summary.num_tokens

    index = json.loads((out / "index.json").read_text())
    assert index["format"] == "autopar-tokens" and index["format_version"] == 1
    assert index["num_documents"] == 4 and index["tokenizer"]["kind"] == "bytes"
    assert summary.num_shards == len(index["shards"]) == -(-summary.num_tokens // 7)
    for number, shard in enumerate(index["shards"]):
        data = (out / shard["file"]).read_bytes()
        assert shard["file"] == f"tokens-{number:05d}.bin"
        assert len(data) == 2 * shard["num_tokens"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
    assert sorted(p.name for p in out.iterdir()) == ["index.json"] + [s["file"] for s in index["shards"]]
    assert _leftovers(tmp_path) == []  # the temporary build directory was renamed, nothing left beside
    dataset.verify()


def test_samples_cross_shard_boundaries(dataset_100):
    stream = dataset_100.read(0, dataset_100.num_tokens)
    assert dataset_100.num_shards == -(-1000 // 64)
    for seq_len in (5, 64, 100, 333):
        assert dataset_100.num_samples(seq_len) == 1000 // seq_len
        for i in range(dataset_100.num_samples(seq_len)):
            assert np.array_equal(dataset_100.sample(i, seq_len), stream[i * seq_len:(i + 1) * seq_len])
    with pytest.raises(IndexError):
        dataset_100.sample(200, 5)


def test_large_files_read_in_chunks_give_the_same_tokens(tmp_path, monkeypatch):
    text = "line one ✓\nzwei 漢字\n" * 5 + "a last line longer than four chunks, no newline: ✓✓✓"
    _write(tmp_path / "big.txt", text)
    tokenizer = _word_tokenizer(tmp_path, extra=sorted(set(text.split())))
    for name, choice in (("bytes", None), ("words", tokenizer)):
        prepare_tokens([str(tmp_path / "big.txt")], str(tmp_path / f"whole-{name}"), tokenizer=choice)
    monkeypatch.setattr(data_prepare, "READ_CHUNK_BYTES", 5)  # cuts inside lines and inside UTF-8 characters
    for name, choice in (("bytes", None), ("words", tokenizer)):
        prepare_tokens([str(tmp_path / "big.txt")], str(tmp_path / f"chunked-{name}"), tokenizer=choice)
        chunked, whole = TokenDataset(tmp_path / f"chunked-{name}"), TokenDataset(tmp_path / f"whole-{name}")
        assert np.array_equal(chunked.read(0, chunked.num_tokens), whole.read(0, whole.num_tokens))
        assert chunked.index["num_documents"] == 1
    assert 0 not in TokenDataset(tmp_path / "chunked-words").read(0, 29).tolist()  # no [UNK] from a split word


def _word_tokenizer(directory: Path, extra=(), eos="</s>", size=None) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = ["[UNK]", "hello", "world"] + ([eos] if eos else []) + list(extra)
    if size:
        words += [f"w{i}" for i in range(size - len(words))]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    path = directory / f"tokenizer-{bool(eos)}-{len(words)}.json"
    tokenizer.save(str(path))
    return str(path)


def test_prepare_with_a_tokenizer_file(tmp_path):
    _write(tmp_path / "in.jsonl", json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "world hello zz"}))
    tokenizer = _word_tokenizer(tmp_path)
    summary = prepare_tokens([str(tmp_path / "in.jsonl")], str(tmp_path / "ds"), tokenizer=tokenizer)
    dataset = TokenDataset(tmp_path / "ds")
    assert dataset.read(0, dataset.num_tokens).tolist() == [1, 2, 3, 2, 1, 0, 3]  # "zz" is [UNK] = 0; EOS </s> = 3
    assert (summary.vocab_size, summary.eos_id, summary.dtype) == (4, 3, "uint16")
    assert dataset.index["tokenizer"]["kind"] == "huggingface" and dataset.index["tokenizer"]["eos_token"] == "</s>"
    assert dataset.index["tokenizer"]["sha256"] == hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()

    no_eos = _word_tokenizer(tmp_path, eos=None)  # no EOS token: documents run together, none appended
    summary = prepare_tokens([str(tmp_path / "in.jsonl")], str(tmp_path / "no-eos"), tokenizer=no_eos)
    assert summary.eos_id is None and TokenDataset(tmp_path / "no-eos").read(0, 5).tolist() == [1, 2, 2, 1, 0]

    wide = _word_tokenizer(tmp_path, size=70_000)  # more ids than uint16 holds
    summary = prepare_tokens([str(tmp_path / "in.jsonl")], str(tmp_path / "wide"), tokenizer=wide)
    assert summary.dtype == "uint32" and summary.vocab_size == 70_000
    assert TokenDataset(tmp_path / "wide").read(0, 3).tolist() == [1, 2, 3]

    with pytest.raises(AutoparError, match=r"EOS token '<eot>' is not in tokenizer"):
        prepare_tokens([str(tmp_path / "in.jsonl")], str(tmp_path / "x"), tokenizer=tokenizer, eos_token="<eot>")
    _write(tmp_path / "broken.json", "{not json")
    for path, message in ((tmp_path / "missing.json", "does not exist"), (tmp_path / "broken.json", "cannot read tokenizer")):
        with pytest.raises(AutoparError, match=message):
            prepare_tokens([str(tmp_path / "in.jsonl")], str(tmp_path / "x"), tokenizer=str(path))
    assert not (tmp_path / "x").exists() and _leftovers(tmp_path) == []


def _epoch_ids(loader: TokenLoader, steps: int) -> list[list[int]]:
    return [loader.next()[1].tolist() for _ in range(steps)]


def test_order_is_seeded_per_epoch_and_drops_the_tail(dataset_100):
    # seq 20 -> 50 samples; global batch 8 -> 6 steps per epoch, 2 samples dropped each epoch
    first = TokenLoader(dataset_100, 20, 8, seed=3, prefetch=0)
    again = TokenLoader(dataset_100, 20, 8, seed=3, prefetch=2)
    other = TokenLoader(dataset_100, 20, 8, seed=4, prefetch=0)
    assert first.steps_per_epoch == 6
    ids = _epoch_ids(first, 12)
    assert ids == _epoch_ids(again, 12) and ids != _epoch_ids(other, 12)
    epoch0, epoch1 = sum(ids[:6], []), sum(ids[6:], [])
    expected0 = np.random.default_rng([3, 0]).permutation(50)[:48].tolist()
    assert epoch0 == expected0 and len(set(epoch0)) == 48 and set(epoch0) <= set(range(50))
    assert len(set(epoch1)) == 48 and epoch1 != epoch0
    assert first.epoch == 1 and first.samples_in_epoch == 48
    tokens, sample_ids = again.next()  # the tokens are the samples' windows
    assert tokens.dtype == torch.long and tokens.shape == (8, 20)
    for row, sample in zip(tokens, sample_ids.tolist()):
        assert row.tolist() == dataset_100.sample(sample, 20).tolist()
    again.close()


def _global_batches(loaders: list[TokenLoader], steps: int) -> list[list[int]]:
    """Each step: the ranks' rows in rank order, i.e. the global batch as ParallelModel.local_batch splits it."""
    batches = []
    for _ in range(steps):
        rows = [loader.next() for loader in loaders]
        assert len({tokens.shape[0] for tokens, _ in rows}) == 1
        batches.append(sum((ids.tolist() for _, ids in rows), []))
    return batches


def test_resume_across_a_change_of_dp_degree(dataset_100, tmp_path):
    seq_len, global_batch, seed = 20, 8, 11  # 50 samples, 6 steps per epoch
    reference = _global_batches([TokenLoader(dataset_100, seq_len, global_batch, seed=seed, prefetch=0)], 9)

    def loaders(dp_size: int, state: dict | None) -> list[TokenLoader]:
        made = [TokenLoader(dataset_100, seq_len, global_batch, rank, dp_size, seed, prefetch=2) for rank in range(dp_size)]
        for loader in made:
            if state is not None:
                loader.load_state_dict(state)
        return made

    batches, state = [], None
    for dp_size, steps in ((2, 2), (4, 3), (1, 4)):
        group = loaders(dp_size, state)
        batches += _global_batches(group, steps)
        states = [loader.state_dict() for loader in group]
        assert all(s == states[0] for s in states)  # the same on every rank, independent of dp
        state = json.loads(json.dumps(states[0]))  # JSON-able, and survives a checkpoint file
        for loader in group:
            loader.close()
    assert batches == reference
    epoch0 = sum(batches[:6], [])
    assert sorted(epoch0) == sorted(set(epoch0)) and len(epoch0) == 48  # nothing repeated, nothing skipped
    assert state == {"format": "autopar-token-loader", "format_version": 1, "seed": seed, "epoch": 1,
                     "samples_in_epoch": 24, "seq_len": seq_len, "global_batch": global_batch,
                     "dataset": {"fingerprint": dataset_100.fingerprint, "num_tokens": 1000}}


def test_state_counts_batches_handed_out_not_prefetched(dataset_100):
    loader = TokenLoader(dataset_100, 10, 4, dp_rank=1, dp_size=2, seed=5, prefetch=3)
    handed = [loader.next()[1].tolist() for _ in range(2)]
    assert loader.wait_prefetched() == 3  # the thread has run ahead of what was handed out
    state = loader.state_dict()
    assert (state["epoch"], state["samples_in_epoch"]) == (0, 8)
    resumed = TokenLoader(dataset_100, 10, 4, dp_rank=1, dp_size=2, seed=5, prefetch=0)
    resumed.load_state_dict(state)
    assert [resumed.next()[1].tolist() for _ in range(3)] == [loader.next()[1].tolist() for _ in range(3)]
    assert handed[0] == np.random.default_rng([5, 0]).permutation(100)[2:4].tolist()  # rank 1: rows 2..3
    loader.close()


def test_resume_with_another_global_batch_continues_at_the_same_sample(dataset_100):
    loader = TokenLoader(dataset_100, 20, 8, seed=2, prefetch=0)
    loader.next()
    smaller = TokenLoader(dataset_100, 20, 4, dp_rank=1, dp_size=2, seed=2, prefetch=0)
    smaller.load_state_dict(loader.state_dict())
    permutation = np.random.default_rng([2, 0]).permutation(50).tolist()
    assert smaller.next()[1].tolist() == permutation[10:12]  # samples 8..11 of the epoch, rank 1's half


def test_loader_state_from_elsewhere_is_refused(dataset_100, tmp_path):
    loader = TokenLoader(dataset_100, 20, 8, seed=1, prefetch=0)
    loader.next()
    state = loader.state_dict()
    _write(tmp_path / "other.txt", "x" * 500)
    prepare_tokens([str(tmp_path / "other.txt")], str(tmp_path / "other"))
    cases = [
        (TokenLoader(tmp_path / "other", 20, 8, seed=1), state, "another dataset"),
        (TokenLoader(dataset_100, 10, 8, seed=1), state, "seq_len 20"),
        (TokenLoader(dataset_100, 20, 8, seed=2), state, "seed 1"),
        (TokenLoader(dataset_100, 20, 8, seed=1), {"epoch": 3}, "not a token loader state"),
        (TokenLoader(dataset_100, 20, 8, seed=1), {**state, "samples_in_epoch": 99}, "damaged"),
    ]
    for target, bad, message in cases:
        with pytest.raises(AutoparError, match=message) as error:
            target.load_state_dict(bad)
        assert "\n" not in str(error.value)


def test_loader_input_errors(dataset_100):
    with pytest.raises(AutoparError, match="does not split evenly over dp=3"):
        TokenLoader(dataset_100, 10, 8, dp_rank=0, dp_size=3)
    with pytest.raises(AutoparError, match="fewer than one global batch of 64"):
        TokenLoader(dataset_100, 100, 64)
    with pytest.raises(AutoparError, match="dp rank 2 of 2"):
        TokenLoader(dataset_100, 10, 8, dp_rank=2, dp_size=2)
    with pytest.raises(AutoparError, match=r"ids up to 256.*vocab ≥ 257"):
        dataset_100.check_vocab(100)
    dataset_100.check_vocab(257)


def test_prepare_errors_name_the_problem_and_leave_nothing(tmp_path):
    _write(tmp_path / "empty.txt", "")
    _write(tmp_path / "good.txt", "fine")
    (tmp_path / "no-files").mkdir()
    _write(tmp_path / "bad.jsonl", json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    _write(tmp_path / "junk.jsonl", "{\"text\": \n")
    _write(tmp_path / "full" / "keep.txt", "someone's file")
    _write(tmp_path / "bin.dat", b"\x00\x00")
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "nope")], out, r"data path .*nope does not exist"),
        ([str(tmp_path / "no-files")], out, "no text files under"),
        ([str(tmp_path / "empty.txt")], out, "no text found"),
        ([str(tmp_path / "good.txt"), str(tmp_path / "bad.jsonl")], out,
         r"bad.jsonl:2: JSONL record has no \"text\" field \(it has: body\)"),
        ([str(tmp_path / "junk.jsonl")], out, r"junk.jsonl:1: not valid JSON"),
        ([str(tmp_path / "bin.dat")], out, "looks binary"),
        ([str(tmp_path / "good.txt")], str(tmp_path / "full"), "not empty and is not a prepared dataset"),
        ([], out, "no input given"),
    ]
    for inputs, target, message in cases:
        with pytest.raises(AutoparError, match=message) as error:
            prepare_tokens(inputs, target)
        assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []  # no dataset, no temporary directory
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


def test_existing_dataset_is_replaced_only_with_overwrite(tmp_path):
    _write(tmp_path / "one.txt", "one")
    _write(tmp_path / "two.txt", "second version")
    out = tmp_path / "ds"
    prepare_tokens([str(tmp_path / "one.txt")], str(out))
    with pytest.raises(AutoparError, match="already holds a prepared dataset: pass --overwrite"):
        prepare_tokens([str(tmp_path / "two.txt")], str(out))
    assert _documents(TokenDataset(out)) == ["one"]
    prepare_tokens([str(tmp_path / "two.txt")], str(out), overwrite=True)
    assert _documents(TokenDataset(out)) == ["second version"] and _leftovers(tmp_path) == []
    (tmp_path / "empty-dir").mkdir()  # an empty directory is a fine target
    prepare_tokens([str(tmp_path / "one.txt")], str(tmp_path / "empty-dir"))
    assert _documents(TokenDataset(tmp_path / "empty-dir")) == ["one"]


def test_damaged_dataset_is_refused_with_the_fix(dataset_100):
    path = dataset_100.path
    shard = path / "tokens-00003.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(AutoparError, match=r"tokens-00003.bin has 126 bytes.*re-run `autopar data prepare`"):
        TokenDataset(path)
    shard.unlink()
    with pytest.raises(AutoparError, match=r"tokens-00003.bin of dataset .* is missing: re-run `autopar data prepare`"):
        TokenDataset(path)
    (path / "index.json").unlink()
    with pytest.raises(AutoparError, match="not a prepared dataset"):
        TokenDataset(path)
    with pytest.raises(AutoparError, match="does not exist"):
        TokenDataset(path / "nowhere")


def test_verify_detects_changed_content(dataset_100):
    shard = dataset_100.path / "tokens-00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(AutoparError, match="does not match its sha256"):
        TokenDataset(dataset_100.path).verify()


def test_cli_prepare_and_info(tmp_path, capsys, corpus):
    out = tmp_path / "ds"
    code = main(["data", "prepare", "--input", str(corpus / "a.txt"), str(corpus / "c.jsonl"), "--out", str(out),
                 "--shard-tokens", "10"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "3 documents" in captured.out and "37 tokens in 4 shard(s) of uint16" in captured.out
    assert main(["data", "info", str(out), "--verify"]) == 0
    captured = capsys.readouterr()
    assert "37 in 4 shard(s)" in captured.out and "verified" in captured.out
    assert main(["data", "info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_tokens"] == 37

    bad = [["data", "prepare", "--input", str(tmp_path / "missing"), "--out", str(tmp_path / "x")],
           ["data", "prepare", "--input", str(corpus), "--out", str(out)],
           ["data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "x"), "--shard-tokens", "0"],
           ["data", "info", str(tmp_path / "missing")],
           ["data", "prepare", "--out", str(tmp_path / "x")]]
    for argv in bad:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("autopar: error: ") and sum(e.startswith("autopar") for e in err) == 1
    assert not (tmp_path / "x").exists()


def _fake_stdlib(root: Path) -> Path:
    _write(root / "os.py", "import sys\n")
    _write(root / "json" / "__init__.py", "'''json'''\n")
    _write(root / "test" / "test_os.py", "skipped: tests\n")
    _write(root / "site-packages" / "pkg.py", "skipped: installed packages\n")
    _write(root / "README.txt", "skipped: not .py\n")
    return root


def test_default_corpus_is_prepared_once_and_safely_shared(tmp_path, capsys):
    source = _fake_stdlib(tmp_path / "stdlib")
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:  # four callers at once, like torchrun ranks on one machine
        paths = list(pool.map(lambda _: default_corpus(str(cache), source_dir=str(source)), range(4)))
    assert len(set(paths)) == 1
    assert capsys.readouterr().err.count("preparing the default corpus") == 1
    dataset = TokenDataset(paths[0])
    assert _documents(dataset) == ["'''json'''\n", "import sys\n"]  # sorted paths: json/__init__.py, os.py
    assert default_corpus(str(cache), source_dir=str(source)) == paths[0]
    assert capsys.readouterr().err == ""  # cached: no second prepare
    (Path(paths[0]) / "tokens-00000.bin").unlink()  # a damaged cache is rebuilt
    assert _documents(TokenDataset(default_corpus(str(cache), source_dir=str(source)))) == ["'''json'''\n", "import sys\n"]
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == [Path(paths[0])]


def test_default_corpus_of_the_real_standard_library(tmp_path, monkeypatch):
    """The real thing takes well under a second: bytes of every stdlib .py outside tests and site-packages."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    dataset = TokenDataset(default_corpus())
    assert dataset.num_tokens > 1_000_000 and dataset.vocab_size == 257 and dataset.index["num_documents"] > 100
    assert Path(dataset.path).parent == tmp_path
    tokens, _ = TokenLoader(dataset, 256, 4, seed=0, prefetch=0).next()
    assert tokens.max() <= EOS


def test_prefetch_thread_errors_reach_the_caller(dataset_100, monkeypatch):
    loader = TokenLoader(dataset_100, 10, 4, seed=0, device="cpu", prefetch=2)
    tokens, _ = loader.next()
    assert tokens.device.type == "cpu"

    def broken(*args, **kwargs):
        raise OSError("the disk went away")

    loader.close()
    monkeypatch.setattr(dataset_100, "read", broken)
    with pytest.raises(OSError, match="the disk went away"):
        loader.next()
    assert loader.state_dict()["samples_in_epoch"] == 4  # the failed batch was not counted
    if not torch.cuda.is_available():
        with pytest.raises(AutoparError, match="no usable CUDA GPU"):
            TokenLoader(dataset_100, 10, 4, device="cuda")
