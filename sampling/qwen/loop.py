"""The Qwen-Image text-to-image loop: prompts + seed -> LATENT, as ``QwenImagePipeline``.

Invariants (what makes the output equal ``QwenImagePipeline(prompt, negative_prompt, true_cfg_scale=cfg,
num_inference_steps=steps, width, height, num_images_per_prompt=batch, generator=torch.Generator("cpu")
.manual_seed(seed), output_type="latent")``, unpacked and converted to raw VAE space, ``latent * latents_std +
latents_mean`` per channel):
- Prompts: ``text.encode_prompts`` (the pipeline's ``encode_prompt``), the batch's rows all of the one prompt (and
  of the negative when guided).
- Noise: one ``torch.Generator("cpu").manual_seed(seed)`` draw of the whole ``[B, 16, h, w]`` float32 shape, packed
  into 2x2 patches (``latents.pack``).
- Schedule: ``flow.schedule.flow_sigmas`` (``linspace(1, 1/steps, steps)`` through diffusers'
  ``FlowMatchEulerDiscreteScheduler`` with ``mu`` from the packed sequence length, the config's exponential shift
  and terminal stretch); the transformer's timestep is ``1000 sigma / 1000`` in the model dtype.
- Guidance (``cfg`` is ``true_cfg_scale``): ``cfg > 1`` runs the transformer ONCE per step on the rows
  ``[prompt x B, negative x B]`` (each row's text zero-padded to a common bucket and masked, which gives each row
  the prediction of its own unpadded call: ``forward.py``) and combines ``u + cfg (c - u)`` rescaled per token to
  the norm of ``c``; otherwise one call on the prompt. Euler: ``x + (sigma_next - sigma) v``; the state stays float32.
- The step is ``program.QwenStepProgram`` over static buffers: ``acceleration`` ``cuda_graph`` captures it whole
  (transformer, CFG combine, Euler update) once per shape key and replays it for every step, seed and prompt of the
  same text bucket; ``compile+cuda_graph`` compiles every transformer block first (``accel.py``); ``none`` runs the
  same program eagerly. On the GPU the host runs at most two steps ahead.
- An edit passes ``reference`` (``forward.QwenReference``): packed reference-image tokens ride after the noise tokens
  in every call, with their ``img_shapes`` entries, and only the noise tokens' prediction is used.
- Every model call runs inside ``engine.session(...)``; ``bridge.check_interrupted()`` runs before every step.
- img2img (``latent_image``, ``denoise`` < 1): ``start.qwen_start``, the Z-Image flow sampler's meaning of
  ``denoise``; CONDITIONING (``positive_cond`` / ``negative_cond``, Qwen2.5-VL hidden states) replaces its side's
  prompt string: ``conditioning.qwen_text_rows``.

Why hand-written rather than calling the pipeline (the tests' reference): batched CFG over static buffers, CUDA-graph
replay, the VRAM policy's sessions and the pack's LATENT conventions do not fit its ``__call__``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ... import bridge
from ...memory.engine import LeanEngine
from ..dit_steps import PreparedDitSteps, prepare_dit_steps, run_dit_steps
from ..flow.schedule import TRAIN_TIMESTEPS
from ..flow.settings import FlowSettings
from ..graph_runner import GraphRunner
from ..loop import resolve_acceleration, step_allocator
from .accel import compiled_forward_fn, eager_forward_fn
from .conditioning import qwen_text_rows
from .forward import QwenReference, qwen_layout, text_capacity
from .latents import pack, to_raw, unpack
from .program import QwenStepProgram
from .start import qwen_start


FAMILY = "qwen_image"


def is_qwen_image(engine: Any) -> bool:
    """Whether ``engine`` is a LEAN_MODEL of the ``qwen_image`` family (this loop's, not the Z-Image sampler's)."""
    return isinstance(engine, LeanEngine) and engine.family == FAMILY


def check_qwen_inputs(engine: Any) -> LeanEngine:
    """The engine, or an error naming ``lean_model`` when it is not a Qwen-Image model."""
    if not is_qwen_image(engine):
        got = engine.family if isinstance(engine, LeanEngine) else type(engine).__name__
        raise ValueError(f"lean_model: expected a Qwen-Image model (family {FAMILY}), got {got}")
    return engine


def sample_qwen_image(engine: LeanEngine, settings: FlowSettings, latent_image: Optional[dict] = None,
                      positive_cond: Any = None, negative_cond: Any = None, quiet: bool = False,
                      runner: Optional[GraphRunner] = None) -> dict:
    """Run the loop; returns ``{"samples": raw latents [B, 16, h, w] float32 on the CPU}`` (module docstring).
    ``runner``: the CUDA-graph runner (the process-wide one when omitted)."""
    s = settings.validated()
    check_qwen_inputs(engine)
    start, sigmas, batch_index = qwen_start(engine, s, latent_image)
    h, w = start.shape[2], start.shape[3]
    bridge.check_interrupted()
    sides = 2 if s.guided else 1
    rows = qwen_text_rows(engine, [s.positive, s.negative][:sides], [positive_cond, negative_cond][:sides],
                          ["positive_cond", "negative_cond"][:sides], start.shape[0])
    text_rows = [row for side in rows for row in side]
    with engine.session("unet"), torch.no_grad():
        x = _denoise(engine, text_rows, pack(start), sigmas, (h, w), s, quiet, runner=runner)
    out = {"samples": to_raw(unpack(x.cpu(), h, w), engine.parts.vae)}
    if batch_index is not None:
        out["batch_index"] = batch_index
    return out


def _denoise(engine: LeanEngine, text_rows: list, x: torch.Tensor, sigmas: torch.Tensor, size: tuple[int, int],
             s: FlowSettings, quiet: bool, reference: Optional[QwenReference] = None,
             runner: Optional[GraphRunner] = None) -> torch.Tensor:
    """The Euler steps under the loop's progress bar over packed float32 latents ``x`` ``[B, N, 64]`` of a latent
    of ``size`` (h, w); ``text_rows``: one ``[L, C]`` tensor per model row (``[prompt x B, negative x B]`` when
    guided); ``reference``: an edit's reference tokens. Call inside ``engine.session("unet")``."""
    with bridge.ProgressBar(sigmas.shape[0] - 1, desc="Qwen-Image", quiet=quiet) as bar:
        return denoise_qwen_batch(engine, text_rows, x, sigmas, size, s, lambda i: bar.update(1), reference, runner)


def _prepare(engine: LeanEngine, text_rows: list, x: torch.Tensor, sigmas: torch.Tensor, size: tuple[int, int],
             s: FlowSettings, reference: Optional[QwenReference], runner: Optional[GraphRunner]) -> PreparedDitSteps:
    device, dit, dtype = engine.device, engine.parts.unet, engine.dtype
    batch = x.shape[0]
    if len(text_rows) != (2 * batch if s.guided else batch):
        raise ValueError(f"{len(text_rows)} text rows for a batch of {batch} (guided={s.guided}); expected "
                         f"{2 * batch if s.guided else batch}")
    reference = reference.checked(batch) if reference is not None else None
    capacity = text_capacity([int(r.shape[0]) for r in text_rows])
    layout = qwen_layout(dit, text_rows, capacity, (1, size[0] // 2, size[1] // 2), reference, dtype, device)
    timesteps = ((sigmas[:-1].to(torch.float32) * TRAIN_TIMESTEPS).to(dtype) / TRAIN_TIMESTEPS).to(device)
    coeffs = torch.stack([torch.full_like(sigmas[:-1], s.cfg), sigmas[1:] - sigmas[:-1]], dim=1)
    coeffs = coeffs.to(device=device, dtype=torch.float32)
    x_dev = x.to(device=device, dtype=torch.float32)

    def build(fn) -> QwenStepProgram:
        return QwenStepProgram(fn, batch, x.shape[1], x.shape[2], layout, dtype, s.guided, step_allocator(engine))

    def prepare(program: QwenStepProgram) -> None:
        program.load(layout, x_dev)
        program.set_step(timesteps[0], coeffs[0])

    shapes = None if reference is None else (tuple(layout.reference.shape), reference.shapes)
    key = ("qwen_image", tuple(x.shape), dtype, s.guided, capacity, layout.text_lengths, shapes,
           layout.modulate_index is not None)
    working = (len(text_rows), *size) if reference is None else None  # the scaled estimate leaves out references
    return prepare_dit_steps(engine, resolve_acceleration(engine, s.acceleration, runner), key, build, prepare,
                             eager_forward_fn(dit), lambda: compiled_forward_fn(engine), runner, timesteps, coeffs,
                             working=working)


def denoise_qwen_batch(engine: LeanEngine, text_rows: list, x_init: torch.Tensor, sigmas: torch.Tensor,
                       size: tuple[int, int], settings: FlowSettings, on_step: Callable[[int], None],
                       reference: Optional[QwenReference] = None,
                       runner: Optional[GraphRunner] = None) -> torch.Tensor:
    """The steps of one batch; call inside ``engine.session("unet")`` under ``torch.no_grad()``. Returns the final
    packed model-space latents (float32, a new tensor on the device). ``bridge.check_interrupted()`` runs before
    every step and ``on_step(i)`` after step ``i`` was enqueued (the caller owns the progress bar)."""
    prepared = _prepare(engine, text_rows, x_init, sigmas, size, settings, reference, runner)
    return run_dit_steps(engine, prepared, on_step)
