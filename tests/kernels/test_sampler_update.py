"""The fused sampler updates (``kernels/sampler_update.py``) equal their plain-torch reference bit for bit, and the
samplers that use them (euler, euler_ancestral, dpmpp_2m, res_multistep) give the same bits on the fused path as on
the plain one.

Runs the Triton kernel on CPU tensors under ``TRITON_INTERPRET=1`` (forced with ``LEANDIFFUSION_SAMPLER_UPDATE=
triton``); the ``gpu`` tests repeat it on the device against the reference with device scalars, where an FMA
contraction or an approximate division would show as differing bits. Guards: each update form (Euler, with ancestral
noise, multistep with and without the previous estimate), a tail block, every operand in its place, negative and
tiny scalars, the dispatcher (the reference on the CPU, for device scalars, for mismatched tensors; the environment
override checked), whole sampler runs on both paths.
"""
import os

import pytest
import torch

from leandiffusion.kernels import sampler_update as su
from leandiffusion.sampling.ksampler.registry import sampler_spec
from leandiffusion.tests.sampling.ksampler.gaussian_toy import ideal_denoiser

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or su.triton is None,
                               reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
SHAPE = (2, 4, 37, 29)  # 8584 elements: several blocks and a tail
EPS_SAMPLING = type("EpsSampling", (), {"is_flow": False})()


def _tensors(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(SHAPE, generator=g) * 7).to(device) for _ in range(4)]


def _scalars(*values, device="cpu"):
    return [torch.tensor(v, dtype=torch.float32, device=device) for v in values]


CASES = [  # (form, scalars): sigma-like, dt-like, up; multistep ratios, negated products, tiny and large values
    ("euler", (14.61, -3.2)), ("euler", (0.0292, -0.0211)), ("noise", (2.7, -1.5, 0.83)),
    ("multistep", (0.62, 0.38, 1.71, -0.71)), ("first", (0.9, 0.1)), ("multistep", (1.0, 3e-4, -2.5e3, 7.0)),
]


def _run(form, scalars, x, d, o, n, dispatch=True):
    update = {"euler": (su.euler, su.euler_reference), "noise": (su.euler, su.euler_reference),
              "multistep": (su.multistep, su.multistep_reference), "first": (su.multistep, su.multistep_reference)}
    fn = update[form][0 if dispatch else 1]
    if form == "euler":
        return fn(x, d, *scalars)
    if form == "noise":
        return fn(x, d, scalars[0], scalars[1], n, 0.6, scalars[2])
    if form == "first":
        return fn(x, d, *scalars)
    return fn(x, d, *scalars, old=o)


@interpret
@pytest.mark.parametrize("form,values", CASES)
def test_kernel_equals_the_reference_bit_for_bit(form, values, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_SAMPLER_UPDATE", "triton")
    x, d, o, n = _tensors()
    launched = []
    real = su._launch
    monkeypatch.setattr(su, "_launch", lambda *a, **k: launched.append(1) or real(*a, **k))
    got = _run(form, _scalars(*values), x, d, o, n)
    want = _run(form, _scalars(*values), x, d, o, n, dispatch=False)
    assert launched and torch.equal(got, want)
    # every operand matters: a changed one changes the result
    for i, t in enumerate((x, d, o, n)):
        if (form in ("euler", "first") and i >= 2) or (form == "noise" and i == 2) or (form == "multistep" and i == 3):
            continue
        moved = [u.clone() for u in (x, d, o, n)]
        moved[i][0, 0, 0, 0] += 1.0
        assert not torch.equal(_run(form, _scalars(*values), *moved), got), (form, i)


def test_the_reference_is_comfyuis_op_sequence():
    x, d, o, n = _tensors()
    sigma, dt, up = _scalars(3.0, -1.25, 0.5)
    assert torch.equal(su.euler_reference(x, d, sigma, dt), x + (x - d) / sigma * dt)
    assert torch.equal(su.euler_reference(x, d, sigma, dt, n, 0.6, up), (x + (x - d) / sigma * dt) + n * 0.6 * up)
    a, b, c, e = _scalars(0.6, 0.4, 1.7, 0.7)
    assert torch.equal(su.multistep_reference(x, d, a, -b, c, -e, o), a * x - b * (c * d - e * o))


def test_dispatcher_takes_the_reference_on_the_cpu_and_for_device_scalars(monkeypatch):
    monkeypatch.setattr(su, "_launch", lambda *a, **k: pytest.fail("kernel taken"))
    x, d, o, n = _tensors()
    assert not su.fused_for(x)
    assert torch.equal(su.euler(x, d, 2.0, -1.0), su.euler_reference(x, d, 2.0, -1.0))
    monkeypatch.setenv("LEANDIFFUSION_SAMPLER_UPDATE", "triton")
    assert su._host_float(torch.tensor(2.0).to("meta")) is None  # a device scalar would need a sync: reference
    monkeypatch.setenv("LEANDIFFUSION_SAMPLER_UPDATE", "fastest")
    with pytest.raises(ValueError, match="LEANDIFFUSION_SAMPLER_UPDATE"):
        su.fused_for(x)


@interpret
def test_mismatched_tensors_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_SAMPLER_UPDATE", "triton")
    x, d, _, _ = _tensors()
    with pytest.raises(ValueError, match="sampler update: every tensor must be contiguous"):
        su.euler(x, d.double(), 2.0, -1.0)


@interpret
@pytest.mark.parametrize("name", ["euler", "euler_ancestral", "dpmpp_2m", "res_multistep", "ddim"])
def test_samplers_give_the_same_bits_on_the_fused_path(name, monkeypatch):
    sigmas = torch.tensor([14.6146, 6.1, 2.7, 1.2, 0.45, 0.12, 0.0292, 0.0])
    x = torch.randn(2, 4, 9, 7, generator=torch.Generator().manual_seed(3)) * 14.6146

    def run(impl):
        monkeypatch.setenv("LEANDIFFUSION_SAMPLER_UPDATE", impl)
        g = torch.Generator().manual_seed(11)
        noise = (lambda sigma, sigma_next: torch.randn(x.shape, generator=g))
        return sampler_spec(name).fn(ideal_denoiser(False), x.clone(), sigmas, sampling=EPS_SAMPLING,
                                     noise_sampler=noise)

    assert torch.equal(run("triton"), run("reference"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form,values", CASES)
def test_gpu_kernel_equals_the_plain_device_ops_bit_for_bit(form, values):
    x, d, o, n = _tensors("cuda")
    assert su.fused_for(x)
    got = _run(form, _scalars(*values), x, d, o, n)  # host scalars: the kernel
    want = _run(form, _scalars(*values, device="cuda"), x, d, o, n)  # device scalars: PyTorch's own kernels
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["euler", "euler_ancestral", "dpmpp_2m", "res_multistep"])
def test_gpu_samplers_on_the_fused_path_match_the_device_scalars(name, monkeypatch):
    sigmas = torch.tensor([14.6146, 6.1, 2.7, 1.2, 0.45, 0.12, 0.0292, 0.0], device="cuda")
    x = torch.randn(2, 4, 64, 64, generator=torch.Generator().manual_seed(3)).cuda() * 14.6146

    def run(impl):
        monkeypatch.setenv("LEANDIFFUSION_SAMPLER_UPDATE", impl)
        g = torch.Generator("cuda").manual_seed(11)
        noise = (lambda sigma, sigma_next: torch.randn(x.shape, generator=g, device="cuda"))
        return sampler_spec(name).fn(ideal_denoiser(False), x.clone(), sigmas, sampling=EPS_SAMPLING,
                                     noise_sampler=noise)

    fused, plain = run("auto"), run("reference")
    # the scalars' log / exp on the host and on the device may differ in their last bit
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
