"""bench/suite_qwen.py in smoke mode (tiny Qwen-Image, CPU, fp32), for both workloads (the edit, the suite's default
and issue 44's acceptance, and text-to-image): every case runs end to end through the node-level API, its rows
validate against bench/schema.py, our latent equals diffusers' pipeline, and a case the pack cannot run yet turns its
targets into FAIL rows naming the reason instead of passing quietly or vanishing."""
import math

import pytest
import torch

from leandiffusion.bench import qwen_cases, qwen_targets, schema, suite_qwen
from leandiffusion.bench.harness import BenchContext


def _rows(ctx):
    return {(r["case"].split("/", 1)[1], r["metric"]): schema.normalise_record(r) for r in ctx.to_json()}


PEERS = {"edit": "diffusers QwenImageEditPlusPipeline", "t2i": "diffusers QwenImagePipeline"}


@pytest.fixture(scope="module", params=["edit", "t2i"])
def smoke(tmp_path_factory, request):
    with pytest.MonkeyPatch.context() as mp:
        if request.param != "edit":  # the edit runs as the default, with the variable unset
            mp.setenv(suite_qwen.ENV_WORKLOAD, request.param)
        else:
            mp.delenv(suite_qwen.ENV_WORKLOAD, raising=False)
        ctx = BenchContext("qwen", tmp_path_factory.mktemp("qwen"), smoke=True)
        suite_qwen.run(ctx)
    ctx.workload = request.param
    return ctx


def test_every_row_is_well_formed_and_keys_are_unique(smoke):
    records = [schema.normalise_record(r) for r in smoke.to_json()]
    assert records and all(schema.validate_record(r) == [] for r in records), records
    assert all(r["case"].startswith(f"{smoke.workload}_64_2steps/") for r in records)
    doc = {"suites": [{"suite": "qwen"}], "records": records}
    assert schema.duplicate_keys(doc) == {}


def test_resident_cases_run_and_ours_equals_the_pipeline(smoke):
    rows = _rows(smoke)
    assert rows[("fp32/none", "smoke_rel_vs_peer")]["passed"] is True
    for key in ("bf16/none", "bf16/cuda_graph", "bf16/compile+cuda_graph", "fp8_e4m3fn/cuda_graph",
                "fp8_e4m3fn_fast/compile+cuda_graph"):
        row = rows[(key, "e2e_ms_vs_peer")]
        assert row["ours"] > 0 and row["peer"] > 0 and row["peer_name"].startswith(PEERS[smoke.workload])
    # the fp8 storage moved the latent, but not far: the fp8 DiT is a copy of the shared bf16 one
    assert 1e-4 < rows[("fp8_e4m3fn/cuda_graph", "rel_vs_bf16")]["ours"] < 0.2
    assert rows[("bf16/cuda_graph", "rel_vs_eager")]["passed"] is True


def test_capped_cases_run_or_fail_their_targets_with_the_reason(smoke):
    rows = _rows(smoke)
    for key, budget in (("stream_12gb/bf16", 12.0), ("stream_8gb/fp8_e4m3fn", 8.0), ("stream_12gb/bf16_plain", 12.0)):
        peak = rows[(key, "peak_reserved_gb")]
        assert peak["target"] == f"<= {budget:g} GB"
        ratio = rows[(key, "e2e_ms_vs_resident")]
        if peak["ours"] is None:  # the pack refuses stream for qwen_image: FAIL, naming the refusal
            assert peak["passed"] is False and "not supported yet" in peak["notes"]
            assert ratio["passed"] is False and ratio["ours"] is None and "not supported yet" in ratio["notes"]
        else:
            assert peak["passed"] is True and ratio["ours"] > 0
    packed = rows[("stream_12gb/bf16", "e2e_ms_vs_plain_copies")]
    assert packed["ours"] > 0 and packed["peer"] > 0 and packed["target"] in (None, "")
    assert rows[("stream_12gb/bf16_plain", "rel_vs_resident")]["passed"] is True
    offload = rows[("stream_12gb/bf16", "e2e_ms_vs_group_offload")]
    assert offload["peer"] > 0 and "group offload" in offload["peer_name"]


def test_stream_edit_runs_both_sides_and_its_latents_equal_the_one_image_runs(smoke):
    """Issue 44's 8-image throughput row: both sides measured, the target stated, and (CPU fp32) the stream's LATENT
    row n exactly the Fused Edit Sampler's edit of picture n with seed + n, so a misordered or mis-seeded row fails."""
    rows = _rows(smoke)
    ratio = rows[("stream_edit_8/stream", "throughput_vs_one_by_one")]
    assert ratio["ours"] > 0 and ratio["peer"] > 0 and ratio["target"].startswith(">= 1.3x")
    assert ratio["passed"] is (ratio["ratio"] >= 1.3)
    same = rows[("stream_edit_8/stream", "rel_vs_one_by_one")]
    assert same["ours"] == 0.0 and same["passed"] is True
    for key in ("stream_edit_8/stream", "stream_edit_8/one_by_one"):
        assert rows[(key, "peak_reserved_gb")]["ours"] is not None


def test_stream_edit_pictures_are_distinct_and_of_one_size():
    from leandiffusion.bench.qwen_stream_edit import N_IMAGES, references

    images = references(64)
    assert images.shape == (N_IMAGES, 64, 64, 3)
    assert all(not torch.equal(images[i], images[j]) for i in range(N_IMAGES) for j in range(i))


def test_the_stream_edit_warm_up_is_a_step_count_the_qwen_schedule_accepts():
    """The smoke run skips warm-ups, so the warm-up's step count is checked against the real schedule here."""
    from leandiffusion.bench.qwen_stream_edit import WARMUP_STEPS
    from leandiffusion.memory.tiny_qwen_image import QWEN_IMAGE_SCHEDULER
    from leandiffusion.sampling.flow.schedule import flow_sigmas

    assert flow_sigmas(dict(QWEN_IMAGE_SCHEDULER), WARMUP_STEPS, 128, 128).shape == (WARMUP_STEPS + 1,)


def test_the_time_guard_learns_one_run_from_the_resident_cuda_graph_row():
    """A call without the peer (e.g. stream + peer_offload) still sizes later parts by a measured run."""
    ctx = _Ctx()
    ctx.smoke, ctx.has_time = False, lambda seconds: True
    runner = suite_qwen._Runner(ctx, _RowsStub(), warmup=1, repeat=1)
    runner.guarded("cuda_graph", ["bf16/cuda_graph"], lambda: {"bf16/cuda_graph": qwen_cases.Run(
        15_000.0, 57.0, torch.zeros(1))})
    assert runner.run_s == pytest.approx(15.0)


class _RowsStub:
    case = "edit_1024_20steps"

    def add(self, key, result):
        pass


def test_the_plain_copies_case_loads_with_packing_off_and_restores_the_setting(monkeypatch):
    """``stream_plain`` differs from ``stream`` only in the loader's packing switch, and only during its load."""
    from leandiffusion.memory.packed_weights import ENV, slot_fraction

    cuda = torch.device("cuda", 0)
    for before in (None, "auto"):
        if before is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, before)
        with qwen_cases._packed_streaming(False):
            assert slot_fraction(cuda, torch.bfloat16) == 0.0
        assert qwen_cases.os.environ.get(ENV) == before
        with qwen_cases._packed_streaming(True):
            assert slot_fraction(cuda, torch.bfloat16) > 0.0
        assert qwen_cases.os.environ.get(ENV) == before


def test_parts_pull_in_what_their_ratios_need(monkeypatch):
    monkeypatch.setenv(suite_qwen.ENV_CASES, "peer_offload,stream_fp8")
    assert suite_qwen.selected_parts() == ("cuda_graph", "fp8", "stream_fp8", "stream", "peer_offload")
    monkeypatch.setenv(suite_qwen.ENV_CASES, "stream_plain")
    assert suite_qwen.selected_parts() == ("cuda_graph", "stream", "stream_plain")
    monkeypatch.setenv(suite_qwen.ENV_CASES, "stream_edit")
    assert suite_qwen.selected_parts() == ("peer", "stream_edit")  # the time guard needs the peer's run time
    monkeypatch.setenv(suite_qwen.ENV_CASES, "cuda_graph,stream_gpu")
    with pytest.raises(ValueError, match=r"LEANDIFFUSION_BENCH_QWEN_CASES: unknown part\(s\) \['stream_gpu'\]"):
        suite_qwen.selected_parts()


class _Ctx:
    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.records, self.skipped = [], []

    def record(self, case, metric, ours, peer=None, peer_name="", target=None, target_kind="", **kwargs):
        self.records.append(dict(case=case, metric=metric, ours=ours, peer=peer, target=target, kind=target_kind,
                                 notes=kwargs.get("notes", "")))

    def skip(self, case, reason):
        self.skipped.append((case, reason))


def test_a_target_fails_when_its_case_was_refused_and_is_skipped_when_not_asked_for():
    ctx = _Ctx()
    rows = qwen_targets.Rows(ctx, "t2i", "diffusers QwenImagePipeline")
    latent = torch.ones(1, 16, 4, 4)
    rows.add("peer", qwen_cases.Run(100.0, 70.0, latent))
    rows.add("bf16/compile+cuda_graph", "unavailable: acceleration='compile+cuda_graph' captured no CUDA graph")
    rows.finish()
    failed = [r for r in ctx.records if r["metric"] == "e2e_ms_vs_peer"]
    assert len(failed) == 1 and failed[0]["case"] == "t2i/bf16/compile+cuda_graph"
    assert math.isnan(failed[0]["ours"]) and failed[0]["peer"] == 100.0 and failed[0]["target"] == 1.2
    assert "captured no CUDA graph" in failed[0]["notes"]
    skipped = dict(ctx.skipped)
    assert "not selected" in skipped["t2i/fp8_e4m3fn_fast/compile+cuda_graph e2e_ms_vs_peer"]


def test_an_accelerated_run_that_captured_no_graph_is_unavailable_on_cuda():
    from leandiffusion.bench.models import tiny_engine

    engine = tiny_engine("sd1")
    with pytest.raises(qwen_cases.Unavailable, match=r"acceleration='cuda_graph' captured no CUDA graph"):
        qwen_cases._check_accelerated(_Ctx("cuda"), engine, "cuda_graph")
    qwen_cases._check_accelerated(_Ctx("cuda"), engine, "none")
    qwen_cases._check_accelerated(_Ctx("cpu"), engine, "cuda_graph")  # the CPU falls back to eager by design
    assert qwen_cases.unavailable_reason(qwen_cases.Unavailable("x")) == "unavailable: x"
    assert qwen_cases.unavailable_reason(ValueError("'stream' is not supported yet for qwen_image")).startswith(
        "unavailable: ")
    assert qwen_cases.unavailable_reason(RuntimeError("shape mismatch")) is None


def test_the_full_size_configs_are_the_real_models_sizes():
    """Built on the meta device (no memory): a typo in the 7B config or a changed diffusers default would
    benchmark another model."""
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from leandiffusion.bench.qwen_models import language_model, qwen25_vl_7b_config
    from leandiffusion.memory.tiny_qwen_image import TEMPLATE_WORDS, build_qwen_tokenizer

    with init_empty_weights():
        dit = QwenImageTransformer2DModel()
        text = Qwen2_5_VLForConditionalGeneration(qwen25_vl_7b_config(build_qwen_tokenizer(TEMPLATE_WORDS)))
    billions = lambda m: sum(p.numel() for p in m.parameters()) / 1e9  # noqa: E731
    assert round(billions(dit), 2) == 20.43 and len(dit.transformer_blocks) == 60
    assert round(billions(text), 2) == 8.29 and round(billions(language_model(text)), 2) == 7.07
    assert round(billions(text.model.visual), 2) == 0.68


def test_the_edit_is_the_default_workload_and_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.delenv(suite_qwen.ENV_WORKLOAD, raising=False)
    ctx = _Ctx()
    ctx.smoke, ctx.quick = False, True
    edit = suite_qwen.workload(ctx)
    assert edit.name == "edit" and edit.case == "edit_64_2steps"  # the CPU runs the small size
    ctx.device = torch.device("cuda")
    assert suite_qwen.workload(ctx).case == "edit_1024_4steps"
    monkeypatch.setenv(suite_qwen.ENV_WORKLOAD, "inpaint")
    with pytest.raises(ValueError, match=r"LEANDIFFUSION_BENCH_QWEN_WORKLOAD='inpaint': expected one of \['edit', "
                                         r"'t2i'\]"):
        suite_qwen.workload(ctx)


def test_the_edit_pipeline_and_engine_see_the_same_pictures_tokens():
    """The peer's processor (transformers' own, video slot skipped) and our sampler's tokenization expand the
    reference's image pads alike, over the tokenizer with the vision markers the 7B config's ids point at."""
    from types import SimpleNamespace

    from PIL import Image

    from leandiffusion.bench.qwen_models import edit_processor, qwen25_vl_7b_config, qwen_tokenizer
    from leandiffusion.memory.qwen_vision import edit_image_processor
    from leandiffusion.sampling.qwen.edit_text import edit_text, tokenize_edit

    tokenizer = qwen_tokenizer()
    config = qwen25_vl_7b_config(tokenizer)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    picture = Image.new("RGB", (384, 384), (200, 30, 30))
    peer = edit_processor(edit_image_processor(), tokenizer)(text=[edit_text("make it blue", 1)], images=[picture],
                                                             padding=True, return_tensors="pt")
    engine = SimpleNamespace(parts=SimpleNamespace(image_processor=edit_image_processor(), tokenizer=tokenizer))
    ours = tokenize_edit(engine, "make it blue", [picture])
    assert torch.equal(peer["input_ids"], ours["input_ids"]) and torch.equal(peer["pixel_values"],
                                                                              ours["pixel_values"])
    assert int((ours["input_ids"] == config.image_token_id).sum()) == 196
