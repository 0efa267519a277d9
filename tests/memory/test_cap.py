"""``memory.cap.allocator_cap``: the allocator cap is set for the block only and restored, also after an error; on
the CPU it does nothing. The GPU test checks PyTorch's behaviour the module relies on: cached blocks are returned
before the process would hold more than the cap, and only live tensors over the cap raise out-of-memory."""
import pytest
import torch

from leandiffusion.memory import cap as cap_mod
from leandiffusion.memory.cap import allocator_cap, device_storage_bytes, release_library_workspaces

GiB = 2 ** 30


def test_storage_bytes_count_each_storage_once():
    lin = torch.nn.Linear(4, 4)  # weight 64 B + bias 16 B (fp32)
    tied = torch.nn.Linear(4, 4)
    tied.weight = lin.weight  # shares lin's storage
    arena = torch.empty(100, dtype=torch.uint8)
    views = (arena[:10], arena[50:])
    assert device_storage_bytes([lin], [], torch.device("cpu")) == 80
    assert device_storage_bytes([lin, tied, None], [*views, None], torch.device("cpu")) == 80 + 16 + 100
    assert device_storage_bytes([lin], [arena], torch.device("cuda", 0)) == 0  # nothing of it on that device


def test_nothing_to_release_on_the_cpu():
    assert release_library_workspaces(torch.device("cpu")) is False


def test_cpu_is_never_capped():
    with allocator_cap(torch.device("cpu"), 1) as capped:
        assert capped is False


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"fraction": 0.75, "calls": []}
    monkeypatch.setattr(cap_mod, "_capped", lambda device: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: state["fraction"], raising=False)

    def set_fraction(fraction, index):
        state["calls"].append(fraction)
        state["fraction"] = fraction

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    return state


def test_cap_is_set_and_restored(fake_cuda):
    with allocator_cap(torch.device("cuda", 0), 4 * GiB) as capped:
        assert capped is True
        assert fake_cuda["fraction"] == pytest.approx(4 / 80)
    assert fake_cuda["fraction"] == 0.75


def test_cap_is_restored_after_an_error(fake_cuda):
    with pytest.raises(RuntimeError, match="boom"):
        with allocator_cap(torch.device("cuda", 0), 4 * GiB):
            raise RuntimeError("boom")
    assert fake_cuda["fraction"] == 0.75


def test_cap_never_loosens_a_tighter_one(fake_cuda):
    fake_cuda["fraction"] = 0.01
    with allocator_cap(torch.device("cuda", 0), 4 * GiB):
        assert fake_cuda["fraction"] == 0.01
    with allocator_cap(torch.device("cuda", 0), 1 << 62):  # "no budget": at most the whole device
        assert fake_cuda["fraction"] == 0.01


@pytest.mark.gpu
def test_cached_blocks_go_back_before_the_cap_is_passed():
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(dev)
    limit = base + 1 * GiB
    with allocator_cap(dev, limit) as capped:
        assert capped
        a = torch.empty(600 * 2 ** 20, dtype=torch.uint8, device=dev)
        del a  # stays cached: reserved 600 MiB, allocated 0
        b = torch.empty(700 * 2 ** 20, dtype=torch.uint8, device=dev)  # does not fit beside the cached 600 MiB
        assert torch.cuda.memory_reserved(dev) <= limit
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(600 * 2 ** 20, dtype=torch.uint8, device=dev)  # live 700 + 600 MiB > 1 GiB
        del b
    c = torch.empty(1300 * 2 ** 20, dtype=torch.uint8, device=dev)  # the cap is gone
    del c
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_cublas_workspaces_of_other_streams_are_released():
    dev = torch.device("cuda")
    a = torch.randn(256, 256, device=dev, dtype=torch.float16)
    torch.cuda.synchronize(dev)
    release_library_workspaces(dev)
    base = torch.cuda.memory_allocated(dev)
    for _ in range(3):  # each new stream that runs a GEMM gets a workspace of its own
        s = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(s):
            a @ a
    torch.cuda.synchronize(dev)
    grown = torch.cuda.memory_allocated(dev)
    assert grown > base  # what the module releases: cuBLAS's workspaces are allocated memory
    assert release_library_workspaces(dev) is True
    assert torch.cuda.memory_allocated(dev) == base
