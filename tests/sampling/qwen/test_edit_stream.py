"""The Stream Edit Sampler's promise: edit n is exactly (``torch.equal``) the one-image Fused Edit Sampler run
(``sample_qwen_edit``) on its image with seed + n, whatever the batch size (1, 2, automatic) and wherever the image
came from (an IMAGE batch, a folder of ComfyUI's input directory); its IMAGE is the untiled decode of that LATENT
(and diffusers' own ``vae.decode`` of it within 1e-4); images of different sizes come out grouped by size. Bad input
is one error naming the input before any stage opens, and a run stopped between steps returns nothing."""
import pytest
import torch
from PIL import Image

from leandiffusion import bridge
from leandiffusion.nodes.edit_stream import LeanEditStreamSampler
from leandiffusion.sampling.qwen.edit import sample_qwen_edit
from leandiffusion.sampling.qwen.edit_stream import EditStreamSettings, run_edit_stream
from leandiffusion.tests.kit.qwen_edit import image_batch, pictures
from leandiffusion.vae.untiled import vae_decode

INPUT_ENV = "LEANDIFFUSION_INPUT"  # the input directory outside ComfyUI (bridge.input_directory)
SMALL = 0.0625  # megapixels: a 256x256-area run
NEGATIVE = "blurry, dark"
STEPS = 2


def _settings(**kw):
    args = dict(instruction="make it red", negative=NEGATIVE, seed=11, steps=STEPS, true_cfg=4.0, megapixels=SMALL,
                acceleration="none", max_batch=0)
    args.update(kw)
    return EditStreamSettings(**args)


def _one_image(engine, settings, n, image):
    return sample_qwen_edit(engine, settings.one_image(n), image, quiet=True)["samples"]


def _diffusers_decode(engine, latent):
    with torch.no_grad():
        image = engine.parts.vae.decode(latent[:, :, None]).sample[:, :, 0]
    return ((image.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1)


@pytest.fixture(scope="module")
def three():
    return image_batch(5, 3, 72, 104)


@pytest.fixture(scope="module")
def references(edit_folder, three):
    """The one-image runs of the three images (seed 11 + n) on a fresh engine of the same folder."""
    from leandiffusion.memory.load import load_engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANDIFFUSION_MODELS", str(edit_folder.parent.parent))
        engine = load_engine(edit_folder.name, "full", device="cpu")
    s = _settings()
    return [_one_image(engine, s, n, three[n:n + 1]) for n in range(3)]


@pytest.mark.parametrize("max_batch,sizes", [(1, (1, 1, 1)), (2, (2, 1)), (0, (3,))])
def test_each_edit_equals_its_one_image_run(edit_full, three, references, max_batch, sizes):
    result = run_edit_stream(edit_full, _settings(max_batch=max_batch), images=three, quiet=True)
    assert result.batch_sizes == sizes and result.oom_retries == 0
    assert result.order == [[0, 1, 2]] and len(result.latents) == 1
    latents, images = result.latents[0], result.images[0]
    assert latents.shape == (3,) + tuple(references[0].shape[1:])
    for n in range(3):
        assert torch.equal(latents[n:n + 1], references[n]), f"edit {n} differs from its one-image run"
    assert not torch.equal(references[0], references[1])  # the seeds (and images) differ
    for n in range(3):  # the decode of its own LATENT row, as the untiled VAE decode gives it for one image
        assert torch.equal(images[n:n + 1], vae_decode(edit_full, latents[n:n + 1]))
    assert images.shape == (3, 8 * latents.shape[2], 8 * latents.shape[3], 3)
    assert (images - _diffusers_decode(edit_full, latents)).abs().max().item() < 1e-4


def test_lowvram_gives_the_same_edits(edit_folder, three, references, monkeypatch):
    """A policy that moves weights per stage runs the stages one after the other: the same results."""
    from leandiffusion.memory.load import load_engine

    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(edit_folder.parent.parent))
    engine = load_engine(edit_folder.name, "lowvram", device="cpu")
    result = run_edit_stream(engine, _settings(max_batch=2), images=three, quiet=True)
    for n in range(3):
        assert torch.equal(result.latents[0][n:n + 1], references[n])


def _write(folder, name, image):
    folder.mkdir(parents=True, exist_ok=True)
    pictures(image)[0].save(folder / name)


def _load_image(path):
    """Load Image's IMAGE of a file (8-bit RGB / 255)."""
    import numpy as np

    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB")).astype("float32") / 255.0)[None]


def test_a_folder_is_edited_after_the_images_sorted_by_name(edit_full, three, references, tmp_path, monkeypatch):
    monkeypatch.setenv(INPUT_ENV, str(tmp_path))
    shots = tmp_path / "shots"
    _write(shots, "b.png", image_batch(7, 1, 72, 104))
    _write(shots, "a.png", image_batch(8, 1, 144, 208))  # another resolution, the same aspect ratio: one size
    (shots / "notes.txt").write_text("not an image")
    node = LeanEditStreamSampler()
    images, latents = node.run(edit_full, "make it red", NEGATIVE, 11, STEPS, 4.0, SMALL, "none", 2,
                               images=three[:1], folder="shots")
    assert len(images) == len(latents) == 1
    samples = latents[0]["samples"]
    assert samples.shape[0] == 3 and images[0].shape[0] == 3
    assert torch.equal(samples[0:1], references[0])
    s = _settings()
    for n, name in ((1, "a.png"), (2, "b.png")):
        assert torch.equal(samples[n:n + 1], _one_image(edit_full, s, n, _load_image(shots / name))), name
    assert node.IS_CHANGED(folder="shots") != ""
    before = node.IS_CHANGED(folder="shots")
    _write(shots, "c.png", image_batch(9, 1, 72, 104))
    assert node.IS_CHANGED(folder="shots") != before


def test_images_of_different_sizes_are_grouped_by_size(edit_full, tmp_path, monkeypatch):
    monkeypatch.setenv(INPUT_ENV, str(tmp_path))
    wide, tall = image_batch(1, 1, 64, 128), image_batch(2, 1, 128, 64)
    _write(tmp_path / "mixed", "0.png", wide)
    _write(tmp_path / "mixed", "1.png", tall)
    _write(tmp_path / "mixed", "2.png", image_batch(3, 1, 64, 128))
    s = _settings(true_cfg=1.0)
    result = run_edit_stream(edit_full, s, folder="mixed", quiet=True)
    assert result.order == [[0, 2], [1]]
    assert result.latents[0].shape[3] > result.latents[0].shape[2]  # wide
    assert result.latents[1].shape[2] > result.latents[1].shape[3]  # tall
    assert torch.equal(result.latents[1], _one_image(edit_full, s, 1, tall))
    assert torch.equal(result.latents[0][:1], _one_image(edit_full, s, 0, wide))


# --------------------------------------------------------------------------------------------- refusals
def _refused(engine, exc, message, opened_sessions, images=None, folder="", **kw):
    with pytest.raises(exc, match=message):
        run_edit_stream(engine, _settings(**kw), images=images, folder=folder, quiet=True)
    assert opened_sessions == []


def test_no_images_is_refused(edit_full, opened_sessions):
    _refused(edit_full, ValueError, r"images: no image to edit; connect an IMAGE", opened_sessions)


def test_a_small_image_is_refused(edit_full, opened_sessions):
    _refused(edit_full, ValueError, r"images: 96x48 px is smaller than 64 px on a side", opened_sessions,
             images=torch.zeros(2, 48, 96, 3))


def test_a_small_folder_image_is_refused_naming_the_file(edit_full, tmp_path, monkeypatch, opened_sessions):
    monkeypatch.setenv(INPUT_ENV, str(tmp_path))
    _write(tmp_path / "in", "a.png", image_batch(0, 1, 72, 104))
    _write(tmp_path / "in", "tiny.png", image_batch(0, 1, 40, 90))
    _refused(edit_full, ValueError, r"folder 'in/tiny\.png': 90x40 px is smaller than 64 px", opened_sessions,
             folder="in")


@pytest.mark.parametrize("folder,message", [
    ("../escape", r"folder='\.\./escape' points outside ComfyUI's input directory"),
    ("/etc", r"folder='/etc' points outside"),
    ("missing", r"folder='missing' is not a folder in ComfyUI's input directory"),
    ("empty", r"folder='empty' holds no image"),
    ("broken", r"folder 'broken': bad\.png could not be read as an image"),
])
def test_a_bad_folder_is_refused(edit_full, tmp_path, monkeypatch, opened_sessions, folder, message):
    monkeypatch.setenv(INPUT_ENV, str(tmp_path))
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "bad.png").write_bytes(b"not a png")
    _refused(edit_full, ValueError, message, opened_sessions, folder=folder)


def test_a_non_edit_model_is_refused(opened_sessions):
    from leandiffusion.tests.kit import tiny_engine

    _refused(tiny_engine("sd1"), ValueError, r"lean_model: expected a Qwen-Image-Edit model \(family "
             r"qwen_image_edit\), got sd1", opened_sessions, images=image_batch(0, 1, 64, 64))


def test_a_qwen_image_without_vision_tower_is_refused(qwen_engine, opened_sessions):
    _refused(qwen_engine, ValueError, r"lean_model: this qwen_image model's text encoder has no vision tower",
             opened_sessions, images=image_batch(0, 1, 64, 64))


@pytest.mark.parametrize("kw,message", [
    ({"max_batch": -1}, r"max_batch"), ({"steps": 0}, r"steps"),
    ({"steps": 1}, r"steps=1: this model's schedule \(a terminal shift\) needs at least 2 steps"),
    ({"seed": 2 ** 64 - 2}, r"seed=18446744073709551614: edit n uses seed \+ n"),
])
def test_bad_settings_are_refused(edit_full, opened_sessions, kw, message):
    _refused(edit_full, ValueError, message, opened_sessions, images=image_batch(0, 3, 64, 64), **kw)


def test_an_interrupted_run_returns_nothing(edit_full, three):
    calls = []

    def hook():
        calls.append(1)
        if len(calls) > 6:
            raise bridge.Interrupted("stop")

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted) as info:
            run_edit_stream(edit_full, _settings(max_batch=1), images=three, quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    assert any("Stream Edit Sampler stopped" in note for note in getattr(info.value, "__notes__", []))


def test_the_automatic_batch_stops_where_one_guided_call_fills_the_gpu(edit_full, monkeypatch):
    """With memory to spare, the DiT's token count alone bounds the automatic batch: a 1024 px edit (16k image
    tokens per guided call) runs one at a time, a 256 px one batches all eight pictures."""
    from leandiffusion.sampling.qwen import edit_stream
    from leandiffusion.sampling.qwen.edit_inputs import collect_items

    monkeypatch.setattr(edit_stream, "available_bytes", lambda engine: 1 << 40)
    pictures8 = image_batch(1, 8, 64, 64)
    big = collect_items(pictures8, "", 1.0)
    assert big[0].sizes.output == (1024, 1024)
    assert edit_stream.choose_batch(edit_full, _settings(megapixels=1.0), big, tiled=True) == 1
    small = collect_items(pictures8, "", SMALL)
    assert edit_stream.choose_batch(edit_full, _settings(), small, tiled=True) == 8
