"""Block-selection recall on the trained retrieval model (CPU, plain PyTorch, unquantized keys).

For each evaluation prompt (``sglang_nvfp4.quality.task``) the model runs densely; at the last token
(the ``<q> KEY`` whose next token is the answer) and in every layer, the blocks of 128 keys other than
the always-attended ones (sink block 0, the own block and the local block before it) are ranked by

* ``quest_mean``: the product's quest score, the mean over the 16 query heads of each head's
  per-dimension upper bound ``relu(q)·kmax + min(q, 0)·kmin`` (what ``indexer.aggregate_queries`` +
  the block bounds compute, here on unquantized keys);
* ``quest_max``: the same bound, maximum over heads instead of mean;
* ``oracle``: the largest attention mass any head puts on the block (true softmax).

Recall = fraction of prompts whose record block is among the top ``--picks`` ranked blocks (13 =
top-16 minus the three fixed blocks). Writes JSON to ``--out``.

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

BLOCK = fmt.PAGE_SIZE  # one indexer block is one cache page


def block_scores(q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """``q [H, D]`` (one token), ``k [L, D]`` -> per-block scores ``[num_blocks]`` by method."""
    n_blocks = (k.shape[0] + BLOCK - 1) // BLOCK
    pad = n_blocks * BLOCK - k.shape[0]
    valid = (torch.arange(n_blocks * BLOCK) < k.shape[0]).view(n_blocks, BLOCK, 1)
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(n_blocks, BLOCK, -1)
    kmax = torch.where(valid, kb, -torch.inf).amax(1)
    kmin = torch.where(valid, kb, torch.inf).amin(1)
    bound = q.clamp(min=0) @ kmax.T + q.clamp(max=0) @ kmin.T  # [H, n_blocks]
    probs = torch.softmax((q @ k.T) * q.shape[-1] ** -0.5, dim=-1)
    mass = torch.nn.functional.pad(probs, (0, pad)).view(q.shape[0], n_blocks, BLOCK).sum(-1)
    return {"quest_mean": bound.mean(0), "quest_max": bound.amax(0), "oracle": mass.amax(0)}


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
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "prompts_per_length":
                   len(args.depths) * args.per_cell, "recall": recall}, f, indent=1)
    for k, v in recall.items():
        print(f"{k}: {v:.3f}")


if __name__ == "__main__":
    main()
