"""Block-selection recall on the trained retrieval model (CPU, plain PyTorch, unquantized keys).

For each evaluation prompt (``sglang_nvfp4.quality.task``) the model runs densely; at the last token
(the ``<q> KEY`` whose next token is the answer) and in every layer, the blocks of 128 keys other than
the always-attended ones (sink block 0, the own block and the local block before it) are ranked by

* ``quest_mean``: the product's quest score, the mean over the 16 query heads of each head's
  per-dimension upper bound ``relu(q)·kmax + min(q, 0)·kmin`` (what ``indexer.aggregate_queries`` +
  the block bounds compute, here on unquantized keys);
* ``quest_max``: the same bound, maximum over heads instead of mean;
* ``sub64_mean`` / ``sub64_max`` / ``sub32_mean`` / ``sub32_max``: the bound per 64- or 32-key sub-block,
  maximum over the block's sub-blocks, then mean / maximum over heads (finer summaries: 2x / 4x the
  summary memory and scoring work);
* ``proxy_mean``: a token-level proxy, the mean query over the heads against every key of the block,
  max-pooled (the scoring MiniMax-M3's learned indexer does, with the head-mean query in place of its
  learned projection; one 128-wide dot product per key);
* ``proxy_4groups``: the same with 4 queries (means of 4 heads each), maximum over the 4;
* ``proxy_heads``: every head's query against every key, max-pooled, maximum over heads (the exact largest
  logit of the block: 16x the work of ``proxy_mean``);
* ``oracle``: the largest attention mass any head puts on the block (true softmax).

Recall = fraction of prompts whose record block is among the top ``--picks`` ranked blocks (13 =
top-16 minus the three fixed blocks), with a 95% Wilson interval. Writes JSON to ``--out``.

``python bench/eval_quality_indexer.py --out results.json [--lengths 4096 8192] [--per-cell 6]``
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from sglang_nvfp4 import format as fmt
from sglang_nvfp4.quality import task
from sglang_nvfp4.quality.model import dense_causal_attention, load_hf
from sglang_nvfp4.quality.stats import wilson_interval

BLOCK = fmt.PAGE_SIZE  # one indexer block is one cache page


def _bounds(q: torch.Tensor, kb: torch.Tensor, valid: torch.Tensor, sub: int) -> torch.Tensor:
    """Quest bound per head and ``sub``-key sub-block, maximum over a block's sub-blocks: ``[H, n_blocks]``."""
    n_blocks, _, d = kb.shape
    kb, valid = kb.view(n_blocks, BLOCK // sub, sub, d), valid.view(n_blocks, BLOCK // sub, sub, 1)
    kmax = torch.where(valid, kb, -torch.inf).amax(2)  # [n_blocks, subs, D]
    kmin = torch.where(valid, kb, torch.inf).amin(2)
    bound = torch.einsum("hd,bsd->hbs", q.clamp(min=0), kmax) + torch.einsum("hd,bsd->hbs", q.clamp(max=0), kmin)
    return bound.nan_to_num(nan=-torch.inf).amax(-1)  # sub-blocks with no key: -inf - inf = nan


def _max_pooled(queries: torch.Tensor, k: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``queries [Q, D]`` against every key, maximum per block and over the queries: ``[n_blocks]``."""
    logits = torch.nn.functional.pad(queries @ k.T, (0, n_blocks * BLOCK - k.shape[0]), value=-torch.inf)
    return logits.view(queries.shape[0], n_blocks, BLOCK).amax(-1).amax(0)


def block_scores(q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """``q [H, D]`` (one token), ``k [L, D]`` -> per-block scores ``[num_blocks]`` by method."""
    n_blocks = (k.shape[0] + BLOCK - 1) // BLOCK
    pad = n_blocks * BLOCK - k.shape[0]
    valid = (torch.arange(n_blocks * BLOCK) < k.shape[0]).view(n_blocks, BLOCK, 1)
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(n_blocks, BLOCK, -1)
    scores = {}
    for name, sub in (("quest", BLOCK), ("sub64", 64), ("sub32", 32)):
        bound = _bounds(q, kb, valid, sub)
        scores[f"{name}_mean"], scores[f"{name}_max"] = bound.mean(0), bound.amax(0)
    scores["proxy_mean"] = _max_pooled(q.mean(0, keepdim=True), k, n_blocks)
    scores["proxy_4groups"] = _max_pooled(q.view(4, -1, q.shape[-1]).mean(1), k, n_blocks)
    scores["proxy_heads"] = _max_pooled(q, k, n_blocks)
    probs = torch.softmax((q @ k.T) * q.shape[-1] ** -0.5, dim=-1)
    mass = torch.nn.functional.pad(probs, (0, pad)).view(q.shape[0], n_blocks, BLOCK).sum(-1)
    scores["oracle"] = mass.amax(0)
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tests/fixtures/retrieval_model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--per-cell", type=int, default=6)
    ap.add_argument("--picks", type=int, nargs="+", default=[13, 5])
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model = load_hf(args.model)
    captured = []

    def attention(q, k, v, scale):
        captured.append((q[0, :, -1].clone(), k[0, 0].clone()))  # one KV head: k[0, 0] is [L, D]
        return dense_causal_attention(q, k, v, scale)

    hits: dict[str, list[bool]] = {}
    for length in args.lengths:
        n_blocks = (length + BLOCK - 1) // BLOCK
        own = (length - 1) // BLOCK
        candidates = torch.tensor([b for b in range(n_blocks) if b not in (0, own, own - 1)])
        for p in task.make_prompts(args.seed, [length], args.depths, args.per_cell):
            captured.clear()
            logits = model(torch.from_numpy(p.tokens)[None], attention=attention)
            hits.setdefault(f"{length}/dense_correct", []).append(int(logits[0, -1].argmax()) == p.answer)
            record_block = (round(p.depth * length) + 2) // BLOCK  # the value token, 2 after <k>
            for layer, (q, k) in enumerate(captured):
                for method, score in block_scores(q, k).items():
                    ranked = candidates[score[candidates].argsort(descending=True)]
                    for picks in args.picks:
                        hits.setdefault(f"{length}/layer{layer}/{method}/top{picks}", []).append(
                            record_block in ranked[:picks].tolist())
    recall = {k: float(np.mean(v)) for k, v in hits.items()}
    interval = {k: wilson_interval(sum(v), len(v)) for k, v in hits.items()}
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "prompts_per_length":
                   len(args.depths) * args.per_cell, "recall": recall, "recall_ci95": interval}, f, indent=1)
    for k, v in recall.items():
        print(f"{k}: {v:.3f} [{interval[k][0]:.3f}, {interval[k][1]:.3f}]")


if __name__ == "__main__":
    main()
