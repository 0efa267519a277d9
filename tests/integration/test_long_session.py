"""One real ComfyUI server (CPU, tiny model) driven through a long, varied session over HTTP, as a user drives it.

The graph is the shipped workflows in one prompt (loader -> LoRA -> Fused DDIM -> tiled decode -> ESRGAN upscale,
and the Stream Scheduler beside them), shrunk to the tiny model like test_comfyui.py. The session varies seed, steps,
LoRA strength and target blocks, swaps and removes the LoRA, changes vram_policy and the tile sizes, the Stream
Scheduler's prompts and max_batch; interrupts a long sampler run; sends a value that fails inside a node (not at
validation); and re-runs earlier prompts. Checks:

- ComfyUI's caching: an unchanged prompt is served from the cache (nothing executes); a changed input re-executes its
  node and what depends on it, nothing upstream or beside it.
- Every re-run of an earlier prompt (after other prompts, the interrupt and the failure evicted its cache entries, so
  it really executes again) gives the same pixels as its first run on the then-fresh server (bit-identical: same
  process, same CPU kernels).
- The server's RSS does not grow over repeated runs that re-execute the same work (bound 16 MiB between the third
  and the last of 8; measured 0 on this machine), nor does its thread count; ``/queue`` is empty at the end; the
  output folder holds exactly the saved images; the pack leaves nothing in the server's temporary folder (TMPDIR).

A server of its own (not the session fixture), so the first run of each prompt really is on a fresh process.
"""
import copy
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.errors import ExecutionFailed
from leandiffusion.runner.local import LocalComfyUI
from leandiffusion.tests.integration.model_files import write_tiny_model_files

pytestmark = pytest.mark.comfyui
LORA_A, LORA_B, UPSCALER = "session_a.safetensors", "session_b.safetensors", "session_up.safetensors"
RSS_GROWTH_BOUND_KB = 16 * 1024


def graph(seed=1, steps=2, lora=(LORA_A, 1.0, "mid_block, up_blocks.1, text_encoder"), policy="auto", width=64,
          height=64, decode_tile=0, upscale_tile=0, stream="a red cube\na blue ball", max_batch=0, prefix="s"):
    g = {
        "1": {"class_type": "LeanModelLoader", "inputs": {
            "model": "tiny-random (test)", "vram_policy": policy, "vram_budget_gb": 4.0, "weight_dtype": "auto",
            "vae_dtype": "auto"}},
        "4": {"class_type": "LeanFusedDDIMSampler", "inputs": {
            "lean_model": ["2", 0] if lora else ["1", 0], "positive": "a fox", "negative": "blurry", "seed": seed,
            "steps": steps, "cfg": 7.5, "eta": 0.0, "width": width, "height": height, "batch_size": 1,
            "timestep_spacing": "leading", "cfg_mode": "batched", "acceleration": "none", "denoise": 1.0}},
        "5": {"class_type": "LeanTiledVAEDecode", "inputs": {
            "samples": ["4", 0], "tile_size": decode_tile, "overlap": 16, "seam_mode": "exact",
            "lean_model": ["1", 0]}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": prefix + "_gen"}},
        "7": {"class_type": "LeanESRGANUpscale", "inputs": {
            "image": ["5", 0], "model_name": UPSCALER, "output_scale": 0.0, "device": "cpu",
            "tile_size": upscale_tile, "tile_overlap": 8, "precision": "auto"}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": prefix + "_up"}},
        "9": {"class_type": "LeanStreamSampler", "inputs": {
            "lean_model": ["1", 0], "prompts": stream, "negative": "blurry", "seed": seed + 100, "steps": 2,
            "cfg": 7.0, "width": 64, "height": 64, "timestep_spacing": "leading", "acceleration": "none",
            "images_per_prompt": 1, "max_batch": max_batch, "decode_tile_size": 0}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix + "_stream"}},
    }
    if lora:
        g["2"] = {"class_type": "LeanLoraInjector", "inputs": {
            "lean_model": ["1", 0], "lora_name": lora[0], "strength": lora[1], "strength_text_encoder": 1.0,
            "target_blocks": lora[2], "mode": "unmerged"}}
    return g


def proc_status(pid):
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "Threads"):
            values[key] = int(rest.split()[0])
    return values


class Session:
    def __init__(self, server):
        self.server = server
        self.client = ComfyClient(server.url)
        self.client_id = uuid.uuid4().hex
        self.ws = self.client.open_websocket(self.client_id)
        self.saved = []

    def run(self, prompt, interrupt_in=None):
        """Run ``prompt``; return (error lines or None, executed node ids, cached node ids, {node: [HxWx3 arrays]})."""
        prompt_id = self.client.submit(prompt, self.client_id)
        events, fired = [], []

        def on_event(kind, data):
            events.append((kind, data))
            if interrupt_in is not None and kind == "executing" and data.get("node") == interrupt_in and not fired:
                fired.append(threading.Timer(1.0, self.client.request, ("POST", "/interrupt"), {"body": {}}))
                fired[0].start()

        error, entry = None, None
        try:
            entry = self.client.follow(prompt_id, self.ws, 600, on_event=on_event)
        except ExecutionFailed as exc:
            error = exc.lines
            for _ in range(50):  # its history entry (with what the nodes that ran before the failure saved)
                entry = self.client.history(prompt_id)
                if entry is not None:
                    break
                time.sleep(0.1)
        for timer in fired:
            timer.join()
        executed = {d["node"] for k, d in events if k == "executing" and d.get("node")}
        cached = {n for k, d in events if k == "execution_cached" for n in d.get("nodes", [])}
        images = {}
        from PIL import Image

        if error is not None:
            entry = {"outputs": {}, **(entry or {})}

        for node_id, out in ((entry or {}).get("outputs") or {}).items():
            for im in out.get("images", []):
                path = Path(self.server.tmp) / "output" / im.get("subfolder", "") / im["filename"]
                self.saved.append(path.name)
                with Image.open(path) as opened:
                    images.setdefault(node_id, []).append(np.asarray(opened).copy())
        return error, executed, cached, images


def assert_same_pictures(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: output nodes {sorted(got)} != {sorted(want)}"
    for node_id in want:
        assert len(got[node_id]) == len(want[node_id]), f"{what}: node {node_id} image count"
        for a, b in zip(got[node_id], want[node_id]):
            assert np.array_equal(a, b), (f"{what}: node {node_id} differs from the first run by up to "
                                          f"{np.abs(a.astype(int) - b.astype(int)).max()}")


@pytest.fixture(scope="module")
def session_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("long_session")
    models, inputs, scratch = root / "models", root / "input", root / "tmp"
    for folder in (models / "checkpoints", models / "diffusers", models / "loras", models / "upscale_models", inputs,
                   scratch):
        folder.mkdir(parents=True)
    write_tiny_model_files(models, LORA_A, UPSCALER)
    from leandiffusion.tests.kit import tiny_components
    from leandiffusion.tests.lora import lorafiles

    c = tiny_components("sd1")
    lorafiles.write(lorafiles.kohya_state_dict({"unet": c["unet"], "text_encoder": c["text_encoder"]},
                                               {"unet": lorafiles.ATTN_FF, "text_encoder": lorafiles.TE_LINEARS},
                                               seed=7), models / "loras" / LORA_B)
    old_tmpdir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(scratch)  # the server's temporary folder (the runner's own folder is made before)
    server = LocalComfyUI(os.environ["COMFYUI_PATH"], cpu=True, models_dir=models, input_dir=inputs,
                          log_path=root / "comfyui.log", start_timeout=300)
    try:
        server.start()
    finally:
        if old_tmpdir is None:
            os.environ.pop("TMPDIR")
        else:
            os.environ["TMPDIR"] = old_tmpdir
    try:
        yield server, scratch
    finally:
        server.stop()


def test_long_session_results_cache_memory_and_cleanliness(session_server):
    server, scratch = session_server
    s = Session(server)
    pid = server.proc.pid
    base = graph()
    err, executed, cached, first = s.run(base)
    assert err is None, server.log_text()[-3000:]
    assert executed == set(base) and not cached

    # an unchanged prompt is served from the cache; a new seed re-runs the samplers and what follows them only
    err, executed, cached, again = s.run(copy.deepcopy(base))
    assert err is None and executed == set() and cached == set(base)
    assert_same_pictures(again, first, "cached re-run")
    err, executed, _, seed2 = s.run(graph(seed=2))
    assert err is None and executed == set(base) - {"1", "2"}
    err, executed, _, _ = s.run(graph(seed=2, steps=3))
    assert err is None and executed == {"4", "5", "6", "7", "8"}

    # LoRA strength, target blocks, swap, removal; policy; tiles; stream prompts and max_batch
    variants = [graph(seed=2, steps=3, lora=(LORA_A, 0.5, "mid_block, up_blocks.1, text_encoder")),
                graph(seed=2, steps=3, lora=(LORA_A, 0.5, "down_blocks")),
                graph(seed=2, steps=3, lora=(LORA_B, 0.5, "down_blocks")),
                graph(seed=2, steps=3, lora=None),
                graph(seed=2, steps=3, policy="lowvram", decode_tile=128, upscale_tile=32),
                graph(seed=2, steps=3, policy="stream", stream="a green tree\na red cube\nsky"),
                graph(seed=2, steps=3, policy="balanced", stream="a green tree\na red cube\nsky", max_batch=1)]
    for prompt in variants:
        err, executed, _, _ = s.run(prompt)
        assert err is None, err
    assert executed == {"9", "10", "1", "2", "4", "5", "6", "7", "8"}  # the policy changed: the loader re-ran

    # an interrupt inside a long sampler run (LoRA attached), then the first prompt again: same pictures
    err, executed, _, _ = s.run(graph(seed=9, steps=400, width=256, height=256), interrupt_in="4")
    assert err is not None and "interrupted" in err[0], err
    err, executed, _, after_interrupt = s.run(copy.deepcopy(base))
    assert err is None and "4" in executed
    assert_same_pictures(after_interrupt, first, "after the interrupt")

    # a value that passes validation and fails inside the LoRA node, then the seed-2 prompt again
    err, _, _, _ = s.run(graph(seed=2, lora=(LORA_A, 1.0, "up_blocks.9")))
    assert err is not None and "LeanLoraInjector" in err[0] and "up_blocks.9" in err[0], err
    err, executed, _, after_failure = s.run(graph(seed=2))
    assert err is None and "2" in executed
    assert_same_pictures(after_failure, seed2, "after the failure")

    # repeated runs that re-execute the same work: no growth of RSS or threads
    stats = []
    for i in range(8):
        err, executed, _, _ = s.run(graph(seed=3, lora=(LORA_A, 0.7 + 0.01 * (i % 2), "mid_block"), prefix="rep"))
        assert err is None and "4" in executed
        stats.append(proc_status(pid))
    growth = stats[-1]["VmRSS"] - stats[2]["VmRSS"]
    assert growth <= RSS_GROWTH_BOUND_KB, f"RSS grew by {growth} KiB over 5 repeated runs: {stats}"
    assert stats[-1]["Threads"] == stats[2]["Threads"], stats

    queue = s.client.get_json("/queue")
    assert queue["queue_running"] == [] and queue["queue_pending"] == []
    assert sorted(p.name for p in (Path(server.tmp) / "output").iterdir()) == sorted(set(s.saved))
    left = [p.name for p in scratch.iterdir() if p.name.startswith("leandiffusion")]
    assert left == [], f"the server left {left} in its temporary folder"
