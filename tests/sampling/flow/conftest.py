"""Shared fixtures of the flow-sampler tests: a tiny Z-Image saved as a diffusers folder, the diffusers pipeline
loaded back from it (the reference) and an engine our loader built from the same folder."""
import pytest


@pytest.fixture(scope="package")
def zimage_models(tmp_path_factory):
    from leandiffusion.memory.tiny_zimage import build_tiny_zimage, save_zimage_folder

    root = tmp_path_factory.mktemp("models")
    save_zimage_folder(build_tiny_zimage(seed=1), root / "diffusers" / "tiny-zimage")
    return root


@pytest.fixture(scope="package")
def zimage_pipe(zimage_models):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(str(zimage_models / "diffusers" / "tiny-zimage"), local_files_only=True)


@pytest.fixture
def zimage_engine(zimage_models, monkeypatch):
    from leandiffusion.memory.load import load_engine

    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(zimage_models))
    return load_engine("tiny-zimage", device="cpu")
