"""What `autopar run` trains on: a prepared token dataset, the embedded corpus, or a synthetic stream.

`--data synthetic` keeps a random-walk stream (every rank draws the whole batch from `--seed`), for
tests that need a stream independent of any dataset. A user's factory model trains on batches shaped
like its example input (`autopar/cli/run_inputs.py`), on its own `batches(global_batch, step)`, or on a
token dataset when it is a language model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autopar.errors import AutoparError

NOISE = 0.1  # share of synthetic tokens drawn uniformly instead of from the walk
SYNTHETIC = "synthetic"
BYTE_VOCAB = 257  # the embedded corpus: 256 byte values and the end-of-document id
SYNTHETIC_STATE = "autopar-synthetic-tokens"


class SyntheticTokens:
    """Deterministic token batches: random walks on a fixed random permutation of the vocabulary,
    with a share of uniform noise. Learnable (a model can lower the loss well below log(vocab)),
    and identical on every rank for a given seed."""

    whole_batch = True  # for the training loop: every rank draws the whole global batch

    def __init__(self, vocab: int, global_batch: int, seq_len: int, seed: int) -> None:
        import torch

        self.vocab, self.global_batch, self.seq_len = vocab, global_batch, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab, generator=self.generator)

    def next_batch(self):
        import torch

        shape = (self.global_batch, self.seq_len)
        noise = torch.randint(0, self.vocab, shape, generator=self.generator)
        jump = torch.rand(shape, generator=self.generator) < NOISE
        tokens = torch.empty(shape, dtype=torch.long)
        tokens[:, 0] = noise[:, 0]
        for t in range(1, self.seq_len):
            tokens[:, t] = torch.where(jump[:, t], noise[:, t], self.successor[tokens[:, t - 1]])
        return tokens

    def state_dict(self) -> dict[str, Any]:
        """The generator's position, JSON-able, so a resumed run draws the batches it would have drawn."""
        return {"format": SYNTHETIC_STATE, "vocab": self.vocab, "seq_len": self.seq_len,
                "generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        if not isinstance(state, dict) or state.get("format") != SYNTHETIC_STATE:
            raise AutoparError("the checkpoint was not trained on --data synthetic: give the --data it was trained "
                               "on, or --resume none to start fresh")
        if (state.get("vocab"), state.get("seq_len")) != (self.vocab, self.seq_len):
            raise AutoparError(f"the checkpoint's synthetic stream has vocab {state.get('vocab')} and seq_len "
                               f"{state.get('seq_len')}, this run {self.vocab} and {self.seq_len}: use the same "
                               f"model config and --seq-len, or --resume none")
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))

    def close(self) -> None:
        pass


def open_data(data: str | None, vocab: int, seq_len: int, global_batch: int):
    """The dataset to train on (None: the synthetic stream), checked against the model before any
    process group or step, so every rank refuses bad data with the same line."""
    from autopar.runtime.data.corpus import default_corpus
    from autopar.runtime.data.loader import TokenDataset

    if data == SYNTHETIC:
        return None
    if data is None:
        if vocab < BYTE_VOCAB:
            raise AutoparError(f"the embedded corpus is byte-level ({BYTE_VOCAB} token ids), the model's vocabulary "
                               f"has {vocab}: use --model-config vocab={BYTE_VOCAB} or larger, or give --data DIR "
                               f"(or --data synthetic)")
        dataset = TokenDataset(default_corpus())
    else:
        dataset = TokenDataset(data)
    dataset.check_vocab(vocab)
    samples = dataset.num_samples(seq_len)
    if samples < global_batch:
        raise AutoparError(f"dataset {dataset.path} has {dataset.num_tokens:,} tokens = {samples} samples of "
                           f"{seq_len}, fewer than one global batch of {global_batch}: use more data or a smaller "
                           f"--global-batch or --seq-len")
    return dataset


@dataclass
class TrainingData:
    """What a run trains on, chosen and checked before any process group starts; `open` makes the
    training loop's batch source once this rank's place in the mesh is known."""

    name: str  # the metrics' `data` field, kept in checkpoints
    tokens_per_sample: int  # for tokens/s and MFU (6 x parameters x tokens): one per sample of a non-token input
    open: Callable[[Any], Any]  # parallel model -> batch source
    describe: Callable[[], str]  # the run's start line says what it trains on


def choose_data(data: str | None, spec, example, seq_len: int, global_batch: int, seed: int) -> TrainingData:
    """Zoo models: the corpus, a dataset or the synthetic token stream, as always. A factory model: a
    token dataset when `--data DIR` is given (a language model), its own `batches` hook, or synthetic
    batches shaped like its example input (`--data synthetic`, or no hook): the token stream when the
    input is int64 ids [batch, seq] of a stated vocabulary, else `SyntheticInputs`."""
    if spec.config is not None:
        return _token_data(data, spec.config.vocab, seq_len, global_batch, seed)
    import torch

    from autopar.cli.run_inputs import (
        FactoryBatches,
        SyntheticInputs,
        check_drawable,
        sample_text,
    )

    ids = example.dim() == 2 and not (example.dtype.is_floating_point or example.dtype == torch.bool)
    tokens_per_sample = example.shape[1] if ids else 1
    if data not in (None, SYNTHETIC):
        if not ids or spec.vocab is None:
            raise AutoparError(f"--data {data} holds token ids [batch, seq], but {spec.name!r} takes "
                               f"{sample_text(example)} and states no vocab_size: train it on --data synthetic "
                               f"or on its batches(global_batch, step) method")
        return _token_data(data, spec.vocab, example.shape[1], global_batch, seed)
    if data is None and callable(getattr(spec.module, "batches", None)):
        FactoryBatches(spec, example, global_batch).next_batch()  # the hook's first batch checked before any group
        return TrainingData(name=f"{spec.name}.batches", tokens_per_sample=tokens_per_sample,
                            open=lambda parallel: FactoryBatches(spec, example, global_batch),
                            describe=lambda: f"{spec.name}'s batches(global_batch, step)")
    own = callable(getattr(spec.module, "make_batch", None))
    if ids and example.dtype == torch.int64 and spec.vocab is not None and not own:  # token ids: a learnable stream
        return _token_data(SYNTHETIC, spec.vocab, example.shape[1], global_batch, seed)
    if not own:
        check_drawable(spec, example)
    SyntheticInputs(spec, example, global_batch, seed).next_batch()  # a make_batch hook checked before any group
    drawn = "by its make_batch(batch, generator)" if own else f"like its example input {sample_text(example)}"
    return TrainingData(name=SYNTHETIC, tokens_per_sample=tokens_per_sample,
                        open=lambda parallel: SyntheticInputs(spec, example, global_batch, seed),
                        describe=lambda: f"synthetic ({drawn}, seed {seed})")


def _token_data(data: str | None, vocab: int, seq_len: int, global_batch: int, seed: int) -> TrainingData:
    dataset = open_data(data, vocab, seq_len, global_batch)
    if dataset is None:
        return TrainingData(
            name=SYNTHETIC, tokens_per_sample=seq_len,
            open=lambda parallel: SyntheticTokens(vocab, global_batch, seq_len, seed),
            describe=lambda: f"synthetic (random walks on a random permutation of the {vocab}-token vocabulary, "
                             f"seed {seed})")

    def loader(parallel):
        from autopar.runtime.data.loader import TokenLoader

        return TokenLoader(dataset, seq_len, global_batch, dp_rank=parallel.layout.dp_rank,
                           dp_size=parallel.layout.size("dp"), seed=seed, device=parallel.layout.device)

    return TrainingData(name=str(dataset.path), tokens_per_sample=seq_len, open=loader,
                        describe=lambda: f"{dataset.path} ({dataset.num_tokens:,} tokens, order seed {seed})")
