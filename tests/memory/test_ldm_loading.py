"""Single-file LDM checkpoints and diffusers folders load into modules equal to the diffusers-built reference.

Guards the promise "loading the test kit's checkpoints in both layouts gives modules whose outputs
match a diffusers-loaded reference (fp32, <= 1e-5)": the kit writes the LDM layout with its own independent key
mapping, the loader converts back with diffusers' converters and shape-inferred configs. Comparing *outputs* (not
just weights) also catches wrong inferred configs (head counts, projection style, time embedding sizes).
"""
import pytest
import torch

from leandiffusion.memory.folders import load_diffusers_folder
from leandiffusion.memory.ldm import load_ldm_checkpoint
from leandiffusion.tests.kit import save_diffusers_folder, save_ldm_checkpoint, tiny_components

TOL = 1e-5
FAMILIES = ["sd1", "sd2", "sd2-v", "sdxl"]


def _unet_out(unet, family, gen_seed=3):
    g = torch.Generator().manual_seed(gen_seed)
    cfg = unet.config
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 77, cfg.cross_attention_dim, generator=g)
    kw = {}
    if cfg.addition_embed_type == "text_time":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(2, pooled, generator=g),
                                   "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}
    with torch.no_grad():
        return unet(x, torch.tensor(321), encoder_hidden_states=ctx, **kw).sample


def _text_out(te, ids):
    with torch.no_grad():
        out = te(ids, output_hidden_states=True)
    extra = [out.text_embeds] if hasattr(out, "text_embeds") else [out.pooler_output]
    return [out.last_hidden_state, out.hidden_states[-2]] + extra


def _vae_out(vae):
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        img = torch.rand(1, 3, 32, 32, generator=g) * 2 - 1
        return [vae.encode(img).latent_dist.mean, vae.decode(torch.randn(1, 4, 4, 4, generator=g)).sample]


def _assert_close(a, b, what):
    diff = (a - b).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff}"


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tmp_path_factory):
    family = request.param
    ref = tiny_components(family)
    root = tmp_path_factory.mktemp(family)
    single = load_ldm_checkpoint(save_ldm_checkpoint(ref, root / "file" / "tiny.safetensors"))
    folder = load_diffusers_folder(save_diffusers_folder(tiny_components(family), root / "folder"))
    return family, ref, single, folder


@pytest.mark.parametrize("layout", ["single", "folder"])
def test_outputs_match_reference(loaded, layout):
    family, ref, single, folder = loaded
    got = single if layout == "single" else folder
    assert got["family"] == family
    assert got["scheduler_config"]["prediction_type"] == ref["scheduler_config"]["prediction_type"]
    _assert_close(_unet_out(got["unet"], family), _unet_out(ref["unet"], family), f"{family} {layout} unet")
    for a, b in zip(_vae_out(got["vae"]), _vae_out(ref["vae"])):
        _assert_close(a, b, f"{family} {layout} vae")
    ids = ref["tokenizer"](["a photo of a cat", "x"], padding="max_length", max_length=77,
                           return_tensors="pt").input_ids
    for key in ("text_encoder", "text_encoder_2"):
        if key in ref:
            for a, b in zip(_text_out(got[key], ids), _text_out(ref[key], ids)):
                _assert_close(a, b, f"{family} {layout} {key}")
    assert ("text_encoder_2" in got) == (family == "sdxl")


def test_single_file_tokenizers_follow_family_conventions(loaded):
    family, ref, single, _ = loaded
    if family == "sdxl":
        assert single["tokenizer"].pad_token == "<|endoftext|>" and single["tokenizer_2"].pad_token == "!"
    elif family in ("sd2", "sd2-v"):
        assert single["tokenizer"].pad_token == "!"  # OpenCLIP pads with token 0, as diffusers' SD2 tokenizer
    else:
        assert single["tokenizer"].pad_token == "<|endoftext|>"
    ids = single["tokenizer"](["a cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    assert ids.shape == (1, 77) and ids[0, 0].item() == 512


# The VAE latent scale of each family's published VAE config (SD1.x / SD2.x 0.18215, SDXL 0.13025): the engine
# scales latents by it (``ModelParts.vae_scaling_factor``), and the VAE's outputs do not depend on it.
PUBLISHED_VAE_SCALING = {"sd1": 0.18215, "sd2": 0.18215, "sd2-v": 0.18215, "sdxl": 0.13025}


def test_vae_scaling_factor_is_the_familys(loaded):
    """Each family's published VAE scaling factor (an SDXL file loaded with SD's 0.18215 passes every output
    comparison, so it is checked by value)."""
    family, ref, single, folder = loaded
    assert ref["vae"].config.scaling_factor == PUBLISHED_VAE_SCALING[family]
    for got in (single, folder):
        assert got["vae"].config.scaling_factor == PUBLISHED_VAE_SCALING[family]


def test_fp16_checkpoint_loads_in_file_dtype(tmp_path):
    ref = tiny_components("sd1")
    path = save_ldm_checkpoint(ref, tmp_path / "half.safetensors", dtype=torch.float16)
    got = load_ldm_checkpoint(path)
    assert next(got["unet"].parameters()).dtype == torch.float16
    out = _unet_out(got["unet"].float(), "sd1")
    ref_out = _unet_out(ref["unet"].half().float(), "sd1")
    _assert_close(out, ref_out, "fp16 file")


# A damaged checkpoint's errors: each must name the file, the part that does not fit and the fix, and come before
# any module is returned.
def _damaged(tmp_path, family, change):
    from safetensors.torch import save_file

    from leandiffusion.tests.kit import ldm_state_dict, tiny_tokenizer_dir

    sd = ldm_state_dict(tiny_components(family))
    change(sd)
    tiny_tokenizer_dir(tmp_path / "tokenizer")
    path = tmp_path / f"damaged-{family}.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


_TE = "cond_stage_model.transformer.text_model.final_layer_norm.weight"
_VAE = "first_stage_model.decoder.conv_out.weight"
_ATTN = "model.diffusion_model.middle_block.1.proj_in.weight"


@pytest.mark.parametrize("family,change,match", [
    ("sd1", lambda sd: sd.pop(_TE), r"text encoder \(cond_stage_model.transformer.\*\): the checkpoint's tensors do "
                                    r"not fit .*final_layer_norm.weight.*re-download it"),
    ("sd1", lambda sd: sd.__setitem__(_VAE, torch.zeros(3, 7, 3, 3)), r"VAE: the checkpoint's tensors do not fit .*"
                                                                        r"decoder.conv_out.weight.*re-download it"),
    ("sdxl", lambda sd: sd.pop(_ATTN), r"UNet: the checkpoint's tensors do not fit .*proj_in.weight.*re-download it"),
    ("sdxl", lambda sd: [sd.pop(k) for k in [k for k in sd if "attn2" in k]],
     r"checkpoint UNet has no cross-attention \(attn2.to_k\) weights; not a text-to-image UNet"),
])
def test_damaged_checkpoint_is_one_named_error(tmp_path, family, change, match):
    path = _damaged(tmp_path, family, change)
    with pytest.raises(ValueError, match=rf"(?s)model='{path.name}' \(detected as {family}\): {match}"):
        load_ldm_checkpoint(path)


def test_a_directory_is_not_read_as_a_checkpoint(tmp_path):
    (tmp_path / "folder.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"model='folder.safetensors': .*folder.safetensors is not a file"):
        load_ldm_checkpoint(tmp_path / "folder.safetensors")


def test_a_file_cut_short_after_its_header_was_read_is_one_named_error(tmp_path, monkeypatch):
    """A download still being written (or replaced) between the header check and the data read."""
    from leandiffusion.memory import ldm

    path = save_ldm_checkpoint(tiny_components("sd1"), tmp_path / "growing.safetensors")
    real_header = ldm.read_header

    def header_then_cut(p):
        shapes = real_header(p)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
        return shapes

    monkeypatch.setattr(ldm, "read_header", header_then_cut)
    with pytest.raises(ValueError, match=r"model='growing.safetensors' could not be read completely \(.*\); the file "
                                         r"is truncated or damaged"):
        load_ldm_checkpoint(path)
