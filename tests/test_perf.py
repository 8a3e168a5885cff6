"""Performance metrics (common/run/perf.py) by hand."""

import pytest
import torch

from common.run.perf import TrainingMemoryPeak, flop_weighted_params, mfu


def test_training_memory_peak_by_hand(monkeypatch):
    """50 GB in use when training starts (a sleeping engine's leftovers, the trainer's 30 GB reserved), PyTorch's
    reserved memory peaks at 60 GB: the device peaked at 80 GB, whatever PyTorch's counters say of vLLM's pool."""
    state = {"free": 90e9, "reserved": 30e9, "max_reserved": 120e9}  # 120: a sleeping pool, counted but unmapped
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], 140e9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: state["max_reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device: state.update(max_reserved=state["reserved"]))
    memory = TrainingMemoryPeak(torch.device("cuda"))
    state.update(max_reserved=60e9, reserved=35e9, free=85e9)  # grew to 60, then freed down to 35
    assert memory.peak() == pytest.approx(80e9)


def test_mfu_by_hand():
    # 6 x 1e9 params x 1e4 tokens in 0.5 s = 1.2e14 FLOP/s, over a 1e15 peak.
    assert mfu(10**9, 1e4, 0.5, 1e15) == pytest.approx(0.12)
    # The same tokens over 4 GPUs in the same time: a quarter of the utilisation (the peak is per GPU).
    assert mfu(10**9, 1e4, 0.5, 1e15, num_gpus=4) == pytest.approx(0.03)
    assert mfu(10**9, 1e4, 0.5, None) is None


def test_flop_weighted_parameters_by_hand():
    """A frozen parameter costs 4 FLOPs per token (forward, input gradient) of a trained one's 6."""
    full = torch.nn.Linear(10, 10, bias=False)  # 100 trained
    frozen = torch.nn.Linear(6, 10, bias=False).requires_grad_(False)  # 60 frozen
    assert flop_weighted_params([full, frozen]) == (100, 100 + 60 * 4 / 6)
