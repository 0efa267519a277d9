"""Tiled VAE decode/encode (exact whole-image GroupNorm statistics, or blended tiles) and the untiled fast path."""
