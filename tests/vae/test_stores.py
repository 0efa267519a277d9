"""``vae/stores.py``: what a band read from a store is, and the device bytes a store reports.

Guards (beyond the exact executor's tests, which use the stores only inside a decode):
- a band read from a ``HostStore`` is its own copy, as on CUDA where it is uploaded to device memory: a later write
  into the store does not change a band already read (on the CPU the read must not be a view of the store);
- ``nbytes`` is the device memory a store holds, which ``exact.run_exact`` subtracts from the budget before
  sizing a stage's bands: a ``DeviceStore`` its whole ``[H, W, C]`` tensor in bytes (not elements), a
  ``HostStore`` none (its host tensor must not count against the VRAM budget).
"""
import pytest
import torch

from leandiffusion.vae.stores import DeviceStore, HostStore, Streams

CPU = torch.device("cpu")


def _image(h=6, w=5, c=3):
    return torch.arange(h * w * c, dtype=torch.float32).reshape(1, c, h, w)


def test_a_band_read_from_a_host_store_is_a_snapshot():
    store = HostStore(6, 5, 3, torch.float32, CPU, Streams(CPU))
    x = _image()
    store.put(0, x)
    store.finish()
    band = store.prefetch(1, 4).wait()
    assert torch.equal(band, x[:, :, 1:4])
    store.put(0, torch.zeros_like(x))
    assert torch.equal(band, x[:, :, 1:4])  # the band read before the write is unchanged
    assert torch.equal(store.host_tensor(), torch.zeros(6, 5, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_stores_report_the_device_bytes_they_hold(dtype):
    h, w, c = 7, 5, 3
    on_device = DeviceStore(h, w, c, dtype, CPU, Streams(CPU))
    on_host = HostStore(h, w, c, dtype, CPU, Streams(CPU))
    assert on_device.nbytes == h * w * c * torch.finfo(dtype).bits // 8
    assert on_host.nbytes == 0
    x = _image(h, w, c).to(dtype)
    on_device.put(0, x)
    assert torch.equal(on_device.prefetch(0, h).wait(), x)
    assert torch.equal(on_device.host_tensor(), x[0].permute(1, 2, 0))
