"""The token-level proxy indexer (``NVFP4_SPARSE_INDEXER=proxy``): MiniMax-M3's learned scoring without
its learned projection, for models that have none (:class:`ProxyIndexer`).

Per KV head, token ``t`` scores block ``b`` by the **max over the block's keys at positions <= pos[t]**
of ``qbar[t] . k``, where ``qbar`` is the mean of the KV head's ``G`` query heads
(:func:`~.summary.aggregate_queries`, fp16) and ``k`` the dequantized K in the cache without the layer's
global scale (``e2m1 * e4m3``; a positive scale changes no ranking). Blocks are then chosen by the rule of
:mod:`.rules`. On the trained retrieval model this score ranks the record's block into the top 13 in
0.983 / 0.950 of prompts at 4K / 8K, against 0.833 / 0.783 for quest (``bench/results/quality_scoring_recall.md``).

It keeps no state: the keys are the cache. The price is scoring every visible key instead of one summary
per block: the Triton path (:func:`sglang_nvfp4.kernels.triton_indexer.select_proxy_blocks`) decodes each
visible K page once per 64-token tile and runs ``qbar . k^T`` on the tensor cores (the M3 scoring kernel,
reading the NVFP4 cache). The torch path (CPU, or ``impl="torch"``) works one request at a time.
"""

from __future__ import annotations

import torch

from .. import format as fmt
from ..reference import check_queries, check_token_metadata
from .protocol import StateBytes
from .rules import check_index_values, check_selection_settings, forced_blocks, rank_blocks
from .summary import aggregate_queries, resolve_impl

__all__ = ["ProxyIndexer", "select_blocks_proxy"]

_SCORES_PER_CHUNK = 1 << 24  # token x head x key scores per chunk on the torch path


def select_blocks_proxy(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, req: torch.Tensor,
                        pos: torch.Tensor, *, topk: int = fmt.TOPK, sink_blocks: int = 1, local_blocks: int = 1,
                        impl: str = "auto") -> torch.Tensor:
    """Top-``topk`` blocks per KV head and token, int32 ``[Hkv, T, topk]`` (ascending ids, then ``-1``), scored
    as in the module docstring. ``q [T, H, 128]``, ``cache`` the layer's NVFP4 cache, ``block_table [R, S]``,
    ``req``, ``pos [T]`` int32 as in the kernel contract (:mod:`sglang_nvfp4.reference`)."""
    hkv = fmt.check_cache(cache)
    t, _ = check_queries(q, hkv)
    check_token_metadata(block_table, req, pos, t, cache.device)
    check_selection_settings(topk, sink_blocks, local_blocks)
    if q.device != cache.device:
        raise ValueError(f"q: on {q.device}, cache on {cache.device}")
    if t == 0:
        return torch.empty(hkv, 0, topk, dtype=torch.int32, device=q.device)
    queries = aggregate_queries(q, hkv, "mean")
    if resolve_impl(impl, q.device) == "triton":
        from ..kernels.triton_indexer import select_proxy_blocks

        return select_proxy_blocks(queries, cache, block_table, req, pos, topk, sink_blocks, local_blocks)
    return _select_torch(queries, cache, block_table, req, pos, topk, sink_blocks, local_blocks)


def _select_torch(queries, cache, block_table, req, pos, topk, sink_blocks, local_blocks):
    t, hkv, _ = queries.shape
    check_index_values(block_table, req, pos, cache.shape[0])
    own = pos.long() // fmt.PAGE_SIZE
    out = torch.empty(hkv, t, topk, dtype=torch.int32, device=queries.device)
    for r in torch.unique(req).tolist():
        tokens = (req == r).nonzero()[:, 0]
        num_blocks = int(own[tokens].max()) + 1
        data = cache[block_table[r, :num_blocks].long(), :hkv]  # K rows: [B, Hkv, 128 keys, 72]
        k = fmt.dequantize_nvfp4(data[..., : fmt.SCALE_OFFSET], data[..., fmt.SCALE_OFFSET :], 1.0)
        k = k.transpose(0, 1).reshape(hkv, num_blocks * fmt.PAGE_SIZE, fmt.HEAD_DIM).float()
        key_pos = torch.arange(num_blocks * fmt.PAGE_SIZE, device=queries.device)
        step = max(1, _SCORES_PER_CHUNK // (hkv * k.shape[1]))
        for start in range(0, tokens.numel(), step):
            chunk = tokens[start : start + step]
            logits = torch.einsum("thd,hkd->htk", queries[chunk].float(), k)
            logits = logits.masked_fill(key_pos[None, None, :] > pos[chunk].long()[None, :, None], -torch.inf)
            scores = logits.view(hkv, chunk.numel(), num_blocks, fmt.PAGE_SIZE).amax(dim=-1)
            forced = forced_blocks(own[chunk], num_blocks, sink_blocks, local_blocks)
            out[:, chunk] = rank_blocks(scores, own[chunk], topk, forced)
    return out


class ProxyIndexer:
    """:class:`~.protocol.BlockIndexer` scoring with :func:`select_blocks_proxy`: no state of its own."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, device=None, *, topk: int = fmt.TOPK,
                 sink_blocks: int = 1, local_blocks: int = 1):
        check_selection_settings(topk, sink_blocks, local_blocks)
        self.topk, self.sink_blocks, self.local_blocks = topk, sink_blocks, local_blocks

    @staticmethod
    def state_bytes(num_layers: int, num_kv_heads: int, **options) -> StateBytes:
        return StateBytes()

    def state_nbytes(self) -> int:
        return 0

    def on_kv_written(self, layer_id, cache, slots, **model_inputs) -> None:
        return None

    def save_tokens(self, layer_id, slots) -> None:
        return None

    def restore_tokens(self, layer_id, cache, slots, saved) -> None:
        return None

    def select(self, layer_id, q, cache, block_table, req, pos, **model_inputs) -> torch.Tensor:
        return select_blocks_proxy(q, cache, block_table, req, pos, topk=self.topk, sink_blocks=self.sink_blocks,
                                   local_blocks=self.local_blocks)
