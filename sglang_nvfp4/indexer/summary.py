"""The training-free indexer: which ``TOPK`` blocks each token attends to, per KV head, from per-page
key summaries kept beside the NVFP4 cache (:class:`SummaryIndexer`, a :class:`~.protocol.BlockIndexer`).

The sparse-attention kernels take ``block_ids [Hkv, T, K] int32`` logical block ids (see
:mod:`sglang_nvfp4.reference`); this module produces them without any trained weights.

Summaries (:class:`BlockSummaries`)
-----------------------------------
For each page and KV head: the mean key over the rows written so far, and optionally the
per-dim max and min (a Quest-style bound). Keys are the dequantized cache contents *without*
the layer's global ``k_scale`` (``e2m1 * e4m3``, as the kernels read them): a positive global
scale does not change any token's ranking of blocks, so summaries need no scale and are a pure
function of the cache bytes. They are stored in fp16 (min/max exactly, the mean rounded once).

``update(cache, slots)`` runs after the layer's K/V were written at ``slots``. For every page
written in the call it recomputes the summaries from the cache over rows ``0..r``, ``r`` the
highest row written to that page in the call. SGLang fills a page in row order (page size 128
= one block; a page's first write after (re)allocation starts at row 0), so rows ``0..r`` are
exactly the tokens written so far: a reused page is reset by its first write, stale rows of a
previous owner are never read, and partial pages, chunked prefill and decode need no special
case. ``fill[page] = r + 1`` records the count. Repeated slots in one call (CUDA-graph padding
entries that all write one dummy slot) are harmless.

Selection (:func:`select_blocks`)
---------------------------------
Token ``t`` (request ``req[t]``, position ``pos[t]``, own block ``own = pos[t] // 128``) sees
blocks ``0..own``. Per KV head, its ``G = H / Hkv`` query heads score each visible block by the
**sum over the G heads** of the per-head score:

* ``"mean"``: ``q_g . mean_b``;
* ``"quest"``: the upper bound of ``q_g . k`` over the block,
  ``sum_d max(q_gd * min_bd, q_gd * max_bd) = relu(q_g) . max_b + min(q_g, 0) . min_b``.

Both sums are linear in per-head query vectors, so they collapse to one aggregated query per
token and KV head (the head mean of ``q``, resp. of ``relu(q)`` and ``min(q, 0)``; a mean rather
than a sum keeps it in fp16 range), rounded to fp16; scores are fp16 x fp16 dot products with
fp32 accumulation. On the evaluation (``bench/eval_indexer.py``, ``bench/results/indexer_recall_*``)
the sum across heads gave quest a higher recall than the max across heads on every data set
(for mean it was mixed), at 1/G of its cost. ``"quest"`` is the summary method by default: the mean key dilutes a
single strongly matching key 128-fold and misses planted needles that the bound finds.

The blocks are then chosen by the selection rule of :mod:`.rules` (own, sink and local blocks
forced; ties select the lower id; a token with at most ``topk`` visible blocks attends all of them).

Implementations: a torch path (CPU, or ``impl="torch"``) and Triton kernels (CUDA/ROCm, or
``impl="triton"`` under ``TRITON_INTERPRET=1``) in :mod:`sglang_nvfp4.kernels.triton_indexer`, which
stream the blocks and keep a running top-k per token in registers (the T x blocks score
matrix is never materialised). Given equal scores both select identically; float summation
order can differ between them by an ulp, which can only swap blocks whose scores agree to
rounding.

GPU path and CUDA graphs: ``BlockSummaries.update`` and ``select_blocks`` with Triton do no
host synchronisation and have no data-dependent shapes (only data-dependent loops inside
kernels), so both can be captured in a CUDA graph. Index values (slots, ``req``, ``pos``,
``block_table`` entries of visible blocks) are checked only on the torch path; the Triton path
trusts them, like the attention kernels.
"""

from __future__ import annotations

import math

import torch

from .. import format as fmt
from ..reference import check_queries, check_token_metadata
from .protocol import StateBytes
from .rules import check_index_values, check_selection_settings, forced_blocks, rank_blocks

__all__ = ["BlockSummaries", "SummaryIndexer", "METHODS", "select_blocks", "aggregate_queries"]

METHODS = ("mean", "quest")
_IMPLS = ("auto", "torch", "triton")
_PAGES_PER_CHUNK = 256  # pages summarised at once on the torch path
_SCORES_PER_CHUNK = 1 << 22  # token x block scores per chunk on the torch path


def resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl: expected one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "torch" if device.type == "cpu" else "triton"
    return impl


class BlockSummaries:
    """Key summaries of one layer's cache pages, per KV head (see the module docstring).

    Attributes (all on ``device``):

    * ``mean``: fp16 ``[num_pages, Hkv, 128]``, mean key over the written rows;
    * ``bounds``: fp16 ``[num_pages, Hkv, 2, 128]`` (index 0 = per-dim max, 1 = min), or
      ``None`` when built with ``minmax=False`` (then only ``method="mean"`` can use it);
    * ``fill``: int32 ``[num_pages]``, rows the summaries cover (0 = never written).

    Memory per page and KV head: 256 bytes (mean), 768 with ``minmax`` (the cache holds 18432), plus
    8 bytes per page (``fill`` and the update's scratch row).
    """

    def __init__(self, num_pages: int, num_kv_heads: int, device=None, *, minmax: bool = True):
        if num_pages < 0 or num_kv_heads <= 0:
            raise ValueError(f"num_pages/num_kv_heads: need >= 0 and > 0, got {num_pages}, {num_kv_heads}")
        self.num_pages, self.num_kv_heads = num_pages, num_kv_heads
        shape = (num_pages, num_kv_heads, fmt.HEAD_DIM)
        self.mean = torch.zeros(shape, dtype=torch.float16, device=device)
        self.bounds = torch.zeros(num_pages, num_kv_heads, 2, fmt.HEAD_DIM, dtype=torch.float16, device=device) if minmax else None
        self.fill = torch.zeros(num_pages, dtype=torch.int32, device=device)
        # Highest row written per page in the current update; -1 between updates.
        self._last_row = torch.full((num_pages,), -1, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.mean.device

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held."""
        return sum(t.nbytes for t in (self.mean, self.bounds, self.fill, self._last_row) if t is not None)

    @staticmethod
    def bytes_per_page(num_kv_heads: int, *, minmax: bool = True) -> int:
        """Bytes per cache page of summaries built with these arguments."""
        return BlockSummaries(1, num_kv_heads, "cpu", minmax=minmax).nbytes

    def keys(self, method: str) -> torch.Tensor:
        """The summary the method scores against: fp16 ``[num_pages, Hkv, 128 or 256]``."""
        if method == "mean":
            return self.mean
        if method == "quest":
            if self.bounds is None:
                raise ValueError("method: 'quest' needs summaries built with minmax=True")
            return self.bounds.view(self.num_pages, self.num_kv_heads, 2 * fmt.HEAD_DIM)
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")

    def update(self, cache: torch.Tensor, slots: torch.Tensor, *, impl: str = "auto") -> None:
        """Refresh the summaries of the pages written at ``slots`` (int32/int64 ``[N]``, ``page * 128 +
        row``) from ``cache``; call after every K/V write of the layer. Graph-capturable on the Triton
        path (no host sync); slot values are checked on the torch path only."""
        hkv = fmt.check_cache(cache)
        if hkv != self.num_kv_heads or cache.shape[0] != self.num_pages:
            raise ValueError(f"cache: {cache.shape[0]} pages x {hkv} KV heads, summaries are for "
                             f"{self.num_pages} x {self.num_kv_heads}")
        if cache.device != self.device:
            raise ValueError(f"cache: on {cache.device}, summaries on {self.device}")
        if fmt.check_slots(slots) == 0:
            return
        if slots.device != self.device:
            raise ValueError(f"slots: on {slots.device}, summaries on {self.device}")
        if resolve_impl(impl, self.device) == "triton":
            from ..kernels.triton_indexer import summarize_pages

            summarize_pages(cache, slots, self._last_row, self.mean, self.bounds, self.fill)
        else:
            self._update_torch(cache, slots)

    def _update_torch(self, cache: torch.Tensor, slots: torch.Tensor) -> None:
        fmt.check_slots(slots, self.num_pages * fmt.PAGE_SIZE)
        page, row = slots.long() // fmt.PAGE_SIZE, (slots % fmt.PAGE_SIZE).int()
        last = torch.full_like(self._last_row, -1).scatter_reduce_(0, page, row, reduce="amax")
        touched = torch.unique(page)
        for start in range(0, touched.numel(), _PAGES_PER_CHUNK):
            pages = touched[start : start + _PAGES_PER_CHUNK]
            data = cache[pages, : self.num_kv_heads]  # K rows: [P, Hkv, 128 tokens, 72]
            k = fmt.dequantize_nvfp4(data[..., : fmt.SCALE_OFFSET], data[..., fmt.SCALE_OFFSET :], 1.0)
            count = last[pages].long() + 1  # [P]
            written = (torch.arange(fmt.PAGE_SIZE, device=k.device)[None, :] < count[:, None])[:, None, :, None]
            total = torch.where(written, k, 0.0).sum(dim=2)
            self.mean[pages] = (total / count[:, None, None]).half()
            if self.bounds is not None:
                self.bounds[pages, :, 0] = torch.where(written, k, -math.inf).amax(dim=2).half()
                self.bounds[pages, :, 1] = torch.where(written, k, math.inf).amin(dim=2).half()
            self.fill[pages] = count.int()


def _validate_select(q, summaries, block_table, req, pos, topk, sink_blocks, local_blocks, method):
    """Shape/dtype/device checks (no device sync); returns ``(T, Hkv)``."""
    if not isinstance(summaries, BlockSummaries):
        raise ValueError(f"summaries: expected BlockSummaries, got {type(summaries).__name__}")
    hkv = summaries.num_kv_heads
    t, _ = check_queries(q, hkv)
    if q.device != summaries.device:
        raise ValueError(f"q: on {q.device}, summaries on {summaries.device}")
    check_token_metadata(block_table, req, pos, t, summaries.device)
    check_selection_settings(topk, sink_blocks, local_blocks)
    summaries.keys(method)  # validates method (and minmax for quest)
    return t, hkv


_AGGREGATE_TOKENS = 8192  # tokens per chunk of the fp32 head averaging (bounds its temporaries)


def aggregate_queries(q: torch.Tensor, num_kv_heads: int, method: str) -> torch.Tensor:
    """``q [T, H, 128]`` -> fp16 ``[T, Hkv, D]`` aggregated queries, ``D`` = 128 (mean) or 256 (quest).

    ``"mean"``: the mean of the G query heads of each KV head; ``"quest"``: the means of
    ``relu(q)`` and ``min(q, 0)``, concatenated (they pair with ``bounds``' max and min).
    Averaged in fp32, ``_AGGREGATE_TOKENS`` tokens at a time."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    t, h, _ = q.shape
    width = fmt.HEAD_DIM if method == "mean" else 2 * fmt.HEAD_DIM
    out = torch.empty(t, num_kv_heads, width, dtype=torch.float16, device=q.device)
    for start in range(0, t, _AGGREGATE_TOKENS):
        rows = slice(start, min(start + _AGGREGATE_TOKENS, t))
        qg = q[rows].float().reshape(-1, num_kv_heads, h // num_kv_heads, fmt.HEAD_DIM)
        if method == "mean":
            out[rows] = qg.mean(dim=2)
        else:
            out[rows, :, : fmt.HEAD_DIM] = qg.clamp(min=0).mean(dim=2)
            out[rows, :, fmt.HEAD_DIM :] = qg.clamp(max=0).mean(dim=2)
    return out


def select_blocks(
    q: torch.Tensor,
    summaries: BlockSummaries,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    *,
    topk: int = fmt.TOPK,
    sink_blocks: int = 1,
    local_blocks: int = 1,
    method: str = "quest",
    impl: str = "auto",
) -> torch.Tensor:
    """Top-``topk`` blocks per KV head per token: int32 ``[Hkv, T, topk]``, ascending ids then ``-1``.

    ``q [T, H, 128]`` (bf16/fp16/fp32), ``block_table [R, S]``, ``req [T]``, ``pos [T]`` (int32) as in
    the kernel contract; scoring is in the module docstring, the rule in :mod:`.rules`. ``impl``: ``"auto"`` (torch on CPU,
    Triton elsewhere), ``"torch"`` or ``"triton"``."""
    t, hkv = _validate_select(q, summaries, block_table, req, pos, topk, sink_blocks, local_blocks, method)
    impl = resolve_impl(impl, q.device)
    if t == 0:
        return torch.empty(hkv, 0, topk, dtype=torch.int32, device=q.device)
    queries = aggregate_queries(q, hkv, method)
    keys = summaries.keys(method)
    if impl == "triton":
        from ..kernels.triton_indexer import select_top_blocks

        return select_top_blocks(queries, keys, block_table, req, pos, topk, sink_blocks, local_blocks)
    return _select_torch(queries, keys, block_table, req, pos, topk, sink_blocks, local_blocks)


def _select_torch(queries, keys, block_table, req, pos, topk, sink_blocks, local_blocks):
    t, hkv, _ = queries.shape
    check_index_values(block_table, req, pos, keys.shape[0])
    own = pos.long() // fmt.PAGE_SIZE
    out = torch.empty(hkv, t, topk, dtype=torch.int32, device=queries.device)
    for r in torch.unique(req).tolist():
        tokens = (req == r).nonzero()[:, 0]
        num_blocks = int(own[tokens].max()) + 1
        summary = keys[block_table[r, :num_blocks].long()].float()  # [B, Hkv, D]
        step = max(1, _SCORES_PER_CHUNK // (num_blocks * hkv))
        for start in range(0, tokens.numel(), step):
            chunk = tokens[start : start + step]
            scores = torch.einsum("thd,bhd->htb", queries[chunk].float(), summary)
            forced = forced_blocks(own[chunk], num_blocks, sink_blocks, local_blocks)
            out[:, chunk] = rank_blocks(scores, own[chunk], topk, forced)
    return out


class SummaryIndexer:
    """The training-free :class:`~.protocol.BlockIndexer`: one :class:`BlockSummaries` per layer, scored
    by :func:`select_blocks`. Summaries are a function of the cache bytes, so it keeps no per-token
    state and ignores ``model_inputs``: a move or an offload restore just recomputes the pages."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, device=None, *, method: str = "quest",
                 topk: int = fmt.TOPK, sink_blocks: int = 1, local_blocks: int = 1):
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        check_selection_settings(topk, sink_blocks, local_blocks)
        self.method, self.topk = method, topk
        self.sink_blocks, self.local_blocks = sink_blocks, local_blocks
        self.summaries = [BlockSummaries(num_pages, num_kv_heads, device, minmax=method == "quest")
                          for _ in range(num_layers)]

    @staticmethod
    def state_bytes(num_layers: int, num_kv_heads: int, method: str = "quest", **options) -> StateBytes:
        """What :class:`SummaryIndexer` with these arguments keeps: summaries per page, nothing per token
        (the selection options do not change it)."""
        return StateBytes(per_page=num_layers * BlockSummaries.bytes_per_page(num_kv_heads, minmax=method == "quest"))

    def state_nbytes(self) -> int:
        return sum(s.nbytes for s in self.summaries)

    def on_kv_written(self, layer_id, cache, slots, **model_inputs) -> None:
        self.summaries[layer_id].update(cache, slots)

    def save_tokens(self, layer_id, slots) -> None:
        return None

    def restore_tokens(self, layer_id, cache, slots, saved) -> None:
        self.summaries[layer_id].update(cache, slots)

    def select(self, layer_id, q, cache, block_table, req, pos, **model_inputs) -> torch.Tensor:
        return select_blocks(q, self.summaries[layer_id], block_table, req, pos, topk=self.topk,
                             sink_blocks=self.sink_blocks, local_blocks=self.local_blocks, method=self.method)
