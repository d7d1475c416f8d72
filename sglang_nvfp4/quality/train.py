"""Train the retrieval model (:mod:`.model`) on the key-value task (:mod:`.task`) and save it in Hugging
Face format.

``python -m sglang_nvfp4.quality.train --out DIR [--device cuda] [--steps 3000]``

Loss: cross-entropy on query values only (every other token is random filler); with ``--late-keys``, plus
``--late-weight`` times the mean loss of the queries asked only at the end of a document, far from their records
(:func:`.task.with_late_queries`: in plain documents the nearest copy of a value is rarely more than a few thousand
tokens back, and models trained on them lost accuracy beyond 8K). A fraction of the
records (``--pair-fraction``) record an already recorded key a second time with another value; a query
after both records is supervised two-hot, ``-0.5 log p(Va) - 0.5 log p(Vb)``, and counts as answered when
its top-2 next tokens are ``{Va, Vb}`` (the ``pair`` family of :mod:`.task`). Context lengths grow during
training (``--lengths``): the next one unlocks when query accuracy at the longest unlocked length reaches
``--advance-at``; every step holds about ``--tokens-per-step`` tokens. AdamW, linear warm-up, constant,
cosine decay over the last ``--decay-fraction``; bf16 autocast on CUDA. The dense accuracy of the saved
model on held-out prompts is measured at the end and stored in ``training.json`` with the wall time and
arguments: ``dense_accuracy_pytorch`` (``single`` prompts, ``{length: accuracy}``) and
``dense_accuracy_pytorch_pair`` (``pair`` prompts, lengths from ``task.PAIR_MIN_LENGTH``).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from . import task
from .model import ModelConfig, RetrievalLM, save_hf

EVAL_SEED = 1_000_003  # held-out prompts: a seed training never uses


def batch(rng: np.random.Generator, length: int, size: int, device, max_gap: int,
          pair_fraction: float, late_keys: int = 0) -> tuple[torch.Tensor, ...]:
    """``size`` documents of ``length`` tokens, each with a mean event gap drawn from ``[2, max_gap]``:
    dense documents make copying any value from the context a poor strategy, which pushes the model to
    key-conditioned lookup early. With ``late_keys``, each document asks that many keys only at its end
    (:func:`~.task.with_late_queries`). Returns ``tokens``, ``labels``, ``labels2`` (:class:`~.task.Document`)
    and ``late`` (bool: the late queries' label positions), each ``[size, length]``."""
    docs, late = [], []
    for _ in range(size):
        doc = task.make_document(rng, length, mean_gap=int(rng.integers(2, max_gap + 1)), pair_fraction=pair_fraction)
        doc, mask = task.with_late_queries(rng, doc, late_keys)
        docs.append(doc)
        late.append(mask)
    stacked = [np.stack([getattr(d, name) for d in docs]) for name in ("tokens", "labels", "labels2")]
    return tuple(torch.from_numpy(x).to(device) for x in (*stacked, np.stack(late)))


def query_loss_and_accuracy(logits: torch.Tensor, labels: torch.Tensor,
                            labels2: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``logits [N, vocab]`` (fp32) at ``N`` queries, ``labels`` / ``labels2`` ``[N]`` (``labels2`` is
    ``IGNORE`` for one-answer queries) -> mean loss (one answer: ``-log p(a)``; two: ``-0.5 log p(a)
    - 0.5 log p(b)``) and the fraction answered (argmax ``== a``; two answers: top-2 set ``== {a, b}``)."""
    two = labels2 != task.IGNORE
    second = torch.where(two, labels2, labels)
    logp = F.log_softmax(logits, dim=-1)
    nll_a = -logp.gather(1, labels[:, None])[:, 0]
    nll_b = -logp.gather(1, second[:, None])[:, 0]
    loss = torch.where(two, 0.5 * (nll_a + nll_b), nll_a).mean()
    top = logits.topk(2, dim=-1).indices
    one_ok = top[:, 0] == labels
    two_ok = ((top[:, 0] == labels) & (top[:, 1] == second)) | ((top[:, 0] == second) & (top[:, 1] == labels))
    return loss, torch.where(two, two_ok, one_ok).float().mean().item()


@torch.no_grad()
def dense_accuracy(model: RetrievalLM, prompts, device, batch_size: int = 8) -> float:
    """Fraction of ``prompts`` answered by the next-token logits after ``<q> KEY`` (plain PyTorch;
    :func:`~.task.is_correct`: argmax is the value, or for ``pair`` prompts the top-2 set is both values)."""
    model.eval()
    hits = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        groups: dict[int, list] = {}
        for p in chunk:
            groups.setdefault(len(p.tokens), []).append(p)
        for group in groups.values():
            tokens = torch.from_numpy(np.stack([p.tokens for p in group])).to(device)
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                                enabled=torch.device(device).type == "cuda"):
                logits = model(tokens)[:, -1]
            ranked = logits.topk(2, dim=-1).indices.tolist()
            hits += sum(task.is_correct(p.answers, r) for r, p in zip(ranked, group))
    model.train()
    return hits / max(1, len(prompts))


def lr_at(step: int, progress: float, peak: float, warmup: int, decay_fraction: float) -> float:
    """Linear warm-up over ``warmup`` steps, constant, then cosine decay to 0 over the last
    ``decay_fraction`` of the run."""
    if step < warmup:
        return peak * (step + 1) / warmup
    start = 1.0 - decay_fraction
    if progress <= start:
        return peak
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - start) / decay_fraction)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--advance-at", type=float, default=0.9, help="query accuracy that unlocks the next length")
    ap.add_argument("--decay-fraction", type=float, default=0.2)
    ap.add_argument("--pair-fraction", type=float, default=0.25,
                    help="probability that a record repeats a once-recorded earlier key with another value "
                         "(queries after both are two-answer queries)")
    ap.add_argument("--max-gap", type=int, default=task.MEAN_EVENT_GAP, help="largest mean event gap of a training document")
    ap.add_argument("--late-keys", type=int, default=0,
                    help="keys per document asked only in its last tenth, far from their records "
                         "(task.with_late_queries)")
    ap.add_argument("--late-weight", type=float, default=1.0,
                    help="weight of the late queries' mean loss, added to the mean loss of all queries")
    ap.add_argument("--time-limit", type=float, default=float("inf"), help="stop after this many seconds")
    ap.add_argument("--eval-per-length", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    cfg = ModelConfig(hidden_size=args.hidden_size, layers=args.layers, intermediate_size=args.intermediate_size,
                      max_position_embeddings=2 * max(32768, max(args.lengths)))  # room to serve the longest prompts
    model = RetrievalLM(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    use_bf16 = torch.device(args.device).type == "cuda"
    lengths = sorted(args.lengths)
    t0 = time.perf_counter()
    history, advances = [], []
    level, ema, steps_run = 0, 0.0, 0
    for step in range(args.steps):
        # With --time-limit, progress is the larger of the step and the time fraction.
        progress = max(step / args.steps, (time.perf_counter() - t0) / args.time_limit)
        if progress >= 1.0:
            print(f"time limit reached after {step} steps", flush=True)
            break
        # Curriculum: every other step at the longest unlocked length, the rest at a shorter one; the next
        # length unlocks once query accuracy at the longest (EMA over steps) reaches --advance-at.
        at_level = step % 2 == 0
        length = lengths[level] if at_level else lengths[int(rng.integers(level + 1))]
        tokens, labels, labels2, late = batch(rng, length, max(1, args.tokens_per_step // length), args.device,
                                              args.max_gap, args.pair_fraction, args.late_keys)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args.lr, args.warmup, args.decay_fraction)
        with torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(tokens)
        mask = labels != task.IGNORE
        loss, acc = query_loss_and_accuracy(logits[mask].float(), labels[mask], labels2[mask])
        late_acc = None
        if late.any():
            late_loss, late_acc = query_loss_and_accuracy(logits[late].float(), labels[late], labels2[late])
            loss = loss + args.late_weight * late_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_run = step + 1
        if at_level:
            ema = 0.9 * ema + 0.1 * acc
            if ema >= args.advance_at and level < len(lengths) - 1:
                level, ema = level + 1, 0.0
                advances.append({"step": step, "length": lengths[level], "elapsed_s": round(time.perf_counter() - t0, 1)})
                print(f"unlocked length {lengths[level]} at step {step}", flush=True)
        if step % args.log_every == 0:
            row = {"step": step, "length": length, "loss": round(loss.item(), 4), "query_acc": round(acc, 4),
                   "late_acc": None if late_acc is None else round(late_acc, 4),
                   "level_ema": round(ema, 3), "lr": opt.param_groups[0]["lr"], "elapsed_s": round(time.perf_counter() - t0, 1)}
            history.append(row)
            print(row, flush=True)
    train_s = time.perf_counter() - t0
    accuracy = {family: {} for family in task.FAMILIES}
    for family in task.FAMILIES:
        for length in lengths:
            if family == "pair" and length < task.PAIR_MIN_LENGTH:
                continue
            prompts = task.make_prompts(EVAL_SEED, [length], [0.0, 0.25, 0.5, 0.75, 1.0],
                                        max(1, args.eval_per_length // 5), family)
            accuracy[family][str(length)] = dense_accuracy(model, prompts, args.device)
            print(f"dense {family} accuracy at {length}: {accuracy[family][str(length)]:.3f}", flush=True)
    device_name = torch.cuda.get_device_name(args.device) if use_bf16 else "cpu"
    save_hf(model, args.out, {"args": vars(args), "steps_run": steps_run, "length_unlocks": advances, "train_seconds": round(train_s, 1),
                              "device": device_name, "dense_accuracy_pytorch": accuracy["single"],
                              "dense_accuracy_pytorch_pair": accuracy["pair"], "history": history,
                              "date": time.strftime("%Y-%m-%d")})
    print(f"saved {args.out} ({train_s:.0f} s of training)", flush=True)


if __name__ == "__main__":
    main()
