"""Tiled VAE decode/encode (exact whole-image GroupNorm statistics, or partly estimated ones: ``blend``) and the
untiled fast path."""
