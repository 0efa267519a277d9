"""ComfyUI's CLIPTextEncode and the pack's prompt strings condition the Fused DDIM Sampler identically (real
ComfyUI server, CPU, fp32).

One workflow per prompt pair: ComfyUI's ``CheckpointLoaderSimple`` -> ``CLIPTextEncode`` (positive, negative) ->
``LeanFusedDDIMSampler`` through ``positive_cond``/``negative_cond`` -> ``SaveLatent`` (path A), and the same sampler
node fed the same texts as its ``positive``/``negative`` strings -> ``SaveLatent`` (path B); both samplers take the
``LeanModelLoader`` model of the same checkpoint (weight_dtype fp32, acceleration none). The checkpoint
(``tests/kit/clip_l.py``) holds a random full-size CLIP-L, which ComfyUI needs; its weights are fp16 values, exact in
fp32 on both sides. Bound: max abs diff of the two latents <= 1e-4 (the acceptance line). The two encoders differ
only in attention kernels: ~3e-6 on the conditioning (measured), which this random UNet turns into ~1.5e-5 per unit
of guidance scale on latents of magnitude ~31 (measured: 4.6e-5 at cfg 6, 1.5e-5 at cfg 2, i.e. ~25 fp32 ulps),
so the test runs cfg 2.5 (~2e-5 expected) to keep the bound meaningful with margin. A dropped weight, a wrong layer
or final norm, a wrong pad token or a truncated long prompt moves the conditioning by O(0.1-1) and the latents by
> 1e-2 (the guard test measures one such change).

``embedding:NAME``: a random 2-vector textual inversion in the server's ``embeddings`` folder, read
by ComfyUI's tokenizer on the CLIPTextEncode path and by the pack's encoder on the string path (the pack refuses an
unknown name, ComfyUI drops it with a warning, so equal latents mean both used it).

The prompts avoid ``[x]`` and ``BREAK``: the pack's strings read them as de-emphasis / chunk break (its extended
syntax), ComfyUI core reads them as text (docs/prompts.md). A guard test checks the paths really differ when the
prompt does change (a comparison that could not fail would prove nothing).
"""
import json
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from leandiffusion.runner.cli import main
from leandiffusion.runner.errors import EXIT_OK
from leandiffusion.tests.kit.clip_l import SD1_CLIP_L_CHECKPOINT

pytestmark = pytest.mark.comfyui
TOL = 1e-4
CFG = 2.5  # the latent difference grows linearly with the guidance scale (module docstring)
LONG = ", ".join(f"(shelf item {i}:1.1) on a wooden shelf" for i in range(14))  # > 75 tokens: 2+ chunks
PAIRS = {
    "weighted": ("(red cube:1.3), studio light", "(blurry:1.2), lowres"),
    "plain": ("a red cube on a table, studio light", ""),
    "nested_escaped_long": ("((glossy)) vase, \\(ceramic\\), (deep (nested:0.7) words), " + LONG, "text, watermark"),
}


def _workflow(prefix: str, cond_texts: tuple, string_texts: tuple) -> dict:
    sampler = {"seed": 5, "steps": 2, "cfg": CFG, "eta": 0.0, "width": 64, "height": 64, "batch_size": 1,
               "timestep_spacing": "leading", "cfg_mode": "batched", "acceleration": "none", "denoise": 1.0}
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD1_CLIP_L_CHECKPOINT}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": cond_texts[0], "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": cond_texts[1], "clip": ["1", 1]}},
        "4": {"class_type": "LeanModelLoader", "inputs": {"model": SD1_CLIP_L_CHECKPOINT, "vram_policy": "auto",
                                                          "vram_budget_gb": 4.0, "weight_dtype": "fp32",
                                                          "vae_dtype": "fp32"}},
        "5": {"class_type": "LeanFusedDDIMSampler",
              "inputs": {"lean_model": ["4", 0], "positive": "ignored: positive_cond is connected",
                         "negative": "ignored too", "positive_cond": ["2", 0], "negative_cond": ["3", 0], **sampler}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"{prefix}/cond"}},
        "7": {"class_type": "LeanFusedDDIMSampler",
              "inputs": {"lean_model": ["4", 0], "positive": string_texts[0], "negative": string_texts[1],
                         **sampler}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"{prefix}/text"}},
    }


def _run_pair(comfyui, tmp_path, cond_texts, string_texts) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = f"prompt_check_{uuid.uuid4().hex[:8]}"
    path = tmp_path / "workflow.api.json"
    path.write_text(json.dumps(_workflow(prefix, cond_texts, string_texts)))
    code = main([str(path), "--server", comfyui.url, "--out", str(tmp_path / "out"), "-q", "--timeout", "900"])
    assert code == EXIT_OK, comfyui.log_text()[-4000:]
    folder = Path(comfyui.tmp) / "output" / prefix

    def latent(name):
        files = sorted(folder.glob(f"{name}_*.latent"))
        assert len(files) == 1, f"expected one {name} latent in {folder}, found {files}"
        return load_file(str(files[0]))["latent_tensor"].float()

    return latent("cond"), latent("text")


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_clip_text_encode_conditioning_matches_prompt_strings(comfyui, clip_l_model_files, tmp_path, pair,
                                                             record_property):
    texts = PAIRS[pair]
    from_cond, from_text = _run_pair(comfyui, tmp_path, texts, texts)
    assert from_cond.shape == from_text.shape == (1, 4, 8, 8)
    diff = (from_cond - from_text).abs().max().item()
    record_property("max_abs_latent_diff", diff)
    assert diff <= TOL, f"{pair}: CLIPTextEncode vs prompt strings, max abs latent diff {diff:.3g} > {TOL}"


def test_prompt_comparison_can_fail(comfyui, clip_l_model_files, tmp_path, record_property):
    """Guard: a weight change of 1.3 -> 1.0 on two words moves the latent far beyond the bound (~0.04 at cfg 2.5)."""
    weighted = PAIRS["weighted"]
    from_cond, from_text = _run_pair(comfyui, tmp_path, weighted, ("red cube, studio light", weighted[1]))
    diff = (from_cond - from_text).abs().max().item()
    record_property("max_abs_latent_diff", diff)
    assert diff > 100 * TOL


@pytest.fixture(scope="module")
def embedding_file(comfyui):
    """``embeddings/lean_style.safetensors``: 2 random vectors of CLIP-L's width (kohya ``emb_params`` layout)."""
    folder = comfyui.models_dir / "embeddings"
    folder.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(11)
    save_file({"emb_params": torch.randn(2, 768, generator=g) * 0.02}, str(folder / "lean_style.safetensors"))


def test_clip_text_encode_embedding_matches_prompt_strings(comfyui, clip_l_model_files, embedding_file, tmp_path,
                                                           record_property):
    texts = ("a photo of embedding:lean_style on a (red cube:1.2)", "embedding:lean_style, blurry")
    from_cond, from_text = _run_pair(comfyui, tmp_path, texts, texts)
    diff = (from_cond - from_text).abs().max().item()
    record_property("max_abs_latent_diff", diff)
    assert "lean_style does not exist" not in comfyui.log_text()
    assert diff <= TOL, f"embedding: CLIPTextEncode vs prompt strings, max abs latent diff {diff:.3g} > {TOL}"
