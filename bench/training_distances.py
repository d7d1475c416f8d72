"""How far back the retrieval model's training queries must look (issue 17, item 4): for 32K training documents
(``sglang_nvfp4.quality.train.batch``'s draw: mean event gap uniform in ``[2, max_gap]``, a quarter of the records
pairs), the distance from each supervised query to the nearest earlier occurrence of its key (its record, or an
earlier query, which repeats the value), with and without ``task.with_late_queries``. CPU, seeded.

    python bench/training_distances.py [--length 32768] [--docs 20]
"""

from __future__ import annotations

import argparse

import numpy as np

from sglang_nvfp4.quality import task

SETTINGS = ((64, 0), (64, 8), (256, 8))  # (max_gap, late_keys): the old recipe, then the two trained on 2026-12-03


def nearest_source_distances(length: int, max_gap: int, late_keys: int, docs: int, seed: int = 0) -> np.ndarray:
    """Distances (tokens) from every supervised query of ``docs`` documents to its key's previous occurrence."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(docs):
        doc = task.make_document(rng, length, mean_gap=int(rng.integers(2, max_gap + 1)), pair_fraction=0.25)
        doc, _ = task.with_late_queries(rng, doc, late_keys)
        last: dict[int, int] = {}
        for i, token in enumerate(doc.tokens[:-2]):
            if token in (task.RECORD, task.QUERY):
                key = int(doc.tokens[i + 1])
                if token == task.QUERY and key in last:
                    out.append(i - last[key])
                last[key] = i
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=20)
    args = ap.parse_args()
    for max_gap, late in SETTINGS:
        x = nearest_source_distances(args.length, max_gap, late, args.docs)
        print(f"max_gap {max_gap}, late_keys {late}: {len(x) / args.docs:.0f} supervised queries per document, "
              f"median distance {np.median(x):.0f}, beyond 8K {np.mean(x > 8192):.4f}, beyond 16K {np.mean(x > 16384):.4f} "
              f"({np.sum(x > 16384) / args.docs:.2f} per document)")


if __name__ == "__main__":
    main()
