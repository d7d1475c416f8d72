"""Kernel benchmarks on a CUDA GPU: NVFP4 sparse prefill and decode against their peers, cache write.

Run on the GPU host (bench/gpu_session.sh does, with the offline SGLang bundle on PYTHONPATH):

    python bench/bench_kernels.py --out DIR            # everything; DIR/kernels_<gpu>.{json,png} (e.g. kernels_h200)
    python bench/bench_kernels.py --profile            # one prefill and one decode launch, for ncu

Prefill: one request of T tokens, T in {8K, 32K, 64K, 128K}, (H, Hkv) in {(64, 4), (16, 1)}, K ids per token
(``--topk``, default 16). Selection patterns: "random" (per token and KV head, the own block plus K - 1
distinct random earlier blocks: the worst case for a tile's union), "shared8" (one random selection per run
of 8 tokens) and "indexer" (``sglang_nvfp4.indexer.select_blocks`` on the benchmark's random data, when that
module imports). ``ours_ms`` is the dispatcher's choice (``implementation``), planned as the SGLang backend plans
it (``selection_run`` 8 for "shared8", so only per-token patterns get token groups, ``token_groups``); on Hopper
both prefill kernels are timed too, ``triton_ms`` (``triton_prefill``) and ``gluon_ms`` (``gluon_prefill``, warp
specialized), with the relative difference of their outputs (``gluon_vs_triton_rel_diff``), and the Gluon
prefill's parts: ``gluon_planner_ms`` (the union planner alone), ``gluon_kernel_ms`` (the kernel over a ready plan)
and ``gluon_producer_only_ms`` (the kernel over the same plan with every member mask cleared: every page decoded,
no products); its predecoded mode (``triton_predecode``): ``gluon_predecoded_ms`` (predecoding, planning and kernel),
``predecode_only_ms``, ``gluon_predecoded_same_bits``, and ``predecoded`` (whether the dispatcher's ``ours_ms`` took it).
Peers in the same run: dense causal SDPA (bf16); FlashInfer's paged prefill (``flashinfer_peers.py``:
fa2 and fa3 over bf16 K/V, fa2 over FlashInfer's NVFP4 KV cache), when FlashInfer imports; SGLang's in-tree
``flash_prefill_with_gqa_share_sparse`` on bf16 K/V holding the same values with the same selection
(block_size_q 1, or 8 for shared8), and "dequantize the selected pages to bf16 (a Triton kernel using the
same tile decoder) + that kernel". The dense peers attend the same (dequantized) values; the fastest of them
is named ``strongest_dense`` per shape. Reported: median ms (``triton.testing.do_bench``, which flushes L2
between runs), effective TF/s on the selected visible keys (4 * 128 flop per query head and key), the tile
union size, speed-ups.

Decode: batch {1, 32, 256} x context {8K, 32K, 128K} (``--decode-batch``, ``--decode-ctx``), H=64/Hkv=4, random
``--decode-topk`` blocks per KV head (default 16), timed as CUDA-graph replays; ``ms`` is the dispatcher's choice
(``implementation``), and on Hopper both decode kernels are timed too (``triton_us``, ``gluon_us``, their
``*_fraction_of_copy`` and ``gluon_vs_triton_rel_diff``); GB/s on the bytes the kernel reads (selected pages, q, selection) and writes (out),
against the measured device-to-device copy bandwidth (bytes read + written). Dense peers (batch x context
<= ``FI_DECODE_MAX_TOKENS``): FlashInfer's tensor-core paged decode over the whole context, bf16 and NVFP4.
FlashInfer compiles its kernels on first use: ``flashinfer.first_call_s`` records each first call.

Decode splits (first, on a cold Triton cache): every fixed split count {1, 2, 4, 8, 16} at batch
{1, 8, 32, 64, 256} and 32K context (``decode_splits``; ``split_first_call_s``: the first launch of each
split count, compile included), the data behind ``triton_decode.DECODE_SPLITS``, at ``--split-topk`` ids per
token; on Hopper the Gluon decode's times per split count too (``gluon_us``, the counts its merge tree accepts),
the data behind ``gluon_decode.decode_splits`` (its choice per batch: the ``splits`` of each decode row).
Decode prefetch (Hopper; ``decode_prefetch``): the Gluon decode with and without its prefetch at the split count
its launch picks, half and twice that, same batches and context, with bit-equality to the default launch: the
data behind ``gluon_decode.prefetches``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

import torch
import triton
import triton.language as tl

import flashinfer_peers
from harness import log
from timing import bench_ms, graph_ms

from sglang_nvfp4 import format as fmt
from sglang_nvfp4 import kernels
from sglang_nvfp4.kernels import triton_decode, triton_prefill
from sglang_nvfp4.kernels.triton_common import (
    BLOCK_WORDS,
    HEAD_DIM,
    PAGE,
    TILE_SCALE,
    load_k_tile,
    load_vt_tile,
    vt_tile_dim,
)

PREFILL_T = (32768, 8192, 65536, 131072)  # the swept and target size first: results are saved as they come
PREFILL_HEADS = ((64, 4), (16, 1))
PATTERNS = ("random", "shared8", "indexer")
SELECTION_RUNS = {"shared8": 8}  # tokens per shared selection, as the plan is told (the others: 1, per token)
SHARED_RUN = 8
INDEXER_MAX_T = 65536  # the indexer pattern is measured up to this length (device-time budget)
DECODE_BATCH = (1, 32, 256)
DECODE_CTX = (8192, 32768, 131072)
DECODE_HEADS = (64, 4)
SWEEP_T = 32768  # prefill and decode configs are swept at this size
DECODE_SWEEP = (None, triton_decode.DECODE_MAX_REGISTERS)  # register cap off / on
FLOP_PER_KEY = 4 * fmt.HEAD_DIM  # QK and PV multiply-adds per query head and key
PAGE_BYTES_READ = 2 * fmt.PAGE_SIZE * fmt.ROW_BYTES  # one head's K and V^T blocks of a page
DEV = "cuda"
SPLIT_SWEEP = (1, 2, 4, 8, 16)
SPLIT_SWEEP_BATCH = (1, 8, 32, 64, 256)
FI_DECODE_MAX_TOKENS = 256 * 32768  # FlashInfer's dense decode peers up to this many cached tokens (memory)


def ceilings() -> dict:
    """Measured device-to-device copy bandwidth and bf16 matmul rate."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEV).random_(0, 256)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    mm_ms = bench_ms(lambda: a @ b)
    return {"copy_GBps": 2 * src.numel() / copy_ms / 1e6, "bf16_matmul_TFps": 2 * 8192**3 / mm_ms / 1e9}


# ----------------------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------------------


def one_request(t: int, hkv: int, gen: torch.Generator):
    """A cache holding one request of ``t`` tokens on shuffled pages, written by the Triton write
    kernel from random bf16 K/V; returns ``(cache, block_table [1, t/128], slots [t])``."""
    pages = t // fmt.PAGE_SIZE
    cache = fmt.alloc_cache(pages, hkv, device=DEV)
    block_table = torch.randperm(pages, device=DEV, generator=gen).int()[None]
    tokens = torch.arange(t, device=DEV)
    slots = block_table[0].long()[tokens // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + tokens % fmt.PAGE_SIZE
    chan = torch.exp(torch.randn(hkv, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.5)
    for start in range(0, t, 16384):
        part = slice(start, start + 16384)
        n = slots[part].shape[0]
        k = (torch.randn(n, hkv, fmt.HEAD_DIM, device=DEV, generator=gen) * chan).bfloat16()
        v = torch.randn(n, hkv, fmt.HEAD_DIM, device=DEV, generator=gen).bfloat16()
        kernels.write_kv(cache, slots[part], k, v, 1.0, 1.0)
    return cache, block_table, slots


def random_blocks(pos: torch.Tensor, hkv: int, gen: torch.Generator, num_blocks: int,
                  topk: int = fmt.TOPK) -> torch.Tensor:
    """Per KV head and token: the own block plus ``topk - 1`` distinct random earlier blocks (all of
    them when fewer), ids in random order then -1. int32 ``[Hkv, T, topk]``."""
    out = torch.full((hkv, pos.shape[0], topk), -1, dtype=torch.int32, device=DEV)
    blocks = torch.arange(num_blocks, device=DEV)
    width = min(topk, num_blocks)
    for start in range(0, pos.shape[0], 4096):
        own = (pos[start : start + 4096].long() // fmt.PAGE_SIZE)[None, :, None]
        score = torch.rand(hkv, own.shape[1], num_blocks, device=DEV, generator=gen)
        score = torch.where(blocks > own, -1.0, torch.where(blocks == own, 2.0, score))
        top, ids = torch.topk(score, width, dim=-1)
        out[:, start : start + 4096, :width] = torch.where(top < 0, -1, ids).int()
    return out


def selection(pattern: str, q, cache, block_table, slots, pos, gen, topk: int = fmt.TOPK) -> torch.Tensor:
    hkv, num_blocks = cache.shape[1] // 2, block_table.shape[1]
    if pattern == "random":
        return random_blocks(pos, hkv, gen, num_blocks, topk)
    if pattern == "shared8":  # runs of 8 tokens never straddle a block; each run takes its last token's draw
        last = random_blocks(pos[SHARED_RUN - 1 :: SHARED_RUN], hkv, gen, num_blocks, topk)
        return last.repeat_interleave(SHARED_RUN, dim=1)[:, : pos.shape[0]].contiguous()
    from sglang_nvfp4.indexer import BlockSummaries, select_blocks

    summaries = BlockSummaries(cache.shape[0], hkv, device=DEV)
    summaries.update(cache, slots)
    req = torch.zeros_like(pos)
    return select_blocks(q, summaries, block_table, req, pos, topk=topk)


def visible_keys(block_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Distinct selected keys at or before each token's position, summed over KV heads and tokens."""
    ids = torch.sort(block_ids.long(), dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    keys = (pos.long()[None, :, None] - fmt.PAGE_SIZE * ids + 1).clamp(0, fmt.PAGE_SIZE)
    return torch.where((ids >= 0) & ~repeat, keys, 0).sum()


# ----------------------------------------------------------------------------------------------
# Peers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _pages_to_bf16_kernel(cache_ptr, pages_ptr, blocks_ptr, k_out_ptr, v_out_ptr, k_scale, v_scale,
                          HKV: tl.constexpr, USE_PTX: tl.constexpr):
    """Dequantize page ``pages[i]`` (logical block ``blocks[i]``) of KV head ``program_id(1)`` into
    bf16 ``k_out, v_out [slots, Hkv, 128]`` at slots ``128 * block + j`` (SGLang's dense layout)."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    page = tl.load(pages_ptr + i).to(tl.int64)
    block = tl.load(blocks_ptr + i).to(tl.int64)
    base = page * (2 * HKV * BLOCK_WORDS)
    slot = block * PAGE + tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_DIM)
    k = load_k_tile(cache_ptr, base + kv_head * BLOCK_WORDS, USE_PTX).to(tl.float32) * (TILE_SCALE * k_scale)
    tl.store(k_out_ptr + (slot[:, None] * HKV + kv_head) * HEAD_DIM + dims[None, :], k.to(tl.bfloat16))
    every_key = tl.full((PAGE,), 1, tl.int1)
    vt = load_vt_tile(cache_ptr, base + (HKV + kv_head) * BLOCK_WORDS, every_key, USE_PTX).to(tl.float32)
    vt = vt * (TILE_SCALE * v_scale)
    tl.store(v_out_ptr + (slot[None, :] * HKV + kv_head) * HEAD_DIM + vt_tile_dim(dims)[:, None], vt.to(tl.bfloat16))


class InTreeSparse:
    """SGLang's ``flash_prefill_with_gqa_share_sparse`` over bf16 K/V of one request."""

    def __init__(self, cache, block_table, block_ids, t):
        from sglang.kernels.ops.attention.minimax_sparse.prefill.topk_sparse import (
            flash_prefill_with_gqa_share_sparse,
        )

        self.fn = flash_prefill_with_gqa_share_sparse
        hkv = cache.shape[1] // 2
        used = torch.unique(block_table[0].long()[torch.unique(block_ids[block_ids >= 0]).long()])
        block_of_page = torch.empty(cache.shape[0], dtype=torch.int32, device=DEV)
        block_of_page[block_table[0].long()] = torch.arange(block_table.shape[1], device=DEV, dtype=torch.int32)
        self.pages, self.blocks = used.int(), block_of_page[used]
        self.cache, self.hkv, self.t = cache, hkv, t
        self.k = torch.zeros(t, hkv, fmt.HEAD_DIM, dtype=torch.bfloat16, device=DEV)
        self.v = torch.zeros_like(self.k)
        self.dequantize()
        i32 = dict(dtype=torch.int32, device=DEV)
        self.common = dict(
            sink=None, req_to_token=torch.arange(t, **i32)[None], slot_ids=torch.zeros(1, **i32),
            block_size_k=fmt.PAGE_SIZE, cu_seqlens=torch.tensor([0, t], **i32), seq_lens=torch.tensor([t], **i32),
            prefix_lens=torch.zeros(1, **i32), max_seqlen_q=t, sm_scale=fmt.HEAD_DIM**-0.5,
        )

    def dequantize(self):
        _pages_to_bf16_kernel[(self.pages.shape[0], self.hkv)](
            self.cache, self.pages, self.blocks, self.k, self.v, 1.0, 1.0, HKV=self.hkv, USE_PTX=True, num_warps=4)

    def attend(self, q, block_ids_per_qblock, block_size_q):
        return self.fn(q=q, k_cache=self.k, v_cache=self.v, topk_idx=block_ids_per_qblock, block_size_q=block_size_q,
                       **self.common)


def dense_causal_ms(q, k_dense, v_dense):
    """Dense causal SDPA (bf16), K/V expanded to the query heads."""
    g = q.shape[1] // k_dense.shape[1]
    q4 = q.transpose(0, 1)[None].contiguous()
    k4 = k_dense.transpose(0, 1).repeat_interleave(g, dim=0)[None].contiguous()
    v4 = v_dense.transpose(0, 1).repeat_interleave(g, dim=0)[None].contiguous()
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True)  # noqa: E731
    return bench_ms(fn)


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def prefill_kernels_case(row, args, out, flop, plan):
    """On Hopper, time both prefill kernels on one problem (each after an untimed call) and compare outputs;
    ``plan``: the dispatcher's, which ``ours_ms`` ran."""
    q, cache, block_ids, block_table, req, pos = args[:6]
    row["implementation"] = plan.implementation
    row["predecoded"] = plan.predecodes  # whether ours_ms (the dispatcher) predecoded
    row["token_groups"] = plan.groups_tokens  # and regrouped its tiles' tokens
    if plan.implementation != "gluon":
        return
    from sglang_nvfp4.kernels import gluon_prefill

    if not gluon_prefill.supports(q.shape[1], cache.shape[1] // 2, block_ids.shape[2]):
        row["implementation"] = "triton (gluon does not serve this shape)"
        return
    outs = {}
    for name, launch in (("triton", triton_prefill.launch), ("gluon", gluon_prefill.launch)):
        outs[name] = launch(*args, torch.full_like(out, float("nan")))
        row[f"{name}_ms"] = bench_ms(lambda: launch(*args, out))
        row[f"{name}_TFps"] = flop / row[f"{name}_ms"] / 1e9
    row["gluon_nan"] = bool(outs["gluon"].isnan().any())
    row["gluon_vs_triton_rel_diff"] = ((outs["gluon"].double() - outs["triton"].double()).norm()
                                       / outs["triton"].double().norm()).item()
    # The predecoded mode (pages decoded once into fp16 tiles, then copied): whole launch, the predecoding alone, bits.
    from sglang_nvfp4.kernels import triton_predecode

    predecoded = triton_predecode.prepare(block_table, req, pos, cache.shape[1] // 2)

    def predecoded_launch(out_):
        triton_predecode.launch(cache, block_table, predecoded)
        return gluon_prefill.launch(*args, out_, predecoded=predecoded)

    row["gluon_predecoded_same_bits"] = torch.equal(predecoded_launch(torch.full_like(out, float("nan"))),
                                                    outs["gluon"])
    row["gluon_predecoded_ms"] = bench_ms(lambda: predecoded_launch(out))
    row["predecode_only_ms"] = bench_ms(lambda: triton_predecode.launch(cache, block_table, predecoded))
    group = q.shape[1] // (cache.shape[1] // 2)
    tile_plan = gluon_prefill.plan(block_ids, block_table, req, pos, group)
    row["gluon_union_mean"] = tile_plan[0].float().mean().item()
    row["speedup_gluon_vs_triton"] = row["triton_ms"] / row["gluon_ms"]
    # Where the time goes: the planner alone, the kernel alone, and the kernel over the same plan with every
    # member mask cleared, which decodes every union page as before while its consumers skip every product
    # (the producer's own time).
    idle_plan = (tile_plan[0], tile_plan[1].clone())
    idle_plan[1][2].zero_()
    row["gluon_producer_only_ms"] = bench_ms(lambda: gluon_prefill.run(q, cache, pos, idle_plan, *args[6:], out))
    row["gluon_kernel_ms"] = bench_ms(lambda: gluon_prefill.run(q, cache, pos, tile_plan, *args[6:], out))
    row["gluon_planner_ms"] = bench_ms(lambda: gluon_prefill.plan(block_ids, block_table, req, pos, group))
    # Per producer size (warps decoding the pages): kernel and producer alone, and whether the output bits equal
    # the default's; the default's entry is the two timings above.
    default = gluon_prefill.PRODUCER_WARPS
    row["gluon_producer_warps_default"] = default
    row["gluon_by_producer_warps"] = {default: {"kernel_ms": row["gluon_kernel_ms"],
                                                "producer_only_ms": row["gluon_producer_only_ms"],
                                                "same_bits_as_default": True}}
    for warps in sorted(set(gluon_prefill.REGISTER_PLANS) - {default}):
        run = lambda plan_: gluon_prefill.run(q, cache, pos, plan_, *args[6:], out, producer_warps=warps)  # noqa: E731
        out.fill_(float("nan"))
        same = torch.equal(run(tile_plan), outs["gluon"])
        row["gluon_by_producer_warps"][warps] = {"kernel_ms": bench_ms(lambda: run(tile_plan)),
                                                 "producer_only_ms": bench_ms(lambda: run(idle_plan)),
                                                 "same_bits_as_default": same}


def prefill_case(t, heads, hkv, pattern, gen, in_tree_ok, sweep, topk=fmt.TOPK):
    cache, block_table, slots = one_request(t, hkv, gen)
    pos = torch.arange(t, device=DEV, dtype=torch.int32)
    req = torch.zeros_like(pos)
    q = (torch.randn(t, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    block_ids = selection(pattern, q, cache, block_table, slots, pos, gen, topk)
    flop = FLOP_PER_KEY * (heads // hkv) * int(visible_keys(block_ids, pos))
    args = (q, cache, block_ids, block_table, req, pos, 1.0, 1.0, fmt.HEAD_DIM**-0.5)
    out = torch.empty_like(q)
    row = {"T": t, "H": heads, "Hkv": hkv, "pattern": pattern, "topk": topk, "selected_flop": flop}
    cfg = triton_prefill.default_prefill_config(heads // hkv)
    union_len, _ = triton_prefill.plan_tiles(block_ids, block_table, req, pos, cfg.tokens_per_tile)
    row.update(config=list(cfg), union_mean=union_len.float().mean().item(), union_max=int(union_len.max()))
    # The dispatcher as the SGLang backend plans it: runs of tokens that share a selection say so (selection_run),
    # which decides predecoding and token groups.
    plan = kernels.plan_attention("prefill", block_table, req, pos, num_kv_heads=hkv,
                                  selection_run=SELECTION_RUNS.get(pattern, 1))
    row["selection_run"] = SELECTION_RUNS.get(pattern, 1)

    def ours():
        return plan.run(q, cache, block_ids, 1.0, 1.0, fmt.HEAD_DIM**-0.5, out=out)

    ours()  # untimed: compile
    row["ours_ms"] = bench_ms(ours)
    row["ours_TFps"] = flop / row["ours_ms"] / 1e9
    prefill_kernels_case(row, args, out, flop, plan)
    ours()  # the dispatcher's output for the peers' comparison
    if sweep:
        row["sweep"] = []
        for c in triton_prefill.PREFILL_CONFIGS:
            u, _ = triton_prefill.plan_tiles(block_ids, block_table, req, pos, c.tokens_per_tile)
            ms = bench_ms(lambda: triton_prefill.launch(*args, out, config=c))
            row["sweep"].append({"config": list(c), "ms": ms, "union_mean": u.float().mean().item()})
    if not in_tree_ok:
        return row, (q, None, None)
    peer = InTreeSparse(cache, block_table, block_ids, t)
    block_size_q = SHARED_RUN if pattern == "shared8" else 1
    per_qblock = block_ids[:, block_size_q - 1 :: block_size_q]
    # right-pad each row's ids with -1, as the in-tree kernel reads the first (#ids >= 0) entries
    per_qblock = torch.sort(per_qblock, dim=-1, descending=True).values.contiguous()
    try:
        theirs = peer.attend(q, per_qblock, block_size_q)
    except Exception as exc:  # noqa: BLE001 - the in-tree peer failing leaves our row and the dense peers
        row["in_tree_error"] = repr(exc)[:300]
        return row, (q, peer.k, peer.v)
    row["in_tree_rel_diff"] = ((theirs.double() - out.double()).norm() / out.double().norm()).item()
    row["in_tree_ms"] = bench_ms(lambda: peer.attend(q, per_qblock, block_size_q))
    row["dequant_ms"] = bench_ms(peer.dequantize)
    row["dequant_in_tree_ms"] = bench_ms(lambda: (peer.dequantize(), peer.attend(q, per_qblock, block_size_q)))
    for name in ("in_tree", "dequant_in_tree"):
        row[f"{name}_TFps"] = flop / row[f"{name}_ms"] / 1e9
        row[f"speedup_vs_{name}"] = row[f"{name}_ms"] / row["ours_ms"]
    k_dense, v_dense = peer.k, peer.v
    return row, (q, k_dense, v_dense)


def output_path(out: str, ext: str) -> str:
    """``out/kernels_<gpu>.<ext>``, named after the GPU that ran (``h200``, ``h100``, ``gh200``, ``mi355x``, ...; the
    whole device name, lower case, for other GPUs), so that a run on another GPU than the one asked for cannot pass
    for it."""
    name = torch.cuda.get_device_name(0)
    model = re.search(r"\b(G?H\d+|[AB]\d+|GB\d+|L40S?|MI\d+\w*)\b", name)
    tag = model.group(1) if model else re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")
    return os.path.join(out, f"kernels_{tag.lower()}.{ext}")


def save(results, out):
    """Write the JSON (after every case, so a run cut short keeps what it measured) and the plot."""
    report = {k: v for k, v in results.items() if not k.startswith("_")}
    with open(output_path(out, "json"), "w") as f:
        json.dump(report, f, indent=1)


def dense_peers(q, k_dense, v_dense, fi) -> dict:
    """Dense causal prefill of one request by every dense peer, on the same values: SDPA and (``fi`` not
    None) FlashInfer's; the fastest is ``strongest_dense``."""
    t, heads = q.shape[0], q.shape[1]
    dense_flop = FLOP_PER_KEY * heads * t * (t + 1) // 2
    times = {"dense": dense_causal_ms(q, k_dense, v_dense)}
    rec = {}
    if fi is not None:
        peers = fi.prefill(q, k_dense, v_dense)
        reference = peers.get("fa2_bf16", {}).get("out")
        for name, res in peers.items():
            if "ms" in res:
                times[f"fi_{name}"] = res["ms"]
                if reference is not None and name != "fa2_bf16":
                    rec[f"fi_{name}_max_abs_diff_vs_fa2_bf16"] = flashinfer_peers.max_abs_diff(res["out"], reference)
            else:
                rec[f"fi_{name}_error"] = res["error"]
    for name, ms in times.items():
        rec[f"{name}_ms"], rec[f"{name}_TFps"] = ms, dense_flop / ms / 1e9
    best = min(times, key=times.get)
    rec.update(strongest_dense="sdpa" if best == "dense" else best, strongest_dense_ms=times[best])
    return rec


def run_prefill(patterns, t_list, in_tree_ok, results, out, fi=None, topks=(fmt.TOPK,), heads_list=PREFILL_HEADS,
                sweep=True):
    cases = [(t, h, hkv, p, k) for t in t_list for h, hkv in heads_list for k in topks for p in patterns
             if p != "indexer" or t <= INDEXER_MAX_T]
    for i, (t, heads, hkv, pattern, topk) in enumerate(cases):
        if i and t != cases[i - 1][0]:
            plot(results, output_path(out, "png"))
        gen = torch.Generator(device=DEV).manual_seed(t + heads + len(pattern))
        try:
            row, (q, k_dense, v_dense) = prefill_case(t, heads, hkv, pattern, gen, in_tree_ok,
                                                      sweep=sweep and t == SWEEP_T and topk == fmt.TOPK, topk=topk)
        except Exception as exc:  # noqa: BLE001 - a failing case is recorded, the run goes on
            row = {"T": t, "H": heads, "Hkv": hkv, "pattern": pattern, "error": repr(exc)[:500]}
            log(f"[{i + 1}/{len(cases)}] prefill T={t} H={heads}/{hkv} {pattern}: FAILED {row['error']}")
            results["prefill"].append(row)
            save(results, out)
            continue
        dense_key = (t, heads, hkv)
        if k_dense is not None and dense_key not in results["_dense"]:
            results["_dense"][dense_key] = dense_peers(q, k_dense, v_dense, fi)
        if dense_key in results["_dense"]:
            row.update(results["_dense"][dense_key])
            row["speedup_vs_dense"] = row["dense_ms"] / row["ours_ms"]
            row["speedup_vs_strongest_dense"] = row["strongest_dense_ms"] / row["ours_ms"]
        results["prefill"].append(row)
        save(results, out)
        kernels_note = (f"; triton {row['triton_ms']:.3f} ms, gluon {row['gluon_ms']:.3f} ms "
                        f"(union {row['gluon_union_mean']:.1f}/8-token tile, rel diff {row['gluon_vs_triton_rel_diff']:.1e})"
                        if "gluon_ms" in row else "")
        log(f"[{i + 1}/{len(cases)}] prefill T={t} H={heads}/{hkv} top{topk} {pattern} [{row.get('implementation')}]"
            f"{kernels_note}: ours {row['ours_ms']:.3f} ms "
            f"({row['ours_TFps']:.0f} TF/s, union {row['union_mean']:.1f}/tile), in-tree {row.get('in_tree_ms', 0):.3f}, "
            f"dequant+in-tree {row.get('dequant_in_tree_ms', 0):.3f}, dense SDPA {row.get('dense_ms', 0):.3f}, "
            f"strongest dense {row.get('strongest_dense', '-')} {row.get('strongest_dense_ms', 0):.3f} ms")
        del q, k_dense, v_dense
        torch.cuda.empty_cache()


def decode_problem(batch, ctx, gen, topk=fmt.TOPK):
    """``batch`` requests of ``ctx`` tokens on random pages of random bytes (scale bytes 0x28..0x3F,
    2**-2..2, no NaN codes), one query token each at the last position, random ``topk`` blocks; returns the
    dispatcher's arguments (tensor scales, as under CUDA graphs)."""
    heads, hkv = DECODE_HEADS
    blocks = ctx // fmt.PAGE_SIZE
    cache = fmt.alloc_cache(batch * blocks, hkv, device=DEV).random_(0, 256, generator=gen)
    cache[..., fmt.SCALE_OFFSET :].random_(0x28, 0x40, generator=gen)
    block_table = torch.randperm(batch * blocks, device=DEV, generator=gen).int().view(batch, blocks)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int32, device=DEV)
    req = torch.arange(batch, dtype=torch.int32, device=DEV)
    block_ids = random_blocks(pos, hkv, gen, blocks, topk)
    q = (torch.randn(batch, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    scales = torch.tensor([1.0], device=DEV), torch.tensor([1.0], device=DEV)
    return q, cache, block_ids, block_table, req, pos, *scales, fmt.HEAD_DIM**-0.5


def decode_dense_peers(batch, ctx, fi, gen) -> dict:
    """FlashInfer's dense decode of ``batch`` requests over their whole ``ctx``-token context (random bf16
    K/V, and the same values in FlashInfer's NVFP4 cache): ``{"fi_fa2_bf16_ms": ..., ...}``."""
    heads, hkv = DECODE_HEADS
    if batch * ctx > FI_DECODE_MAX_TOKENS:
        return {"fi_skipped": f"batch x ctx = {batch * ctx} > FI_DECODE_MAX_TOKENS {FI_DECODE_MAX_TOKENS}"}
    k = torch.randn(batch * ctx, hkv, fmt.HEAD_DIM, device=DEV, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(batch * ctx, hkv, fmt.HEAD_DIM, device=DEV, generator=gen, dtype=torch.bfloat16)
    q = (torch.randn(batch, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    rec = {}
    for name, res in fi.decode(q, k, v, batch).items():
        if "ms" in res:
            rec[f"fi_{name}_ms"] = res["ms"]
        else:
            rec[f"fi_{name}_error"] = res["error"]
    return rec


def decode_kernels(args, moved, copy_gbps) -> dict:
    """On Hopper, both decode kernels on the same problem: ``triton_us`` / ``gluon_us``, their fraction of copy
    bandwidth and the relative difference of their outputs (``{}`` elsewhere)."""
    if kernels.plan_attention("decode", args[3], args[4], args[5], num_kv_heads=args[1].shape[1] // 2).implementation \
            != "gluon":
        return {}
    from sglang_nvfp4.kernels import gluon_decode

    rec, outs = {}, {}
    for name, launch in (("triton", triton_decode.launch), ("gluon", gluon_decode.launch)):
        outs[name] = torch.full_like(args[0], float("nan"))
        launch(*args, outs[name])
        rec[f"{name}_us"] = 1e3 * graph_ms(lambda: launch(*args, outs[name]))
        rec[f"{name}_fraction_of_copy"] = moved / (rec[f"{name}_us"] * 1e-3) / 1e6 / copy_gbps
    rec["gluon_nan"] = bool(outs["gluon"].isnan().any())
    rec["gluon_vs_triton_rel_diff"] = ((outs["gluon"].double() - outs["triton"].double()).norm()
                                       / outs["triton"].double().norm()).item()
    rec["speedup_gluon_vs_triton"] = rec["triton_us"] / rec["gluon_us"]
    return rec


def decode_case(batch, ctx, gen, copy_gbps, sweep, fi=None, topk=fmt.TOPK):
    args = decode_problem(batch, ctx, gen, topk)
    q, block_ids = args[0], args[2]
    heads, hkv = DECODE_HEADS
    out = torch.empty_like(q)
    pages = int((block_ids >= 0).sum())  # distinct by construction
    moved = pages * PAGE_BYTES_READ + 2 * q.numel() * q.element_size() + block_ids.numel() * 4
    row = {"batch": batch, "ctx": ctx, "H": heads, "Hkv": hkv, "topk": topk, "bytes": moved,
           "implementation": kernels.plan_attention("decode", args[3], args[4], args[5], num_kv_heads=hkv).implementation}
    if row["implementation"] == "gluon":
        from sglang_nvfp4.kernels import gluon_decode

        row["splits"] = gluon_decode.decode_splits(batch, hkv, block_ids.shape[2], q.device)
    else:
        row["splits"] = triton_decode.DECODE_SPLITS
    row["ms"] = graph_ms(lambda: kernels.sparse_decode(*args, out=out))
    row["GBps"] = moved / row["ms"] / 1e6
    row["fraction_of_copy"] = row["GBps"] / copy_gbps
    row.update(decode_kernels(args, moved, copy_gbps))
    if sweep:
        row["sweep"] = []
        for cap in DECODE_SWEEP:
            ms = graph_ms(lambda: triton_decode.launch(*args, out, max_registers=cap))
            row["sweep"].append({"max_registers": cap, "ms": ms, "GBps": moved / ms / 1e6})
    if fi is not None:
        del args, q, block_ids, out
        torch.cuda.empty_cache()
        row.update(decode_dense_peers(batch, ctx, fi, gen))
        times = {k[: -len("_ms")]: v for k, v in row.items() if k.startswith("fi_") and k.endswith("_ms")}
        if times:
            best = min(times, key=times.get)
            row.update(strongest_dense=best, strongest_dense_ms=times[best],
                       speedup_vs_strongest_dense=times[best] / row["ms"])
    return row


def run_split_sweep(results, out, topk=fmt.TOPK):
    """Decode time per fixed split count and batch size at ``SWEEP_T`` context: the data behind
    ``triton_decode.DECODE_SPLITS`` (one value for every batch size keeps decode batch-invariant).
    Also the first call's wall time per split count (the Triton compile, on a cold cache)."""
    for batch in SPLIT_SWEEP_BATCH:
        gen = torch.Generator(device=DEV).manual_seed(batch)
        args = decode_problem(batch, SWEEP_T, gen, topk)
        out_t = torch.empty_like(args[0])
        row = {"batch": batch, "ctx": SWEEP_T, "topk": topk, "us": {}}
        launches = {"us": triton_decode.launch}
        if kernels.plan_attention("decode", args[3], args[4], args[5], num_kv_heads=DECODE_HEADS[1]).implementation \
                == "gluon":
            from sglang_nvfp4.kernels import gluon_decode

            launches["gluon_us"] = gluon_decode.launch
        for key, launch in launches.items():
            row[key] = {}
            for splits in SPLIT_SWEEP:
                fewest, most = gluon_decode.split_range(topk) if key == "gluon_us" else (1, splits)
                if not fewest <= splits <= most:
                    continue  # a count the Gluon decode's merge tree does not take
                t0 = time.perf_counter()
                launch(*args, out_t, splits=splits)
                torch.cuda.synchronize()
                results.setdefault("split_first_call_s", {}).setdefault(f"{key}:{splits}", time.perf_counter() - t0)
                row[key][str(splits)] = 1e3 * graph_ms(lambda: launch(*args, out_t, splits=splits))
        results["decode_splits"].append(row)
        save(results, out)
        for key in launches:
            log(f"decode splits ({key}), batch {batch}: " + ", ".join(f"{k}: {v:.1f} us" for k, v in row[key].items()))


def run_prefetch_sweep(results, out, topk=fmt.TOPK):
    """The Gluon decode's time with and without its prefetch (``gluon_decode.launch(prefetch=)``) per split count
    (the one its launch picks, half and twice that) and batch size at ``SWEEP_T`` context; ``equal``: every output
    is bit-identical to the default launch's (they must be). The data behind ``gluon_decode.prefetches``."""
    from sglang_nvfp4.kernels import gluon_decode

    for batch in SPLIT_SWEEP_BATCH:
        gen = torch.Generator(device=DEV).manual_seed(batch)
        args = decode_problem(batch, SWEEP_T, gen, topk)
        width, hkv = args[2].shape[2], DECODE_HEADS[1]
        splits = gluon_decode.decode_splits(batch, hkv, width, args[0].device)
        rows = max(16, triton.next_power_of_2(DECODE_HEADS[0] // hkv))
        default = gluon_decode.prefetches(rows, width, batch * hkv * splits, args[0].device)
        want = gluon_decode.launch(*args, torch.full_like(args[0], float("nan")))
        row = {"batch": batch, "ctx": SWEEP_T, "topk": topk, "default_splits": splits, "default_prefetch": default,
               "us": {}, "equal": True}
        fewest, most = gluon_decode.split_range(width)
        for count in (c for c in (splits // 2, splits, 2 * splits) if fewest <= c <= most):
            for prefetch in (False, True):
                out_t = torch.full_like(args[0], float("nan"))
                gluon_decode.launch(*args, out_t, splits=count, prefetch=prefetch)
                row["equal"] &= bool(torch.equal(out_t, want))
                row["us"][f"{'prefetch' if prefetch else 'none'}:{count}"] = 1e3 * graph_ms(
                    lambda: gluon_decode.launch(*args, out_t, splits=count, prefetch=prefetch))
        results["decode_prefetch"].append(row)
        save(results, out)
        chosen = f"{'prefetch' if default else 'none'}:{splits}"
        best = min(row["us"], key=row["us"].get)
        log(f"decode prefetch, top-{topk} batch {batch}: default {chosen} {row['us'][chosen]:.1f} us, best {best} "
            f"{row['us'][best]:.1f} us, equal {row['equal']}; " + ", ".join(f"{k} {v:.1f}" for k, v in row["us"].items()))


def run_decode(results, copy_gbps, out, fi=None, topks=(fmt.TOPK,), batches=DECODE_BATCH, contexts=DECODE_CTX):
    cases = [(b, c, k) for k in topks for c in contexts for b in batches]
    for i, (batch, ctx, topk) in enumerate(cases):
        gen = torch.Generator(device=DEV).manual_seed(batch + ctx)
        try:
            row = decode_case(batch, ctx, gen, copy_gbps, sweep=(batch, ctx, topk) == (256, SWEEP_T, fmt.TOPK), fi=fi,
                              topk=topk)
        except Exception as exc:  # noqa: BLE001
            row = {"batch": batch, "ctx": ctx, "topk": topk, "error": repr(exc)[:500]}
            log(f"[{i + 1}/{len(cases)}] decode batch={batch} ctx={ctx} top{topk}: FAILED {row['error']}")
        else:
            kernels_note = (f"; triton {row['triton_us']:.1f} us ({100 * row['triton_fraction_of_copy']:.0f}%), "
                            f"gluon {row['gluon_us']:.1f} us ({100 * row['gluon_fraction_of_copy']:.0f}%), "
                            f"rel diff {row['gluon_vs_triton_rel_diff']:.1e}" if "gluon_us" in row else "")
            log(f"[{i + 1}/{len(cases)}] decode batch={batch} ctx={ctx} top{topk} [{row['implementation']}]: "
                f"{row['ms'] * 1e3:.1f} us, {row['GBps']:.0f} GB/s ({100 * row['fraction_of_copy']:.0f}% of copy), "
                f"splits {row['splits']}{kernels_note}; "
                f"strongest dense {row.get('strongest_dense', '-')} {row.get('strongest_dense_ms', 0) * 1e3:.1f} us")
        results["decode"].append(row)
        save(results, out)
        torch.cuda.empty_cache()


def run_write(results):
    for n in (256, 32768):
        hkv = 4
        cache = fmt.alloc_cache(n // fmt.PAGE_SIZE + 1, hkv, device=DEV)
        slots = torch.arange(n, device=DEV)
        k, v = torch.randn(2, n, hkv, fmt.HEAD_DIM, device=DEV).bfloat16()
        ms = graph_ms(lambda: kernels.write_kv(cache, slots, k, v, 1.0, 1.0))
        moved = 2 * k.numel() * 2 + n * hkv * (fmt.BYTES_PER_TOKEN_PER_HEAD + fmt.CODE_BYTES) + slots.numel() * 8
        results["write"].append({"tokens": n, "Hkv": hkv, "ms": ms, "GBps": moved / ms / 1e6})
        log(f"write {n} tokens x {hkv} KV heads: {ms * 1e3:.1f} us")


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, pattern in zip(axes[:2], ("random", "shared8")):
        rows = sorted((r for r in results["prefill"] if r.get("pattern") == pattern and r["H"] == 64 and "ours_ms" in r
                       and r.get("topk", fmt.TOPK) == fmt.TOPK), key=lambda r: r["T"])
        ts = [r["T"] for r in rows]
        for key, label in (("ours_ms", "NVFP4 fused (ours)"), ("in_tree_ms", "in-tree sparse, bf16 KV"),
                           ("dequant_in_tree_ms", "dequant + in-tree"), ("dense_ms", "dense causal SDPA bf16"),
                           ("fi_fa3_bf16_ms", "FlashInfer fa3 dense bf16"),
                           ("fi_fa2_nvfp4_ms", "FlashInfer fa2 dense NVFP4")):
            if rows and all(key in r for r in rows):
                ax.plot(ts, [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="ms",
               title=f"prefill H=64/Hkv=4, top-16 {pattern}")
        ax.set_xticks(sorted(ts), [f"{t // 1024}K" for t in sorted(ts)])
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    if not results["decode"]:
        ax.set_axis_off()
    for ctx in DECODE_CTX if results["decode"] else ():
        rows = [r for r in results["decode"] if r.get("ctx") == ctx and "GBps" in r]
        ax.plot([r["batch"] for r in rows], [r["GBps"] for r in rows], marker="o", label=f"ctx {ctx // 1024}K")
    if results["decode"]:
        ax.axhline(results["ceilings"]["copy_GBps"], color="k", ls="--", label="measured copy")
        ax.axhline(0.7 * results["ceilings"]["copy_GBps"], color="gray", ls=":", label="70% of copy (target)")
        ax.set(xscale="log", xlabel="batch", ylabel="GB/s (bytes read + written)", title="decode H=64/Hkv=4, top-16")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{results['meta']['gpu']}, {results['meta']['date']}: {results['meta']['command']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile():
    """One warm-up and one measured launch of prefill (T=32K, H=64/Hkv=4, random) and decode
    (batch 256, ctx 32K); run under ``ncu --launch-skip 2 --launch-count 2 -k regex:_sparse_``."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    cache, block_table, slots = one_request(SWEEP_T, 4, gen)
    pos = torch.arange(SWEEP_T, device=DEV, dtype=torch.int32)
    q = (torch.randn(SWEEP_T, 64, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    block_ids = random_blocks(pos, 4, gen, block_table.shape[1])
    decode_args = decode_problem(256, SWEEP_T, gen)
    for _ in range(2):
        kernels.sparse_prefill(q, cache, block_ids, block_table, torch.zeros_like(pos), pos, 1.0, 1.0, fmt.HEAD_DIM**-0.5)
        kernels.sparse_decode(*decode_args)
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results", help="folder for kernels_<gpu>.json / .png")
    parser.add_argument("--profile", action="store_true", help="only the launches to profile with ncu")
    parser.add_argument("--prefill-t", type=int, nargs="*", default=list(PREFILL_T))
    parser.add_argument("--topk", type=int, nargs="*", default=[fmt.TOPK], help="prefill ids per token")
    parser.add_argument("--heads", nargs="*", default=[f"{h}/{k}" for h, k in PREFILL_HEADS],
                        help="prefill query/KV heads, e.g. 64/4")
    parser.add_argument("--no-sweep", action="store_true", help="skip the prefill config sweep")
    parser.add_argument("--decode-topk", type=int, nargs="*", default=[fmt.TOPK], help="decode ids per token")
    parser.add_argument("--decode-batch", type=int, nargs="*", default=list(DECODE_BATCH))
    parser.add_argument("--decode-ctx", type=int, nargs="*", default=list(DECODE_CTX))
    parser.add_argument("--split-topk", type=int, nargs="*", default=[fmt.TOPK], help="ids per token, split sweep")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["prefill", "decode", "write", "flashinfer", "splits", "prefetch", "in-tree"])
    args = parser.parse_args()
    if args.profile:
        return profile()
    os.makedirs(args.out, exist_ok=True)
    patterns = list(PATTERNS)
    try:
        import sglang_nvfp4.indexer  # noqa: F401
    except ImportError as exc:
        print(f"note: the 'indexer' pattern is skipped: sglang_nvfp4.indexer does not import ({exc})")
        patterns.remove("indexer")
    try:
        from sglang.kernels.ops.attention.minimax_sparse.prefill import topk_sparse  # noqa: F401

        in_tree_ok = "in-tree" not in args.skip
    except ImportError as exc:
        print(f"note: SGLang peers are skipped: the in-tree kernel does not import ({exc})")
        in_tree_ok = False
    fi = None
    reason = "skipped (--skip flashinfer)" if "flashinfer" in args.skip else flashinfer_peers.unavailable_reason()
    if reason is None:
        fi = flashinfer_peers.FlashInferPeers(DEV)
    else:
        print(f"note: FlashInfer peers are skipped: {reason}")
    props = torch.cuda.get_device_properties(0)
    results = {
        "meta": {"gpu": props.name, "sms": props.multi_processor_count, "date": datetime.date.today().isoformat(),
                 "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
                 "patterns": patterns},
        "prefill": [], "decode": [], "write": [], "decode_splits": [], "decode_prefetch": [], "_dense": {},
        "flashinfer": {"version": fi.fi.__version__, "first_call_s": fi.first_call_s} if fi else {"skipped": reason},
    }
    log(f"{props.name}: measuring copy bandwidth and bf16 matmul")
    results["ceilings"] = ceilings()
    log(f"copy {results['ceilings']['copy_GBps']:.0f} GB/s, bf16 matmul {results['ceilings']['bf16_matmul_TFps']:.0f} TF/s")
    if "splits" not in args.skip:
        for topk in args.split_topk:
            run_split_sweep(results, args.out, topk)
    if "prefetch" not in args.skip and torch.cuda.get_device_capability() == (9, 0) and torch.version.hip is None:
        for topk in args.split_topk:
            run_prefetch_sweep(results, args.out, topk)
    if "write" not in args.skip:
        run_write(results)
    if "decode" not in args.skip:
        run_decode(results, results["ceilings"]["copy_GBps"], args.out, fi, args.decode_topk, args.decode_batch,
                   args.decode_ctx)
    if "prefill" not in args.skip:
        heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
        run_prefill(patterns, args.prefill_t, in_tree_ok, results, args.out, fi, args.topk, heads, not args.no_sweep)
    save(results, args.out)
    if results["prefill"] or results["decode"]:
        plot(results, output_path(args.out, "png"))
    log(f"wrote {output_path(args.out, 'json')}" + (" and .png" if results["prefill"] or results["decode"] else ""))
    summary(results)


def summary(results):
    print("\nprefill (ms; speed-up of ours in brackets; strongest dense = fastest of SDPA and FlashInfer)")
    print(f"{'T':>7} {'H/Hkv':>6} {'pattern':>8} {'ours':>8} {'TF/s':>6} {'union':>6} {'in-tree':>15} "
          f"{'deq+in-tree':>15} {'SDPA':>15} {'strongest dense':>28}")
    for r in results["prefill"]:
        if "ours_ms" not in r:
            print(f"{r['T']:>7} {r['H']}/{r['Hkv']:<4} {r['pattern']:>8}  error")
            continue
        peer = lambda k: f"{r[k + '_ms']:8.2f} ({r['speedup_vs_' + k]:4.1f}x)" if k + "_ms" in r else " " * 15  # noqa: E731
        print(f"{r['T']:>7} {r['H']:>3}/{r['Hkv']:<2} {r['pattern']:>8} {r['ours_ms']:8.3f} {r['ours_TFps']:6.0f} "
              f"{r['union_mean']:6.1f} {peer('in_tree')} {peer('dequant_in_tree')} {peer('dense')} "
              f"{r.get('strongest_dense', '-'):>12} {peer('strongest_dense')}")
    both = [r for r in results["prefill"] if "gluon_ms" in r]
    if both:
        print("\nprefill kernels on Hopper (ms): Triton vs warp-specialized Gluon, same problem")
        for r in both:
            print(f"{r['T']:>7} {r['H']:>3}/{r['Hkv']:<2} top{r['topk']:<3} {r['pattern']:>8} triton {r['triton_ms']:8.3f} "
                  f"gluon {r['gluon_ms']:8.3f} ({r['speedup_gluon_vs_triton']:.2f}x, {r['gluon_TFps']:.0f} TF/s) "
                  f"rel diff {r['gluon_vs_triton_rel_diff']:.1e} nan {r['gluon_nan']}")
            print(f"{'':>16} planner {r['gluon_planner_ms']:.3f}, kernel {r['gluon_kernel_ms']:.3f}, "
                  f"producer alone {r['gluon_producer_only_ms']:.3f}")
            for warps, w in sorted(r["gluon_by_producer_warps"].items()):
                print(f"{'':>16} {warps} producer warps: kernel {w['kernel_ms']:.3f}, producer alone "
                      f"{w['producer_only_ms']:.3f}, same bits {w['same_bits_as_default']}")
    print("\ndecode H=64/Hkv=4 (strongest dense: FlashInfer's dense decode over the whole context)")
    for r in results["decode"]:
        if "ms" in r:
            best = (f"; {r['strongest_dense']} {r['strongest_dense_ms'] * 1e3:.1f} us "
                    f"({r['speedup_vs_strongest_dense']:.1f}x)" if "strongest_dense" in r else "")
            both = (f"; triton {r['triton_us']:.1f} us, gluon {r['gluon_us']:.1f} us "
                    f"({r['speedup_gluon_vs_triton']:.2f}x)" if "gluon_us" in r else "")
            print(f"batch {r['batch']:>3} ctx {r['ctx'] // 1024:>3}K top{r.get('topk', fmt.TOPK):<3}: {r['ms'] * 1e3:8.1f} us "
                  f"{r['GBps']:6.0f} GB/s {100 * r['fraction_of_copy']:4.0f}% of copy{both}{best}")
    fi = results.get("flashinfer", {})
    if fi.get("first_call_s"):
        print("\nFlashInfer first calls (s, JIT compile included when not cached): "
              + ", ".join(f"{k} {v:.1f}" for k, v in fi["first_call_s"].items()))


if __name__ == "__main__":
    main()
