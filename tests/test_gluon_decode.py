"""The Gluon decode for Hopper (``sglang_nvfp4.kernels.gluon_decode``).

Gluon has no interpreter, so its CPU twin is a compile check: on any host the kernel is compiled for sm_90 with
the installed Triton and its PTX must show the design (wgmma with register A operands fed by the inline PTX
decoders, no spills), and a decoded tile must reach wgmma's operand layout without moving data. On a Hopper GPU (marked ``gpu``) the kernel is compared with
the reference and with the Triton decode: NaN-poisoned outputs, garbage (often E4M3 NaN) bytes past every
request's last token, -1 and repeated ids, blocks past the position, 1 to 32 heads per KV head, every split
count, q in bf16/fp16/fp32, scales by value and on the device. Batch invariance and CUDA-graph replay of the
decode are tested through the dispatcher (``tests/test_kernels_gpu.py``), which serves Hopper with this kernel.
"""

from __future__ import annotations

import pytest
import torch
import triton

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gluon_compile import compile_for_hopper, registers_and_stack
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.kernels import gluon_decode, triton_decode
from sglang_nvfp4.kernels.gluon_common import decode_word_planes, k_scale_operand

ON_HOPPER = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper (sm_90) GPU")
DEV = "cuda"


def _signature(q_dtype: str, by_pointer: bool) -> dict:
    ptr_scale = "*fp32" if by_pointer else "fp32"
    sig = {"q_ptr": q_dtype, "out_ptr": q_dtype, "part_acc_ptr": "*fp32", "part_stats_ptr": "*fp32", "cache_ptr": "*u8"}
    sig.update({name: "*i32" for name in ("block_ids_ptr", "block_table_ptr", "req_ptr", "pos_ptr")})
    sig.update({"k_scale": ptr_scale, "v_scale": ptr_scale, "sm_scale": "fp32"})
    sig.update({name: "i32" for name in ("K", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_ih",
                                         "stride_it", "stride_ik", "stride_br", "stride_bs")})
    sig.update({name: "constexpr" for name in ("HKV", "GROUP", "ROWS", "K_POW2", "SPLITS", "CHUNKS_PER_SPLIT",
                                               "STACK_LEVELS", "PREFETCH", "L2_PAGES", "K_SCALE_BY_POINTER",
                                               "V_SCALE_BY_POINTER")})
    return sig


@pytest.mark.parametrize("group, width, splits, prefetch, by_pointer, l2_pages", [
    (16, 32, 8, False, True, 2), (16, 16, 8, False, False, 0), (16, 16, 1, False, False, 2),
    (16, 16, 1, True, False, 2), (16, 32, 1, True, True, 0), (16, 32, 2, True, False, 2), (16, 64, 2, False, False, 4),
    (8, 16, 2, True, False, 1), (32, 64, 2, False, True, 2),
    (16, 16, 8, True, False, 2), (16, 32, 16, True, False, 2),  # 1 chunk per split, prefetching
])
def test_compiles_for_hopper(group, width, splits, prefetch, by_pointer, l2_pages):
    """What ``launch`` compiles, with its register cap, with and without the prefetch where it may pick it, and with
    0 to 4 pages prefetched into L2 (one bulk prefetch per block, K and V^T, in the loop and before it)."""
    rows = max(16, triton.next_power_of_2(group))
    chunks_per_split = gluon_decode.num_chunks(width) // splits
    stack_levels = chunks_per_split.bit_length()
    constexprs = {"HKV": 4, "GROUP": group, "ROWS": rows, "K_POW2": gluon_decode.selection_slots(width), "SPLITS": splits,
                  "CHUNKS_PER_SPLIT": chunks_per_split, "STACK_LEVELS": stack_levels, "PREFETCH": prefetch,
                  "L2_PAGES": l2_pages, "K_SCALE_BY_POINTER": by_pointer, "V_SCALE_BY_POINTER": by_pointer}
    compiled = compile_for_hopper(gluon_decode._sparse_decode_kernel, _signature("*bf16", by_pointer), constexprs,
                                  gluon_decode.NUM_WARPS.value, gluon_decode.max_registers(rows, width, prefetch))
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ptx.count("cvt.rn.f16x2.e4m3x2") >= 32 * 4  # 32 code words per thread
    assert ptx.count("ld.global.v2.b32") >= 16  # a row's 4 code words in two 8-byte loads (rows are 72 bytes)
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 2 * l2_pages
    assert registers_and_stack(compiled)[1] == 0  # no spills under the register cap
    # fp16 Q^T and P^T, the merge stack (fp32 partials), and reduction scratch
    stack_bytes = stack_levels * (rows * fmt.HEAD_DIM + 2 * rows) * 4
    assert compiled.metadata.shared <= 2 * rows * fmt.HEAD_DIM * 2 + stack_bytes + 1024


@gluon.jit
def _decoded_tile_kernel(words_ptr, out_ptr):
    """One tile's code words, loaded in ``WORDS_LAYOUT``, decoded and put in wgmma's A-operand layout, stored."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row = gl.arange(0, 128, layout=gl.SliceLayout(1, gluon_decode.WORDS_LAYOUT))[:, None]
    word = gl.arange(0, 16, layout=gl.SliceLayout(0, gluon_decode.WORDS_LAYOUT))[None, :]
    words = gl.load(words_ptr + row * 16 + word)
    scale = k_scale_operand(gl.reshape(words >> 24, gluon_decode.TILE_6D))
    tile = gluon_decode._as_operand(decode_word_planes(gl.reshape(words, gluon_decode.TILE_6D), (scale,) * 4), operand)
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, operand))[:, None]
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, operand))[None, :]
    gl.store(out_ptr + rows * 128 + cols, tile)


def test_decoded_tiles_reach_the_wgmma_operand_layout_without_moving_data():
    """The design's premise: the words each thread loads decode into exactly the values its wgmma A-operand
    registers hold, so the layout change after decoding is a renaming of registers. A mismatch (another thread
    layout of the words, another column order) compiles to shared-memory staging or warp shuffles."""
    ptx = compile_for_hopper(_decoded_tile_kernel, {"words_ptr": "*u32", "out_ptr": "*fp16"}, {}, 4).asm["ptx"]
    assert ptx.count("cvt.rn.f16x2.e4m3x2") >= 16 * 4  # the tile was decoded
    for data_movement in ("st.shared", "ld.shared", "ldmatrix", "stmatrix", "shfl"):
        assert data_movement not in ptx, data_movement


@pytest.mark.parametrize("heads, kv_heads, want", [(64, 4, True), (16, 1, True), (4, 4, True), (128, 4, True),
                                                   (256, 4, False)])
def test_supported_shapes(heads, kv_heads, want):
    assert gluon_decode.supports(heads, kv_heads, 32) is want


def _decode_problem(seed, lens, heads, kv_heads, width, q_dtype=torch.bfloat16):
    from test_kernels_gpu import filled_cache, random_selection

    gen = torch.Generator(device=DEV).manual_seed(seed)
    cache, block_table = filled_cache(lens, kv_heads, gen)
    pos = torch.tensor(lens, device=DEV).int() - 1
    req = torch.arange(len(lens), device=DEV).int()
    last_block = torch.tensor([(n - 1) // fmt.PAGE_SIZE for n in lens], device=DEV)
    block_ids = random_selection(pos, last_block, kv_heads, width, gen)
    q = (torch.randn(len(lens), heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).to(q_dtype)
    return q, cache, block_ids, block_table, req, pos


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("lens, heads, kv_heads, width, splits", [
    ([32768 - 37 * r for r in range(64)], 64, 4, 32, None),  # the default budget at 32K, the default splits
    ([9000, 130, 1, 4097], 64, 4, 16, 1),  # partial last pages, a one-token request
    ([131072, 5000], 16, 1, 64, 2),  # 16/1 at the widest budget
    ([20000, 7000, 3000], 32, 4, 32, 8),  # 8 heads per KV head
    ([6000, 333], 40, 4, 16, 4),  # 10 heads per KV head: padded rows
    ([6000, 2000], 4, 4, 32, 4),  # 1 head per KV head
    ([6000, 2000], 128, 4, 16, 4),  # 32 heads per KV head
])
@pytest.mark.parametrize("scales_on_device", [False, True])
def test_matches_the_reference_and_the_triton_decode(lens, heads, kv_heads, width, splits, scales_on_device):
    from sglang_nvfp4.reference import sparse_prefill_reference

    q, cache, block_ids, block_table, req, pos = _decode_problem(len(lens) + heads + width, lens, heads, kv_heads, width)
    assert gluon_decode.supports(heads, kv_heads, width)
    k_scale, v_scale = 0.5, 2.0
    if scales_on_device:
        k_scale, v_scale = torch.tensor([k_scale], device=DEV), torch.tensor([v_scale], device=DEV)
    args = (q, cache, block_ids, block_table, req, pos, k_scale, v_scale, fmt.HEAD_DIM**-0.5)
    out = gluon_decode.launch(*args, torch.full_like(q, float("nan")), splits=splits)
    assert not out.isnan().any()
    want = sparse_prefill_reference(*args)
    assert _rel_err(out, want) < 6e-3  # bf16 output rounding dominates, as for the Triton decode
    triton_out = triton_decode.launch(*args, torch.full_like(q, float("nan")), splits=splits or 4)
    assert _rel_err(out, triton_out) < 4e-3


DROPPED_PAGE_PROBLEMS = pytest.mark.parametrize("lens, heads, kv_heads, width", [
    ([9000, 130, 1, 4097, 32768, 300], 64, 4, 16),  # partial last pages, a one-token request
    ([20000, 7000, 3000], 32, 4, 32),
    ([131072, 5000], 16, 1, 64),
    ([6000, 333], 40, 4, 5),  # padded rows, a width that is no power of two
])


def _dropped_page_args(seed, lens, heads, kv_heads, width):
    """Launch arguments of a problem where repeated and -1 ids drop pages, so chunks end early and some splits are
    empty."""
    q, cache, block_ids, block_table, req, pos = _decode_problem(seed, lens, heads, kv_heads, width)
    block_ids[0, 1] = -1
    block_ids[-1, 0, 1::2] = block_ids[-1, 0, 0]
    return q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5


@pytest.mark.gpu
@hopper_only
@DROPPED_PAGE_PROBLEMS
def test_every_split_count_gives_the_same_bits(lens, heads, kv_heads, width):
    """The merge tree does not depend on the split count (module docstring), so neither does the output: one split
    (no partials, no combine) against every count the launch accepts."""
    args = _dropped_page_args(91 + width, lens, heads, kv_heads, width)
    q = args[0]
    fewest, most = gluon_decode.split_range(width)
    counts = [1 << i for i in range(fewest.bit_length() - 1, most.bit_length())]
    outs = {n: gluon_decode.launch(*args, torch.full_like(q, float("nan")), splits=n) for n in counts}
    assert not outs[fewest].isnan().any()
    for n in counts:
        assert torch.equal(outs[n], outs[fewest]), n
    assert torch.equal(gluon_decode.launch(*args, torch.full_like(q, float("nan"))), outs[fewest])


@pytest.mark.gpu
@hopper_only
@DROPPED_PAGE_PROBLEMS
def test_prefetch_gives_the_same_bits(lens, heads, kv_heads, width):
    """The prefetches change when a page's bytes are loaded, not the arithmetic: with and without the register
    prefetch, and with 0, 1 or 3 pages brought into L2 ahead, at one split and at the most splits (where a program's
    prefetches run past its last page), the same bits. Where the register prefetch would spill (more than 32 ids per
    token), the launch refuses it."""
    args = _dropped_page_args(17 + width, lens, heads, kv_heads, width)
    q = args[0]
    for splits in gluon_decode.split_range(width):
        want = gluon_decode.launch(*args, torch.full_like(q, float("nan")), splits=splits, prefetch=False, l2_pages=0)
        assert not want.isnan().any()
        for l2_pages in (1, 3):
            out = gluon_decode.launch(*args, torch.full_like(q, float("nan")), splits=splits, prefetch=False,
                                      l2_pages=l2_pages)
            assert torch.equal(out, want), (splits, l2_pages)
        if gluon_decode.selection_slots(width) > 32:
            with pytest.raises(ValueError, match="prefetch"):
                gluon_decode.launch(*args, torch.full_like(q, float("nan")), splits=splits, prefetch=True)
            continue
        out = gluon_decode.launch(*args, torch.full_like(q, float("nan")), splits=splits, prefetch=True)
        assert torch.equal(out, want), splits


def test_split_counts_follow_the_batch(monkeypatch):
    """Many splits for a few tokens, one for large batches, always within the accepted range (132 multiprocessors,
    an H200's); a count outside it is refused. Programs that leave multiprocessors idle prefetch into registers."""
    monkeypatch.setattr(gluon_decode, "_multiprocessors", lambda device: 132)
    cpu = torch.device("cpu")
    assert [gluon_decode.prefetches(16, 16, 4 * t * splits, cpu)
            for t, splits in ((1, 8), (8, 8), (32, 2), (64, 1), (256, 1))] == [True, False, False, False, False]
    assert gluon_decode.prefetches(16, 32, 4 * 1 * 16, cpu) and not gluon_decode.prefetches(16, 32, 4 * 8 * 8, cpu)
    assert not gluon_decode.prefetches(32, 32, 4, cpu) and not gluon_decode.prefetches(16, 64, 4, cpu)  # would spill
    assert [gluon_decode.decode_splits(t, 4, 16, cpu) for t in (1, 8, 32, 64, 256)] == [8, 8, 2, 1, 1]
    assert [gluon_decode.decode_splits(t, 4, 32, cpu) for t in (1, 8, 32, 64, 256)] == [16, 8, 2, 1, 1]
    assert gluon_decode.decode_splits(256, 4, 1024, cpu) == 32  # a dense layer's width: 16 chunks per split
    assert gluon_decode.decode_splits(1, 1, 1, cpu) == 1
    # The L2 prefetch runs one page past the bytes a program loads, where it walks that far.
    assert [gluon_decode.l2_prefetch_pages(prefetch, pages) for prefetch, pages in
            ((False, 16), (True, 8), (True, 2), (False, 2), (False, 1), (True, 3))] == [1, 2, 0, 1, 0, 2]
    assert gluon_decode.split_range(16) == (1, 8) and gluon_decode.split_range(1024) == (32, 512)
    q = torch.zeros(1, 16, fmt.HEAD_DIM)
    with pytest.raises(ValueError, match="splits"):
        gluon_decode.launch(q, torch.zeros(1, 2, 128, 72, dtype=torch.uint8), torch.zeros(1, 1, 16, dtype=torch.int32),
                            None, None, None, 1.0, 1.0, 1.0, q, splits=16)
    with pytest.raises(ValueError, match="l2_pages: 0 to 8, got 9"):
        gluon_decode.launch(q, torch.zeros(1, 2, 128, 72, dtype=torch.uint8), torch.zeros(1, 1, 16, dtype=torch.int32),
                            None, None, None, 1.0, 1.0, 1.0, q, splits=1, prefetch=False, l2_pages=9)
    wide = torch.zeros(1, 32, fmt.HEAD_DIM)  # 32 rows per KV head: a prefetch would spill
    with pytest.raises(ValueError, match="prefetch"):
        gluon_decode.launch(wide, torch.zeros(1, 2, 128, 72, dtype=torch.uint8),
                            torch.zeros(1, 1, 16, dtype=torch.int32), None, None, None, 1.0, 1.0, 1.0, wide, splits=1,
                            prefetch=True)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_query_dtypes(q_dtype):
    from sglang_nvfp4.reference import sparse_prefill_reference

    q, cache, block_ids, block_table, req, pos = _decode_problem(7, [3000, 700], 64, 4, 32, q_dtype)
    args = (q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5)
    out = gluon_decode.launch(*args, torch.full_like(q, float("nan")))
    assert out.dtype == q_dtype and _rel_err(out, sparse_prefill_reference(*args)) < 6e-3


@pytest.mark.gpu
@hopper_only
def test_dispatcher_serves_hopper_decode_with_gluon():
    from sglang_nvfp4 import kernels

    q, cache, block_ids, block_table, req, pos = _decode_problem(3, [2000, 9000], 64, 4, 32)
    plan = kernels.plan_attention("decode", block_table, req, pos, num_kv_heads=4)
    assert plan.implementation == "gluon"
    via_plan = plan.run(q, cache, block_ids, 0.5, 2.0, fmt.HEAD_DIM**-0.5)
    direct = gluon_decode.launch(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5,
                                 torch.full_like(q, float("nan")))
    assert torch.equal(via_plan, direct)
