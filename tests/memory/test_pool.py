"""Buffer pool: keyed by role/shape/dtype, address-stable, and a repeated run allocates nothing new.

Guards the promise "in steady state a repeated run allocates no new device memory" at the pool level
(CPU here; the GPU test in test_gpu_stream.py checks torch's allocator counters too).
"""
import pytest
import torch

from leandiffusion.memory.pool import BufferPool


def _run(pool, batch=2):
    lat = pool.get("latents", (batch, 4, 8, 8))
    noise = pool.get("noise", (batch, 4, 8, 8))
    ctx = pool.get("context", (2 * batch, 77, 64), torch.float16)
    lat.copy_(torch.ones_like(lat))
    noise.normal_()
    return lat.data_ptr(), noise.data_ptr(), ctx.data_ptr()


def test_second_run_allocates_nothing_and_keeps_addresses():
    pool = BufferPool("cpu")
    first = _run(pool)
    stats = pool.stats()
    second = _run(pool)
    assert first == second
    assert pool.stats().allocations == stats.allocations == 3
    assert pool.stats().hits == 3


def test_keys_separate_role_shape_and_dtype():
    pool = BufferPool("cpu")
    a = pool.get("latents", (1, 4, 8, 8))
    assert pool.get("latents", (2, 4, 8, 8)) is not a
    assert pool.get("latents", (1, 4, 8, 8), torch.float16) is not a
    assert pool.get("noise", (1, 4, 8, 8)) is not a
    assert pool.get("latents", (1, 4, 8, 8)) is a


def test_zero_like_trim_release():
    pool = BufferPool("cpu")
    src = torch.arange(6.0).reshape(2, 3)
    buf = pool.like("emb", src)
    assert torch.equal(buf, src) and pool.get("emb", (2, 3), zero=True).abs().sum() == 0
    pool.trim(["emb"])
    assert pool.stats().buffers == 0
    pool.get("x", (1,))
    pool.release()
    assert pool.stats().buffers == 0 and pool.stats().bytes == 0


@pytest.mark.parametrize("args,err", [(("", (1,)), ValueError), (("r", (-1,)), ValueError),
                                      (("r", (1,), "fp16"), TypeError)])
def test_bad_arguments(args, err):
    with pytest.raises(err):
        BufferPool("cpu").get(*args)


def test_each_role_keeps_a_bounded_number_of_shapes():
    """Unbounded growth: every distinct shape (image size, batch, prompt length) used to stay allocated forever."""
    pool = BufferPool("cpu", max_per_role=2)
    held = [pool.get("latents", (b, 4, 8, 8)) for b in range(1, 11)]
    noise = pool.get("noise", (1, 4, 8, 8))
    assert pool.stats().buffers == 3
    assert pool.get("latents", (10, 4, 8, 8)) is held[-1] and pool.get("noise", (1, 4, 8, 8)) is noise
    assert pool.get("latents", (9, 4, 8, 8)) is held[-2]
    again = pool.get("latents", (1, 4, 8, 8))  # evicted long ago: a new buffer; the old one stays valid for its holder
    assert again is not held[0] and held[0].shape == (1, 4, 8, 8)
    assert pool.get("latents", (9, 4, 8, 8)) is held[-2]  # the most recently used shapes stay
    assert pool.stats().buffers == 3
    default = BufferPool("cpu")
    for b in range(1, 50):
        default.get("latents", (b,))
    assert default.stats().buffers == default.max_per_role
    with pytest.raises(ValueError, match="max_per_role"):
        BufferPool("cpu", max_per_role=0)
