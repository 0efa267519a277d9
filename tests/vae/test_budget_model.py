"""The exact tiler's memory count holds its budget on the full-size SD / SDXL VAE (the two share the architecture),
in fp16 and fp32, decode and encode, checked without a GPU.

The bug it guards: README "Known limits" (session 14) had `exact` decode in fp32 at 2048 px peak at 1.53 GB with a
1.0 GiB budget. Two parts of that were countable on the CPU: the mid-block attention was not budgeted at all (its
input, output, normalised input, q, k, v and attention output held at once: 0.88 GiB at 2048 px in fp32, 3.5 GiB at
4096 px, whatever the budget), and the band estimate was a formula (3 x the largest value + input + head) that
matched no dtype, with the stages' stores planned around it. The run here is on the ``meta`` device with
``LiveBytes`` counting every tensor the executor allocates (``live_bytes.py``), so a budget overrun in the tensor
count fails here; kernel workspaces and copies in flight on side streams are the GPU diagnostic's part
(scripts/diag/vae_budget_fp32.py).
"""
import pytest
import torch

from leandiffusion.bench.models import SD_VAE
from leandiffusion.tests.vae.live_bytes import LiveBytes
from leandiffusion.vae import attention
from leandiffusion.vae.exact import BandCost, attention_band_bytes, band_bytes
from leandiffusion.vae.program import Op, Stage
from leandiffusion.vae.targets import from_module
from leandiffusion.vae.tiled import tiled_decode, tiled_encode

GiB = 2 ** 30


@pytest.fixture(scope="module")
def meta_vae():
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        return AutoencoderKL(**SD_VAE).eval().requires_grad_(False)


def _o_n_attention(q, k, v, tf32=False):
    """What CUDA runs for the VAE's attention (PyTorch's memory-efficient kernel, O(N)): the output only. The CPU
    fallback's chunked score matrices are not what a CUDA budget has to hold."""
    return torch.empty_like(q)


@pytest.mark.parametrize("kind,dtype,size,budget_gib", [
    ("decode", torch.float32, 2048, 0.75),  # old code: 0.88 GiB (attention)
    ("decode", torch.float32, 4096, 3.0),  # old code: 3.50 GiB (attention)
    ("decode", torch.float16, 4096, 1.0),  # old code: 1.75 GiB (attention)
    ("decode", torch.float16, 2048, 0.75),
    ("decode", torch.float32, 1024, 1.0),
    ("encode", torch.float32, 2048, 0.75),  # old code: 0.88 GiB (attention)
    ("encode", torch.float16, 1024, 0.75),
])
def test_exact_tensors_stay_within_the_budget(meta_vae, monkeypatch, kind, dtype, size, budget_gib):
    """Every tensor the exact tiler holds at once (stores, band work, attention keys and values) fits the
    activation budget, and the bands use most of it (little waste: >= 85%)."""
    monkeypatch.setattr(attention, "_sdpa", _o_n_attention)
    vae = meta_vae.to(dtype)
    target = from_module(vae, "meta", dtype)
    budget = int(budget_gib * GiB)
    live = LiveBytes("meta", exclude=list(vae.parameters()) + list(vae.buffers()))
    with live:
        if kind == "decode":
            tiled_decode(target, torch.zeros(1, 4, size // 8, size // 8), 0, 64, "exact", budget_bytes=budget,
                         quiet=True)
        else:
            tiled_encode(target, torch.zeros(1, size, size, 3), 0, 64, "exact", budget_bytes=budget, quiet=True)
    assert live.peak <= budget, f"{live.peak / GiB:.3f} GiB held at {live.peak_op} > budget {budget_gib} GiB"
    assert live.peak >= 0.85 * budget, f"{live.peak / GiB:.3f} GiB: the count wastes the {budget_gib} GiB budget"


def test_copies_in_flight_are_counted():
    """With side copy streams the previous band's upload and download are still allocated while a band computes
    (``_BandWaits`` bounds them to one band): the count adds exactly their bytes."""
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    stage = Stage("chain", [Op("conv3", conv)], name="c")
    shapes = stage.shapes(8, 40, 10)
    need = [(4, 16), (5, 15)]
    base = BandCost(eb=4, in_eb=4, in_on_device=False, out_eb=4)
    flight = BandCost(eb=4, in_eb=4, in_on_device=False, out_eb=4, in_flight=True)
    upload, download = 8 * 12 * 10 * 4, 16 * 10 * 10 * 4
    assert band_bytes(stage, shapes, 1, need, flight) == band_bytes(stage, shapes, 1, need, base) + upload + download


@pytest.mark.parametrize("eb", [2, 4])
def test_attention_count_holds_whole_map_keys_and_values(eb):
    """The attention's keys and values cover the whole map whatever the band; the rest scales with the band."""
    cost = BandCost(eb=eb, in_eb=eb, in_on_device=True)
    one, two = (attention_band_bytes(512, 256, 256, rows, cost) for rows in (1, 2))
    kv = 2 * 512 * 256 * 256 * eb
    per_row = two - one
    assert one - per_row == kv + 2 ** 20  # + SMALL_TENSORS
    assert per_row == 512 * 256 * (3 * eb + (4 if eb < 4 else 0))
