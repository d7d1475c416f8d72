"""Triton sparse decode over the NVFP4 cache: one query token per request (contract:
:mod:`sglang_nvfp4.reference`); entry point :func:`launch`, called by the dispatcher
:mod:`sglang_nvfp4.kernels`. The selection is ``block_ids [Hkv, T, K]`` int32, as for prefill.

Decode reads each selected page once per (token, KV head), so the aim is bytes in flight: one
program per (token, KV head, split) holds the ``GROUP`` query heads (padded to 16) and walks its
share of the token's deduplicated selection (split ``s`` takes the ``s``-th, ``s + SPLITS``-th, ...
kept block). ``SPLITS`` is the same for every batch (:data:`DECODE_SPLITS`): a token's partial sums, and
so its output, do not depend on how many other requests share the batch (batch invariance), and the
kernel compiles once for all batch sizes. The products are transposed, ``S^T = K.Q^T`` and
``O^T += V^T.P^T``: keys and dims sit on the matrix unit's M side (128 rows, Hopper's wgmma) and the
heads on N, so the decoded tiles are the register A operands. Triton decodes them in a blocked layout
and converts them to the operand layout through shared memory, which bounds this kernel on Hopper
(``bench/results/kernels_h200.md``); there the dispatcher runs :mod:`.gluon_decode` instead, which
decodes straight into the operand layout.
With ``SPLITS > 1`` each program writes its partial ``(acc, max, sum)`` and ``_combine_splits_kernel``
merges them along a binary tree over the splits (:func:`combine_splits`; a split with no block is the
identity), a slice of the columns per program.
The softmax step and the final normalisation are the prefill kernel's (:mod:`.triton_common`), on the
transposed tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    BLOCK_WORDS,
    HEAD_DIM,
    LOG2E,
    PAGE,
    TILE_SCALE,
    global_scale,
    load_k_tile,
    load_vt_tile,
    merge_partials,
    normalize_and_store,
    online_softmax_step,
    uses_ptx,
)

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
DECODE_MAX_REGISTERS = 168  # NVIDIA: 3 programs per multiprocessor instead of 2, without spills (Triton 3.6)
# Splits per (token, KV head), whatever the batch size (batch invariance; one compile for all batch sizes).
# Swept on the H200 at 32K context, batch 1-256 (bench/results/kernels_h200.md, 2026-12-01).
DECODE_SPLITS = 4
# Partial-sum columns per combine program: 4 programs per (token, KV head). Small batches have few (token, KV head)
# pairs: with one program per pair reading 64 KB of the Gluon decode's partials (8 splits x 16 rows x 128 fp32), the
# combine took 8.9 us at batch 8 on the H200; the slices save 5 us (bench/results/m3_h200.md, 2026-12-03).
COMBINE_COLUMNS = 32


@triton.jit
def _sparse_decode_kernel(
    q_ptr, out_ptr, part_acc_ptr, part_stats_ptr, cache_ptr,  # q/out [T, H, 128]; partials fp32
    block_ids_ptr, block_table_ptr, req_ptr, pos_ptr,  # int32 [Hkv, T, K], [R, S], [T], [T]
    k_scale, v_scale, sm_scale,
    K, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ih, stride_it, stride_ik, stride_br, stride_bs,  # block_ids strides, block_table strides
    HKV: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, K_POW2: tl.constexpr, SPLITS: tl.constexpr,
    K_SCALE_BY_POINTER: tl.constexpr, V_SCALE_BY_POINTER: tl.constexpr, USE_PTX: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The token's selection: keep the first occurrence of each block that starts at or before pos.
    slot = tl.arange(0, K_POW2)
    block = tl.load(block_ids_ptr + kv_head * stride_ih + token.to(tl.int64) * stride_it + slot * stride_ik,
                    mask=slot < K, other=-1)
    pos = tl.load(pos_ptr + token)
    req = tl.load(req_ptr + token)
    selected = (block >= 0) & (block * PAGE <= pos)
    repeat = (block[:, None] == block[None, :]) & selected[None, :] & (slot[None, :] < slot[:, None])
    keep = selected & (tl.max(repeat.to(tl.int32), axis=1) == 0)
    order = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    num_kept = tl.sum(keep.to(tl.int32), axis=0)

    rows = tl.arange(0, ROWS)
    live = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + token.to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=live[:, None], other=0.0).to(tl.float16)
    logit_scale = sm_scale * LOG2E * TILE_SCALE * global_scale(k_scale, K_SCALE_BY_POINTER)

    keys = tl.arange(0, PAGE)
    # Transposed products (keys and dims on the M side, the query heads on N): the decoded tiles are
    # the A operands, so only Q^T and P^T pass through shared memory.
    q_t = tl.trans(q)  # [128 dims, ROWS]
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc_t = tl.zeros((HEAD_DIM, ROWS), tl.float32)
    for j in range(split, num_kept, SPLITS):
        block_j = tl.sum(tl.where(keep & (order == j), block, 0), axis=0)
        page = tl.load(block_table_ptr + req.to(tl.int64) * stride_br + block_j * stride_bs).to(tl.int64)
        page_base = page * (2 * HKV * BLOCK_WORDS)  # in 4-byte words
        k = load_k_tile(cache_ptr, page_base + kv_head * BLOCK_WORDS, USE_PTX)
        s_t = tl.dot(k, q_t)  # [128 keys, ROWS]
        visible = (block_j * PAGE + keys) <= pos
        # Key 128 * block_j <= pos is visible to every row: no row's max stays -inf.
        p_t, alpha, m_i, l_i = online_softmax_step(s_t, visible[:, None], logit_scale, m_i, l_i,
                                                   KEY_AXIS=0, ROWS_MAY_SEE_NOTHING=False)
        vt = load_vt_tile(cache_ptr, page_base + (HKV + kv_head) * BLOCK_WORDS, visible, USE_PTX)
        acc_t = tl.dot(vt, p_t.to(tl.float16), acc_t * alpha[None, :])
    acc = tl.trans(acc_t)

    if SPLITS == 1:
        out_scale = TILE_SCALE * global_scale(v_scale, V_SCALE_BY_POINTER)
        normalize_and_store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh, acc, l_i, out_scale, live,
                            tl.arange(0, HEAD_DIM))
    else:
        part = (token.to(tl.int64) * HKV + kv_head) * SPLITS + split
        tl.store(part_acc_ptr + part * ROWS * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :], acc)
        tl.store(part_stats_ptr + part * 2 * ROWS + rows, m_i)
        tl.store(part_stats_ptr + part * 2 * ROWS + ROWS + rows, l_i)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_acc_ptr, part_stats_ptr, v_scale, stride_ot, stride_oh,
    HKV: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, LEVELS: tl.constexpr,
    COLUMNS: tl.constexpr, V_SCALE_BY_POINTER: tl.constexpr,
):
    """Program (token, KV head, slice of COLUMNS partial-sum columns): the split merge of that slice, along the
    binary tree over the ``SPLITS = 2**LEVELS`` splits (neighbours first: splits 2i and 2i + 1, then pairs of
    pairs, ...)."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.arange(0, SPLITS)
    rows = tl.arange(0, ROWS)
    columns = tl.program_id(2) * COLUMNS + tl.arange(0, COLUMNS)
    part = (token.to(tl.int64) * HKV + kv_head) * SPLITS + split  # [SPLITS]
    stats = part_stats_ptr + part[:, None] * 2 * ROWS + rows[None, :]
    m = tl.load(stats)  # [SPLITS, ROWS]
    l = tl.load(stats + ROWS)
    acc = tl.load(part_acc_ptr + part[:, None, None] * ROWS * HEAD_DIM + rows[None, :, None] * HEAD_DIM
                  + columns[None, None, :])  # [SPLITS, ROWS, COLUMNS]
    for _ in tl.static_range(LEVELS):  # the partials halve at each level
        m_a, m_b = tl.split(tl.permute(tl.reshape(m, (m.shape[0] // 2, 2, ROWS)), (0, 2, 1)))
        l_a, l_b = tl.split(tl.permute(tl.reshape(l, (l.shape[0] // 2, 2, ROWS)), (0, 2, 1)))
        acc_a, acc_b = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0] // 2, 2, ROWS, COLUMNS)), (0, 2, 3, 1)))
        m, l, acc = merge_partials(m_a, l_a, acc_a, m_b, l_b, acc_b, DIM_AXIS=2)
    out_scale = TILE_SCALE * global_scale(v_scale, V_SCALE_BY_POINTER)
    head = kv_head * GROUP + rows
    normalize_and_store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh, tl.reshape(acc, (ROWS, COLUMNS)),
                        tl.reshape(l, (ROWS,)), out_scale, rows < GROUP, columns)


def launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out, splits: int = DECODE_SPLITS,
           num_warps: int = DECODE_NUM_WARPS, num_stages: int = DECODE_NUM_STAGES,
           max_registers: int | None = DECODE_MAX_REGISTERS):
    """Sparse decode (:func:`sglang_nvfp4.kernels.sparse_decode`): launch the decode kernel (and the
    split combine); arguments as validated by the dispatcher.

    ``q``, ``out``: ``[T, H, 128]`` (bf16/fp16/fp32) with unit stride in the last dim, one token per
    row; ``cache``, ``block_ids`` (int32 ``[Hkv, T, K]``), ``block_table``, ``req``, ``pos`` and the scales
    as for :func:`.triton_prefill.launch`; ``splits``: programs per (token, KV head), a power of two
    (the benchmark's knob; any fixed value keeps the output batch-invariant); ``max_registers``: register
    cap per thread on NVIDIA (None: no cap). Returns ``out``."""
    t, h, _ = q.shape
    hkv = cache.shape[1] // 2
    group = h // hkv
    if t == 0:
        return out
    width = block_ids.shape[2]
    rows, part_acc, part_stats = split_partials(out, hkv, group, splits)
    k_by_pointer, v_by_pointer = isinstance(k_scale, torch.Tensor), isinstance(v_scale, torch.Tensor)
    register_cap = {"maxnreg": max_registers} if uses_ptx(q.device) and max_registers else {}
    _sparse_decode_kernel[(t, hkv, splits)](
        q, out, part_acc, part_stats, cache, block_ids, block_table, req.contiguous(), pos.contiguous(),
        k_scale, v_scale, float(sm_scale),
        width, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *block_ids.stride(), *block_table.stride(),
        HKV=hkv, GROUP=group, ROWS=rows, K_POW2=triton.next_power_of_2(width), SPLITS=splits,
        K_SCALE_BY_POINTER=k_by_pointer, V_SCALE_BY_POINTER=v_by_pointer, USE_PTX=uses_ptx(q.device),
        num_warps=num_warps, num_stages=num_stages, **register_cap,
    )
    if splits > 1:
        combine_splits(out, part_acc, part_stats, v_scale, hkv, group, rows, splits)
    return out


def split_partials(out, hkv: int, group: int, splits: int):
    """The split schedule's buffers for ``out [T, H, 128]``: ``(rows, part_acc, part_stats)`` as
    :func:`combine_splits` reads them, ``rows`` the query heads per KV head padded for ``tl.dot``. One split needs
    none (``out`` stands in, unused). ``ValueError`` unless ``splits`` is a power of two. The Gluon decode uses the
    same buffers."""
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    rows = max(MIN_DOT_ROWS, triton.next_power_of_2(group))
    if splits == 1:
        return rows, out, out
    t = out.shape[0]
    part_acc = torch.empty((t, hkv, splits, rows, HEAD_DIM), dtype=torch.float32, device=out.device)
    part_stats = torch.empty((t, hkv, splits, 2, rows), dtype=torch.float32, device=out.device)
    return rows, part_acc, part_stats


def combine_splits(out, part_acc, part_stats, v_scale, hkv: int, group: int, rows: int, splits: int):
    """Merge the ``splits`` partials of every (token, KV head) into ``out [T, H, 128]`` along a binary tree:
    splits ``2i`` and ``2i + 1`` first (:func:`.triton_common.merge_partials`), then pairs of those, and so on.
    A split that covers an aligned range of a fixed tree's leaves and merges them along the same tree (the Gluon
    decode does) leaves the output the same for any split count.

    ``part_acc``: fp32 ``[T, Hkv, splits, rows, 128]``, column ``c`` holding dim ``vt_tile_dim(c)``;
    ``part_stats``: fp32 ``[T, Hkv, splits, 2, rows]``, the running max (base 2) and sum of each row (a split
    that saw nothing: ``-inf`` and 0). The Gluon decode writes the same partials."""
    _combine_splits_kernel[(out.shape[0], hkv, HEAD_DIM // COMBINE_COLUMNS)](
        out, part_acc, part_stats, v_scale, out.stride(0), out.stride(1),
        HKV=hkv, GROUP=group, ROWS=rows, SPLITS=splits, LEVELS=splits.bit_length() - 1, COLUMNS=COMBINE_COLUMNS,
        V_SCALE_BY_POINTER=isinstance(v_scale, torch.Tensor), num_warps=4,
    )
