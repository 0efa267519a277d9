"""The flow-matching sampler for DiT families (Z-Image): schedule, prompt encoding, static-shape DiT call, the
step program the CUDA graph captures, and the loop."""
