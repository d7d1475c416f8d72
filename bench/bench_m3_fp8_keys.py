"""fp8 index keys (``NVFP4_SPARSE_INDEX_KEYS=fp8``) against the model-dtype (bf16) ones: how MiniMax-M3's learned
selection changes when its index keys are stored in fp8 (CPU, the torch path of
:func:`sglang_nvfp4.indexer.select_blocks_learned`, whose bf16 selections are the in-tree semantics).

One request per (context length, seed) on one page per block, M3's reduced-config selection (4 index heads, top-16,
1 leading and 1 trailing block forced), ``--tokens`` query tokens at random positions past the first 16 blocks (so
every one selects 16 of more visible blocks). Key distributions (``--kinds``):

* ``random``: idx_q and idx_k standard normal in bf16. Block scores are maxima of 128 random logits, so many
  blocks are near ties: the hardest case for any rounding.
* ``planted``: as ``random``, and for each query token and index head one non-forced block before the token holds a
  key equal to that head's query times ``--signal`` (0.4: an expected logit of 0.4 x 128 = 51, where a random key's
  logit has standard deviation 11.3): a block that holds what the head looks for.

Per kind and length: the fraction of (head, token) rows whose block set is identical in both storages (Wilson 95%
interval; rows of one token are not independent, so the interval is optimistic), the mean fraction of a row's
selected blocks that both storages select, and (``planted``) the fraction of (head, token) rows whose planted block
each storage selects. The keys are drawn in fp32 and stored as the model would give them (bf16; fp8 quantizes
those); as a noise floor of rounding itself, the same fp32 keys stored in fp16 (3 more significant bits than bf16)
are compared with bf16 too (``fp16_*``).

``python bench/bench_m3_fp8_keys.py --out DIR`` writes ``m3_fp8_keys.json`` under DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from sglang_nvfp4 import format as fmt
from sglang_nvfp4.indexer import IndexKeys, select_blocks_learned
from sglang_nvfp4.quality.stats import wilson_interval

INDEX_HEADS, TOPK, INIT_BLOCKS, LOCAL_BLOCKS = 4, 16, 1, 1  # the reduced M3 config's sparse_attention_config
KINDS = ("random", "planted")
STORAGES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--tokens", type=int, default=256, help="query tokens per context and seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--signal", type=float, default=0.4, help="planted key = this times the head's index query")
    return ap.parse_args(argv)


def problem(kind: str, context: int, tokens: int, signal: float, gen: torch.Generator):
    """(idx_q [T, 4, 128] bf16, idx_k [context, 128] fp32, pos [T] int32, planted block per token and head
    [T, 4] or None)."""
    idx_k = torch.randn(context, 128, generator=gen)
    low = TOPK * fmt.PAGE_SIZE
    pos = torch.randint(low, context, (tokens,), generator=gen, dtype=torch.int32)
    idx_q = torch.randn(tokens, INDEX_HEADS, 128, generator=gen)
    planted = None
    if kind == "planted":
        own = pos.long() // fmt.PAGE_SIZE
        # distinct blocks that are not forced: past the leading one, before the token's own block
        planted = torch.stack([INIT_BLOCKS + torch.randperm(int(b) - INIT_BLOCKS - (LOCAL_BLOCKS - 1),
                                                            generator=gen)[:INDEX_HEADS] for b in own])
        # one row per (token, head), none shared: the next unused row of the block
        used = torch.zeros(-(-context // fmt.PAGE_SIZE), dtype=torch.long)
        rows = torch.empty_like(planted)
        for i, b in enumerate(planted.reshape(-1).tolist()):
            rows.view(-1)[i] = b * fmt.PAGE_SIZE + used[b]
            used[b] += 1
        if int(used.max()) > fmt.PAGE_SIZE:
            raise ValueError(f"--tokens {tokens}: more planted keys than rows in a block at context {context}")
        idx_k[rows.reshape(-1)] = (signal * idx_q).reshape(-1, 128)
    return idx_q.bfloat16(), idx_k, pos, planted


def selections(idx_q, idx_k, pos, dtype) -> torch.Tensor:
    """int32 [4, T, 16]: the learned selection with the fp32 keys ``idx_k`` stored as ``dtype`` (fp8: quantized from
    their bf16 values, as the model gives them)."""
    blocks = -(-idx_k.shape[0] // fmt.PAGE_SIZE)
    keys = IndexKeys(blocks, dtype=dtype)
    keys.write(torch.arange(idx_k.shape[0]), idx_k.to(torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype))
    table = torch.arange(blocks, dtype=torch.int32)[None]
    req = torch.zeros_like(pos)
    return select_blocks_learned(idx_q, keys, table, req, pos, topk=TOPK, sink_blocks=INIT_BLOCKS,
                                 local_blocks=LOCAL_BLOCKS - 1, impl="torch")


def agreement(base: torch.Tensor, other: torch.Tensor) -> tuple[int, float]:
    """(rows with identical block sets, mean fraction of a row's selected blocks that ``other`` selects too)."""
    same_set = int((torch.sort(base, -1).values == torch.sort(other, -1).values).all(-1).sum())
    shared = (base[..., :, None] == other[..., None, :]).any(-1) & (base >= 0)
    return same_set, (shared.sum(-1).float() / (base >= 0).sum(-1).float()).mean().item()


def compare(sel: dict, planted) -> dict:
    """fp8 and fp16 selections against bf16 ones (``sel``: storage name -> int32 [heads, T, 16])."""
    rows = sel["bf16"].shape[0] * sel["bf16"].shape[1]
    row = {"rows": rows}
    for name, prefix in (("fp8", ""), ("fp16", "fp16_")):
        same_set, shared = agreement(sel["bf16"], sel[name])
        row.update({f"{prefix}identical_sets": same_set, f"{prefix}identical_fraction": same_set / rows,
                    f"{prefix}identical_ci95": wilson_interval(same_set, rows), f"{prefix}mean_shared_fraction": shared})
    if planted is not None:
        for name, ids in sel.items():
            hit = (ids == planted.T[:, :, None]).any(-1)  # [heads, T]: the head's own planted block selected
            row[f"planted_recall_{name}"] = hit.float().mean().item()
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {"command": "python bench/bench_m3_fp8_keys.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor()
               or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "config": {"index_heads": INDEX_HEADS, "topk": TOPK, "init_blocks": INIT_BLOCKS,
                          "local_blocks": LOCAL_BLOCKS, "tokens": args.tokens, "seeds": args.seeds,
                          "signal": args.signal}, "rows": []}
    for kind in args.kinds:
        for context in args.contexts:
            per_seed = []
            for seed in args.seeds:
                gen = torch.Generator().manual_seed(1000 * seed + context)
                idx_q, idx_k, pos, planted = problem(kind, context, args.tokens, args.signal, gen)
                t0 = time.perf_counter()
                sel = {name: selections(idx_q, idx_k, pos, dtype) for name, dtype in STORAGES.items()}
                per_seed.append(compare(sel, planted))
                print(f"{kind} {context} seed {seed}: {per_seed[-1]} ({time.perf_counter() - t0:.1f} s)", flush=True)
            n = sum(r["rows"] for r in per_seed)
            summary = {"kind": kind, "context": context, "rows": n}
            for prefix in ("", "fp16_"):
                hits = sum(r[f"{prefix}identical_sets"] for r in per_seed)
                summary.update({f"{prefix}identical_fraction": hits / n,
                                f"{prefix}identical_ci95": wilson_interval(hits, n),
                                f"{prefix}mean_shared_fraction": sum(r[f"{prefix}mean_shared_fraction"] * r["rows"]
                                                                     for r in per_seed) / n})
            if kind == "planted":
                summary.update({f"planted_recall_{name}": sum(r[f"planted_recall_{name}"] * r["rows"]
                                                              for r in per_seed) / n for name in STORAGES})
            results["rows"].append(summary)
            print(f"== {summary}", flush=True)
            with open(os.path.join(args.out, "m3_fp8_keys.json"), "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
