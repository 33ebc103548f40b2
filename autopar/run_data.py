"""What `autopar run` trains on: a prepared token dataset, the embedded corpus, or a synthetic stream.

`--data synthetic` keeps a random-walk stream (every rank draws the whole batch from `--seed`), for
tests that need a stream independent of any dataset.
"""

from __future__ import annotations

from typing import Any

from autopar.errors import AutoparError

NOISE = 0.1  # share of synthetic tokens drawn uniformly instead of from the walk
SYNTHETIC = "synthetic"
BYTE_VOCAB = 257  # the embedded corpus: 256 byte values and the end-of-document id
SYNTHETIC_STATE = "autopar-synthetic-tokens"


class SyntheticTokens:
    """Deterministic token batches: random walks on a fixed random permutation of the vocabulary,
    with a share of uniform noise. Learnable (a model can lower the loss well below log(vocab)),
    and identical on every rank for a given seed."""

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


def open_data(data: str | None, vocab: int, seq_len: int, global_batch: int):
    """The dataset to train on (None: the synthetic stream), checked against the model before any
    process group or step, so every rank refuses bad data with the same line."""
    from autopar.runtime.data import TokenDataset, default_corpus

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
