"""Qwen-Image text-to-image: prompt encoding as ``QwenImagePipeline.encode_prompt`` and the flow-matching loop
with true CFG, over diffusers' own ``QwenImageTransformer2DModel``."""
