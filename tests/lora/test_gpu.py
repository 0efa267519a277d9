"""GPU: a CUDA graph captured inside a LoRA view's session follows strength changes on replay (no recapture),
in fp16, for unmerged and merged; the graph equals eager at every strength. Skipped without CUDA.
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

pytestmark = pytest.mark.gpu
FP16_REL = 2e-3


def _graph(view, inputs):
    kw = {"added_cond_kwargs": inputs["added_cond_kwargs"]} if "added_cond_kwargs" in inputs else {}
    call = lambda: view.unet(inputs["latents"], inputs["timestep"], inputs["context"], **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out, call


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
@pytest.mark.parametrize("mode", ["unmerged", "merged"])
@torch.no_grad()
def test_graph_replay_follows_strength(tmp_path, family, mode):
    c = tiny_components(family)
    engine = engine_from_parts(parts_from_components(c), device="cuda", dtype=torch.float16,
                               vae_dtype=torch.float16)
    roots = {"unet": c["unet"]}
    sd = lf.kohya_state_dict(roots, {"unet": re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)}, rank=4)
    path = lf.write(sd, tmp_path / "g.safetensors")
    inputs = lf.unet_inputs(family)
    inputs = {k: (v.cuda().half() if torch.is_tensor(v) else v) for k, v in inputs.items()}
    if "added_cond_kwargs" in inputs:
        inputs["added_cond_kwargs"] = {k: v.cuda().half() for k, v in inputs["added_cond_kwargs"].items()}
    views = [inject_lora(engine, path, s, 1.0, mode=mode) for s in (1.0, -0.7, 0.0)]
    assert len({v.adapters[0].graph_key for v in views}) == 1
    ptrs = [p.data_ptr() for p in engine.parts.unet.parameters()]
    with views[0].session("unet"):
        graph, out, _ = _graph(views[0], inputs)
    results = []
    for view in views + [views[0]]:
        with view.session("unet"):
            graph.replay()
            torch.cuda.synchronize()
            replayed = out.clone()
            eager = view.unet(inputs["latents"], inputs["timestep"], inputs["context"],
                              **({"added_cond_kwargs": inputs["added_cond_kwargs"]} if family == "sdxl" else {}))
        assert _rel(replayed, eager) <= FP16_REL
        results.append(replayed)
    base = engine.unet(inputs["latents"], inputs["timestep"], inputs["context"],
                       **({"added_cond_kwargs": inputs["added_cond_kwargs"]} if family == "sdxl" else {}))
    assert _rel(results[0], base) > 1e-2  # the LoRA acts
    assert _rel(results[2], base) <= FP16_REL  # strength 0 (the same graph) gives the base model
    assert torch.equal(results[0], results[3])
    assert ptrs == [p.data_ptr() for p in engine.parts.unet.parameters()]
