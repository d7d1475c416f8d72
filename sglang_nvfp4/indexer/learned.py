"""The learned indexer: block selection from a model's own index projections (MiniMax-M3's
``index_qkv_proj``), a :class:`~.protocol.BlockIndexer` that keeps the model's index keys beside the
NVFP4 cache (:class:`LearnedIndexer`).

What the model hands the attention call of a sparse layer (``model_inputs``): ``idx_q [T, Hi, D]``
(``Hi`` index heads, already normed and roped) and ``idx_k [T, 1, D]`` (one index-key head shared by
the index heads), bf16, ``D = 128``. Index head ``h`` selects for KV head ``h`` (``Hi == Hkv``: the
configurations with several index heads per KV head, whose selections SGLang unions to ``g * topk``
blocks, are refused at start-up by :mod:`sglang_nvfp4.sglang.minimax_m3`).

Index keys (:class:`IndexKeys`): one ``[slots, D]`` tensor per sparse layer, written at the tokens' cache
slots (``out_cache_loc``) with the main K/V, in the model dtype (``2 D`` bytes a token, as SGLang keeps them) or
in fp8 (``D + 1`` bytes, ``NVFP4_SPARSE_INDEX_KEYS=fp8``): each key's E4M3 codes after scaling by the power of
two that puts its largest magnitude in ``[128, 256)``, and that power's inverse as one E8M0 byte
(:func:`.fp8.quantize_rows`). They follow the tokens: a radix-cache prefix or an earlier chunk keeps its slots,
so its index keys are reused as they are; a move or an offload restore carries them
(:meth:`LearnedIndexer.save_tokens` / ``restore_tokens``).

Scores (:func:`select_blocks_learned`), MiniMax-M3's in-tree semantics (SGLang 0.5.23,
``minimax_sparse/prefill/flash_with_topk_idx.py``, ``block_size_q = 1``, score type ``max``): token
``t`` at position ``p`` scores block ``b`` per index head by the **max over the block's keys at
positions <= p** of ``idx_q[t, h] . idx_k[key]`` (fp32 products of the stored values; the in-tree
``D ** -0.5 * log2(e)`` factor is positive and changes no ranking, so it is left out; fp8 keys score with
their dequantized values, ``codes * 2**(e - 127)``). Blocks are then
chosen by :mod:`.rules`: M3's ``sparse_init_block`` leading blocks are this project's ``sink_blocks``,
and its ``sparse_local_block`` counts the own block, so ``local_blocks = sparse_local_block - 1``.
Equal scores select the lower block id (SGLang's bitonic and radix top-k leave ties unspecified).

Implementations: torch (CPU, or ``impl="torch"``; one request at a time, token chunks bounded by
``_SCORES_PER_CHUNK``) and a Triton kernel (:func:`sglang_nvfp4.kernels.triton_indexer.select_learned_blocks`:
tensor-core ``idx_q . idx_k^T`` per 128-key block, max-reduced in registers, merged into a running
top-k; no score matrix in memory, no host sync, so decode runs it inside CUDA graphs). With fp8 keys the
kernel converts the codes to the queries' dtype (exact), runs the same products and multiplies each key's
column by its power of two (exact), so both paths score the dequantized keys.
"""

from __future__ import annotations

import math

import torch

from .. import format as fmt
from ..reference import check_token_metadata
from .fp8 import E8M0_BIAS, dequantize_rows, quantize_rows
from .protocol import StateBytes
from .rules import check_index_values, check_selection_settings, forced_blocks, max_into_runs, rank_blocks
from .summary import resolve_impl

__all__ = ["IndexKeys", "LearnedIndexer", "select_blocks_learned", "INDEX_DIM", "INDEX_KEY_DTYPES"]

INDEX_DIM = 128  # the index head size the kernels are built for (MiniMax-M3's sparse_index_dim)
MODEL_DTYPES = (torch.bfloat16, torch.float16)  # of idx_q / idx_k, and of index keys kept as the model gives them
INDEX_KEY_DTYPES = (*MODEL_DTYPES, torch.float8_e4m3fn)  # fp8: E4M3 codes + one E8M0 exponent per key
_SCORES_PER_CHUNK = 1 << 24  # token x head x key scores per chunk on the torch path


class IndexKeys:
    """A layer's index keys, row = cache slot: ``keys [num_pages * 128, D]`` in ``dtype`` (bf16 by default), and
    for fp8 (``torch.float8_e4m3fn``) ``exponents`` uint8 ``[num_pages * 128]`` (:func:`.fp8.quantize_rows`;
    ``None`` otherwise)."""

    def __init__(self, num_pages: int, device=None, *, dtype: torch.dtype = torch.bfloat16, dim: int = INDEX_DIM):
        if dtype not in INDEX_KEY_DTYPES:
            raise ValueError(f"dtype: index keys are stored as {INDEX_KEY_DTYPES}, got {dtype}")
        slots = num_pages * fmt.PAGE_SIZE
        self.keys = torch.zeros(slots, dim, dtype=dtype, device=device)
        self.exponents = torch.full((slots,), E8M0_BIAS, dtype=torch.uint8, device=device) if self.fp8 else None

    @property
    def fp8(self) -> bool:
        return self.keys.dtype == torch.float8_e4m3fn

    @staticmethod
    def bytes_per_token(dtype: torch.dtype = torch.bfloat16, dim: int = INDEX_DIM) -> int:
        """Bytes per token slot: the key, plus its exponent byte in fp8."""
        size = torch.empty((), dtype=dtype).element_size()
        return dim * size + (1 if dtype == torch.float8_e4m3fn else 0)

    def nbytes(self) -> int:
        return self.keys.nbytes + (self.exponents.nbytes if self.fp8 else 0)

    def write(self, slots: torch.Tensor, idx_k: torch.Tensor) -> None:
        """Store ``idx_k [N, 1, D]`` (or ``[N, D]``) at ``slots [N]``, quantized when the keys are fp8 (no host
        sync: CUDA-graph safe)."""
        n = fmt.check_slots(slots)
        if idx_k.shape[0] != n or idx_k.numel() != n * self.keys.shape[1]:
            raise ValueError(f"idx_k: expected [{n}, 1, {self.keys.shape[1]}] for {n} slots, got {tuple(idx_k.shape)}")
        slots, idx_k = slots.long(), idx_k.reshape(n, -1)
        if self.fp8 and resolve_impl("auto", self.keys.device) == "triton":  # one launch (decode: in CUDA graphs)
            from ..kernels.triton_indexer import write_fp8_index_keys

            write_fp8_index_keys(self.keys, self.exponents, slots, idx_k.contiguous())
        elif self.fp8:
            codes, exponents = quantize_rows(idx_k)
            self.keys.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))  # no fp8 index_copy_ on CPU
            self.exponents.index_copy_(0, slots, exponents)
        else:
            self.keys.index_copy_(0, slots, idx_k.to(self.keys.dtype))

    def values(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, D]``: the keys at ``slots [N]`` as scoring sees them (fp8: dequantized)."""
        slots = slots.long()
        if self.fp8:
            return dequantize_rows(self.keys[slots], self.exponents[slots])
        return self.keys[slots].float()

    def save(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored bytes of ``slots [N]`` (fp8: uint8 ``[N, D + 1]``, the codes then the exponent)."""
        slots = slots.long()
        if self.fp8:
            return torch.cat([self.keys[slots].view(torch.uint8), self.exponents[slots, None]], dim=1)
        return self.keys[slots].clone()

    def restore(self, slots: torch.Tensor, saved: torch.Tensor) -> None:
        """Put back what :meth:`save` returned at ``slots``."""
        slots = slots.long()
        if self.fp8:
            self.keys[slots] = saved[:, :-1].contiguous().view(torch.float8_e4m3fn)
            self.exponents[slots] = saved[:, -1]
        else:
            self.keys[slots] = saved.to(self.keys.dtype)


def _check_select_inputs(idx_q, keys, block_table, req, pos):
    if idx_q.dim() != 3 or idx_q.shape[2] != keys.shape[1] or idx_q.dtype not in MODEL_DTYPES:
        raise ValueError(f"idx_q: expected bf16/fp16 [T, Hi, {keys.shape[1]}], got {idx_q.dtype} {tuple(idx_q.shape)}")
    if idx_q.device != keys.device:
        raise ValueError(f"idx_q: on {idx_q.device}, index keys on {keys.device}")
    check_token_metadata(block_table, req, pos, idx_q.shape[0], keys.device)


def select_blocks_learned(idx_q: torch.Tensor, keys: IndexKeys, block_table: torch.Tensor, req: torch.Tensor,
                          pos: torch.Tensor, *, topk: int = fmt.TOPK, sink_blocks: int = 1, local_blocks: int = 0,
                          impl: str = "auto") -> torch.Tensor:
    """Top-``topk`` blocks per index head (= KV head) and token, int32 ``[Hi, T, topk]`` (ascending ids,
    then ``-1``), scored as in the module docstring. ``block_table [R, S]``, ``req [T]``, ``pos [T]``
    int32 as in the kernel contract (:mod:`sglang_nvfp4.reference`)."""
    _check_select_inputs(idx_q, keys.keys, block_table, req, pos)
    check_selection_settings(topk, sink_blocks, local_blocks)
    t, heads = idx_q.shape[:2]
    if t == 0:
        return torch.empty(heads, 0, topk, dtype=torch.int32, device=idx_q.device)
    if resolve_impl(impl, idx_q.device) == "triton":
        from ..kernels.triton_indexer import select_learned_blocks

        return select_learned_blocks(idx_q, keys.keys, block_table, req, pos, topk, sink_blocks, local_blocks,
                                     key_exponents=keys.exponents)
    return _select_torch(idx_q, keys, block_table, req, pos, topk, sink_blocks, local_blocks)


def _select_torch(idx_q, keys: IndexKeys, block_table, req, pos, topk, sink_blocks, local_blocks):
    check_index_values(block_table, req, pos, keys.keys.shape[0] // fmt.PAGE_SIZE)
    rows = torch.arange(fmt.PAGE_SIZE, device=idx_q.device)

    def request_keys(r: int, num_blocks: int) -> torch.Tensor:  # one index-key head, shared: [1, B * 128, D]
        slots = (block_table[r, :num_blocks].long()[:, None] * fmt.PAGE_SIZE + rows).reshape(-1)
        return keys.values(slots)[None]

    return select_by_max_pooled_keys(idx_q, request_keys, req, pos, topk, sink_blocks, local_blocks)


def select_by_max_pooled_keys(queries: torch.Tensor, request_keys, req: torch.Tensor, pos: torch.Tensor, topk: int,
                              sink_blocks: int, local_blocks: int, groups: int = 1,
                              runs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The torch path shared by the learned and the proxy indexer: int32 ``[H, T, topk]`` for ``queries [T, H *
    groups, D]`` (``groups`` consecutive query rows per selecting head). ``request_keys(r, num_blocks)`` gives fp32
    keys ``[H or 1, num_blocks * 128, D]`` of request ``r``'s first blocks; a token scores a block by the max over
    its keys at positions <= ``pos`` and over the head's query rows of ``q . k``, then the rule of :mod:`.rules`
    chooses. One request at a time, token chunks bounded by ``_SCORES_PER_CHUNK``, each scoring the blocks up to
    its last token's own block. Keys past a token's position lie in its own block, which the rule always selects,
    so the scores are not masked at the position (as in the Triton kernel): the selections are the same.
    ``runs``: ``(run, run_pos)`` of :func:`.rules.token_runs` to select once per run of tokens (the max of its
    tokens' scores), ``None`` to select per token."""
    t, rows, _ = queries.shape
    heads = rows // groups
    own = pos.long() // fmt.PAGE_SIZE
    out = torch.empty(heads, t, topk, dtype=torch.int32, device=queries.device)
    if runs is not None:
        run, run_pos = runs
        width = int(own.max()) + 1 if t else 0
        run_scores = torch.full((heads, run_pos.shape[0], width), -math.inf, device=queries.device)
    for r in torch.unique(req).tolist():
        tokens = (req == r).nonzero()[:, 0]
        num_blocks = int(own[tokens].max()) + 1
        k = request_keys(r, num_blocks)
        step = max(1, _SCORES_PER_CHUNK // (rows * k.shape[1]))
        for start in range(0, tokens.numel(), step):
            chunk = tokens[start : start + step]
            n = chunk.numel()
            blocks = int(own[chunk].max()) + 1  # later blocks are visible to no token of the chunk
            q = queries[chunk].float().transpose(0, 1).reshape(heads, groups * n, -1)  # [H, groups * C, D]
            logits = torch.matmul(q, k[:, : blocks * fmt.PAGE_SIZE].transpose(1, 2))  # [H, groups * C, keys]
            scores = logits.view(heads, groups, n, blocks, fmt.PAGE_SIZE).amax(dim=(1, -1))
            if runs is None:
                forced = forced_blocks(own[chunk], blocks, sink_blocks, local_blocks)
                out[:, chunk] = rank_blocks(scores, own[chunk], topk, forced)
            else:
                max_into_runs(run_scores[..., :blocks], run[chunk], scores)
    if runs is not None and t:
        run_own = run_pos.long() // fmt.PAGE_SIZE
        chosen = rank_blocks(run_scores, run_own, topk, forced_blocks(run_own, width, sink_blocks, local_blocks))
        out.copy_(chosen.index_select(1, run))
    return out


class LearnedIndexer:
    """:class:`~.protocol.BlockIndexer` over a model's index projections: :class:`IndexKeys` for each
    layer in ``sparse_layers`` (local layer ids), scored by :func:`select_blocks_learned`. Layers outside
    ``sparse_layers`` keep no state and are not asked to select (the backend attends every visible block
    there). ``model_inputs`` must carry ``idx_k`` on writes and ``idx_q`` on selections of sparse layers."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, device=None, *,
                 sparse_layers: tuple[int, ...], topk: int = fmt.TOPK, sink_blocks: int = 1, local_blocks: int = 0,
                 key_dtype: torch.dtype = torch.bfloat16):
        check_selection_settings(topk, sink_blocks, local_blocks)
        bad = [x for x in sparse_layers if not 0 <= x < num_layers]
        if bad:
            raise ValueError(f"sparse_layers: local layer ids {bad} outside [0, {num_layers})")
        self.topk, self.sink_blocks, self.local_blocks = topk, sink_blocks, local_blocks
        self.num_kv_heads = num_kv_heads
        self.index_keys = {layer: IndexKeys(num_pages, device, dtype=key_dtype) for layer in sorted(set(sparse_layers))}

    @staticmethod
    def state_bytes(num_layers: int, num_kv_heads: int, *, sparse_layers: tuple[int, ...],
                    key_dtype: torch.dtype = torch.bfloat16, **options) -> StateBytes:
        """Index keys of every sparse layer, per token slot."""
        return StateBytes(per_token=len(set(sparse_layers)) * IndexKeys.bytes_per_token(key_dtype))

    def state_nbytes(self) -> int:
        return sum(k.nbytes() for k in self.index_keys.values())

    def _keys(self, layer_id: int, what: str) -> IndexKeys:
        keys = self.index_keys.get(layer_id)
        if keys is None:
            raise ValueError(f"layer {layer_id}: not a sparse layer of this indexer ({what})")
        return keys

    def on_kv_written(self, layer_id, cache, slots, *, idx_k=None, **model_inputs) -> None:
        keys = self.index_keys.get(layer_id)
        if keys is None:
            return
        if idx_k is None:
            raise ValueError(f"layer {layer_id}: a sparse layer's K/V write needs the model's idx_k")
        keys.write(slots, idx_k)

    def save_tokens(self, layer_id, slots) -> torch.Tensor | None:
        keys = self.index_keys.get(layer_id)
        return None if keys is None else keys.save(slots)

    def restore_tokens(self, layer_id, cache, slots, saved) -> None:
        keys = self.index_keys.get(layer_id)
        if keys is not None:
            keys.restore(slots, saved)

    def select(self, layer_id, q, cache, block_table, req, pos, *, idx_q=None, **model_inputs) -> torch.Tensor:
        keys = self._keys(layer_id, "select")
        if idx_q is None:
            raise ValueError(f"layer {layer_id}: a sparse layer's selection needs the model's idx_q")
        if idx_q.dim() != 3 or idx_q.shape[1] != self.num_kv_heads:
            raise ValueError(f"idx_q: {tuple(idx_q.shape)}, expected [T, {self.num_kv_heads}, D]: one index head per "
                             "KV head")
        return select_blocks_learned(idx_q, keys, block_table, req, pos, topk=self.topk,
                                     sink_blocks=self.sink_blocks, local_blocks=self.local_blocks)
