"""sglang-nvfp4: sparse attention over an NVFP4 KV cache, served by SGLang.

Modules: :mod:`.format` (cache layout), :mod:`.reference` (kernel contract, torch oracle).
"""

__version__ = "0.1.0"
