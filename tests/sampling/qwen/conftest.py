"""Shared fixtures of the Qwen-Image sampling tests: a tiny Qwen-Image saved as a diffusers folder, the diffusers
pipeline loaded back from it (the reference) and engines our loader built from the same folder, with the text
stage resident (``full``), on the CPU (``lowvram``) and, for the edit model, under ``stream``."""
import pytest
from diffusers import QwenImagePipeline

from leandiffusion.memory.load import load_engine
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_folder


@pytest.fixture(scope="package")
def qwen_folder(tmp_path_factory):
    """``<models>/diffusers/tiny-qwen``: the tiny Qwen-Image (seed 1) as a QwenImagePipeline folder."""
    return save_qwen_image_folder(build_tiny_qwen_image(seed=1),
                                  tmp_path_factory.mktemp("models") / "diffusers" / "tiny-qwen")


@pytest.fixture(scope="package")
def qwen_pipe(qwen_folder):
    return QwenImagePipeline.from_pretrained(str(qwen_folder), local_files_only=True)


@pytest.fixture(params=["full", "lowvram"])
def qwen_engine(qwen_folder, monkeypatch, request):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(qwen_folder.parent.parent))
    return load_engine(qwen_folder.name, request.param, device="cpu")


@pytest.fixture(scope="package")
def load_qwen(qwen_folder):
    """``load(policy, weight_dtype)``: a fresh CPU engine over the tiny folder (for module-scoped engines)."""
    def load(policy="full", weight_dtype="auto"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LEANDIFFUSION_MODELS", str(qwen_folder.parent.parent))
            return load_engine(qwen_folder.name, policy, weight_dtype=weight_dtype, device="cpu")

    return load


@pytest.fixture(scope="package")
def edit_folder(tmp_path_factory):
    """``<models>/diffusers/tiny-qwen-edit``: the tiny Qwen-Image (seed 2) as a QwenImageEditPlusPipeline folder."""
    from leandiffusion.memory.tiny_qwen_image import save_qwen_image_edit_folder

    return save_qwen_image_edit_folder(build_tiny_qwen_image(seed=2),
                                       tmp_path_factory.mktemp("models") / "diffusers" / "tiny-qwen-edit")


@pytest.fixture(scope="package")
def edit_pipe(edit_folder):
    from leandiffusion.tests.kit.qwen_edit import load_edit_pipeline

    return load_edit_pipeline(edit_folder)


@pytest.fixture(params=["full", "lowvram", "stream"])
def edit_engine(edit_folder, monkeypatch, request):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(edit_folder.parent.parent))
    return load_engine(edit_folder.name, request.param, device="cpu")


@pytest.fixture
def edit_full(edit_folder, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(edit_folder.parent.parent))
    return load_engine(edit_folder.name, "full", device="cpu")
