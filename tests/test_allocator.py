"""The runtime's CUDA allocator setting (`runtime/allocator.py`): expandable segments on a CUDA
device unless the user configured the allocator; nothing on the CPU."""

from __future__ import annotations

import pytest
import torch

import autopar.runtime.allocator as allocator


@pytest.fixture
def setter(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in allocator.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_expandable_segments_on_a_cuda_device(setter):
    assert allocator.configure_allocator(torch.device("cuda", 0)) == "expandable segments"
    assert setter == ["expandable_segments:True"]


def test_a_users_setting_is_left_alone(setter, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert allocator.configure_allocator(torch.device("cuda")) == \
        "as the user set it (PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512)" + allocator.PRICED_FOR
    assert setter == []
    # a setting that keeps expandable segments runs what the plan priced: nothing to add
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    assert allocator.configure_allocator(torch.device("cuda")) == \
        "as the user set it (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:512)"


def test_nothing_on_the_cpu_and_a_refusal_is_reported(setter, monkeypatch):
    assert allocator.configure_allocator(torch.device("cpu")) == "not applied (not a CUDA device)"
    assert setter == []

    def refuse(_setting):
        raise RuntimeError("expandable_segments not supported on this platform\nmore")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    assert allocator.configure_allocator(torch.device("cuda")) == \
        "default (expandable segments unavailable: expandable_segments not supported on this platform)" \
        + allocator.PRICED_FOR


def test_which_notes_mean_expandable_segments_were_on(setter, monkeypatch):
    """`expandable_in_effect` reads a run's note as `gpu_rows.py` needs it: what the memory model priced."""
    on = allocator.configure_allocator(torch.device("cuda"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    kept = allocator.configure_allocator(torch.device("cuda"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    dropped = allocator.configure_allocator(torch.device("cuda"))
    assert [allocator.expandable_in_effect(note) for note in (on, kept, dropped)] == [True, True, False]
    assert not allocator.expandable_in_effect("")  # files before the runtime set them
    assert not allocator.expandable_in_effect("default (expandable segments unavailable: no)" + allocator.PRICED_FOR)
