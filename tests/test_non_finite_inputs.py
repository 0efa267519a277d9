"""NaN and infinite values are refused where they enter, naming the input, before any model runs on them.

Guards: NaN/inf in a LATENT, an IMAGE or a CONDITIONING, prompt weights such as ``(cat:nan)``, ``(cat:inf)`` or
``(cat:1e308)``, an embedding file holding NaN and a checkpoint (single file or diffusers folder) holding NaN
weights used to give black or NaN pictures with no error (only LoRA and upscaler files were checked).
"""
import pytest
import torch
from safetensors.torch import load_file, save_file

from leandiffusion.memory.finite import refuse_non_finite_input, refuse_non_finite_inputs
from leandiffusion.memory.load import load_engine
from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode
from leandiffusion.sampling.prompt_encoder import PROMPT_CACHE
from leandiffusion.sampling.prompt_parser import parse_weights
from leandiffusion.tests.kit import save_diffusers_folder, save_ldm_checkpoint, tiny_components, tiny_engine
from leandiffusion.tests.upscale import helpers as upscale_helpers
from leandiffusion.torchfile import any_non_finite
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_one_check_of_several_tensors_finds_a_bad_value_in_any_of_them(value, dtype):
    finite = [torch.rand(2, 4, 8, 8, dtype=dtype), torch.rand(2, 77, 16, dtype=dtype), torch.rand(2, 12)]
    assert not any_non_finite(finite)
    for i in range(len(finite)):
        tensors = [t.clone() for t in finite]
        tensors[i].view(-1)[5] = value
        assert any_non_finite(tensors), f"{value} in tensor {i} ({dtype}) was missed"
    huge = torch.full((4,), 3e38)  # finite, but its fp32 sum overflows: decided exactly, not refused
    assert not any_non_finite([huge, torch.full((3,), 6e4, dtype=torch.float16)])
    assert any_non_finite([torch.tensor([1 + 1j, complex(0, INF)])])
    assert not any_non_finite([torch.arange(4), torch.ones(3, dtype=torch.bool), torch.empty(0), torch.tensor([1j])])


def test_the_finite_case_is_one_reduction_per_tensor_and_no_read_back_per_tensor():
    """The GPU cost of the checks (measured by ``bench/suite_finite.py``): in the finite case each tensor costs one
    fp32 ``sum`` and the tensors share one read-back (``stack`` + ``tolist``); no ``isfinite`` mask is written and
    no per-tensor ``item()``/``bool()`` (a host sync each on a GPU) runs. Before, every tensor had its own sync: a
    CONDITIONING and its ``pooled_output`` two."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cond, pooled = torch.rand(2, 77, 64, dtype=torch.float16), torch.rand(2, 32, dtype=torch.float16)
    with Ops() as ops:
        refuse_non_finite_inputs([("positive_cond", cond), ("positive_cond (pooled_output)", pooled)], "fix it")
    assert ops.names.count("sum") == 2, ops.names
    assert not {"isfinite", "_local_scalar_dense", "isnan", "isinf"} & set(ops.names), ops.names
    with pytest.raises(ValueError, match=r"positive_cond \(pooled_output\): holds 1 NaN and 0 infinite values of 64"):
        refuse_non_finite_inputs([("positive_cond", cond), ("positive_cond (pooled_output)", _poisoned((2, 32), NAN))],
                                 "fix it")


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
