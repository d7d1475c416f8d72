"""The proxy indexer's fp8 block scores alone (no top-k) on a Hopper GPU: the Triton kernel against the
warp-specialized Gluon kernel per blocks per program.

    python bench/bench_proxy_scores.py [--t 32768] [--chunk 8192] [--blocks 8 16 32 64 256] [--subtiles 2 4]
                                       [--every N] [--out DIR]

One request of ``--t`` tokens, 64 query heads over 4 KV heads (16 groups per KV head, the default proxy over every
query head), random K/V written by ``kernels.write_kv`` on shuffled pages, fp16 queries. Scored twice: the whole
prompt, and its last ``--chunk`` tokens (an extend over the rest as prefix). ``--every N`` scores only every
``N``-th of those tokens (positions ``N - 1``, ``2N - 1``, ...: the runs' last tokens of ``PROXY_SHARE=N``,
``PROXY_SHARE_SCORE=last``). Per case: the Triton kernel at the
launch ``select_proxy_blocks`` gives it, the Gluon kernel at its default blocks per program
(``gluon_proxy.blocks_per_program``) and at each ``--blocks``, for each ``--subtiles`` per consumer; each Gluon
row has the max |difference| from the Triton scores and whether the same blocks are visible (NaN-poisoned
outputs). ``--key-tiles``: the Gluon kernel at its defaults again, copying predecoded E4M3 key tiles
(``triton_predecode``) instead of decoding pages (``gluon, key tiles``: its ms, the predecoding's own ms, which the
attention shares, and whether its scores equal the decoding kernel's bit for bit on whole blocks). CUDA-graph
replays after an untimed
run, medians (``timing.graph_ms``). Writes ``DIR/proxy_scores.json``. The data behind
``gluon_proxy.blocks_per_program`` and its subtiles (``bench/results/proxy_scores_h200.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 4, 128, 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--t", type=int, default=32768, help="prompt tokens (a multiple of 128)")
    parser.add_argument("--chunk", type=int, default=8192, help="tokens of the second case: the prompt's last ones")
    parser.add_argument("--blocks", type=int, nargs="*", default=[8, 16, 32, 64, 256],
                        help="Gluon blocks per program to time besides its default")
    parser.add_argument("--subtiles", type=int, nargs="*", default=[2, 4], choices=[2, 4],
                        help="Gluon subtiles per consumer to time besides its default")
    parser.add_argument("--every", type=int, default=1,
                        help="score the tokens at positions N-1, 2N-1, ... only (runs of N scored as their last token)")
    parser.add_argument("--key-tiles", action="store_true", help="also time the Gluon kernel on predecoded key tiles")
    parser.add_argument("--out", default="proxy_scores_out")
    args = parser.parse_args(argv)
    if args.t <= 0 or args.t % PAGE or not 0 < args.chunk <= args.t:
        parser.error(f"--t: a positive multiple of {PAGE}, --chunk in (0, t]; got {args.t}, {args.chunk}")
    if args.every < 1 or args.chunk < args.every:
        parser.error(f"--every: at least 1 and at most --chunk, got {args.every}")
    if any(b <= 0 for b in args.blocks):
        parser.error(f"--blocks: positive counts, got {args.blocks}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_proxy_scores.py needs a CUDA GPU (the Gluon kernel is sm_90 only)")
    from timing import graph_ms

    from sglang_nvfp4 import format as fmt
    from sglang_nvfp4 import kernels
    from sglang_nvfp4.kernels import gluon_proxy
    from sglang_nvfp4.kernels import triton_indexer as ti

    dev = torch.device("cuda")
    groups = HEADS // KV_HEADS
    gen = torch.Generator(device=dev).manual_seed(HEADS)
    blocks = args.t // PAGE
    cache = fmt.alloc_cache(blocks, KV_HEADS, device=dev)
    table = torch.randperm(blocks, device=dev, generator=gen).int().view(1, blocks)
    offsets = torch.arange(args.t, device=dev)
    slots = table[0].long()[offsets // PAGE] * PAGE + offsets % PAGE
    for part in slots.split(65536):
        k, v = (torch.randn(part.shape[0], KV_HEADS, HEAD_DIM, device=dev, generator=gen).bfloat16() for _ in range(2))
        kernels.write_kv(cache, part, k, v, 1.0, 1.0)
    pos = torch.arange(args.t, dtype=torch.int32, device=dev)
    req = torch.zeros_like(pos)
    q = (torch.randn(args.t, HEADS, HEAD_DIM, device=dev, generator=gen) * 0.3).half()
    props = torch.cuda.get_device_properties(dev)
    results = {"meta": {"gpu": props.name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                        "command": " ".join(sys.argv), "implementation": kernels.resolve_implementation(dev)},
               "rows": []}
    for count_in in dict.fromkeys((args.t, args.chunk)):
        scored = torch.arange(args.t - count_in, args.t, device=dev)
        scored = scored[(scored + 1) % args.every == 0]
        n = scored.shape[0]
        qn, req_n, pos_n = q[scored].contiguous(), req[scored].contiguous(), pos[scored].contiguous()
        tokens, per_program = ti.learned_tiling(n, 1, groups, ti.PROXY_PREFILL_ROWS)
        want = torch.full((KV_HEADS, n, blocks), float("nan"), device=dev)
        ms = graph_ms(lambda: ti.proxy_block_scores(qn, cache, table, req_n, pos_n, want, tokens, per_program, groups,
                                                    True))
        results["rows"].append({"n": n, "of_tokens": count_in, "every": args.every, "kernel": "triton",
                                "tokens": tokens, "blocks": per_program, "ms": ms})
        print(f"n={n} triton ({tokens} tokens, {per_program} blocks per program): {ms:.3f} ms", flush=True)
        if not gluon_proxy.supports(dev, n, 1, groups):
            print("  the Gluon kernel does not serve this device or call", flush=True)
            continue
        visible = torch.isfinite(want)
        for subtiles in dict.fromkeys([gluon_proxy.SUBTILES, *args.subtiles]):
            tiles = -(-n // gluon_proxy.tokens_per_tile(groups, subtiles))
            default = gluon_proxy.blocks_per_program(tiles, blocks, KV_HEADS, props.multi_processor_count)
            for count in dict.fromkeys([default, *args.blocks]):
                got = torch.full_like(want, float("nan"))
                ms = graph_ms(lambda: gluon_proxy.block_scores(qn, cache, table, req_n, pos_n, got, groups, count,
                                                               subtiles))
                diff = (got[visible] - want[visible]).abs().max().item()
                same = bool(torch.equal(torch.isfinite(got), visible))
                is_default = count == default and subtiles == gluon_proxy.SUBTILES
                results["rows"].append({"n": n, "of_tokens": count_in, "every": args.every, "kernel": "gluon",
                                        "subtiles": subtiles, "blocks": count, "default": is_default, "ms": ms,
                                        "max_abs_diff_vs_triton": diff, "same_visible_blocks": same})
                print(f"  gluon {subtiles} subtiles, {count} blocks per program{' (default)' if is_default else ''}: "
                      f"{ms:.3f} ms, max |diff| {diff:.3g}, same visible blocks {same}", flush=True)
                if is_default:
                    decoded = got
        if args.key_tiles:
            from sglang_nvfp4.kernels import triton_predecode

            predecoded = triton_predecode.prepare(table, req_n, pos_n, KV_HEADS, key_tiles=True)
            predecode_ms = graph_ms(lambda: triton_predecode.launch(cache, table, predecoded))
            got = torch.full_like(want, float("nan"))
            ms = graph_ms(lambda: gluon_proxy.block_scores(qn, cache, table, req_n, pos_n, got, groups,
                                                           key_tiles=predecoded.key_tiles))
            whole = (torch.arange(blocks, device=dev) + 1) * PAGE <= predecoded.kv_len[0]  # blocks before the end
            got_whole, decoded_whole = got[:, :, whole], decoded[:, :, whole]  # NaN where a token does not see a block
            same = bool(torch.equal(got_whole.isnan(), decoded_whole.isnan())  # then the bits of the others
                        and torch.equal(got_whole.nan_to_num().view(torch.int32),
                                        decoded_whole.nan_to_num().view(torch.int32)))
            results["rows"].append({"n": n, "of_tokens": count_in, "every": args.every, "kernel": "gluon, key tiles",
                                    "default": True, "ms": ms, "predecode_ms": predecode_ms,
                                    "same_bits_as_decoding_on_whole_blocks": same})
            print(f"  gluon on key tiles: {ms:.3f} ms (+ predecoding {predecode_ms:.3f} ms, shared with the attention), "
                  f"same bits as decoding {same}", flush=True)
        del want
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "proxy_scores.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
