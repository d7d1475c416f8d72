"""A tiny random-weight model in Hugging Face format, generated locally (no hub access).

GraniteForCausalLM (Llama-like; its MLP needs no CuTe-DSL kernels, so it also serves on the GPU
bundle host) with the backend's attention shape: 16 query heads per KV head, head_dim 128. A
byte-level BPE tokenizer is trained on a small synthetic corpus with ``tokenizers``.

``python -m sglang_nvfp4.tiny_model OUT_DIR [--kv-heads 1] [--layers 2] [--seed 0] [--hidden-size 256]
[--heads-per-kv 16] [--context-len 16384] [--vocab-size 512] [--no-weights]``
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

VOCAB_SIZE = 512
_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or "
    "had not but first one their its new after who they have two been has more also into other "
    "page block key value cache sparse attention token model query head layer memory"
).split()


# Prompt words for tests, benchmarks and the demo: words of the tokenizer's corpus, about one token each.
PROMPT_WORDS = "the of and to in is was for on that with as by at from page block key value cache sparse".split()


def random_text(rng: random.Random, n_words: int) -> str:
    """``n_words`` words drawn from :data:`PROMPT_WORDS` with ``rng``, joined by spaces."""
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(n_words))


def _corpus(seed: int, lines: int = 2000):
    rng = random.Random(seed)
    for _ in range(lines):
        yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) + f" {rng.randint(0, 99999)}."


def _write_tokenizer(out_dir: str, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(out_dir)


def granite_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, layers: int, heads: int,
                   kv_heads: int, head_dim: int, context_len: int, rope_theta: float = 10000.0,
                   rms_norm_eps: float = 1e-5) -> dict:
    """``config.json`` of a GraniteForCausalLM with neutral multipliers (attention scale head_dim ** -0.5, as
    a plain Llama), untied LM head, no biases, bf16; special tokens bos 0, eos 1, pad 2."""
    return {
        "architectures": ["GraniteForCausalLM"], "model_type": "granite",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": context_len,
        "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "attention_multiplier": head_dim**-0.5, "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0, "logits_scaling": 1.0, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }


def minimax_m3_config(*, vocab_size: int, hidden_size: int, layers: int, heads: int, kv_heads: int,
                      context_len: int, sparse_layers: list[int] | None = None, moe_layers: list[int] | None = None,
                      topk_blocks: int = 16, init_blocks: int = 1, local_blocks: int = 1,
                      intermediate_size: int | None = None, dense_intermediate_size: int | None = None) -> dict:
    """``config.json`` of a MiniMax-M3 (``MiniMaxM3SparseForCausalLM``) shaped like the released model's
    attention: head_dim 128, rotary_dim 64, per-head gemma QK norm, one learned index head of 128 per KV head
    (keys only), blocks of 128, ``topk_blocks``; ``sparse_layers`` (default all) use the learned indexer,
    ``moe_layers`` (default none) have 8 experts top-2 (``intermediate_size`` each, default hidden), the others a
    dense swigluoai MLP (``dense_intermediate_size``, default 2 x hidden)."""
    sparse_layers = list(range(layers)) if sparse_layers is None else sparse_layers
    moe_layers = moe_layers or []
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m2", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128, "rotary_dim": 64,
        "rope_theta": 5000000.0, "max_position_embeddings": context_len, "rms_norm_eps": 1e-6,
        "use_qk_norm": True, "qk_norm_type": "per_head", "use_gemma_norm": True, "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "intermediate_size": intermediate_size or hidden_size,
        "dense_intermediate_size": dense_intermediate_size or 2 * hidden_size, "num_local_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "scoring_func": "sigmoid", "use_routing_bias": True, "routed_scaling_factor": 2.0,
        "moe_layer_freq": [int(i in moe_layers) for i in range(layers)], "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "sparse_attention_config": {
            "sparse_attention_freq": [int(i in sparse_layers) for i in range(layers)],
            "sparse_disable_index_value": [1] * layers, "sparse_num_index_heads": kv_heads,
            "sparse_index_dim": 128, "sparse_block_size": 128, "sparse_topk_blocks": topk_blocks,
            "sparse_init_block": init_blocks, "sparse_local_block": local_blocks, "sparse_score_type": "max",
        },
    }


def make_tiny_m3_model(out_dir: str, *, kv_heads: int = 2, layers: int = 2, heads_per_kv: int = 16,
                       hidden_size: int = 256, context_len: int = 16384, seed: int = 0,
                       vocab_size: int = VOCAB_SIZE, **m3_options) -> str:
    """A MiniMax-M3 config (:func:`minimax_m3_config`) and the tokenizer, no weights: serve it with
    ``--load-format dummy`` (SGLang's seeded random weights). Returns ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    _write_tokenizer(out_dir, seed)
    config = minimax_m3_config(vocab_size=vocab_size, hidden_size=hidden_size, layers=layers,
                               heads=heads_per_kv * kv_heads, kv_heads=kv_heads, context_len=context_len, **m3_options)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


def make_tiny_model(out_dir: str, *, kv_heads: int = 1, layers: int = 2, heads_per_kv: int = 16,
                    hidden_size: int = 256, context_len: int = 16384, seed: int = 0, weights: bool = True,
                    vocab_size: int = VOCAB_SIZE, intermediate_size: int | None = None) -> str:
    """Write config, a tokenizer and (unless ``weights=False``, for ``--load-format dummy``) random
    safetensors weights to ``out_dir``; returns ``out_dir``. A ``vocab_size`` above the tokenizer's
    serves benchmarks that feed random token ids (``sglang.benchmark.one_batch`` draws ids < 10000);
    ``intermediate_size``: the MLP's width (default 2 x ``hidden_size``)."""
    if weights and vocab_size != VOCAB_SIZE:
        raise ValueError(f"vocab_size: random weights are generated for the tokenizer's {VOCAB_SIZE}, got {vocab_size}")
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    _write_tokenizer(out_dir, seed)
    heads, head_dim, inter = heads_per_kv * kv_heads, 128, intermediate_size or 2 * hidden_size
    config = granite_config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=inter, layers=layers,
                            heads=heads, kv_heads=kv_heads, head_dim=head_dim, context_len=context_len)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if not weights:
        return out_dir
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    # Scales chosen so that attention moves the logits (its output is as large as the embedding)
    # and next-token distributions are peaked but not one-hot. The q/k and lm_head scales are set
    # for hidden_size 256 and scaled by sqrt(256 / hidden_size) (1 at the default), so that
    # attention scores and logits keep those statistics at other widths.
    width = (256 / hidden_size) ** 0.5
    tensors = {"model.embed_tokens.weight": rand(VOCAB_SIZE, hidden_size, std=1.0),
               "lm_head.weight": rand(VOCAB_SIZE, hidden_size, std=0.15 * width),
               "model.norm.weight": torch.ones(hidden_size, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden_size, std=0.1 * width),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden_size, std=0.1 * width),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden_size, std=hidden_size**-0.5),
            p + "self_attn.o_proj.weight": rand(hidden_size, heads * head_dim, std=(heads * head_dim) ** -0.5),
            p + "mlp.gate_proj.weight": rand(inter, hidden_size),
            p + "mlp.up_proj.weight": rand(inter, hidden_size),
            p + "mlp.down_proj.weight": rand(hidden_size, inter),
            p + "input_layernorm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
        })
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads-per-kv", type=int, default=16)
    ap.add_argument("--context-len", type=int, default=16384)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="above the tokenizer's only with --no-weights")
    ap.add_argument("--no-weights", action="store_true", help="config and tokenizer only (for --load-format dummy)")
    args = ap.parse_args()
    print(make_tiny_model(args.out_dir, kv_heads=args.kv_heads, layers=args.layers, seed=args.seed,
                          hidden_size=args.hidden_size, heads_per_kv=args.heads_per_kv, context_len=args.context_len,
                          weights=not args.no_weights, vocab_size=args.vocab_size))


if __name__ == "__main__":
    main()
