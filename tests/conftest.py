"""Shared fixtures: the tiny zoo models the tests trace, each traced once per session."""

from __future__ import annotations

import functools

import pytest

import autopar
from autopar.cost_models.facts import model_facts
from autopar.models import build_model

GPT_512 = "layers=8,hidden=512,heads=8,vocab=4096,seq_len=256"  # the cost-model and search tests' GPT
GPT_256 = "layers=2,hidden=256,heads=8,vocab=1000,seq_len=128"  # one layer type for the intra-op ILP
TINY_GPT = "layers=4,hidden=32,heads=4,vocab=96,seq_len=16"  # what parity tests train
TINY_LLAMA = "layers=4,hidden=32,heads=4,kv_heads=2,vocab=96,seq_len=16"


@functools.cache
def traced_zoo(family: str, config: str, batch: int = 2, precision: str = "bf16", name: str | None = None):
    """(spec, graph, facts) of a zoo model traced at `batch` (cached: tests must not modify them)."""
    spec = build_model(family, config)
    graph = autopar.trace(spec.module, spec.example_inputs(batch), loss_fn=spec.loss_fn, precision=precision,
                          name=name)
    c = spec.config
    return spec, graph, model_facts(graph, heads=c.heads, kv_heads=c.num_kv_heads, vocab=c.padded_vocab)


@pytest.fixture(scope="session", autouse=True)
def probe_cache_of_the_session(tmp_path_factory):
    """`autopar plan` keeps its probes' answers (`autopar.probe_cache`) in a folder of this session,
    not the user's cache: CLI tests, in this process or a subprocess, never read a stale one."""
    import os

    folder = tmp_path_factory.mktemp("probes")
    previous = os.environ.get("AUTOPAR_PROBE_CACHE")
    os.environ["AUTOPAR_PROBE_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("AUTOPAR_PROBE_CACHE", None)
    else:
        os.environ["AUTOPAR_PROBE_CACHE"] = previous


@pytest.fixture(scope="session")
def zoo_trace():
    """`traced_zoo` for tests that trace their own configuration."""
    return traced_zoo


@pytest.fixture(scope="session")
def gpt_512():
    """(graph, facts) of an 8-layer GPT, hidden 512, bf16, batch 2."""
    _, graph, facts = traced_zoo("gpt", GPT_512)
    return graph, facts


@pytest.fixture(scope="session")
def gpt_256():
    """(spec, graph, facts) of a 2-layer GPT, hidden 256, bf16, batch 2."""
    return traced_zoo("gpt", GPT_256)


@pytest.fixture(scope="session")
def tiny_gpt_fp32():
    """(graph, facts) of the parity tests' 4-layer GPT, fp32, batch 2."""
    _, graph, facts = traced_zoo("gpt", TINY_GPT, precision="fp32")
    return graph, facts


@pytest.fixture(scope="session")
def tiny_llama_fp32():
    _, graph, facts = traced_zoo("llama", TINY_LLAMA, precision="fp32")
    return graph, facts


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread (as the gloo workers run) is ~100x faster on a busy 2-core
    machine. Modules whose tests build tiny plans in this process use it (`pytestmark`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_process_group(monkeypatch):
    """A gloo process group of one process, for `parallelize` in the test's own process."""
    import torch.distributed as dist

    from parity_harness import _free_port

    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                            LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
