"""Pipeline parallelism on Hugging Face models no one here wrote: plan pp=2, train, compare.

Each model is built from a tiny config (no download, dropout off), planned through the public path
(trace → search with the pipeline cut tried on the model's inputs → build_plan) with pp=2 (1F1B,
micro-batch 2), trained 3 steps on 2 gloo processes, and compared with one process: losses to
relative 1e-5, gathered final weights to 1e-5, and each rank's last-step collectives equal to the
plan's ledger. A model is `ok`, `refused (reason)` (no pp plan offered), or `FAILED (what)`.

    python benchmarks/pipeline_coverage.py                 # every model
    python benchmarks/pipeline_coverage.py --models llama,t5
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VOCAB, SEQ, IMAGE, SEED, STEPS, GLOBAL_BATCH = 96, 16, 16, 1234, 3, 8
NO_DROPOUT = ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
              "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout_rate", "hidden_dropout", "drop_path_rate",
              "classifier_dropout", "qa_dropout", "seq_classif_dropout", "embed_dropout", "summary_first_dropout")


class EncoderDecoder(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(input_ids=ids, decoder_input_ids=ids)


class ImageModel(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, pixels):
        return self.inner(pixel_values=pixels)


def zoo() -> dict[str, tuple]:
    """name -> (config class, model class, config kwargs, wrapper, input kind)."""
    import transformers as T

    lm = dict(vocab_size=VOCAB, max_position_embeddings=64)
    decoder = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, **lm)
    seq2seq = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                   encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=0, decoder_start_token_id=0, **lm)
    encoder = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, intermediate_size=64, **lm)
    vision = dict(image_size=IMAGE, num_labels=10)
    return {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(decoder, num_key_value_heads=2), None, "ids"),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(decoder, num_key_value_heads=2), None, "ids"),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(decoder, num_key_value_heads=2), None, "ids"),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(decoder, num_key_value_heads=2, head_dim=8), None, "ids"),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(decoder, pad_token_id=0), None, "ids"),
        "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(n_layer=4, n_embd=32, n_head=4, n_positions=64,
                                                       vocab_size=VOCAB), None, "ids"),
        "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, decoder, None, "ids"),
        "gptj": (T.GPTJConfig, T.GPTJForCausalLM, dict(n_layer=4, n_embd=32, n_head=4, n_positions=64, rotary_dim=4,
                                                       vocab_size=VOCAB), None, "ids"),
        "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(num_hidden_layers=4, hidden_size=32,
                                                             num_attention_heads=4, vocab_size=VOCAB), None, "ids"),
        "bloom": (T.BloomConfig, T.BloomForCausalLM, dict(n_layer=4, hidden_size=32, n_head=4, vocab_size=VOCAB),
                  None, "ids"),
        "opt": (T.OPTConfig, T.OPTForCausalLM, dict(num_hidden_layers=4, hidden_size=32, ffn_dim=64,
                                                    num_attention_heads=4, word_embed_proj_dim=32, **lm), None, "ids"),
        "bert": (T.BertConfig, T.BertForMaskedLM, encoder, None, "ids"),
        "roberta": (T.RobertaConfig, T.RobertaForMaskedLM, encoder, None, "ids"),
        "electra": (T.ElectraConfig, T.ElectraForMaskedLM, dict(encoder, embedding_size=32), None, "ids"),
        "distilbert": (T.DistilBertConfig, T.DistilBertForMaskedLM, dict(n_layers=4, dim=32, n_heads=4, hidden_dim=64,
                                                                         **lm), None, "ids"),
        "t5": (T.T5Config, T.T5ForConditionalGeneration, dict(d_model=32, d_kv=8, d_ff=64, num_layers=4,
                                                              num_decoder_layers=4, num_heads=4, vocab_size=VOCAB,
                                                              decoder_start_token_id=0, pad_token_id=0),
               EncoderDecoder, "ids"),
        "bart": (T.BartConfig, T.BartForConditionalGeneration, seq2seq, EncoderDecoder, "ids"),
        "mbart": (T.MBartConfig, T.MBartForConditionalGeneration, seq2seq, EncoderDecoder, "ids"),
        "pegasus": (T.PegasusConfig, T.PegasusForConditionalGeneration, seq2seq, EncoderDecoder, "ids"),
        "vit": (T.ViTConfig, T.ViTForImageClassification, dict(vision, hidden_size=32, num_hidden_layers=4,
                                                               num_attention_heads=4, intermediate_size=64,
                                                               patch_size=4), ImageModel, "pixels"),
        "deit": (T.DeiTConfig, T.DeiTForImageClassification, dict(vision, hidden_size=32, num_hidden_layers=4,
                                                                  num_attention_heads=4, intermediate_size=64,
                                                                  patch_size=4), ImageModel, "pixels"),
        "swin": (T.SwinConfig, T.SwinForImageClassification, dict(vision, patch_size=2, embed_dim=16, depths=[2, 2],
                                                                  num_heads=[2, 2], window_size=2), ImageModel,
                 "pixels"),
        "convnext": (T.ConvNextConfig, T.ConvNextForImageClassification, dict(vision, num_stages=2,
                                                                              hidden_sizes=[8, 16], depths=[2, 2]),
                     ImageModel, "pixels"),
    }


def build(name: str) -> nn.Module:
    config_class, model_class, kwargs, wrapper, _ = zoo()[name]
    config = config_class(**kwargs, use_cache=False)
    config._attn_implementation = "eager"
    for key in NO_DROPOUT:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = model_class(config)
    return wrapper(model) if wrapper else model


def batches(name: str, batch: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    if zoo()[name][4] == "pixels":
        return [torch.randn(batch, 3, IMAGE, IMAGE, generator=generator) for _ in range(steps)]
    return [torch.randint(2, VOCAB, (batch, SEQ), generator=generator) for _ in range(steps)]


def loss_fn(output, inputs: torch.Tensor) -> torch.Tensor:
    logits = output.logits.float()
    if inputs.is_floating_point():
        return F.cross_entropy(logits, inputs[:, 0, 0, :logits.shape[-1]].argmax(-1))
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), inputs[:, 1:].reshape(-1))


def plan_for(name: str):
    """The pp=2 plan through the public path, or the reason none is offered."""
    import dataclasses

    from autopar.cluster import load_cluster
    from autopar.cost_models.facts import model_facts
    from autopar.errors import AutoparError
    from autopar.graph import trace
    from autopar.runtime.pipeline.schedule import pipeline_refusal
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.plan_builder import build_plan
    from autopar.searcher.search import search

    model = build(name)
    example = batches(name, 1, 1)[0].to("meta")
    graph = trace(model, (example,), loss_fn=loss_fn, name=name, seq_len=SEQ)
    facts = model_facts(graph, heads=4, kv_heads=4, vocab=VOCAB)
    capabilities = dataclasses.replace(capabilities_for(model), pipeline_refusal=pipeline_refusal(model, (example,)))
    cluster = load_cluster("dgx-h100", gpus=2)
    try:
        result = search(graph, facts, cluster, GLOBAL_BATCH, use_ilp=False, capabilities=capabilities,
                        fixed=dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2))
    except AutoparError as error:
        return None, str(error)
    return build_plan(result.best or result.ranked[0], graph, facts, cluster), None


def _worker(rank: int, port: int, name: str, plan_json: str, outdir: str) -> None:
    from autopar.plan_schema import Plan
    from autopar.runtime.collectives import CollectiveCounter, group_axes
    from autopar.runtime.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        parallel = parallelize(build(name), Plan.from_json(plan_json), loss_fn=loss_fn, seed=SEED)
        optimizer = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
        data = batches(name, GLOBAL_BATCH, STEPS)
        losses = [parallel.train_step(batch, optimizer, max_grad_norm=1.0) for batch in data[:-1]]
        with CollectiveCounter(group_axes(parallel)) as counter:
            losses.append(parallel.train_step(data[-1], optimizer, max_grad_norm=1.0))
        state = parallel.full_state_dict()
        torch.save({"losses": losses, "state": state, "collectives": counter.counts.as_rows(),
                    "pp_rank": parallel.layout.pp_rank}, Path(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def reference(name: str) -> tuple[list[float], dict]:
    model = copy.deepcopy(build(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in batches(name, GLOBAL_BATCH, STEPS):
        loss = loss_fn(model(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {key: value.detach() for key, value in model.named_parameters()}


def compare(plan, ranks: list[dict], losses: list[float], state: dict) -> str | None:
    """What differs from one process, or None."""
    from autopar.cost_models.collectives import merge_world

    for result in ranks:
        if not torch.allclose(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=0):
            return f"losses {result['losses']} vs {losses}"
        predicted = {(r.axis, r.kind): (r.calls, round(r.bytes)) for r in plan.predicted.collectives[result["pp_rank"]]}
        predicted = merge_world(predicted, {axis.name: axis.size for axis in plan.mesh})
        if result["collectives"] != {key: (calls, round(size)) for key, (calls, size) in predicted.items()}:
            return f"ledger {result['collectives']} vs predicted {predicted}"
    gathered = {key: value for result in ranks for key, value in result["state"].items()}
    if set(gathered) != set(state):
        return f"weights {sorted(set(gathered) ^ set(state))[:3]} missing or extra"
    for key, value in gathered.items():
        if not torch.allclose(value, state[key], rtol=1e-5, atol=1e-5):
            return f"weight {key} differs by {(value - state[key]).abs().max().item():.1e}"
    return None


def run(name: str) -> str:
    try:
        plan, refusal = plan_for(name)
    except Exception as error:  # noqa: BLE001 - a benchmark row, not a crash of the benchmark
        return f"FAILED (plan: {type(error).__name__}: {str(error).splitlines()[0][:160]})"
    if plan is None:
        return f"refused ({refusal[:160]})"
    with tempfile.TemporaryDirectory() as outdir:
        for attempt in range(3):  # another job on this machine may take the free port first
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            try:
                mp.start_processes(_worker, args=(port, name, plan.to_json(), outdir), nprocs=2, start_method="spawn")
                break
            except Exception as error:  # noqa: BLE001
                if "EADDRINUSE" in str(error) and attempt < 2:
                    continue
                lines = [line for line in str(error).splitlines() if line.strip()]
                return f"FAILED (run: {lines[-1][:160] if lines else type(error).__name__})"
        ranks = [torch.load(Path(outdir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    wrong = compare(plan, ranks, *reference(name))
    return "ok" if wrong is None else f"FAILED (parity: {wrong[:160]})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n] or list(zoo())
    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    counts: dict[str, int] = {}
    for name in names:
        start = time.time()
        status = run(name)
        counts[status.split()[0]] = counts.get(status.split()[0], 0) + 1
        print(f"{name:12s} {status}  ({time.time() - start:.0f} s)", flush=True)
    print(f"pp=2 with parity: {counts.get('ok', 0)}/{len(names)} ok, {counts.get('refused', 0)} refused, "
          f"{counts.get('FAILED', 0)} failed")
    return 0 if counts.get("FAILED", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
