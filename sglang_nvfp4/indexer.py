"""Block indexer: which ``TOPK`` blocks each token attends to, per KV head.

The sparse-attention kernels take ``topk [Hkv, T, K] int32`` logical block ids (see
:mod:`sglang_nvfp4.reference`). This module produces them without any trained weights, from
per-page key summaries kept beside the NVFP4 cache, and defines the :class:`BlockIndexer`
protocol through which a model's own index projections can replace it.

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
(for mean it was mixed), at 1/G of its cost. ``"quest"`` is the default: the mean key dilutes a
single strongly matching key 128-fold and misses planted needles that the bound finds.

The own block, the first ``sink_blocks`` blocks and the ``local_blocks`` blocks before the own
block are always selected (if visible); the remaining slots go to the visible blocks in the
order (score descending, block id ascending): **equal scores select the lower block id**. NaN
scores rank as the lowest finite score, +-inf as +-FLT_MAX; a visible block always beats an
empty slot. A token with at most ``topk`` visible blocks therefore selects all of them (dense).
Output rows hold the selected ids in ascending order, then ``-1`` padding. No block after the
token's own is ever selected.

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
from typing import Protocol, runtime_checkable

import torch

from . import format as fmt

__all__ = [
    "BlockSummaries",
    "BlockIndexer",
    "SummaryIndexer",
    "METHODS",
    "select_blocks",
    "aggregate_queries",
    "forced_blocks",
    "rank_blocks",
    "block_attention_mass",
    "oracle_blocks",
]

METHODS = ("mean", "quest")
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_IMPLS = ("auto", "torch", "triton")
_FLT_MAX = torch.finfo(torch.float32).max
_PAGES_PER_CHUNK = 256  # pages summarised at once on the torch path
_SCORES_PER_CHUNK = 1 << 22  # token x block scores per chunk on the torch path


def _resolve_impl(impl: str, device: torch.device) -> str:
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

    Memory per page and KV head: 256 bytes (mean), 768 with ``minmax`` (the cache holds 18432).
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
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots: expected int32/int64 [N], got {slots.dtype} {tuple(slots.shape)}")
        if slots.device != self.device:
            raise ValueError(f"slots: on {slots.device}, summaries on {self.device}")
        if slots.numel() == 0:
            return
        if _resolve_impl(impl, self.device) == "triton":
            from .kernels.triton_indexer import summarize_pages

            summarize_pages(cache, slots, self._last_row, self.mean, self.bounds, self.fill)
        else:
            self._update_torch(cache, slots)

    def _update_torch(self, cache: torch.Tensor, slots: torch.Tensor) -> None:
        capacity = self.num_pages * fmt.PAGE_SIZE
        if int(slots.min()) < 0 or int(slots.max()) >= capacity:
            raise ValueError(f"slots: values must be in [0, {capacity}), got {int(slots.min())}..{int(slots.max())}")
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
    if q.dim() != 3 or q.shape[2] != fmt.HEAD_DIM or q.dtype not in _Q_DTYPES:
        raise ValueError(f"q: expected bf16/fp16/fp32 [T, H, {fmt.HEAD_DIM}], got {q.dtype} {tuple(q.shape)}")
    t = q.shape[0]
    if q.shape[1] % hkv:
        raise ValueError(f"q: {q.shape[1]} query heads is not a multiple of the summaries' {hkv} KV heads")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table: expected int32 [R, S], got {block_table.dtype} {tuple(block_table.shape)}")
    for name, x in (("req", req), ("pos", pos)):
        if x.dtype != torch.int32 or x.shape != (t,):
            raise ValueError(f"{name}: expected int32 [{t}], got {x.dtype} {tuple(x.shape)}")
    for name, x in (("q", q), ("block_table", block_table), ("req", req), ("pos", pos)):
        if x.device != summaries.device:
            raise ValueError(f"{name}: on {x.device}, summaries on {summaries.device}")
    if topk < 1:
        raise ValueError(f"topk: must be >= 1, got {topk}")
    if sink_blocks < 0 or local_blocks < 0:
        raise ValueError(f"sink_blocks/local_blocks: must be >= 0, got {sink_blocks}, {local_blocks}")
    if sink_blocks + local_blocks + 1 > topk:
        raise ValueError(f"topk: {topk} slots cannot hold the own block + {sink_blocks} sink_blocks + "
                         f"{local_blocks} local_blocks")
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
    the kernel contract; the rule is in the module docstring. ``impl``: ``"auto"`` (torch on CPU,
    Triton elsewhere), ``"torch"`` or ``"triton"``."""
    t, hkv = _validate_select(q, summaries, block_table, req, pos, topk, sink_blocks, local_blocks, method)
    impl = _resolve_impl(impl, q.device)
    if t == 0:
        return torch.empty(hkv, 0, topk, dtype=torch.int32, device=q.device)
    queries = aggregate_queries(q, hkv, method)
    keys = summaries.keys(method)
    if impl == "triton":
        from .kernels.triton_indexer import select_top_blocks

        return select_top_blocks(queries, keys, block_table, req, pos, topk, sink_blocks, local_blocks)
    return _select_torch(queries, keys, block_table, req, pos, topk, sink_blocks, local_blocks)


def _validate_index_values(block_table, req, pos, num_pages):
    """Range checks on the index tensors (syncs with the device)."""
    if int(req.min()) < 0 or int(req.max()) >= block_table.shape[0]:
        raise ValueError(f"req: rows must be in [0, {block_table.shape[0]}), got {int(req.min())}..{int(req.max())}")
    if int(pos.min()) < 0:
        raise ValueError(f"pos: positions must be >= 0, got min {int(pos.min())}")
    if int(pos.max()) // fmt.PAGE_SIZE >= block_table.shape[1]:
        raise ValueError(f"pos: block {int(pos.max()) // fmt.PAGE_SIZE} is beyond the block table's "
                         f"{block_table.shape[1]} columns")
    own = pos.long() // fmt.PAGE_SIZE
    visible = torch.arange(block_table.shape[1], device=pos.device)[None, :] <= own[:, None]
    pages = block_table[req.long()]
    if bool((visible & ((pages < 0) | (pages >= num_pages))).any()):
        raise ValueError(f"block_table: a visible block maps to a page outside [0, {num_pages})")


def forced_blocks(own: torch.Tensor, num_blocks: int, sink_blocks: int, local_blocks: int) -> torch.Tensor:
    """bool ``[C, num_blocks]``: the own block, the first ``sink_blocks`` and the ``local_blocks``
    before the own block, of tokens whose own blocks are ``own [C]`` (visible ones only)."""
    blocks = torch.arange(num_blocks, device=own.device)[None, :]
    own = own[:, None]
    return (blocks <= own) & ((blocks == own) | (blocks < sink_blocks) | (blocks >= own - local_blocks))


def rank_blocks(scores: torch.Tensor, own: torch.Tensor, topk: int, forced: torch.Tensor) -> torch.Tensor:
    """The selection rule on ``scores [..., C, B]`` (column ``b`` = block ``b``) of tokens whose own
    blocks are ``own [C]``, with ``forced [C, B]`` always kept: int32 ``[..., C, topk]``, ascending
    ids then ``-1``. Visible = ``b <= own``; others rank by (score desc, id asc)."""
    visible = torch.arange(scores.shape[-1], device=scores.device)[None, :] <= own[:, None]
    s = scores.nan_to_num(nan=-_FLT_MAX, posinf=_FLT_MAX, neginf=-_FLT_MAX)
    s = torch.where(forced, math.inf, s)
    s = torch.where(visible, s, -math.inf)
    width = min(topk, s.shape[-1])
    sorted_scores, order = torch.sort(s, dim=-1, descending=True, stable=True)  # ties: lower id first
    empty = torch.iinfo(torch.int32).max
    chosen = torch.where(sorted_scores[..., :width] > -math.inf, order[..., :width], empty)
    chosen = torch.sort(chosen, dim=-1).values
    out = torch.full((*s.shape[:-1], topk), -1, dtype=torch.int32, device=s.device)
    out[..., :width] = torch.where(chosen == empty, -1, chosen).int()
    return out


def _select_torch(queries, keys, block_table, req, pos, topk, sink_blocks, local_blocks):
    t, hkv, _ = queries.shape
    _validate_index_values(block_table, req, pos, keys.shape[0])
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


def block_attention_mass(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    k_scale,
    sm_scale: float,
) -> torch.Tensor:
    """True attention mass per block, for evaluation: float64 ``[Hkv, T, S]`` (``S`` = block-table
    columns). Entry ``[h, t, b]`` sums, over the G query heads of KV head ``h``, the dense causal
    softmax weight (fp32 logits over the dequantized K) of token ``t`` on the keys of block ``b``;
    each row sums to G. Blocks after the token's own get 0."""
    hkv = fmt.check_cache(cache)
    t, h = q.shape[0], q.shape[1]
    if q.dim() != 3 or q.shape[2] != fmt.HEAD_DIM or h % hkv:
        raise ValueError(f"q: expected [T, H, {fmt.HEAD_DIM}] with H a multiple of {hkv}, got {tuple(q.shape)}")
    if block_table.dim() != 2 or req.shape != (t,) or pos.shape != (t,):
        raise ValueError("block_table/req/pos: expected [R, S], [T], [T]")
    _validate_index_values(block_table, req, pos, cache.shape[0])
    group = h // hkv
    mass = torch.zeros(hkv, t, block_table.shape[1], dtype=torch.float64, device=q.device)
    for r in torch.unique(req).tolist():
        tokens = (req == r).nonzero()[:, 0]
        num_blocks = int(pos[tokens].max()) // fmt.PAGE_SIZE + 1
        k = fmt.read_kv(cache, block_table[r, :num_blocks], k_scale, 1.0)[0]  # [B, Hkv, 128, 128]
        k = k.transpose(0, 1).reshape(hkv, num_blocks * fmt.PAGE_SIZE, fmt.HEAD_DIM)
        key_pos = torch.arange(num_blocks * fmt.PAGE_SIZE, device=q.device)
        for tok in tokens.split(64):
            qq = q[tok].float().view(len(tok), hkv, group, fmt.HEAD_DIM)
            logits = torch.einsum("tngd,nkd->tngk", qq, k) * sm_scale
            logits = logits.masked_fill(key_pos[None, None, None, :] > pos[tok].long()[:, None, None, None], -math.inf)
            p = torch.softmax(logits.double(), dim=-1).sum(dim=2)  # [C, Hkv, keys]
            per_block = p.view(len(tok), hkv, num_blocks, fmt.PAGE_SIZE).sum(dim=-1)
            mass[:, tok, :num_blocks] = per_block.transpose(0, 1)
    return mass


def oracle_blocks(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    k_scale,
    sm_scale: float,
    *,
    topk: int = fmt.TOPK,
) -> torch.Tensor:
    """The ``topk`` blocks of largest :func:`block_attention_mass` per KV head and token (evaluation
    only; equal masses select the lower id; nothing is forced): int32 ``[Hkv, T, topk]``, ascending
    ids then ``-1``."""
    if topk < 1:
        raise ValueError(f"topk: must be >= 1, got {topk}")
    mass = block_attention_mass(q, cache, block_table, req, pos, k_scale, sm_scale)
    own = pos.long() // fmt.PAGE_SIZE
    return rank_blocks(mass, own, topk, torch.zeros(mass.shape[1:], dtype=torch.bool, device=mass.device))


@runtime_checkable
class BlockIndexer(Protocol):
    """What the SGLang attention backend calls, per layer, to get the kernels' ``topk``.

    The backend owns the layer caches and block tables; an indexer owns whatever it keeps per
    page (summaries, or a model's index keys) and sees every K/V write:

    * ``on_kv_written(layer_id, cache, slots, k, **model_inputs)``: after the backend wrote
      ``k``/``v`` ``[N, Hkv, 128]`` for ``slots [N]`` into ``cache``;
    * ``select(layer_id, q, cache, block_table, req, pos, **model_inputs) -> int32 [Hkv, T, topk]``,
      logical block ids of request ``req[t]`` as in the kernel contract (``-1`` = none), at most
      ``topk`` per row, none after the token's own block.

    ``model_inputs`` carries what a model-provided indexer needs beyond attention's tensors (e.g.
    MiniMax-M3's ``idx_q``/``idx_k`` projections, forwarded by the backend from the model's
    attention call); the training-free :class:`SummaryIndexer` ignores it. Both methods must be
    free of host syncs on the GPU to run inside CUDA-graph decode.
    """

    topk: int

    def on_kv_written(self, layer_id: int, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                      **model_inputs) -> None: ...

    def select(self, layer_id: int, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               req: torch.Tensor, pos: torch.Tensor, **model_inputs) -> torch.Tensor: ...


class SummaryIndexer:
    """The training-free :class:`BlockIndexer`: one :class:`BlockSummaries` per layer, scored by
    :func:`select_blocks`. Summaries are computed from the cache bytes, so ``k`` is not used."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, device=None, *, method: str = "quest",
                 topk: int = fmt.TOPK, sink_blocks: int = 1, local_blocks: int = 1):
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        if sink_blocks < 0 or local_blocks < 0 or sink_blocks + local_blocks + 1 > topk:
            raise ValueError(f"topk: {topk} slots cannot hold the own block + {sink_blocks} sink_blocks + "
                             f"{local_blocks} local_blocks")
        self.method, self.topk = method, topk
        self.sink_blocks, self.local_blocks = sink_blocks, local_blocks
        self.summaries = [BlockSummaries(num_pages, num_kv_heads, device, minmax=method == "quest")
                          for _ in range(num_layers)]

    def on_kv_written(self, layer_id, cache, slots, k, **model_inputs) -> None:
        self.summaries[layer_id].update(cache, slots)

    def select(self, layer_id, q, cache, block_table, req, pos, **model_inputs) -> torch.Tensor:
        return select_blocks(q, self.summaries[layer_id], block_table, req, pos, topk=self.topk,
                             sink_blocks=self.sink_blocks, local_blocks=self.local_blocks, method=self.method)
