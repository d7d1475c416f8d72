"""The warp-specialized Gluon prefill (``sglang_nvfp4.kernels.gluon_prefill``).

Gluon has no interpreter, so its CPU twin is a compile check: on any host the kernel is compiled for sm_90
with the installed Triton (CI: 3.8; the GPU host: 3.6) and its PTX must hold what the design relies on
(wgmma from shared memory, register reallocation between the partitions, mbarrier hand-offs). On a Hopper
GPU (marked ``gpu``) it is checked against the reference at realistic shapes, with NaN-poisoned outputs,
garbage (often E4M3 NaN) bytes in every unwritten cache row, tiles that span requests, chunks that start
mid-page, -1 ids, repeated ids and blocks past a token's position; and for batch invariance.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
from triton.runtime.jit import mangle_type

from gluon_compile import compile_for_hopper, compile_triton_for_hopper, cuobjdump, registers_and_stack
from sglang_nvfp4 import format as fmt

from sglang_nvfp4.kernels import gluon_prefill, triton_predecode, triton_prefill

ON_HOPPER = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper (sm_90) GPU")
DEV = "cuda"


def _signature(by_pointer: bool, predecoded: bool, ordered: bool = False) -> dict:
    ptr_scale = "*fp32" if by_pointer else "fp32"
    # The predecoded tiles' TMA descriptor as the launcher passes it (its type only: a CPU tensor stands in).
    tiles = torch.empty(1, 4, 2, fmt.PAGE_SIZE, fmt.HEAD_DIM, dtype=torch.float16)
    desc = mangle_type(gluon_prefill.tiles_descriptor(tiles)) if predecoded else "constexpr"
    sig = {name: "*i32" for name in ("plan_len_ptr", "plan_page_ptr", "plan_block_ptr", "plan_members_ptr")}
    sig = {"q_ptr": "*bf16", "out_ptr": "*bf16", "cache_ptr": "*u8", "pos_ptr": "*i32",
           "order_ptr": "*i32" if ordered else "constexpr", "tiles_desc": desc, **sig,
           "k_scale": ptr_scale, "v_scale": ptr_scale, "sm_scale": "fp32"}
    sig.update({name: "i32" for name in ("T", "stride_qt", "stride_qh", "stride_ot", "stride_oh")})
    sig.update({name: "constexpr" for name in ("HKV", "GROUP", "GROUP_POW2", "TOKENS", "WIDTH", "K_SCALE_BY_POINTER",
                                               "V_SCALE_BY_POINTER", "PRODUCER_WARPS", "CONSUMER_REGS",
                                               "PRODUCER_REGS", "PREDECODED", "RING_SLOTS", "ORDERED")})
    return sig


def compile_sm90(group: int, width: int, by_pointer: bool, producer_warps: int | None, predecoded: bool = False,
                 ordered: bool = False):
    """The kernel compiled for sm_90 with the installed Triton, as :func:`gluon_prefill.run` launches it for 4 KV
    heads of ``group`` query heads, ``width`` ids per token and the ``producer_warps`` register plan, or in predecoded
    mode (``producer_warps`` then ignored, as by ``run``), with a token order (``ordered``) or consecutive tiles;
    also used by ``bench/gluon_resources.py``."""
    tokens = gluon_prefill.tokens_per_consumer(group)
    if predecoded:
        producer_warps, plan = gluon_prefill.TILE_COPY_WARPS, gluon_prefill.TILE_COPY_REGISTER_PLAN
    else:
        plan = gluon_prefill.REGISTER_PLANS[producer_warps]
    max_regs, consumer_regs, producer_regs = plan
    constexprs = {"HKV": 4, "GROUP": group, "GROUP_POW2": triton.next_power_of_2(group), "TOKENS": tokens,
                  "WIDTH": 2 * tokens * triton.next_power_of_2(width), "K_SCALE_BY_POINTER": by_pointer,
                  "V_SCALE_BY_POINTER": by_pointer, "PRODUCER_WARPS": producer_warps,
                  "CONSUMER_REGS": consumer_regs, "PRODUCER_REGS": producer_regs, "PREDECODED": predecoded,
                  "RING_SLOTS": gluon_prefill.ring_slots(predecoded), "ORDERED": ordered}
    if not predecoded:
        constexprs["tiles_desc"] = None
    if not ordered:
        constexprs["order_ptr"] = None
    return compile_for_hopper(gluon_prefill._ws_prefill_kernel, _signature(by_pointer, predecoded, ordered),
                              constexprs, 4, max_regs)


@pytest.mark.parametrize("producer_warps", sorted(gluon_prefill.REGISTER_PLANS))
@pytest.mark.parametrize("group, width, by_pointer", [(16, 32, False), (8, 16, True)])
def test_compiles_for_hopper(group, width, by_pointer, producer_warps):
    max_regs, _, producer_regs = gluon_prefill.REGISTER_PLANS[producer_warps]
    compiled = compile_sm90(group, width, by_pointer, producer_warps)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.num_warps == 8 + producer_warps  # two consumer warpgroups and the producer
    assert compiled.metadata.num_warps * 32 * max_regs <= 65536  # one CTA's registers fit the SM
    assert re.search(rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{producer_regs};", ptx)  # the producer's share
    assert compiled.metadata.shared <= 227 * 1024  # one CTA per SM fits
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx and "mbarrier.try_wait" in ptx
    assert ptx.count("cvt.rn.f16x2.e4m3x2") >= 8  # the inline PTX decoders of K and V^T
    # The producer's page reads, written twice (the first page before the loop, the next one inside it): per page
    # and thread of a 4-warp producer 8 + 8 eight-byte loads of K and V^T code words (16 words per thread), 4 of V^T
    # scale-word pairs (one per token octet, shared by the thread's 4 dims of a scale group), and 8 K scale bytes, one
    # per group of the thread's words; 8 warps share a page's bytes, each thread loading half as many.
    share = 4 / producer_warps
    assert ptx.count("ld.global.v2.b32") == 2 * (8 + 8 + 4) * share
    assert ptx.count("ld.global.b8") == 2 * 8 * share
    # The producer reads its plan entries from its shared copy of the plan: page, block and member mask, before the
    # loop and in it (the rest of the kernel has at most 4 such loads).
    assert ptx.count("ld.shared.b32") >= 6
    # The scale operands reach the words' threads without shuffles (a layout mismatch adds 64 per copy); the
    # remaining ones are the row reductions of the softmax, the consumers' first-position minimum and the
    # producer's live-key maximum.
    assert ptx.count("shfl.sync") < 40
    _assert_one_fma_per_exponent(ptx)


def _assert_one_fma_per_exponent(ptx: str, scores: int = 2 * 64):
    """Each score's exponent is one multiply-add, ``s * logit_scale + (bias - max)`` (``triton_common.fold_scores``):
    at least ``scores`` (per thread: the two consumers' 64 each) ``fma.rn.f32``, and no subtraction per score (with
    the max subtracted from a rounded logit, each consumer's 64 scores per thread took 64 ``sub.f32``)."""
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) >= scores
    assert len(re.findall(r"\bsub(\.rn)?\.f32\b", ptx)) <= 16  # per-row terms only (before: 132)


def test_triton_kernel_takes_the_same_softmax_step_on_hopper():
    """The Triton prefill kernel, compiled for sm_90 at 16 heads per KV head as the dispatcher's fallback launches it,
    fuses each exponent's multiply-add as the Gluon consumers do (64 scores per thread: 4 tokens x 16 heads x 128
    keys over 128 threads), the step on which their same output bits rest (``test_gives_the_triton_kernels_bits``).
    Before ``fold_scores`` it took 66 ``sub.f32`` and 2 ``fma.rn.f32``."""
    config = triton_prefill.default_prefill_config(16)
    signature = {"q_ptr": "*bf16", "out_ptr": "*bf16", "cache_ptr": "*u8"}
    signature.update({name: "*i32" for name in ("pos_ptr", "plan_len_ptr", "plan_page_ptr", "plan_block_ptr",
                                                "plan_members_ptr")})
    signature.update({name: "fp32" for name in ("k_scale", "v_scale", "sm_scale")})
    signature.update({name: "i32" for name in ("T", "stride_qt", "stride_qh", "stride_ot", "stride_oh")})
    constexprs = {"HKV": 4, "GROUP": 16, "GROUP_POW2": 16, "BLOCK_T": config.tokens_per_tile, "WIDTH": 64,
                  "K_SCALE_BY_POINTER": False, "V_SCALE_BY_POINTER": False, "USE_PTX": True}
    signature.update({name: "constexpr" for name in constexprs})
    compiled = compile_triton_for_hopper(triton_prefill._sparse_prefill_kernel, signature, constexprs,
                                         {"num_warps": config.num_warps, "num_stages": config.num_stages})
    scores_per_thread = config.tokens_per_tile * 16 * fmt.PAGE_SIZE // (32 * config.num_warps)
    assert scores_per_thread == 64
    _assert_one_fma_per_exponent(compiled.asm["ptx"], scores_per_thread)


@pytest.mark.parametrize("predecoded", [False, True])
def test_token_order_compiles_for_hopper(predecoded):
    """With a token order (``group_tokens``) each consumer loads its rows' tokens from it, and so does the fused
    producer for its tile's positions; nothing else changes: the same products, no spills, one CTA per SM."""
    ordered = compile_sm90(16, 32, False, 8, predecoded=predecoded, ordered=True)
    plain = compile_sm90(16, 32, False, 8, predecoded=predecoded)
    ptx, plain_ptx = ordered.asm["ptx"], plain.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == plain_ptx.count("wgmma.mma_async")
    # The order's pointer reaches the worker partitions through shared memory, as their other arguments do.
    assert plain.metadata.shared <= ordered.metadata.shared <= min(plain.metadata.shared + 64, 227 * 1024)
    assert registers_and_stack(ordered)[1] <= registers_and_stack(plain)[1]  # no more stack (spills) than without
    # The order's loads: each consumer's Q rows and output rows, and in the fused mode the producer's positions.
    assert ptx.count("ld.global") > plain_ptx.count("ld.global")
    _assert_one_fma_per_exponent(ptx)


@pytest.mark.parametrize("words", [4, 16, 128])  # block-table widths up to 256, 1024 and 8192 blocks (1M keys)
def test_one_warp_regroups_a_window_without_spills(words):
    """``group_tokens`` runs one warp per window at up to 16 ids per token (``triton_prefill.group_warps``): compiled
    for sm_90 as a launch at top-16 specializes it (16-divisible pointers and sizes, the ids' last stride 1), the
    kernel keeps the window's ids and its bitset of ``words`` words in registers: no local-memory stores or loads."""
    assert triton_prefill.group_warps(16) == 1 and triton_prefill.group_warps(17) == 8
    signature = {"block_ids_ptr": "*i32", "req_ptr": "*i32", "pos_ptr": "*i32", "order_ptr": "*i32", "T": "i32",
                 "K": "i32", "places": "i32", "stride_ih": "i32", "stride_it": "i32", "stride_ik": "constexpr",
                 "BLOCK_T": "constexpr", "K_POW2": "constexpr", "WINDOW": "constexpr", "WORDS": "constexpr"}
    constexprs = {"stride_ik": 1, "BLOCK_T": 8, "K_POW2": 16, "WINDOW": triton_prefill.GROUP_WINDOW, "WORDS": words}
    sizes_too = [name for name, kind in signature.items() if kind != "constexpr"]
    compiled = compile_triton_for_hopper(triton_prefill._group_tokens_kernel, signature, constexprs,
                                         {"num_warps": triton_prefill.group_warps(16)}, divisible=sizes_too)
    sass = cuobjdump(compiled, "-sass")
    assert "HGMMA" not in sass and "SHFL" in sass  # the kernel it should be, its reductions within the warp
    assert not re.search(r"\b(STL|LDL)\b", sass)


@pytest.mark.parametrize("group, width, by_pointer", [(16, 32, False), (8, 16, True)])
def test_predecoded_mode_compiles_for_hopper(group, width, by_pointer):
    """Predecoded mode: the producer warpgroup copies each union entry's K and V^T tiles with the TMA (128-byte
    swizzled, two boxes of 64 dims per tile) and decodes nothing; the consumers are those of the fused kernel."""
    max_regs, _, producer_regs = gluon_prefill.TILE_COPY_REGISTER_PLAN
    compiled = compile_sm90(group, width, by_pointer, None, predecoded=True)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.num_warps == 8 + gluon_prefill.TILE_COPY_WARPS
    assert compiled.metadata.num_warps * 32 * max_regs <= 65536
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{producer_regs};", ptx)
    assert compiled.metadata.shared <= 227 * 1024
    ring = gluon_prefill.TILE_COPY_STAGES * 2 * fmt.PAGE_SIZE * fmt.HEAD_DIM * 2  # slots of a K and a V^T fp16 tile
    assert ring <= compiled.metadata.shared < ring + 40 * 1024  # and the two Q tiles, the barriers
    assert ptx.count("cp.async.bulk.tensor.2d") == 2  # the K and the V^T copies (each split by warp into 2 boxes)
    assert ptx.count("mbarrier.arrive.expect_tx") == 2
    assert "cvt.rn.f16x2.e4m3x2" not in ptx and "ld.global.v2.b32" not in ptx  # no page decoding, no page loads
    assert ptx.count("wgmma.mma_async") == compile_sm90(group, width, by_pointer, 8).asm["ptx"].count("wgmma.mma_async")
    assert [m["block_size"] for m in compiled.metadata.tensordesc_meta] == [[fmt.PAGE_SIZE, 64]]
    _assert_one_fma_per_exponent(ptx)


def _producer_loop(sass: str) -> list[str]:
    """The instructions of the producer's page loop in ``sass`` (``cuobjdump -sass``): the shortest loop (a backward
    branch's range) that converts E4M3 scales (``F2FP.F16.E4M3``, the decoders)."""
    instructions = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in instructions:
        target = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            body = [t for a, t in instructions if int(target.group(1), 16) <= a <= address]
            if any("F2FP.F16.E4M3" in t for t in body):
                loops.append(body)
    return min(loops, key=len)


@pytest.mark.parametrize("producer_warps", sorted(gluon_prefill.REGISTER_PLANS))
def test_next_pages_k_loads_are_issued_before_the_vt_tile_decodes(producer_warps):
    """Each page's loads must be in flight while the other half of the page decodes: the fence before each hand-off
    waits for them. ptxas may sink the next page's K loads below the V^T tile's decoding, and did in two producers
    that were 3.5-6.7% slower with fewer instructions (``bench/results/kernels_v2_h200.md``, 2026-12-06): the K
    loads then waited, exposed, at the top of the next page. Between the loop's two fences (K hand-off, then V^T
    hand-off) the K loads come first, then the V^T tile's 16-byte stores."""
    loop = _producer_loop(cuobjdump(compile_sm90(16, 32, False, producer_warps), "-sass"))
    fences = [i for i, text in enumerate(loop) if text.startswith("MEMBAR")]
    assert len(fences) == 2, fences  # the K hand-off, then the V^T hand-off
    between = loop[fences[0]:fences[1]]
    loads = [i for i, text in enumerate(between) if text.startswith("LDG")]
    stores = [i for i, text in enumerate(between) if text.startswith("STS.128")]
    assert len(stores) == 64 // producer_warps  # the V^T tile: 32 KB in 16-byte stores over 32 threads a warp
    assert loads and max(loads) < min(stores), (loads, stores)


@pytest.mark.parametrize("heads, kv_heads, width, want", [
    (64, 4, 16, True), (64, 4, 32, True), (64, 4, 64, False), (16, 1, 32, True), (32, 4, 16, True),
    (32, 4, 32, False), (4, 1, 16, False), (128, 1, 16, False),
])
def test_supported_shapes(heads, kv_heads, width, want):
    assert gluon_prefill.supports(heads, kv_heads, width) is want


def _problem(seed, lens, extends, heads, kv_heads, width):
    from test_kernels_gpu import filled_cache, random_selection

    gen = torch.Generator(device=DEV).manual_seed(seed)
    cache, block_table = filled_cache(lens, kv_heads, gen)
    pos = torch.cat([torch.arange(n - e, n) for n, e in zip(lens, extends)]).int().to(DEV)
    req = torch.cat([torch.full((e,), r) for r, e in enumerate(extends)]).int().to(DEV)
    last_block = torch.tensor([(n - 1) // fmt.PAGE_SIZE for n in lens], device=DEV)[req.long()]
    block_ids = random_selection(pos, last_block, kv_heads, width, gen)
    q = (torch.randn(pos.shape[0], heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    return q, cache, block_ids, block_table, req, pos, gen


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("lens, extends, heads, kv_heads, width", [
    ([4396, 700], [4096, 700], 64, 4, 16),   # a chunk starting mid-page, then a whole request
    ([33068, 700], [32768, 700], 64, 4, 32),  # the default budget at 32K
    ([8492, 1000, 333], [8192, 999, 333], 16, 1, 32),  # 16/1; tiles across three requests
    ([5000, 3000], [1000, 777], 32, 4, 16),  # 8 query heads per KV head: 16-token tiles
    ([3000], [2999], 40, 4, 16),  # 10 heads per KV head: padded rows
])
@pytest.mark.parametrize("scales_on_device", [False, True])
def test_matches_the_reference(lens, extends, heads, kv_heads, width, scales_on_device):
    from sglang_nvfp4.reference import sparse_prefill_reference

    q, cache, block_ids, block_table, req, pos, gen = _problem(sum(lens) + heads, lens, extends, heads, kv_heads, width)
    assert gluon_prefill.supports(heads, kv_heads, width)
    k_scale, v_scale = 0.5, 2.0
    if scales_on_device:
        k_scale, v_scale = torch.tensor([k_scale], device=DEV), torch.tensor([v_scale], device=DEV)
    out = torch.full_like(q, float("nan"))
    gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, fmt.HEAD_DIM**-0.5, out)
    assert not out.isnan().any()
    sample = torch.randperm(q.shape[0], device=DEV, generator=gen)[:512]
    want = sparse_prefill_reference(q[sample], cache, block_ids[:, sample].contiguous(), block_table, req[sample],
                                    pos[sample], k_scale, v_scale, fmt.HEAD_DIM**-0.5)
    assert _rel_err(out[sample], want) < 6e-3  # bf16 output rounding dominates, as for the Triton kernel


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("lens, extends, heads, kv_heads, width", [
    ([33068, 700], [32768, 700], 64, 4, 32),
    ([8492, 1000, 333], [8192, 999, 333], 16, 1, 32),
    ([5000, 3000], [1000, 777], 32, 4, 16),
    ([3000], [2999], 40, 4, 16),
])
def test_producer_sizes_give_the_same_bits(lens, extends, heads, kv_heads, width):
    """Every producer size (``REGISTER_PLANS``) decodes the same values into the ring: the same output bits."""
    q, cache, block_ids, block_table, req, pos, _ = _problem(sum(lens) + 7, lens, extends, heads, kv_heads, width)
    outs = [gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5,
                                 torch.full_like(q, float("nan")), producer_warps=warps)
            for warps in sorted(gluon_prefill.REGISTER_PLANS)]
    assert not outs[0].isnan().any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


# Problems on which two launch modes must give the same bits: a chunk starting mid-page then a whole request; the
# default budget at 32K; 16/1 heads with tiles across three requests; 8 heads per KV head (16-token tiles); 10 heads
# per KV head (padded rows).
SAME_BITS_PROBLEMS = [
    ([4396, 700], [4096, 700], 64, 4, 16),
    ([33068, 700], [32768, 700], 64, 4, 32),
    ([8492, 1000, 333], [8192, 999, 333], 16, 1, 32),
    ([5000, 3000], [1000, 777], 32, 4, 16),
    ([3000], [2999], 40, 4, 16),
]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("lens, extends, heads, kv_heads, width", SAME_BITS_PROBLEMS)
@pytest.mark.parametrize("scales_on_device, key_tiles", [(False, False), (True, True)])
def test_predecoded_mode_gives_the_same_bits(lens, extends, heads, kv_heads, width, scales_on_device, key_tiles):
    """The pages decoded once into tiles (garbage, often E4M3 NaN codes, in every unwritten row; chunks that start
    mid-page; tiles across requests), by the predecoding kernel with and without its E4M3 key tiles, give the fused
    kernel's output bits (signed zeros included)."""
    q, cache, block_ids, block_table, req, pos, _ = _problem(sum(lens) + 5, lens, extends, heads, kv_heads, width)
    k_scale, v_scale = 0.5, 2.0
    if scales_on_device:
        k_scale, v_scale = torch.tensor([k_scale], device=DEV), torch.tensor([v_scale], device=DEV)
    fused = gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, fmt.HEAD_DIM**-0.5,
                                 torch.full_like(q, float("nan")))
    predecoded = triton_predecode.prepare(block_table, req, pos, kv_heads, key_tiles)
    predecoded.tiles.fill_(float("nan"))  # slots past each request's keys must never be read
    triton_predecode.launch(cache, block_table, predecoded)
    out = gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, fmt.HEAD_DIM**-0.5,
                               torch.full_like(q, float("nan")), predecoded=predecoded)
    assert not fused.isnan().any()
    assert torch.equal(out.view(torch.int16), fused.view(torch.int16))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("lens, extends, heads, kv_heads, width", [p for p in SAME_BITS_PROBLEMS if p[2] == 16 * p[3]])
def test_gives_the_triton_kernels_bits(lens, extends, heads, kv_heads, width):
    """With 16 query heads per KV head (the benchmark's shapes, where the two gave the same bits on an H100,
    ``bench/results/kernels_v2_h100_1207.md``), the Gluon prefill and the Triton kernel take the same softmax step
    (``triton_common.fold_scores``), products and sums: the same output bits."""
    q, cache, block_ids, block_table, req, pos, _ = _problem(sum(lens) + 9, lens, extends, heads, kv_heads, width)
    args = (q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5)
    gluon = gluon_prefill.launch(*args, torch.full_like(q, float("nan")))
    triton_out = triton_prefill.launch(*args, torch.full_like(q, float("nan")))
    assert not gluon.isnan().any()
    assert torch.equal(gluon.view(torch.int16), triton_out.view(torch.int16))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("lens, extends, heads, kv_heads, width", SAME_BITS_PROBLEMS)
@pytest.mark.parametrize("predecode", [False, True])
def test_token_groups_give_the_same_bits(lens, extends, heads, kv_heads, width, predecode):
    """Tiles of regrouped tokens (``token_groups``: tiles across requests, a last tile with fewer tokens) give the
    consecutive tiles' output bits, fused and predecoded; the order places every token once, and its tiles visit
    fewer union pages in all than consecutive tiles."""
    q, cache, block_ids, block_table, req, pos, _ = _problem(sum(lens) + 11, lens, extends, heads, kv_heads, width)
    group = heads // kv_heads
    order = gluon_prefill.group_tokens(block_ids, block_table, req, pos, group)
    t = q.shape[0]
    for h in range(kv_heads):
        placed = order[h][order[h] < t]
        assert torch.equal(torch.sort(placed).values, torch.arange(t, device=DEV, dtype=torch.int32))
    ungrouped = gluon_prefill.plan(block_ids, block_table, req, pos, group)[0].sum()
    assert gluon_prefill.plan(block_ids, block_table, req, pos, group, order)[0].sum() < ungrouped
    extra = {}
    if predecode:
        extra["predecoded"] = triton_predecode.prepare(block_table, req, pos, kv_heads)
        triton_predecode.launch(cache, block_table, extra["predecoded"])
    outs = [gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5,
                                 torch.full_like(q, float("nan")), token_groups=grouped, **extra)
            for grouped in (False, True)]
    assert not outs[0].isnan().any()
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("setting", ["auto", "off"])
def test_dispatcher_predecodes_long_prefills(monkeypatch, setting):
    """A plan whose forward has enough tokens per block-table slot predecodes (unless turned off), with the same bits
    as the fused kernel; a short extend over a long prefix does not."""
    from sglang_nvfp4 import kernels

    monkeypatch.setenv(kernels.PREDECODE_ENV, setting)
    q, cache, block_ids, block_table, req, pos, _ = _problem(9, [8192], [8192], 64, 4, 16)
    assert triton_predecode.pays(q.shape[0], block_table)
    plan = kernels.plan_attention("prefill", block_table, req, pos, num_kv_heads=4)
    assert plan.predecodes == (setting == "auto")
    direct = gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5,
                                  torch.full_like(q, float("nan")))
    assert torch.equal(plan.run(q, cache, block_ids, 0.5, 2.0, fmt.HEAD_DIM**-0.5), direct)
    if setting == "auto":
        # Another layer's cache through the same plan is decoded again (its own bits); the tiles are what the kernel
        # reads: poisoned after that layer's decoding, the same cache object's second run reads them, not the cache.
        other = cache.clone()
        other[:, :4, :, :fmt.SCALE_OFFSET] ^= 0x11  # other K codes (an E2M1 mantissa bit of each), the same scales
        want = gluon_prefill.launch(q, other, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5,
                                    torch.full_like(q, float("nan")))
        assert torch.equal(plan.run(q, other, block_ids, 0.5, 2.0, fmt.HEAD_DIM**-0.5), want)
        assert not torch.equal(want, direct)
        plan.predecode(other, q.shape[1], block_ids.shape[2]).tiles.fill_(float("nan"))
        assert plan.run(q, other, block_ids, 0.5, 2.0, fmt.HEAD_DIM**-0.5).isnan().all()
    tail = slice(q.shape[0] - 64, q.shape[0])
    short = kernels.plan_attention("prefill", block_table, req[tail].contiguous(), pos[tail].contiguous(),
                                   num_kv_heads=4)
    assert not short.predecodes
    # The last 512 tokens (8 per slot), a chunk over a prefix: predecoded with per-token selections, not with shared
    # ones; the same bits either way.
    chunk = slice(q.shape[0] - 512, q.shape[0])
    args = (q[chunk], cache, block_ids[:, chunk].contiguous(), block_table, req[chunk].contiguous(),
            pos[chunk].contiguous())
    want = gluon_prefill.launch(*args, 0.5, 2.0, fmt.HEAD_DIM**-0.5, torch.full_like(args[0], float("nan")))
    for run, predecodes in ((1, setting == "auto"), (8, False)):
        plan = kernels.plan_attention("prefill", *args[3:], num_kv_heads=4, selection_run=run)
        assert plan.predecodes == predecodes, run
        assert torch.equal(plan.run(args[0], cache, args[2], 0.5, 2.0, fmt.HEAD_DIM**-0.5), want), run


@pytest.mark.gpu
@hopper_only
def test_dispatcher_serves_hopper_prefill_with_gluon():
    from sglang_nvfp4 import kernels

    q, cache, block_ids, block_table, req, pos, _ = _problem(3, [2000], [2000], 64, 4, 16)
    plan = kernels.plan_attention("prefill", block_table, req, pos, num_kv_heads=4)
    assert plan.implementation == "gluon"
    via_plan = plan.run(q, cache, block_ids, 0.5, 2.0, fmt.HEAD_DIM**-0.5)
    direct = gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5,
                                  torch.full_like(q, float("nan")))
    assert torch.equal(via_plan, direct)


@pytest.mark.gpu
@hopper_only
def test_batch_invariant():
    """Three extends whose tiles span requests, selections in random slot order: each request alone gets
    the bits it gets in the batch."""
    q, cache, block_ids, block_table, req, pos, gen = _problem(5, [5000, 3000, 1500], [1000, 777, 333], 64, 4, 16)
    block_ids = torch.gather(block_ids, 2, torch.rand(block_ids.shape, device=DEV, generator=gen).argsort(dim=2))

    def attend(q, block_ids, req, pos):
        out = torch.full_like(q, float("nan"))
        return gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5, out)

    whole = attend(q, block_ids, req, pos)
    for tokens in [torch.nonzero(req == r)[:, 0] for r in range(3)] + [torch.arange(1003, 1500, device=DEV)]:
        alone = attend(q[tokens].contiguous(), block_ids[:, tokens].contiguous(), req[tokens].contiguous(),
                       pos[tokens].contiguous())
        assert torch.equal(alone, whole[tokens])


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("producer_warps, predecoded", [(4, False), (8, False), (None, True)])
def test_full_and_empty_unions(producer_warps, predecoded):
    """The producer reads each plan entry and its page one step ahead. Tiles whose union fills the plan row (every
    token selects blocks no other token of its tile does, so the read past the last entry is past the row) and
    tiles with an empty union (every id -1: outputs 0) must match the reference, in predecoded mode too."""
    from sglang_nvfp4.reference import sparse_prefill_reference
    from test_kernels_gpu import filled_cache

    heads, kv_heads, width = 64, 4, 16
    tile_tokens = 2 * gluon_prefill.tokens_per_consumer(heads // kv_heads)
    t = 4 * tile_tokens
    lens = [tile_tokens * width * fmt.PAGE_SIZE]  # as many blocks as a tile's tokens x ids
    gen = torch.Generator(device=DEV).manual_seed(11)
    cache, block_table = filled_cache(lens, kv_heads, gen)
    pos = torch.arange(lens[0] - t, lens[0], device=DEV, dtype=torch.int32)
    req = torch.zeros(t, dtype=torch.int32, device=DEV)
    # Token i of a tile selects blocks i * width .. i * width + width - 1 (all before its position), shuffled.
    own = torch.arange(t, device=DEV) % tile_tokens
    block_ids = (own[None, :, None] * width + torch.arange(width, device=DEV)[None, None, :]).expand(kv_heads, t, width)
    block_ids = torch.gather(block_ids, 2, torch.rand(kv_heads, t, width, device=DEV, generator=gen).argsort(dim=2))
    block_ids = block_ids.int().contiguous()
    block_ids[:, tile_tokens:2 * tile_tokens] = -1  # the second tile's union is empty
    union_len, _ = gluon_prefill.plan(block_ids, block_table, req, pos, heads // kv_heads)
    full = tile_tokens * width  # = the plan row's width
    assert union_len.tolist() == [[full, 0, full, full]] * kv_heads  # the last tile's row ends the plan tensor
    q = (torch.randn(t, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    out = torch.full_like(q, float("nan"))
    tiles = None  # the fused mode
    if predecoded:
        tiles = triton_predecode.launch(cache, block_table, triton_predecode.prepare(block_table, req, pos, kv_heads))
    gluon_prefill.launch(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5, out,
                         producer_warps=producer_warps, predecoded=tiles)
    want = sparse_prefill_reference(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5)
    assert torch.equal(out[tile_tokens:2 * tile_tokens], torch.zeros_like(out[:tile_tokens]))
    assert _rel_err(out, want) < 6e-3
