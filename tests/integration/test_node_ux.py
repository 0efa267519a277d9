"""What a ComfyUI user sees of the pack's nodes in the real ComfyUI (CPU, tiny model), through the HTTP API and
the websocket as the web UI uses them: output tooltips in /object_info, progress messages of long nodes
(reaching their max exactly once, never past it), Cancel (``POST /interrupt``) honoured between steps/tiles with
no output file written and the next prompt unaffected (a merged LoRA interrupted mid-run leaves the base weights
exact), model files replaced on disk picked up on the next run while unchanged ones stay cached, and errors that
name the node's own input. Needs ``COMFYUI_PATH`` (see conftest.py); skipped without it.

Guards what a user sees: OUTPUT_TOOLTIPS on every node; progress from the Tiled VAE nodes in 'blend' mode too (a
1024 px CPU decode runs 100 s); a LoRA or upscale model file replaced under the same name is picked up (not the
cached output); the Stream Scheduler Sampler names its ``decode_tile_size`` as such, not ``tile_size``.
"""
import json
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

import leandiffusion
from leandiffusion.runner.local import PACK_LINK_NAME
from leandiffusion.tests.integration.model_files import write_tiny_model_files

pytestmark = pytest.mark.comfyui

LORA = "ux_lora.safetensors"
UPSCALER = "ux_upscaler.safetensors"
LOADER = {"class_type": "LeanModelLoader", "inputs": {"model": "tiny-random (test)", "vram_policy": "auto",
                                                      "vram_budget_gb": 4.0, "weight_dtype": "auto",
                                                      "vae_dtype": "auto"}}


def _sampler(model_ref, **changes):
    inputs = {"lean_model": model_ref, "positive": "a red cube", "negative": "", "seed": 3, "steps": 2, "cfg": 7.5,
              "eta": 0.0, "width": 64, "height": 64, "batch_size": 1, "timestep_spacing": "leading",
              "cfg_mode": "batched", "acceleration": "none", "denoise": 1.0}
    inputs.update(changes)
    return {"class_type": "LeanFusedDDIMSampler", "inputs": inputs}


def _lora(model_ref, **changes):
    inputs = {"lean_model": model_ref, "lora_name": LORA, "strength": 1.0, "strength_text_encoder": 1.0,
              "target_blocks": "", "mode": "unmerged"}
    inputs.update(changes)
    return {"class_type": "LeanLoraInjector", "inputs": inputs}


def _upscale(image_ref, **changes):
    inputs = {"image": image_ref, "model_name": UPSCALER, "output_scale": 0.0, "device": "cpu", "tile_size": 0,
              "tile_overlap": 8, "precision": "auto"}
    inputs.update(changes)
    return {"class_type": "LeanESRGANUpscale", "inputs": inputs}


def _save_latent(ref, prefix):
    return {"class_type": "SaveLatent", "inputs": {"samples": ref, "filename_prefix": prefix}}


def _save_image(ref, prefix):
    return {"class_type": "SaveImage", "inputs": {"images": ref, "filename_prefix": prefix}}


class Server:
    """The session's ComfyUI, driven as the web UI drives it: POST /prompt with a client id, then the websocket."""

    def __init__(self, comfyui):
        self.url = comfyui.url
        self.output = Path(comfyui.tmp) / "output"
        self.models = comfyui.models_dir

    def post(self, path, body):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def run(self, prompt, interrupt_when=None, timeout=300):
        """Queue ``prompt`` and follow it; returns (http status, body or messages). ``interrupt_when(type, data)``:
        POST /interrupt the first time it is true. Messages are (type, data) of this prompt, in order."""
        import websocket

        client_id = uuid.uuid4().hex
        ws = websocket.create_connection(self.url.replace("http", "ws", 1) + "/ws?clientId=" + client_id,
                                         timeout=timeout)
        try:
            status, body = self.post("/prompt", {"prompt": prompt, "client_id": client_id})
            if status != 200:
                return status, body
            prompt_id, messages, sent = body["prompt_id"], [], False
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                frame = ws.recv()
                if not isinstance(frame, str):
                    continue
                msg = json.loads(frame)
                kind, data = msg["type"], msg.get("data") or {}
                if data.get("prompt_id") not in (None, prompt_id) or kind in ("status", "progress_state"):
                    continue
                messages.append((kind, data))
                if interrupt_when is not None and not sent and interrupt_when(kind, data):
                    self.post("/interrupt", {})
                    sent = True
                    messages.append(("interrupt_sent", {"at": time.monotonic()}))
                if kind in ("execution_success", "execution_error", "execution_interrupted"):
                    return status, messages
            raise AssertionError(f"prompt {prompt_id} did not finish within {timeout} s: {messages[-5:]}")
        finally:
            ws.close()

    def outputs(self):
        return {p for p in self.output.rglob("*") if p.is_file()} if self.output.exists() else set()


def _ends(messages):
    return [kind for kind, _ in messages if kind in ("execution_success", "execution_error", "execution_interrupted")]


def _executed(messages):
    return [data["node"] for kind, data in messages if kind == "executing" and data.get("node") is not None]


def _progress(messages, node):
    return [(data["value"], data["max"]) for kind, data in messages if kind == "progress" and data["node"] == node]


def _assert_progress_sane(messages, node):
    values = _progress(messages, node)
    assert values, f"node {node} sent no progress message"
    top = values[0][1]
    assert all(m == top for _, m in values), f"node {node}: progress max changed: {values}"
    assert all(0 < v <= top for v, _ in values), f"node {node}: progress out of 1..max: {values}"
    assert [v for v, _ in values] == sorted(v for v, _ in values), f"node {node}: progress went back: {values}"
    assert sum(1 for v, _ in values if v == top) == 1, f"node {node}: max reached {values.count((top, top))} times"
    return values


def _latent(server, prefix):
    from safetensors.torch import load_file

    files = sorted(server.output.glob(f"{prefix}_*.latent"))
    assert len(files) == 1, f"expected one {prefix} latent, found {files}"
    return load_file(str(files[0]))["latent_tensor"]


@pytest.fixture(scope="module")
def server(comfyui):
    """The session server with a tiny kohya LoRA and a tiny compact x4 upscaler in its model folders."""
    write_tiny_model_files(comfyui.models_dir, LORA, UPSCALER)
    return Server(comfyui)


# --------------------------------------------------------------------------------------------- /object_info
def test_object_info_has_output_tooltips_for_every_pack_node(server):
    with urllib.request.urlopen(server.url + "/object_info", timeout=60) as resp:
        info = json.loads(resp.read())
    ours = {k: v for k, v in info.items() if str(v.get("python_module", "")).endswith("." + PACK_LINK_NAME)}
    assert set(ours) == set(leandiffusion.NODE_CLASS_MAPPINGS)
    for node_id, spec in ours.items():
        tips = spec.get("output_tooltips") or []
        assert len(tips) == len(spec["output"]) and all(tips), f"{node_id}: output tooltips {tips}"
        for section in ("required", "optional"):
            for name, conf in (spec["input"].get(section) or {}).items():
                assert len(conf) > 1 and conf[1].get("tooltip"), f"{node_id}.{name}: no tooltip"


# --------------------------------------------------------------------------------------------- progress
@pytest.mark.parametrize("seam_mode", ["exact", "blend"])
def test_tiled_vae_decode_and_encode_report_progress(server, seam_mode):
    prompt = {"1": LOADER,
              "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 2}},
              "3": {"class_type": "LeanTiledVAEDecode", "inputs": {"samples": ["2", 0], "tile_size": 128,
                                                                   "overlap": 32, "seam_mode": seam_mode,
                                                                   "lean_model": ["1", 0]}},
              "4": {"class_type": "LeanTiledVAEEncode", "inputs": {"pixels": ["3", 0], "tile_size": 128,
                                                                   "overlap": 32, "seam_mode": seam_mode,
                                                                   "lean_model": ["1", 0]}},
              "5": _save_latent(["4", 0], f"ux_progress_{seam_mode}")}
    status, messages = server.run(prompt)
    assert status == 200 and _ends(messages) == ["execution_success"], messages[-3:]
    decode, encode = _assert_progress_sane(messages, "3"), _assert_progress_sane(messages, "4")
    # both modes: one unit per stage of the VAE per image (the loader's tiny SD1-like VAE), 2 images
    from leandiffusion.memory.tiny import build_tiny_components
    from leandiffusion.vae.adapters import decoder_program, encoder_program

    vae = build_tiny_components("sd1")["vae"]
    units = (2 * len(decoder_program(vae).stages), 2 * len(encoder_program(vae).stages))
    assert (decode[-1], encode[-1]) == ((units[0], units[0]), (units[1], units[1])), (decode, encode)


def test_sampler_and_upscale_report_progress(server):
    prompt = {"1": LOADER, "2": _sampler(["1", 0], steps=3), "3": _save_latent(["2", 0], "ux_progress_sampler"),
              "4": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 2, "color": 99}},
              "5": _upscale(["4", 0], tile_size=32), "6": {"class_type": "PreviewImage", "inputs": {"images": ["5", 0]}}}
    status, messages = server.run(prompt)
    assert status == 200 and _ends(messages) == ["execution_success"], messages[-3:]
    assert _assert_progress_sane(messages, "2")[-1] == (3, 3)
    assert _assert_progress_sane(messages, "5")[-1] == (8, 8)  # 2 images x 2 x 2 tiles


# --------------------------------------------------------------------------------------------- interruption
def _after_progress(node, value):
    return lambda kind, data: kind == "progress" and data.get("node") == node and data["value"] >= value


@pytest.mark.parametrize("case", ["sampler", "stream", "decode_exact", "decode_blend", "upscale"])
def test_interrupt_stops_the_node_promptly_and_saves_nothing(server, case):
    if case == "sampler":
        prompt = {"1": LOADER, "2": _sampler(["1", 0], steps=500), "3": _save_latent(["2", 0], "ux_int")}
    elif case == "stream":
        prompt = {"1": LOADER, "2": {"class_type": "LeanStreamSampler", "inputs": {
            "lean_model": ["1", 0], "prompts": "a\nb", "negative": "", "seed": 0, "steps": 300, "cfg": 7.5,
            "width": 64, "height": 64, "timestep_spacing": "leading", "acceleration": "none",
            "images_per_prompt": 1, "max_batch": 1, "decode_tile_size": 0}}, "3": _save_image(["2", 0], "ux_int")}
    elif case.startswith("decode"):
        prompt = {"1": LOADER,
                  "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
                  "3": {"class_type": "LeanTiledVAEDecode", "inputs": {"samples": ["2", 0], "tile_size": 128,
                                                                       "overlap": 32, "seam_mode": case[7:],
                                                                       "lean_model": ["1", 0]}},
                  "4": _save_image(["3", 0], "ux_int")}
    else:
        prompt = {"1": {"class_type": "EmptyImage", "inputs": {"width": 512, "height": 512, "batch_size": 1,
                                                               "color": 1234}},
                  "2": _upscale(["1", 0], tile_size=64), "3": _save_image(["2", 0], "ux_int")}
    node = "3" if case.startswith("decode") else "2"
    before = server.outputs()
    status, messages = server.run(prompt, interrupt_when=_after_progress(node, 2))
    assert status == 200
    assert _ends(messages) == ["execution_interrupted"], [k for k, _ in messages][-5:]
    interrupted = next(d for k, d in messages if k == "execution_interrupted")
    assert interrupted["node_id"] == node
    values = _progress(messages, node)
    assert values[-1][0] < values[-1][1] / 2, f"the node ran on after the interrupt: {values[-3:]}"
    assert server.outputs() == before, "an interrupted run left output files"


def test_interrupted_merged_lora_leaves_the_model_exact_and_the_server_usable(server):
    """Cancel while a merged LoRA is written into the shared engine's weights: the next prompt on the same (cached)
    loader output gives exactly the latent it gave before (acceleration 'cuda_graph' falls back to eager on the CPU,
    so it is the same computation under an input ComfyUI has not cached)."""
    base = {"1": LOADER, "2": _sampler(["1", 0], seed=11), "3": _save_latent(["2", 0], "ux_merged_base")}
    status, messages = server.run(base)
    assert _ends(messages) == ["execution_success"]
    merged = {"1": LOADER, "4": _lora(["1", 0], mode="merged", strength=3.0, strength_text_encoder=3.0),
              "2": _sampler(["4", 0], seed=11, steps=500), "3": _save_latent(["2", 0], "ux_merged_int")}
    status, messages = server.run(merged, interrupt_when=_after_progress("2", 2))
    assert _ends(messages) == ["execution_interrupted"]
    after = {"1": LOADER, "2": _sampler(["1", 0], seed=11, acceleration="cuda_graph"),
             "3": _save_latent(["2", 0], "ux_merged_after")}
    status, messages = server.run(after)
    assert _ends(messages) == ["execution_success"] and "1" not in _executed(messages)
    assert not list(server.output.glob("ux_merged_int_*"))
    assert (_latent(server, "ux_merged_after") - _latent(server, "ux_merged_base")).abs().max().item() == 0.0


# --------------------------------------------------------------------------------------------- caching
def test_cache_reruns_only_what_changed_and_picks_up_replaced_model_files(server):
    from safetensors.torch import load_file, save_file

    from leandiffusion.tests.upscale.helpers import random_compact

    def prompt(seed=3, strength=1.0):
        return {"1": LOADER, "2": _lora(["1", 0], strength=strength), "3": _sampler(["2", 0], seed=seed),
                "4": _save_latent(["3", 0], "ux_cache"),
                "5": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": 1,
                                                             "color": 7}},
                "6": _upscale(["5", 0]), "7": {"class_type": "PreviewImage", "inputs": {"images": ["6", 0]}}}

    def executed(p):
        status, messages = server.run(p)
        assert _ends(messages) == ["execution_success"], messages[-3:]
        return set(_executed(messages))

    executed(prompt())
    assert executed(prompt()) == set(), "an identical prompt ran nodes again"
    assert executed(prompt(seed=4)) == {"3", "4"}
    assert executed(prompt(seed=4, strength=0.5)) == {"2", "3", "4"}  # the loader (1) is not run again
    lora_path = server.models / "loras" / LORA
    tensors = load_file(str(lora_path))
    save_file({k: v * 0.5 for k, v in tensors.items()}, str(lora_path))
    assert executed(prompt(seed=4, strength=0.5)) == {"2", "3", "4"}, "a replaced LoRA file was not picked up"
    save_file(random_compact(seed=1), str(server.models / "upscale_models" / UPSCALER))
    assert executed(prompt(seed=4, strength=0.5)) == {"6", "7"}, "a replaced upscale model was not picked up"
    assert executed(prompt(seed=4, strength=0.5)) == set()


# --------------------------------------------------------------------------------------------- errors
def test_stream_decode_tile_size_error_names_its_input_and_server_stays_usable(server):
    prompt = {"1": LOADER, "2": {"class_type": "LeanStreamSampler", "inputs": {
        "lean_model": ["1", 0], "prompts": "a", "negative": "", "seed": 0, "steps": 2, "cfg": 7.5, "width": 64,
        "height": 64, "timestep_spacing": "leading", "acceleration": "none", "images_per_prompt": 1,
        "max_batch": 0, "decode_tile_size": 64}}, "3": _save_image(["2", 0], "ux_err")}
    status, messages = server.run(prompt)
    error = next(d for k, d in messages if k == "execution_error")
    assert error["node_type"] == "LeanStreamSampler" and error["exception_type"] == "ValueError"
    assert error["exception_message"].startswith("decode_tile_size=64 is below the minimum 128 px; use 0 (auto)")
    status, messages = server.run({"1": LOADER, "2": _sampler(["1", 0], seed=21),
                                   "3": _save_latent(["2", 0], "ux_err_after")})
    assert _ends(messages) == ["execution_success"]


@pytest.mark.parametrize("change, node_type, text", [
    (lambda p: p["2"]["inputs"].update(lora_name="nope.safetensors"), None, "lora_name: 'nope.safetensors' not in"),
    (lambda p: p["3"]["inputs"].update(steps=0), None, "Value 0 smaller than min of 1"),
    (lambda p: p["3"]["inputs"].update(width=100), "LeanFusedDDIMSampler",
     "width=100 is not a multiple of 8 (the VAE downsamples by 8); use 96 or 104"),
    (lambda p: p["2"]["inputs"].update(target_blocks="no_such_block"), "LeanLoraInjector",
     "target_blocks: 'no_such_block' names no module of the unet"),
], ids=["missing_lora_file", "steps_below_min", "width_not_multiple_of_8", "unknown_target_block"])
def test_bad_inputs_are_reported_with_input_and_value(server, change, node_type, text):
    prompt = {"1": LOADER, "2": _lora(["1", 0]), "3": _sampler(["2", 0], seed=31), "4": _save_latent(["3", 0], "x")}
    change(prompt)
    status, body = server.run(prompt)
    if node_type is None:  # refused by /prompt validation
        assert status == 400
        details = [f"{e['message']} {e.get('details', '')}" for n in body["node_errors"].values() for e in n["errors"]]
        assert any(text in d for d in details), details
    else:
        error = next(d for k, d in body if k == "execution_error")
        assert error["node_type"] == node_type and text in error["exception_message"], error["exception_message"]
