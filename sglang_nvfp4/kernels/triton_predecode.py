"""Decode a forward's visible pages once per layer into fp16 tiles: the input of the Gluon prefill's predecoded mode
(:mod:`.gluon_prefill`), whose producer then copies tiles instead of decoding them; entry point :func:`launch`.

Why. In a long prefill every page is visited by many tiles of tokens: at 32K with runs of 8 tokens sharing their
16 selected blocks, each of a KV head's 256 pages is decoded by about 256 tiles, and decoding is what paces the fused
kernel (``bench/results/kernels_v2_h200.md``). Decoded once here, a page costs one pass of its 18 KB and a write of
its 64 KB of fp16, and the attention kernel reads fp16 tiles through the TMA.

Tiles. ``tiles`` is fp16 ``[R * S, Hkv, 2, 128, 128]`` for a block table ``[R, S]``: slot ``r * S + b`` holds block
``b`` of batch request ``r``, as K ``[128 keys, 128 dims]`` and V^T ``[128 dims, 128 keys]``, both in natural order,
each value ``e2m1 * e4m3 / TILE_SCALE``, exactly the fused kernels' tile values (:mod:`.triton_common`). Keys at or
past ``kv_len[r]`` (slots never written: their bytes may be E4M3 NaN codes) are 0 in K and V^T, so that a key no row
can see gets no weight (``p = 0``) and no NaN; slots of blocks wholly past ``kv_len[r]`` or without a page (a ``-1``
entry, which the kernel contract allows for blocks no token selects) are not written.

Key tiles (optional, for the proxy indexer's fp8 scores, :mod:`.gluon_proxy`): ``key_tiles`` E4M3 ``[R * S, Hkv, 128,
128]``, each K tile times ``FP8_KEY_SCALE`` rounded to E4M3 (round to nearest even), the values the score kernels
decode and round themselves: 16 KB more per slot and KV head, so that the score kernel copies keys too.

A forward predecodes once per layer, after the layer's cache write and before its selection: the indexer and the
attention read the same tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import format as fmt
from .triton_common import BLOCK_WORDS, HEAD_DIM, PAGE, load_k_tile, load_vt_tile, uses_ptx, vt_tile_dim
from .triton_indexer import FP8_KEY_SCALE, to_e4m3

@triton.jit
def _predecode_kernel(
    cache_ptr, block_table_ptr, kv_len_ptr, tiles_ptr, key_tiles_ptr,  # uint8, int32 [R, S], int32 [R], fp16, e4m3
    S, stride_br, stride_bs,
    HKV: tl.constexpr, USE_PTX: tl.constexpr, KEY_TILES: tl.constexpr,
):
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = slot // S
    block = slot % S
    kv_len = tl.load(kv_len_ptr + r)
    page = tl.load(block_table_ptr + r.to(tl.int64) * stride_br + block * stride_bs,
                   mask=block * PAGE < kv_len, other=-1).to(tl.int64)
    if page >= 0:  # a block below kv_len without a page (-1: no token selects it) is left undecoded
        page_base = page * (2 * HKV * BLOCK_WORDS)  # in 4-byte words
        key_live = block * PAGE + tl.arange(0, PAGE) < kv_len
        k = load_k_tile(cache_ptr, page_base + kv_head * BLOCK_WORDS, USE_PTX)
        k = tl.where(key_live[:, None], k, 0.0)
        vt = load_vt_tile(cache_ptr, page_base + (HKV + kv_head) * BLOCK_WORDS, key_live, USE_PTX)
        rows = tl.arange(0, PAGE)
        cols = tl.arange(0, HEAD_DIM)
        k_tile = tiles_ptr + (slot.to(tl.int64) * HKV + kv_head) * (2 * PAGE * HEAD_DIM)
        tl.store(k_tile + rows[:, None] * HEAD_DIM + cols[None, :], k)
        # load_vt_tile's row i holds dim vt_tile_dim(i): stored to that dim's row, the tile is in natural order.
        tl.store(k_tile + PAGE * HEAD_DIM + vt_tile_dim(rows)[:, None] * PAGE + cols[None, :], vt)
        if KEY_TILES:  # times FP8_KEY_SCALE, a power of two: exact in fp16 (at most 336), then rounded to E4M3
            key_tile = key_tiles_ptr + (slot.to(tl.int64) * HKV + kv_head) * (PAGE * HEAD_DIM)
            tl.store(key_tile + rows[:, None] * HEAD_DIM + cols[None, :], to_e4m3(k * FP8_KEY_SCALE))


# The fused kernels decode a page once per tile that selected it; predecoding decodes each of the block table's slots
# once (a wider write than a fused decode) and makes the attention kernel read 3.5x the bytes per page. It is taken
# when the forward has at least this many query tokens per slot. Measured on an H100 (the last chunk of a 64K or 128K
# prompt, bench/results/predecode_chunks_h100.md): per-token selections ran 9-18% faster predecoded at 4 tokens per
# slot and up to 2% slower at 2; selections shared by runs of 8 tokens (the default proxy's), whose fused kernel already
# decodes a page once for a whole run, ran 5% slower at 8 and 4.5% faster at 16. Runs of 2 or 4 tokens were not
# measured and take the shared threshold too.
MIN_TOKENS_PER_SLOT = 4  # selections per token
MIN_TOKENS_PER_SLOT_SHARED = 16  # selections shared by runs of tokens


def pays(num_tokens: int, block_table: torch.Tensor, selection_run: int = 1) -> bool:
    """Whether a prefill of ``num_tokens`` query tokens over ``block_table [R, S]`` should predecode;
    ``selection_run``: consecutive tokens that share one selection (1: each token selects its own blocks)."""
    least = MIN_TOKENS_PER_SLOT if selection_run == 1 else MIN_TOKENS_PER_SLOT_SHARED
    return block_table.numel() > 0 and num_tokens >= least * block_table.numel()


class Predecoded(NamedTuple):
    """One forward's predecoded tiles (:func:`prepare`), refilled for each layer by :func:`launch`."""

    slot_table: torch.Tensor  # int32 [R, S]: slot r * S + b of block b of request r (a block table over the tiles)
    kv_len: torch.Tensor  # int32 [R]: keys of each request that some query token sees
    tiles: torch.Tensor  # fp16 [R * S, Hkv, 2, 128, 128]: K and V^T tiles (module docstring)
    key_tiles: torch.Tensor | None  # E4M3 [R * S, Hkv, 128, 128]: fp8 key tiles, or None


def prepare(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, num_kv_heads: int,
            key_tiles: bool = False) -> Predecoded:
    """The tiles and metadata of one forward over ``block_table`` int32 ``[R, S]``, ``req``/``pos`` int32 ``[T]``
    (validated by the dispatcher's plan), with fp8 ``key_tiles`` too when asked; no kernel runs (the tiles are
    uninitialised)."""
    rows, width = block_table.shape
    slot_table = torch.arange(rows * width, dtype=torch.int32, device=block_table.device).view(rows, width)
    tiles = alloc_tiles(block_table, num_kv_heads)
    keys = torch.empty(tiles.shape[:2] + tiles.shape[3:], dtype=torch.float8_e4m3fn, device=tiles.device) \
        if key_tiles else None
    return Predecoded(slot_table, kv_lengths(req, pos, rows), tiles, keys)


def kv_lengths(req: torch.Tensor, pos: torch.Tensor, num_requests: int) -> torch.Tensor:
    """int32 ``[num_requests]``: each request's keys some token of the forward can see (its largest query
    position + 1; 0 for a request without tokens). ``req``, ``pos``: int32 ``[T]``."""
    kv_len = torch.zeros(num_requests, dtype=torch.int32, device=pos.device)
    return kv_len.scatter_reduce_(0, req.long(), pos + 1, reduce="amax")


TILE_SHAPE = (2, fmt.PAGE_SIZE, fmt.HEAD_DIM)  # a slot's K and V^T tiles, per KV head


def check_key_tiles(key_tiles: torch.Tensor, slots: int, num_kv_heads: int, where: str) -> None:
    """``ValueError`` (prefixed by ``where``) unless ``key_tiles`` is contiguous float8_e4m3fn
    ``[slots, Hkv, 128, 128]``, as :func:`prepare` makes them."""
    want = (slots, num_kv_heads, *TILE_SHAPE[1:])
    if key_tiles.shape != want or key_tiles.dtype != torch.float8_e4m3fn or not key_tiles.is_contiguous():
        raise ValueError(f"{where}: key_tiles: expected contiguous float8_e4m3fn {want}, "
                         f"got {key_tiles.dtype} {tuple(key_tiles.shape)}")


def alloc_tiles(block_table: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Uninitialised fp16 tiles ``[R * S, Hkv, 2, 128, 128]`` for ``block_table [R, S]`` (see the module docstring)."""
    slots = block_table.shape[0] * block_table.shape[1]
    return torch.empty((slots, num_kv_heads, *TILE_SHAPE), dtype=torch.float16, device=block_table.device)


def launch(cache: torch.Tensor, block_table: torch.Tensor, predecoded: Predecoded) -> Predecoded:
    """Decode every block of ``block_table`` (int32 ``[R, S]``) that starts below its request's
    ``predecoded.kv_len`` (int32 ``[R]``) from ``cache`` (uint8 ``[pages, 2 * Hkv, 128, 72]``) into the tiles of
    ``predecoded`` (:func:`prepare`); arguments as the dispatcher validated them (block table entries below
    ``kv_len`` map valid pages or are ``-1``). Returns ``predecoded``."""
    hkv = cache.shape[1] // 2
    slots = block_table.shape[0] * block_table.shape[1]
    tiles, key_tiles = predecoded.tiles, predecoded.key_tiles
    if tiles.shape != (slots, hkv, *TILE_SHAPE) or tiles.dtype != torch.float16 or not tiles.is_contiguous():
        raise ValueError(f"tiles: expected contiguous fp16 {(slots, hkv, *TILE_SHAPE)}, "
                         f"got {tiles.dtype} {tuple(tiles.shape)}")
    if key_tiles is not None:
        check_key_tiles(key_tiles, slots, hkv, "triton_predecode.launch")
    if slots:
        _predecode_kernel[(slots, hkv)](
            cache, block_table, predecoded.kv_len, tiles, tiles if key_tiles is None else key_tiles,
            block_table.shape[1], *block_table.stride(),
            HKV=hkv, USE_PTX=uses_ptx(cache.device), KEY_TILES=key_tiles is not None, num_warps=4,
        )
    return predecoded
