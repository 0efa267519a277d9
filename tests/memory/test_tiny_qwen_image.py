"""The tiny Qwen-Image (``memory/tiny_qwen_image.py``) is a real ``QwenImagePipeline`` folder: diffusers loads it
back and samples a latent on the CPU in fp32, and its tokenizer gives the pipeline's prompt template the real
model's token count, so the pipeline's fixed drop of leading tokens removes exactly the template's system turn."""
import pytest
import torch


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from diffusers import QwenImagePipeline

    from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_folder

    folder = save_qwen_image_folder(build_tiny_qwen_image(seed=1), tmp_path_factory.mktemp("qwen") / "tiny-qwen")
    return QwenImagePipeline.from_pretrained(str(folder), local_files_only=True)


def test_the_saved_folder_is_a_qwen_image_pipeline_that_samples_a_latent(pipe):
    out = pipe("a red cat", negative_prompt="blurry", true_cfg_scale=4.0, num_inference_steps=2, width=64,
               height=48, num_images_per_prompt=2, generator=torch.Generator("cpu").manual_seed(0),
               output_type="latent").images
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert out.shape == (2, (48 // 16) * (64 // 16), 64)  # 2x2-packed 16-channel latents
    assert torch.isfinite(out).all() and out.std().item() > 0.1
    assert (out[0] - out[1]).abs().max().item() > 1e-2  # each image its own noise


def test_the_template_drop_removes_exactly_the_system_turn(pipe):
    prefix, _ = pipe.prompt_template_encode.split("{}")
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx
    kept = pipe.tokenizer(pipe.prompt_template_encode.format("a red cat")).input_ids
    kept = kept[pipe.prompt_template_encode_start_idx:]
    assert pipe.tokenizer.decode(kept) == "a red cat<|im_end|>\n<|im_start|>assistant\n"


def test_another_seed_gives_another_model():
    from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image

    a, b = build_tiny_qwen_image(seed=1), build_tiny_qwen_image(seed=2)
    assert not torch.equal(a["transformer"].proj_out.weight, b["transformer"].proj_out.weight)
    again = build_tiny_qwen_image(seed=1)
    assert torch.equal(a["transformer"].proj_out.weight, again["transformer"].proj_out.weight)
