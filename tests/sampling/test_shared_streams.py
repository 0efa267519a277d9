"""One CUDA stream per (device, role) (``sampling/shared_streams.py``), checked on the CPU with a stand-in stream.

Guards (the only other test is a GPU test): the role is part of the key; ``cuda`` and ``cuda:<current>`` name one
device, so one stream; a second call returns the cached stream, not a new one; the stream is made on the device asked
for, not the current one.
"""
from __future__ import annotations

import pytest
import torch

from leandiffusion.sampling import shared_streams


class FakeStream:
    def __init__(self, device=None):
        self.device = device


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(shared_streams, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_one_stream_per_device_and_role(fake_cuda):
    first = shared_streams.shared_stream(torch.device("cuda", 1), "capture-warmup")
    assert shared_streams.shared_stream(torch.device("cuda", 1), "capture-warmup") is first
    assert shared_streams.shared_stream("cuda", "capture-warmup") is first  # "cuda" is the current device, 1
    assert shared_streams.shared_stream(torch.device("cuda", 1), "vae") is not first
    other = shared_streams.shared_stream(torch.device("cuda", 0), "capture-warmup")
    assert other is not first and other.device == torch.device("cuda", 0)
    assert first.device == torch.device("cuda", 1)
