"""ESRGAN-family upscalers: architectures, declarative detection, ncnn conversion and the tiled runner.

Public entry points: ``load_upscaler(path)`` (``loader``), ``upscale_images(upscaler, images, ...)``
(``runner``), ``python -m leandiffusion.upscale.convert_ncnn SRC.param OUT.safetensors``.
"""
