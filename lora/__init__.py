"""LoRA support: file formats, key mapping, unmerged injection by hooks, merged injection with bit-exact restore.

Entry point: ``inject_lora(engine, path, strength, strength_text_encoder, target_blocks, mode)`` returns a new
engine view; see ``adapter.py`` for the invariants and ``docs/lora.md`` for the user-facing description.
"""
from .adapter import LoraAdapter, inject_lora
from .formats import LoraLayer, ParsedLora, parse_lora, read_state_dict
from .loader import LoadedLora, clear_cache, load_lora

__all__ = ["LoraAdapter", "inject_lora", "LoraLayer", "ParsedLora", "parse_lora", "read_state_dict",
           "LoadedLora", "clear_cache", "load_lora"]
