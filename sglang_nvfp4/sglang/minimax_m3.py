"""MiniMax-M3 (``MiniMaxM3SparseForCausalLM``) under ``nvfp4_sparse``: the one place that reads M3's
``sparse_attention_config`` and decides what this backend serves of it.

M3's sparse layers carry a learned indexer (``index_qkv_proj``): their attention call passes ``idx_q``
``[T, Hi, 128]`` and ``idx_k`` ``[T, 1, 128]`` and expects ``(idx_o, attn_output)`` back. Under this
backend they select with :class:`sglang_nvfp4.indexer.LearnedIndexer` (the in-tree semantics over the
model's index keys, kept per token slot beside the NVFP4 cache) and attend with the NVFP4 kernels; its
dense layers (``sparse_attention_freq`` 0) attend every visible block of the NVFP4 cache. SGLang's own
M3 pool (``MiniMaxSparseKVPool``) and hybrid backend are replaced by the plugin's hooks
(:mod:`.plugin`).

Supported (else a start-up error naming the field): ``sparse_block_size`` 128 (one page = one block),
``sparse_index_dim`` 128, ``sparse_topk_blocks`` <= 16 (the kernels' width), ``sparse_score_type``
``max``, one index head per KV head (``sparse_num_index_heads == num_key_value_heads``; SGLang unions
the selections of several index heads to ``g * topk`` blocks; fewer index heads than KV heads has no
in-tree meaning), index value heads disabled on every
sparse layer (``sparse_disable_index_value``: the released M3 has no ``index_v_proj``).

Index keys are kept in the checkpoint's dtype, as SGLang keeps them, or in fp8 (``NVFP4_SPARSE_INDEX_KEYS=fp8``,
:data:`INDEX_KEY_STORAGE`): 129 instead of 256 bytes a token and sparse layer, scored with their dequantized
values (selections then differ from the in-tree ones where the rounding reorders blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import format as fmt
from ..indexer import LearnedIndexer
from ..indexer.learned import INDEX_DIM

# NVFP4_SPARSE_INDEX_KEYS: how the learned indexer stores index keys; "model": the checkpoint's dtype (None here)
INDEX_KEY_STORAGE = {"model": None, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class M3Sparsity:
    """What this backend serves of an M3 checkpoint's ``sparse_attention_config``."""

    sparse_layers: frozenset[int]  # global ids of the layers with the learned indexer
    topk: int  # sparse_topk_blocks
    init_blocks: int  # sparse_init_block: leading blocks always attended
    local_blocks: int  # sparse_local_block: trailing blocks always attended, the token's own included
    key_dtype: torch.dtype = torch.bfloat16  # the checkpoint's torch_dtype (fp16 or else bf16), as SGLang keeps
    # index keys (a --dtype override of the checkpoint's is not followed), or fp8 (NVFP4_SPARSE_INDEX_KEYS)

    def indexer_kind(self, start_layer: int, num_layers: int, dense_layers=frozenset()) -> tuple[type, dict]:
        """The indexer of a rank's layers ``start_layer .. start_layer + num_layers - 1`` and its options (this
        project's rule counts ``local_blocks`` before the own block). Layers in ``dense_layers`` (global ids,
        ``None`` = every layer) attend every block, so they keep no index keys."""
        local = tuple(x - start_layer for x in sorted(self.sparse_layers)
                      if start_layer <= x < start_layer + num_layers and dense_layers is not None
                      and x not in dense_layers)
        return LearnedIndexer, {"sparse_layers": local, "topk": self.topk, "sink_blocks": self.init_blocks,
                                "local_blocks": self.local_blocks - 1, "key_dtype": self.key_dtype}


def is_m3(hf_config) -> bool:
    """SGLang's own test (``is_minimax_sparse``: the architecture name), which routes M3 to its pool and backend."""
    from sglang.srt.configs.model_config import is_minimax_sparse

    return is_minimax_sparse(hf_config)


def _text_config(hf_config):
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def m3_sparsity(hf_config, index_keys: str = "model") -> M3Sparsity | None:
    """``None`` for other models; for M3, its sparsity with index keys stored as ``index_keys`` says
    (:data:`INDEX_KEY_STORAGE`), or ``ValueError`` naming what is not supported."""
    if not is_m3(hf_config):
        return None
    text = _text_config(hf_config)
    cfg = getattr(text, "sparse_attention_config", None) or getattr(hf_config, "sparse_attention_config", None)
    where = "nvfp4_sparse: MiniMax-M3 sparse_attention_config"
    if not cfg:
        raise ValueError(f"{where} is missing")
    freq = list(cfg.get("sparse_attention_freq") or [])
    num_layers = text.num_hidden_layers
    if len(freq) != num_layers:
        raise ValueError(f"{where}: sparse_attention_freq has {len(freq)} entries for {num_layers} layers")
    sparse = frozenset(i for i, f in enumerate(freq) if f)
    no_value = list(cfg.get("sparse_disable_index_value") or [])
    with_value = sorted(i for i in sparse if i >= len(no_value) or not no_value[i])
    if with_value:
        raise ValueError(f"{where}: index value heads (sparse_disable_index_value 0) on layers {with_value} are not "
                         "supported; only index keys (the released M3 has no index_v_proj)")
    checks = [("sparse_block_size", cfg.get("sparse_block_size"), fmt.PAGE_SIZE),
              ("sparse_index_dim", cfg.get("sparse_index_dim"), INDEX_DIM),
              ("sparse_score_type", cfg.get("sparse_score_type", "max"), "max"),
              ("sparse_num_index_heads", cfg.get("sparse_num_index_heads"), text.num_key_value_heads)]
    for name, value, supported in checks:
        if value != supported:
            raise ValueError(f"{where}: {name}={value!r} is not supported (only {supported!r}"
                             + (", one index head per KV head)" if name == "sparse_num_index_heads" else ")"))
    topk = cfg.get("sparse_topk_blocks")
    if not isinstance(topk, int) or not 1 <= topk <= fmt.TOPK:
        raise ValueError(f"{where}: sparse_topk_blocks={topk!r} is not supported (1..{fmt.TOPK})")
    block = fmt.PAGE_SIZE
    init = cfg.get("sparse_init_block")
    init = math.ceil(cfg.get("sparse_init_tokens", 0) / block) if init is None else init
    local = cfg.get("sparse_local_block")
    local = math.ceil(cfg.get("sparse_local_tokens", 0) / block) + 1 if local is None else local
    if init < 0 or local < 1 or init + local > topk:
        raise ValueError(f"{where}: sparse_init_block={init}, sparse_local_block={local} do not fit "
                         f"sparse_topk_blocks={topk} (need init >= 0, local >= 1, init + local <= topk)")
    dtype = getattr(text, "torch_dtype", None) or getattr(hf_config, "torch_dtype", None)
    key_dtype = INDEX_KEY_STORAGE[index_keys] or (torch.float16 if dtype in (torch.float16, "float16")
                                                  else torch.bfloat16)
    return M3Sparsity(sparse, topk, init, local, key_dtype)
