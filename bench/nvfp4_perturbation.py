"""How much NVFP4 storage amplifies a bf16-sized change of K/V (CPU, seconds).

Tensor parallelism changes the order of the all-reduce sums, so the hidden state that produces
K/V differs by about one bf16 rounding step in some elements. A bf16 cache stores that change as it
is; NVFP4 storage moves an element by a whole E2M1 step (or a block by an E4M3 scale step) whenever
the change crosses a rounding boundary. This measures both on random K/V: per element, the change
after storage relative to the tensor's RMS, and the change of one attention output row (16 query
heads over 2048 keys), for a bf16 cache and for NVFP4 (``sglang_nvfp4.format`` round trip).

``python bench/nvfp4_perturbation.py [--fraction 0.1] [--seed 0]``
"""

from __future__ import annotations

import argparse
import json

import torch

from sglang_nvfp4.format import HEAD_DIM, dequantize_nvfp4, quantize_nvfp4


def bf16_step(x: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``x`` (bf16) with ``fraction`` of its elements moved one bf16 step up or down."""
    bits = x.view(torch.int16)
    pick = torch.rand(x.shape, generator=gen) < fraction
    sign = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1, 1).to(torch.int16)
    return torch.where(pick, bits + sign, bits).view(torch.bfloat16)


def nvfp4_round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize_nvfp4(*quantize_nvfp4(x, 1.0), 1.0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(q @ k.T / HEAD_DIM**0.5, dim=-1)
    return p @ v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, default=0.1, help="share of K/V elements moved one bf16 step")
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    k, v = (torch.randn(args.keys, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(16, HEAD_DIM, generator=gen)
    k2, v2 = bf16_step(k, args.fraction, gen), bf16_step(v, args.fraction, gen)
    out = {"fraction_moved": args.fraction, "keys": args.keys, "seed": args.seed}
    for name, store in (("bf16", lambda t: t.float()), ("nvfp4", nvfp4_round_trip)):
        ka, kb, va, vb = store(k), store(k2), store(v), store(v2)
        rms = ka.pow(2).mean().sqrt()
        oa, ob = attention(q, ka, va), attention(q, kb, vb)
        out[name] = {"elements_changed": (ka != kb).float().mean().item(),
                     "mean_abs_change_over_rms": ((ka - kb).abs().mean() / rms).item(),
                     "attention_out_rel_change": ((oa - ob).norm() / oa.norm()).item()}
    out["amplification_attention_out"] = out["nvfp4"]["attention_out_rel_change"] / out["bf16"]["attention_out_rel_change"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
