"""The model configs of bench_e2e's ``one_batch`` and ``offline`` steps (``--models``, ``--offline-model``).

Granite-shaped, head_dim 128, ``--load-format dummy`` (config and tokenizer only, random weights drawn by
SGLang), vocab 32000: ``one_batch`` draws token ids < 10000, the tokenizer is not used for them.

* ``gqa64x4``: 64 query / 4 KV heads, hidden 4096, 4 layers.
* ``tiny``: 16 query / 1 KV head, hidden 256, 2 layers.
"""

from __future__ import annotations

import os

from sglang_nvfp4.tiny_model import make_tiny_model

MODELS = {
    "gqa64x4": {"kv_heads": 4, "layers": 4, "hidden_size": 4096, "heads_per_kv": 16},
    "tiny": {"kv_heads": 1, "layers": 2, "hidden_size": 256, "heads_per_kv": 16},
}
VOCAB_SIZE = 32000


def dummy_model(out_dir: str, name: str, context_len: int) -> str:
    """Config and tokenizer of model ``name`` at ``context_len``, in a folder of its own under ``out_dir``."""
    return make_tiny_model(os.path.join(out_dir, f"{name}_ctx{context_len}"), context_len=context_len, weights=False,
                           vocab_size=VOCAB_SIZE, **MODELS[name])


def model_record(name: str, context_len: int) -> dict:
    """The config of model ``name`` as e2e.json records it."""
    return {**MODELS[name], "context_len": context_len, "vocab_size": VOCAB_SIZE, "load_format": "dummy"}
