"""The Fused Flow Sampler loop: prompts (or Qwen3 CONDITIONING) + seed (+ a LATENT) -> LATENT, as ZImagePipeline.

Invariants (what makes the output equal ``ZImagePipeline(prompt, negative_prompt, num_inference_steps=steps,
guidance_scale=cfg - 1, width, height, num_images_per_prompt=batch, generator=torch.Generator("cpu")
.manual_seed(seed), output_type="latent")`` converted to raw VAE space, ``latents / scaling_factor + shift_factor``):
- Schedule: ``schedule.flow_sigmas`` from the model's scheduler config; model timestep ``(1000 - 1000 sigma) / 1000``.
- Noise: one ``torch.Generator("cpu").manual_seed(seed)`` draw of the whole ``[B, 16, h, w]`` float32 shape (or
  ComfyUI's per-``batch_index`` draws for a LATENT that carries one); txt2img starts from it.
- img2img (a ``latent_image`` with ``denoise`` < 1, or ``denoise`` < 1 from an empty latent, as ComfyUI's
  EmptyLatentImage gives): ComfyUI's rule, the last ``steps + 1`` sigmas of an ``int(steps / denoise)`` schedule,
  starting from ``sigma0 noise + (1 - sigma0) x0`` with ``x0 = (raw - shift) * scale``.
- Guidance: ``cfg > 1`` runs the DiT on ``[cond x B, uncond x B]`` and combines ``u + cfg (c - u)``; otherwise one
  pass on the positive prompt only.
- Every model call runs inside ``engine.session(...)``; ``bridge.check_interrupted()`` runs before every step and
  the progress bar advances after it; on the GPU the host runs at most two steps ahead.

Why hand-written rather than calling the pipeline (the tests' reference): static caption buffers
(``dit_forward``), the fused update kernel, CUDA-graph replay and placement sessions do not fit its ``__call__``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ... import bridge
from ...memory.engine import LeanEngine
from ...memory.families import check_node_runs
from ..dit_steps import PreparedDitSteps, prepare_dit_steps, run_dit_steps
from ..graph_runner import GraphRunner
from ..latent_input import batch_index_of, batch_latents, check_latent, check_latent_size, initial_noise
from ..loop import resolve_acceleration, step_allocator, vae_scale_factor
from .accel import compiled_dit_fn, eager_dit_fn
from .captions import flow_captions
from .dit_forward import ImageGrid, caption_capacity, caption_layout
from .program import FlowStepProgram
from .schedule import flow_sigmas, model_timesteps
from .settings import FlowSettings

logger = logging.getLogger(__name__)


def check_flow_engine(engine: Any) -> LeanEngine:
    if not isinstance(engine, LeanEngine):
        raise TypeError(f"lean_model: expected a LEAN_MODEL from a Memory Pool Loader, got {type(engine).__name__}")
    if not engine.parts.is_flow:
        raise ValueError(f"lean_model is a {engine.family} model; the Fused Flow Sampler runs flow-matching DiTs "
                         f"(Z-Image): use the Fused DDIM Sampler for {engine.family}, or load a Z-Image model")
    check_node_runs(engine.family, "Fused Flow Sampler")
    return engine


def sample_flow(engine: LeanEngine, settings: FlowSettings, latent_image: Optional[dict] = None,
                positive_cond: Any = None, negative_cond: Any = None, runner: Optional[GraphRunner] = None,
                quiet: bool = False) -> dict:
    """Run the sampler; returns ``{"samples": raw latents [B, C, h, w] float32 on the CPU}`` (module docstring)."""
    check_flow_engine(engine)
    s = settings.validated()
    parts = engine.parts
    factor = vae_scale_factor(engine)
    init, batch_index = None, None
    if latent_image is not None:
        rows = check_latent(engine, latent_image)
        check_latent_size(rows.shape, factor, s.batch_size)
        init = batch_latents(rows.float().cpu(), s.batch_size)
        batch_index = batch_index_of(latent_image, rows.shape[0], init.shape[0])
        shape = tuple(init.shape)
    else:
        shape = (s.batch_size, parts.latent_channels, s.height // factor, s.width // factor)
    grid = ImageGrid.of(shape[2], shape[3], int(parts.unet.config.all_patch_size[0]))
    img2img = s.denoise < 1.0
    sigmas = flow_sigmas(parts.scheduler_config, s.steps, shape[2], shape[3], s.denoise if img2img else 1.0)
    generator = torch.Generator(device="cpu").manual_seed(s.seed)
    x = initial_noise(shape, generator, batch_index)
    scale, shift = parts.vae_scaling_factor, parts.vae_shift_factor
    if img2img:
        x0 = ((init if init is not None else torch.zeros(shape)) - shift) * scale
        x = sigmas[0] * x + (1.0 - sigmas[0]) * x0
    bridge.check_interrupted()
    captions = flow_captions(engine, s.positive, s.negative, s.guided, shape[0], positive_cond, negative_cond)
    with engine.session("unet"), torch.no_grad():
        x = _denoise(engine, captions, x, sigmas, grid, s, runner, quiet)
    out = {"samples": x.float().cpu() / scale + shift}
    if batch_index is not None:
        out["batch_index"] = batch_index
    return out


def _prepare(engine: LeanEngine, captions: list, x: torch.Tensor, sigmas: torch.Tensor, grid: ImageGrid,
             s: FlowSettings, runner: Optional[GraphRunner]) -> PreparedDitSteps:
    device, dit = engine.device, engine.parts.unet
    capacity = caption_capacity([int(c.shape[0]) for c in captions])
    layout = caption_layout(dit, captions, grid, capacity, engine.dtype, device)
    timesteps = model_timesteps(sigmas).to(device)
    steps = sigmas[:-1] - sigmas[1:]
    coeffs = torch.stack([torch.full_like(steps, s.cfg), steps], dim=1).to(device)
    x_dev = x.to(device)
    mode = resolve_acceleration(engine, s.acceleration, runner)

    def build(fn) -> FlowStepProgram:
        return FlowStepProgram(fn, x.shape[0], x.shape[1], grid, layout, engine.dtype, s.guided,
                               step_allocator(engine))

    def prepare(program: FlowStepProgram) -> None:
        program.load(layout, x_dev)
        program.set_step(timesteps[0], coeffs[0])

    key = ("flow", tuple(x.shape), engine.dtype, s.guided, capacity, str(layout.caption_freqs.dtype))
    return prepare_dit_steps(engine, mode, key, build, prepare, eager_dit_fn(dit), lambda: compiled_dit_fn(engine),
                             runner, timesteps, coeffs, working=(len(captions), *x.shape[2:]))


def _denoise(engine: LeanEngine, captions: list, x: torch.Tensor, sigmas: torch.Tensor, grid: ImageGrid,
             s: FlowSettings, runner: Optional[GraphRunner], quiet: bool) -> torch.Tensor:
    """The steps under the sampler's own progress bar; returns the final model-space latents."""
    with bridge.ProgressBar(sigmas.shape[0] - 1, desc="Fused Flow", quiet=quiet) as bar:
        return denoise_flow_batch(engine, captions, x, sigmas, grid, s, lambda i: bar.update(1), runner)


def denoise_flow_batch(engine: LeanEngine, captions: list, x_init: torch.Tensor, sigmas: torch.Tensor,
                       grid: ImageGrid, settings: FlowSettings, on_step: Callable[[int], None],
                       runner: Optional[GraphRunner] = None) -> torch.Tensor:
    """The flow steps of one batch; call inside ``engine.session("unet")`` under ``torch.no_grad()``.

    ``x_init``: model-space latents at ``sigmas[0]`` (float32, CPU or device); ``captions``: one ``[L, C]`` row per
    DiT row (``flow_captions``' layout: the batch's positives, then its negatives when ``settings.guided``);
    ``settings`` supplies cfg, guidance and acceleration. ``bridge.check_interrupted()`` runs before every step and
    ``on_step(i)`` after step ``i`` was enqueued (the caller owns the progress bar). Returns the final model-space
    latents (float32, a new tensor on the device).
    """
    return run_dit_steps(engine, _prepare(engine, captions, x_init, sigmas, grid, settings, runner), on_step)
