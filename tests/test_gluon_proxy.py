"""The warp-specialized fp8 proxy scores for Hopper (``sglang_nvfp4.kernels.gluon_proxy``): its CPU twin is a compile
check (Gluon has no interpreter), with the installed Triton (CI's) and, through ``tests/test_gluon_host_triton.py``,
the GPU host's. On a Hopper GPU its scores are checked against float64 ones in ``tests/test_proxy_indexer.py``
(``check_fp8_kernel``), where the dispatch sends fp8 prefill scores to it."""

from __future__ import annotations

import re

import pytest
import torch
import triton
from triton.runtime.jit import mangle_type

from gluon_compile import compile_for_hopper
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.kernels import gluon_proxy


def _signature(key_tiles: bool) -> dict:
    # The key tiles' TMA descriptor as the launcher passes it (its type only: a CPU tensor stands in).
    tiles = torch.empty(1, 4, fmt.PAGE_SIZE, fmt.HEAD_DIM, dtype=torch.float8_e4m3fn)
    desc = mangle_type(gluon_proxy.key_tiles_descriptor(tiles)) if key_tiles else "constexpr"
    sig = {"queries_ptr": "*bf16", "query_rows_ptr": "*i32", "cache_ptr": "*u8", "block_table_ptr": "*i32",
           "req_ptr": "*i32", "pos_ptr": "*i32", "scores_ptr": "*fp32", "keys_desc": desc}
    sig.update({name: "i32" for name in ("T", "num_cols", "stride_qt", "stride_qh", "stride_br", "stride_bs")})
    sig.update({name: "constexpr" for name in ("HKV", "HEADS", "HP", "TOKENS", "BLOCKS", "SUBTILES", "QUERY_ROWS",
                                               "KEY_TILES")})
    return sig


def compile_sm90(groups: int, subtiles: int, query_rows: bool = True, key_tiles: bool = False):
    """The kernel compiled for sm_90 with the installed Triton for 4 KV heads of ``groups`` query groups, ``subtiles``
    per consumer and ``MAX_BLOCKS_PER_PROGRAM`` blocks, reading bf16 queries (the layer's) through ``query_rows`` or
    in order (pointers 16-byte aligned, as the JIT specializes them), keys from the cache or from predecoded
    ``key_tiles`` (also used by ``bench/gluon_resources.py``)."""
    constexprs = {"HKV": 4, "HEADS": groups, "HP": triton.next_power_of_2(groups),
                  "TOKENS": gluon_proxy.tokens_per_subtile(groups), "BLOCKS": gluon_proxy.MAX_BLOCKS_PER_PROGRAM,
                  "SUBTILES": subtiles, "QUERY_ROWS": query_rows, "KEY_TILES": key_tiles}
    if not key_tiles:
        constexprs["keys_desc"] = None
    return compile_for_hopper(gluon_proxy._ws_proxy_scores_kernel, _signature(key_tiles), constexprs, 4,
                              gluon_proxy.MAX_REGS)


@pytest.mark.parametrize("groups, subtiles, query_rows", [(16, 4, True), (16, 2, False)])
def test_key_tiles_mode_compiles_for_hopper(groups, subtiles, query_rows):
    """With predecoded key tiles the producer copies each block's E4M3 tile with the TMA (one 128 x 128 box) and
    decodes nothing; the consumers' products are those of the decoding kernel."""
    compiled = compile_sm90(groups, subtiles, query_rows, key_tiles=True)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.num_warps == 12 and compiled.metadata.shared <= 227 * 1024
    assert ptx.count("cp.async.bulk.tensor.2d") == 1 and ptx.count("mbarrier.arrive.expect_tx") == 1
    assert "cvt.rn.f16x2.e4m3x2" not in ptx  # no key decoding
    assert "cvt.rn.satfinite.e4m3x2.f16x2" not in ptx  # nor rounding keys to E4M3 (the queries round from fp32)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{gluon_proxy.KEY_TILE_PRODUCER_REGS.value};", ptx)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 2 * subtiles * 2 * 4
    assert [m["block_size"] for m in compiled.metadata.tensordesc_meta] == [[fmt.PAGE_SIZE, fmt.HEAD_DIM]]


@pytest.mark.parametrize("groups, subtiles, query_rows", [(16, 4, True), (16, 4, False), (3, 4, False),
                                                          (1, 4, False), (16, 2, True)])
def test_compiles_for_hopper(groups, subtiles, query_rows):
    compiled = compile_sm90(groups, subtiles, query_rows)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.num_warps == 12  # two consumer warpgroups and the producer
    assert compiled.metadata.shared <= 227 * 1024  # one CTA per SM fits
    assert "setmaxnreg" in ptx and "mbarrier.try_wait" in ptx
    # Per consumer, each subtile's 128 rows x 128 keys: two 64-row tiles x four 32-dim steps of fp8 wgmma from
    # shared memory; two consumers.
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 2 * subtiles * 2 * 4
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.satfinite.e4m3x2.f16x2" in ptx  # key decode, rounding to E4M3
    assert "cvt.rn.f16.f32" in ptx or "cvt.rn.f16x2.f32" in ptx  # bf16 queries rounded to fp16 (the proxy's)


def test_blocks_per_program_fill_the_gpu():
    """A whole row of up to 256 blocks per program where the grid holds 2 programs per multiprocessor (132, an
    H100's or H200's), fewer blocks for short extends over long prefixes, never fewer than 16."""
    assert gluon_proxy.tokens_per_tile(16, 2) == 32 and gluon_proxy.tokens_per_tile(3, 2) == 128
    assert gluon_proxy.tokens_per_tile(16, 4) == 64
    # Tiles of the default launch (4 subtiles: 64 tokens at 16 groups), 64/4 heads:
    assert gluon_proxy.blocks_per_program(512, 256, 4, 132) == 256  # 32K prefill: 2,048 programs
    assert gluon_proxy.blocks_per_program(128, 256, 4, 132) == 256  # an 8K chunk over a 24K prefix: 512 programs
    assert gluon_proxy.blocks_per_program(4, 1024, 4, 132) == 32  # 256 tokens over 128K: 16 x 32 programs
    assert gluon_proxy.blocks_per_program(1, 1024, 4, 132) == 16  # 64 tokens: 4 x 64 programs, the floor
    assert gluon_proxy.blocks_per_program(1, 8, 1, 132) == 16  # nothing to split


@pytest.mark.parametrize("tokens, rows, groups, want", [(4096, 1, 16, True), (4096, 3, 1, True), (8, 8, 16, False),
                                                     (4096, 1, 17, False)])
def test_serves_hopper_prefill_of_at_most_16_groups(monkeypatch, tokens, rows, groups, want):
    import sglang_nvfp4.kernels as kernels

    monkeypatch.setattr(kernels, "resolve_implementation", lambda device: "gluon")
    monkeypatch.setattr(kernels, "_gluon_serves", lambda device: True)
    assert gluon_proxy.supports(torch.device("cuda"), tokens, rows, groups) is want
    monkeypatch.setattr(kernels, "_gluon_serves", lambda device: False)  # NVFP4_SPARSE_KERNEL=gluon off Hopper
    assert gluon_proxy.supports(torch.device("cuda"), tokens, rows, groups) is False
    monkeypatch.setattr(kernels, "_gluon_serves", lambda device: True)
    monkeypatch.setattr(kernels, "resolve_implementation", lambda device: "triton")
    assert gluon_proxy.supports(torch.device("cuda"), tokens, rows, groups) is False
