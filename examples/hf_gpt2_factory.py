"""A model factory for `autopar run`: a tiny Hugging Face GPT-2 built from a config (no download).

    autopar run --model examples.hf_gpt2_factory:build --model-config layers=2,hidden=64 \
        --cluster local --global-batch 8 --steps 20 --log-every 5
    torchrun --nproc-per-node 2 -m autopar run --model examples.hf_gpt2_factory:build \
        --cluster local --global-batch 8 --steps 20 --strategy tp=2

(run from the repository root, or put this folder on PYTHONPATH). The factory's keyword arguments
are what `--model-config k=v,...` sets. The module it returns states one training step:
`loss(output, ids)` is what is trained, `default_seq_len` the sequence length when `--seq-len` is
not given, `init_module_(path, module)` how to initialize a module that has no `reset_parameters`
(the model is built on the meta device; each rank materializes only its shards); the inputs (token ids, one tensor [batch, seq]) and their range come from the model's
Hugging Face config (`vocab_size`), so `autopar run` draws synthetic batches of ids by itself, or
reads `--data DIR` from `autopar data prepare` when vocab >= the dataset's.
"""

import torch
import transformers
from torch import nn


class TinyGPT2(transformers.GPT2LMHeadModel):
    """Hugging Face's GPT-2 plus what `autopar run` reads off a factory's model."""

    def loss(self, output, ids: torch.Tensor) -> torch.Tensor:
        """What autopar traces, plans and trains: position t predicts token t+1."""
        logits = output.logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                           ids[:, 1:].reshape(-1))

    def init_module_(self, path: str, module: nn.Module) -> None:
        """autopar builds the model on the meta device and gives each rank only its shards, initializing
        one module at a time under a seed of its path; HF's Conv1D has no reset_parameters, so say how."""
        self._init_weights(module)


def build(layers: int = 2, hidden: int = 32, heads: int = 4, vocab: int = 96, seq_len: int = 16) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                     n_positions=max(seq_len, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=1)
    model = TinyGPT2(config)
    model.default_seq_len = seq_len  # the sequence length when --seq-len is not given
    return model
