"""The token-level proxy indexer (``NVFP4_SPARSE_INDEXER=proxy``): MiniMax-M3's learned scoring without
its learned projection, for models that have none (:class:`ProxyIndexer`).

Per KV head, token ``t`` scores block ``b`` by the **max over the block's keys at positions <= pos[t]**
of ``qbar[t] . k``, where ``qbar`` is the mean of the KV head's ``G`` query heads
(:func:`~.summary.aggregate_queries`, fp16) and ``k`` the dequantized K in the cache without the layer's
global scale (``e2m1 * e4m3``; a positive scale changes no ranking). With ``groups`` > 1
(``NVFP4_SPARSE_PROXY_GROUPS``) the KV head's query heads are split into that many runs of consecutive heads,
each run's mean is a query, and the score is the max over them too; with one group per query head (``all``,
the default) a block scores the largest logit any of the KV head's query heads has on its keys. Blocks are then
chosen by the rule of :mod:`.rules`. On the trained retrieval model the every-head score kept the answers within
1 point of dense at 4K-32K where 8 groups lost 5 and 4 groups 12 (``pair`` prompts at 32K,
``bench/results/quality_selection_model_h200.md``).

It keeps no state: the keys are the cache. The price is scoring every visible key instead of one summary
per block: the Triton path (:func:`sglang_nvfp4.kernels.triton_indexer.select_proxy_blocks`) decodes each
visible K page once per program of 256 (token, query) rows, runs ``qbar . k^T`` on the tensor cores (the M3
scoring kernel, reading the NVFP4 cache) and takes the max over a token's queries in registers. The torch path
(CPU, or ``impl="torch"``) works one request at a time.

``precision="fp8"`` (``NVFP4_SPARSE_PROXY_PRECISION=fp8``) rounds each query row and each key to E4M3 before the
products (:func:`round_queries_fp8`, :func:`round_keys_fp8`; the Triton kernel runs them on Hopper's fp8 tensor
cores, twice the fp16 rate, and the torch path computes the same rounded values in fp32). A query row is scaled by
the power of two that puts its largest magnitude in ``[128, 256)`` and a key by 1/8 (its ``e2m1 * e4m3`` value is
at most 2688), so the rounding keeps E4M3's 4 significant bits and scores keep their units.

``share`` > 1 (``NVFP4_SPARSE_PROXY_SHARE``) has runs of up to ``share`` consecutive positions of one request select
once in prefill batches (:mod:`.rules`, "Shared selections"): a block scores the max over the run's tokens too, so
the run attends the blocks that serve any of its tokens best. The tokens then share their pages, which the prefill
kernels decode once per tile of tokens: fewer pages per tile, less attention time. With ``share_score="last"``
(``NVFP4_SPARSE_PROXY_SHARE_SCORE``) a run selects as its last token alone would: only the runs' last tokens are
scored, ``1 / share`` of the score products.
"""

from __future__ import annotations

import torch

from .. import format as fmt
from ..reference import check_queries, check_token_metadata
from .fp8 import round_rows
from .learned import select_by_max_pooled_keys
from .protocol import StateBytes
from .rules import (at_run_ends, check_index_values, check_selection_settings, check_share, max_runs, shares_selections,
                    token_runs)
from .summary import aggregate_queries, resolve_impl

__all__ = ["PRECISIONS", "ProxyIndexer", "round_keys_fp8", "round_queries_fp8", "select_blocks_proxy"]

PRECISIONS = ("fp16", "fp8")  # operands of the proxy's products (the module docstring)
FP8_KEY_FACTOR = 1 / 8  # keys (e2m1 * e4m3, at most 2688) times this fit E4M3 (at most 448) with room to spare


def round_queries_fp8(queries: torch.Tensor) -> torch.Tensor:
    """fp32 ``queries [..., D]`` rounded to E4M3 per row: ``e4m3(q * 2**j) / 2**j`` (round to nearest even), ``2**j``
    taking the row's largest magnitude into ``[128, 256)`` (:func:`.fp8.round_rows`); zero rows stay zero. The rule of
    the Triton kernel's ``_fp8_query_rows``."""
    return round_rows(queries)


def round_keys_fp8(keys: torch.Tensor) -> torch.Tensor:
    """fp32 keys (``e2m1 * e4m3`` values) rounded to E4M3 after the factor 1/8, back in their units."""
    return (keys.float() * FP8_KEY_FACTOR).to(torch.float8_e4m3fn).float() / FP8_KEY_FACTOR


def select_blocks_proxy(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, req: torch.Tensor,
                        pos: torch.Tensor, *, topk: int = fmt.TOPK, sink_blocks: int = 1, local_blocks: int = 1,
                        groups: int | None = 1, precision: str = "fp16", share: int = 1, share_score: str = "max",
                        impl: str = "auto", key_tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Top-``topk`` blocks per KV head and token, int32 ``[Hkv, T, topk]`` (ascending ids, then ``-1``), scored
    as in the module docstring with ``groups`` queries per KV head (``None``: every query head is one), the
    products' ``precision`` (``"fp16"`` or ``"fp8"``) and runs of ``share`` positions selecting once, scored by
    ``share_score`` (``"max"`` or ``"last"``).
    ``q [T, H, 128]``, ``cache`` the layer's NVFP4 cache, ``block_table [R, S]``, ``req``, ``pos [T]`` int32 as
    in the kernel contract (:mod:`sglang_nvfp4.reference`). ``key_tiles``: the forward's predecoded E4M3 key tiles
    holding ``cache``'s keys (:meth:`sglang_nvfp4.kernels.AttentionPlan.predecode`), which fp8 scores on Hopper copy
    instead of decoding the cache's pages: the same selection."""
    hkv = fmt.check_cache(cache)
    t, heads = check_queries(q, hkv)
    group = heads // hkv
    check_token_metadata(block_table, req, pos, t, cache.device)
    check_selection_settings(topk, sink_blocks, local_blocks)
    groups = group if groups is None else groups
    if groups < 1 or group % groups:
        raise ValueError(f"groups={groups}: must divide the {group} query heads per KV head")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    check_share(share, share_score)
    if q.device != cache.device:
        raise ValueError(f"q: on {q.device}, cache on {cache.device}")
    if t == 0:
        return torch.empty(hkv, 0, topk, dtype=torch.int32, device=q.device)
    runs = None
    if shares_selections(share, t, block_table.shape[0]):
        runs = token_runs(req, pos, share, max_runs(t, block_table.shape[0], share))
        if share_score == "last":  # each run's last token selects alone, and its run takes the selection
            run, run_pos = runs
            last = at_run_ends(run, torch.arange(t, dtype=torch.int32, device=pos.device), run_pos.shape[0])
            chosen = _select(q, last, cache, block_table, req[last], run_pos, topk, sink_blocks, local_blocks, groups,
                             precision, None, impl, key_tiles)
            return chosen.index_select(1, run)
    return _select(q, None, cache, block_table, req, pos, topk, sink_blocks, local_blocks, groups, precision, runs,
                   impl, key_tiles)


def _select(q, query_rows, cache, block_table, req, pos, topk, sink_blocks, local_blocks, groups, precision, runs,
            impl, key_tiles):
    """:func:`select_blocks_proxy` (arguments checked there) for the tokens of ``req``, ``pos``, whose queries are
    rows ``query_rows`` (int32) of ``q``, or all of them in order (``None``)."""
    hkv = cache.shape[1] // 2
    group = q.shape[1] // hkv
    triton_path = resolve_impl(impl, q.device) == "triton"
    if groups == group and triton_path:
        # one query per head: the layer's queries as they are, which the score kernels read (rows picked, rounded
        # to fp16) themselves: no copy (a gather and an fp16 conversion cost 0.14 ms per layer for the runs' last
        # tokens at 32K, 64/4, on an H100; the conversion of every token's, 0.76 ms)
        queries = q if q.stride(2) == 1 else q.contiguous()
    else:
        if query_rows is not None:
            q, query_rows = q[query_rows.long()], None
        # [T, Hkv * groups, 128] fp16: means of runs of consecutive heads; one run per head is the query itself
        queries = q.to(torch.float16) if groups == group else aggregate_queries(q, hkv * groups, "mean")
    if triton_path:
        from ..kernels.triton_indexer import select_proxy_blocks

        return select_proxy_blocks(queries, cache, block_table, req, pos, topk, sink_blocks, local_blocks,
                                   groups=groups, fp8=precision == "fp8", runs=runs, query_rows=query_rows,
                                   key_tiles=key_tiles)
    return _select_torch(queries, cache, block_table, req, pos, topk, sink_blocks, local_blocks, groups, precision,
                         runs)


def _select_torch(queries, cache, block_table, req, pos, topk, sink_blocks, local_blocks, groups, precision, runs):
    hkv = queries.shape[1] // groups
    check_index_values(block_table, req, pos, cache.shape[0])
    fp8 = precision == "fp8"

    def request_keys(r: int, num_blocks: int) -> torch.Tensor:  # dequantized K per KV head: [Hkv, B * 128, 128]
        data = cache[block_table[r, :num_blocks].long(), :hkv]  # K rows: [B, Hkv, 128 keys, 72]
        k = fmt.dequantize_nvfp4(data[..., : fmt.SCALE_OFFSET], data[..., fmt.SCALE_OFFSET :], 1.0)
        k = k.transpose(0, 1).reshape(hkv, num_blocks * fmt.PAGE_SIZE, fmt.HEAD_DIM).float()
        return round_keys_fp8(k) if fp8 else k

    queries = round_queries_fp8(queries) if fp8 else queries
    return select_by_max_pooled_keys(queries, request_keys, req, pos, topk, sink_blocks, local_blocks, groups, runs)


class ProxyIndexer:
    """:class:`~.protocol.BlockIndexer` scoring with :func:`select_blocks_proxy` (``groups`` queries per KV head,
    ``None``: every query head; products in ``precision``; runs of ``share`` positions selecting once, scored by
    ``share_score``): no state of its own."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, device=None, *, topk: int = fmt.TOPK,
                 sink_blocks: int = 1, local_blocks: int = 1, groups: int | None = 1, precision: str = "fp16",
                 share: int = 1, share_score: str = "max"):
        check_selection_settings(topk, sink_blocks, local_blocks)
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
        check_share(share, share_score)
        self.topk, self.sink_blocks, self.local_blocks, self.groups = topk, sink_blocks, local_blocks, groups
        self.precision, self.share, self.share_score = precision, share, share_score
        self.wants_key_tiles = precision == "fp8"  # the Gluon fp8 scores copy predecoded key tiles

    @property
    def selection_run(self) -> int:
        """Tokens of a prefill that select once (``share``; :func:`.rules.shares_selections`)."""
        return self.share

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

    def select(self, layer_id, q, cache, block_table, req, pos, *, key_tiles=None, **model_inputs) -> torch.Tensor:
        """As the protocol's; ``key_tiles``: the forward's predecoded E4M3 key tiles of this layer, when its plan
        predecodes (:func:`select_blocks_proxy`)."""
        return select_blocks_proxy(q, cache, block_table, req, pos, topk=self.topk, sink_blocks=self.sink_blocks,
                                   local_blocks=self.local_blocks, groups=self.groups, precision=self.precision,
                                   share=self.share, share_score=self.share_score, key_tiles=key_tiles)
