"""NaN and infinite values are refused where they enter, naming the input, before any model runs on them.

Guards: NaN/inf in a LATENT, an IMAGE or a CONDITIONING, prompt weights such as ``(cat:nan)``, ``(cat:inf)`` or
``(cat:1e308)``, an embedding file holding NaN and a checkpoint (single file or diffusers folder) holding NaN
weights used to give black or NaN pictures with no error (only LoRA and upscaler files were checked).
"""
import pytest
import torch
from safetensors.torch import load_file, save_file

from leandiffusion.memory.finite import refuse_non_finite_input
from leandiffusion.memory.load import load_engine
from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode
from leandiffusion.sampling.prompt_encoder import PROMPT_CACHE
from leandiffusion.sampling.prompt_parser import parse_weights
from leandiffusion.tests.kit import save_diffusers_folder, save_ldm_checkpoint, tiny_components, tiny_engine
from leandiffusion.tests.upscale import helpers as upscale_helpers
from leandiffusion.upscale.loader import build_upscaler
from leandiffusion.upscale.runner import upscale_images

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def sd1():
    return tiny_engine("sd1")


def _args(engine, **overrides):
    args = dict(lean_model=engine, positive="a boat", negative="fog", seed=1, steps=1, cfg=5.0, eta=0.0, width=64,
                height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="none")
    args.update(overrides)
    return args


def _poisoned(shape, value, at=(0,)):
    t = torch.rand(shape)
    t.view(-1)[list(at)] = value
    return t


def test_the_check_counts_and_names():
    refuse_non_finite_input(torch.rand(3, 3), "x", "fix it")  # finite: nothing
    refuse_non_finite_input(torch.full((4,), 60000.0, dtype=torch.float16), "x", "fix it")  # the fp32 sum overflows
    with pytest.raises(ValueError, match=r"x: holds 2 NaN and 1 infinite values of 9; .*: fix it"):
        refuse_non_finite_input(torch.tensor([NAN, NAN, INF, 0, 0, 0, 0, 0, 0.0]).reshape(3, 3), "x", "fix it")


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_latent_with_non_finite_values_is_refused_by_name(sd1, opened_sessions, value):
    latent = {"samples": _poisoned((1, 4, 8, 8), value)}
    with pytest.raises(ValueError, match=r"latent_image: holds [01] NaN and [01] infinite values of 256"):
        LeanFusedDDIMSampler().run(**_args(sd1), latent_image=latent)
    assert opened_sessions == []
    with pytest.raises(ValueError, match=r"samples: holds [01] NaN and [01] infinite values"):
        LeanTiledVAEDecode().decode(latent, 0, 64, "exact", lean_model=sd1)


@pytest.mark.parametrize("value", [NAN, INF])
def test_an_image_with_non_finite_values_is_refused_by_name(sd1, value):
    image = _poisoned((1, 64, 64, 3), value)
    with pytest.raises(ValueError, match=r"pixels: holds [01] NaN and [01] infinite values"):
        LeanTiledVAEEncode().encode(image, 0, 64, "exact", lean_model=sd1)
    with pytest.raises(ValueError, match=r"image: holds [01] NaN and [01] infinite values"):
        upscale_images(build_upscaler(upscale_helpers.random_compact()), image, device="cpu", quiet=True)


@pytest.mark.parametrize("side", ["positive_cond", "negative_cond"])
def test_a_conditioning_with_nan_is_refused_by_name(sd1, opened_sessions, side):
    PROMPT_CACHE.clear()
    cond = [[_poisoned((1, 77, 64), NAN), {}]]
    with pytest.raises(ValueError, match=rf"{side}: holds 1 NaN and 0 infinite values"):
        LeanFusedDDIMSampler().run(**_args(sd1, **{side: cond}))
    assert opened_sessions == []


@pytest.mark.parametrize("text, shown", [("a (cat:nan) boat", "nan"), ("a (cat:inf) boat", "inf"),
                                         ("a (cat:1e308) boat", r"1e\+308"), ("(cat:-500)", "-500")])
def test_absurd_prompt_weights_are_refused(sd1, opened_sessions, text, shown):
    with pytest.raises(ValueError, match=rf"prompt: the weight of \(cat:.*\) is {shown}; a weight must be a finite"):
        parse_weights(text)
    PROMPT_CACHE.clear()
    with pytest.raises(ValueError, match=r"a weight must be a finite number within \+-100"):
        LeanFusedDDIMSampler().run(**_args(sd1, positive=text))
    assert opened_sessions == []
    assert parse_weights("(cat:1.5) (dog:-1) (x:100)") == [("cat", 1.5), (" ", 1.0), ("dog", -1.0), (" ", 1.0),
                                                           ("x", 100.0)]


def test_an_embedding_with_nan_is_refused_by_name(sd1, tmp_path, monkeypatch):
    (tmp_path / "embeddings").mkdir()
    save_file({"emb_params": _poisoned((2, 64), NAN)}, str(tmp_path / "embeddings" / "broken.safetensors"))
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    PROMPT_CACHE.clear()
    with pytest.raises(ValueError, match=r"embedding:broken.safetensors: holds 1 NaN .* use another embedding"):
        LeanFusedDDIMSampler().run(**_args(sd1, positive="a boat, embedding:broken"))


def _poison_file(path):
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if tensors[k].is_floating_point() and tensors[k].numel() > 1)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = NAN
    save_file(tensors, str(path))
    return key


def test_a_single_file_checkpoint_with_nan_weights_is_refused(tmp_path, monkeypatch):
    path = save_ldm_checkpoint(tiny_components("sd1"), tmp_path / "checkpoints" / "broken.safetensors")
    _poison_file(path)
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    with pytest.raises(ValueError, match=r"model='broken.safetensors' \(\w+\): 1 tensors hold NaN or infinite "
                                         r"values .* re-download the checkpoint"):
        load_engine("broken.safetensors", vram_policy="auto", device="cpu")


def test_a_diffusers_folder_with_nan_weights_is_refused(tmp_path, monkeypatch):
    folder = save_diffusers_folder(tiny_components("sd1"), tmp_path / "diffusers" / "broken")
    _poison_file(next((folder / "vae").glob("*.safetensors")))
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    with pytest.raises(ValueError, match=r"model='broken' \(vae\): 1 tensors hold NaN or infinite values"):
        load_engine("broken", vram_policy="auto", device="cpu")
