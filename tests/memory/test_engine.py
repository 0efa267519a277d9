"""The engine handle (``memory/engine.py``): views, sessions, per-stage dtypes and the model-call conventions.

Guards: a scheduler config without ``prediction_type`` means epsilon; the text stage holds both SDXL encoders; a
stage is moved when only its dtype differs; each stage gets its own dtype; adapters attach in the order they were
added and detach in reverse, and a failed attach detaches only those that attached; an unknown stage is refused
before the placement enters; the error's other arguments survive the out-of-memory hint; stage-aware adapters
detach per stage and the placement names the stage device; SDXL time ids are (height, width, ...) in float32; a
plain engine places every stage; parts own their scheduler config; SDXL's second tokenizer is kept; the VAE's own
scaling factor is used.
"""
from __future__ import annotations

import pytest
import torch

from leandiffusion.memory import engine as eng_mod
from leandiffusion.memory.engine import LeanEngine, ModelParts, engine_from_parts, modules_of_stage
from leandiffusion.tests.kit import (assert_unet_call_passes_sdxl_conditioning, tiny_components, tiny_engine,
                                     tiny_parts)


class Recorder:
    """An adapter that logs attach/detach calls; ``fail`` makes its attach raise."""

    def __init__(self, name, log, fail=False):
        self.name, self.log, self.fail = name, log, fail

    def attach(self, parts):
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        self.log.append(("attach", self.name))

    def detach(self, parts):
        self.log.append(("detach", self.name))


class StageRecorder(Recorder):
    def attach_stage(self, parts, stage):
        self.log.append(("attach_stage", self.name, stage))

    def detach_stage(self, parts, stage):
        self.log.append(("detach_stage", self.name, stage))


class LoggingPlacement:
    name = "logging"

    def __init__(self, log, device="cpu"):
        self.log, self._device = log, torch.device(device)

    def enter(self, engine, stage, text_shape=None):
        self.log.append(("enter", stage))

    def exit(self, engine, stage):
        self.log.append(("exit", stage))

    def stage_device(self, engine, stage):
        return self._device


def _view(placement=None, **kw):
    parts = tiny_engine("sd1").parts
    return LeanEngine(parts=parts, device=torch.device("cpu"), placement=placement or LoggingPlacement([]), **kw)


def test_a_scheduler_config_without_prediction_type_means_epsilon():
    parts = tiny_parts("sd1")
    bare = ModelParts(**{**{f: getattr(parts, f) for f in ("family", "unet", "vae", "text_encoder", "tokenizer")},
                         "scheduler_config": {}})
    assert bare.prediction_type == "epsilon"
    v = ModelParts(**{**{f: getattr(parts, f) for f in ("family", "unet", "vae", "text_encoder", "tokenizer")},
                      "scheduler_config": {"prediction_type": "v_prediction"}})
    assert v.prediction_type == "v_prediction"


def test_the_text_stage_holds_both_sdxl_encoders_and_each_stage_its_dtype():
    parts = tiny_parts("sdxl")
    assert modules_of_stage(parts, "text") == [parts.text_encoder, parts.text_encoder_2]
    assert parts.tokenizer_2 is not None and parts.tokenizer_2 is not parts.tokenizer
    engine = engine_from_parts(parts, dtype=torch.bfloat16, vae_dtype=torch.float16, text_dtype=torch.float64)
    dtypes = {name: next(getattr(parts, name).parameters()).dtype
              for name in ("unet", "vae", "text_encoder", "text_encoder_2")}
    assert dtypes == {"unet": torch.bfloat16, "vae": torch.float16, "text_encoder": torch.float64,
                      "text_encoder_2": torch.float64}
    assert engine.dtype_for("text") == torch.float64 and engine.dtype_for("vae") == torch.float16
    assert engine.with_changes(text_dtype=None).dtype_for("text") == torch.bfloat16


def test_a_session_moves_a_stage_whose_dtype_alone_differs():
    engine = tiny_engine("sd1")
    half = engine.with_changes(vae_dtype=torch.float16)
    with half.session("vae"):
        assert next(engine.parts.vae.parameters()).dtype == torch.float16
    with engine.session("vae"):
        assert next(engine.parts.vae.parameters()).dtype == torch.float32


def test_adapters_attach_in_order_detach_in_reverse_and_the_placement_always_exits():
    log = []
    engine = _view(LoggingPlacement(log)).with_adapter(Recorder("a", log)).with_adapter(Recorder("b", log))
    with engine.session("unet"):
        assert log == [("enter", "unet"), ("attach", "a"), ("attach", "b")]
    assert log[3:] == [("detach", "b"), ("detach", "a"), ("exit", "unet")]

    log.clear()
    failing = _view(LoggingPlacement(log)).with_adapter(Recorder("a", log)).with_adapter(Recorder("b", log, True))
    with pytest.raises(RuntimeError, match="b failed"):
        with failing.session("text"):
            pass
    assert log == [("enter", "text"), ("attach", "a"), ("detach", "a"), ("exit", "text")]


def test_stage_aware_adapters_get_the_stage_and_an_unknown_stage_opens_nothing():
    log = []
    engine = _view(LoggingPlacement(log)).with_adapter(StageRecorder("s", log))
    with engine.session("vae"):
        pass
    assert log == [("enter", "vae"), ("attach_stage", "s", "vae"), ("detach_stage", "s", "vae"), ("exit", "vae")]
    log.clear()
    with pytest.raises(ValueError, match="stage='decoder'"):
        with engine.session("decoder"):
            pass
    assert log == []


def test_the_placement_decides_the_stage_device():
    class Meta(LoggingPlacement):
        def stage_device(self, engine, stage):
            return torch.device("meta") if stage == "text" else engine.device

    engine = _view(Meta([]))
    assert engine.stage_device("text") == torch.device("meta") and engine.stage_device("unet") == engine.device


def test_an_out_of_memory_hint_keeps_the_errors_other_arguments():
    class Hinting(LoggingPlacement):
        def out_of_memory_hint(self, stage):
            return "lower the budget"

    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    with pytest.raises(oom) as info:
        with _view(Hinting([])).session("unet"):
            raise oom("out of memory", 7)
    assert info.value.args == ("out of memory\nlower the budget", 7)


def test_the_unet_gets_sdxls_added_conditioning():
    engine = tiny_engine("sdxl")
    assert_unet_call_passes_sdxl_conditioning(engine, engine.unet)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdxl_time_ids_are_height_then_width_in_float32(dtype):
    engine = LeanEngine(parts=tiny_parts("sdxl"), device=torch.device("cpu"), dtype=dtype)
    ids = engine.time_ids(3000, 2049, 2)
    assert ids.dtype == torch.float32
    assert ids.tolist() == [[3000.0, 2049.0, 0.0, 0.0, 3000.0, 2049.0]] * 2


def test_views_do_not_share_the_scheduler_config_of_their_components():
    comps = tiny_components("sd1")
    parts = eng_mod.parts_from_components(comps)
    comps["scheduler_config"]["prediction_type"] = "v_prediction"
    assert parts.prediction_type == "epsilon"


def test_the_vae_scaling_factor_is_the_vaes_own():
    assert tiny_parts("sdxl").vae_scaling_factor == pytest.approx(0.13025)


@pytest.mark.gpu
def test_a_session_on_plain_cuda_moves_nothing_already_in_place(monkeypatch):
    """``cuda`` names the current device, so a resident engine on ``cuda`` must not call ``Module.to`` again at
    every session (parameters report ``cuda:0``)."""
    engine = engine_from_parts(tiny_parts("sd1"), device="cuda")
    calls = []
    real = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: calls.append(type(self).__name__) or
                        real(self, *a, **k))
    for stage in ("text", "unet", "vae"):
        with engine.session(stage):
            pass
    assert calls == []
