"""Fused kernels: each a Triton kernel, a plain-torch reference with the same signature and a dispatcher."""
