"""The model configs of bench_e2e's ``one_batch`` and ``offline`` steps (``--models``, ``--offline-model``).

Granite-shaped, head_dim 128, ``--load-format dummy`` (config and tokenizer only, random weights drawn by
SGLang), vocab 32000: ``one_batch`` draws token ids < 10000, the tokenizer is not used for them.

* ``gqa64x4``: 64 query / 4 KV heads, hidden 4096, 4 layers.
* ``gqa16x1``: one rank of a Qwen3-235B-A22B-shaped model at ``--tp-size 4``, as one GPU serves it: 16 query / 1 KV
  head (64 / 4 split 4 ways), hidden 4096, and a dense MLP of 3072, the width of the 8 active experts' 1536 split 4
  ways (the same products per token as the rank's MoE, without its routing); 4 layers.
* ``tiny``: 16 query / 1 KV head, hidden 256, 2 layers.
* ``m3``: MiniMax-M3 (``MiniMaxM3SparseForCausalLM``) reduced as in issue 16: 2 layers, both with the learned
  indexer (4 index heads of 128, top-16 blocks of 128, init 1, local 1), hidden 2048, 64 query / 4 KV heads,
  rotary_dim 64, layer 0 a dense MLP (4096), layer 1 8 experts top-2 (512 each) + a shared expert, vocab
  200064. Served by ``triton`` it runs SGLang's in-tree M3 path (its sparse backend, bf16 KV and index keys).
"""

from __future__ import annotations

import os

from sglang_nvfp4.tiny_model import make_tiny_m3_model, make_tiny_model

MODELS = {
    "gqa64x4": {"kv_heads": 4, "layers": 4, "hidden_size": 4096, "heads_per_kv": 16},
    "gqa16x1": {"kv_heads": 1, "layers": 4, "hidden_size": 4096, "heads_per_kv": 16, "intermediate_size": 3072},
    "tiny": {"kv_heads": 1, "layers": 2, "hidden_size": 256, "heads_per_kv": 16},
    "m3": {"kv_heads": 4, "layers": 2, "hidden_size": 2048, "heads_per_kv": 16, "moe_layers": [1],
           "intermediate_size": 512, "dense_intermediate_size": 4096},
}
MINIMAX_M3_MODELS = {"m3"}
VOCAB_SIZE = 32000
M3_VOCAB_SIZE = 200064


def context_len(max_input: int, output_len: int) -> int:
    """A model config's context length for prompts of up to ``max_input`` tokens and ``output_len`` new ones: 131072
    (the configs' usual context) unless they need more (SGLang's request-to-token table is context_len + 4 wide)."""
    return max(131072, -(-(max_input + output_len + 8) // 1024) * 1024)


def dummy_model(out_dir: str, name: str, ctx: int) -> str:
    """Config and tokenizer of model ``name`` with a context of ``ctx`` tokens, in a folder of its own under
    ``out_dir``."""
    folder = os.path.join(out_dir, f"{name}_ctx{ctx}")
    if name in MINIMAX_M3_MODELS:
        return make_tiny_m3_model(folder, context_len=ctx, vocab_size=M3_VOCAB_SIZE, **MODELS[name])
    return make_tiny_model(folder, context_len=ctx, weights=False, vocab_size=VOCAB_SIZE, **MODELS[name])


def model_record(name: str, context_len: int) -> dict:
    """The config of model ``name`` as e2e.json records it."""
    vocab = M3_VOCAB_SIZE if name in MINIMAX_M3_MODELS else VOCAB_SIZE
    return {**MODELS[name], "context_len": context_len, "vocab_size": vocab, "load_format": "dummy"}
