"""DDIM schedule math, CFG, the fused sampler loop, the CUDA-graph runner and the stream scheduler."""
