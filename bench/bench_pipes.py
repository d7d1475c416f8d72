"""Issue rates of the single instructions the page decoders and the softmax are made of, alone and in pairs, on one GPU.

    python bench/bench_pipes.py --out DIR        # DIR/pipes.json

Each case is a Triton kernel whose threads run 256 x 16 dependent copies of one PTX instruction on their own
32-bit value (8 independent chains per thread, 64 programs of 1024 threads per SM): enough independent warps that
the instruction's pipe, not its latency, sets the time. Reported per case: the median time
(``triton.testing.do_bench``) and the instructions per nanosecond per SM (thread instructions, i.e. lanes).
Cases: ``cvt.rn.f16x2.e4m3x2`` (the decoders' conversion), ``lop3.b32``, ``prmt.b32``, ``shf.l.wrap.b32`` (their
integer work), ``mul.rn.f16x2`` (their scale products), ``ex2.approx.ftz.f32`` and ``cvt.rn.f16x2.f32`` (the prefill
consumers' softmax and rounding of ``P``), ``ex2.approx.f16x2`` (two fp16 exponentials per instruction, which sm_90
issues as two ``MUFU.EX2.F16``: whether they are cheaper than fp32 ones) and ``fma.rn.f32`` (a full-rate reference).
Rates count PTX instructions, so one ``ex2.approx.f16x2`` is two exponentials.

Pairs (``PAIRS``, 8 warps): the same threads run two chains, one of each instruction. A pair that takes the sum of
its parts' times shares one unit; one that takes the longer part's time runs on two. That tells which work of the
Gluon prefill's producer (decoding) and consumers (softmax) competes for the same unit of a multiprocessor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import triton
import triton.language as tl

CHAINS = {
    "cvt.rn.f16x2.e4m3x2": "{.reg .b16 h0, h1; .reg .b32 r; mov.b32 r, $1;"
                           + "mov.b32 {h0, h1}, r; cvt.rn.f16x2.e4m3x2 r, h0;" * 16 + "mov.b32 $0, r;}",
    "lop3.b32": "{.reg .b32 r; mov.b32 r, $1;" + "lop3.b32 r, r, 0x1C1C1C1C, 0x80808080, 0xF8;" * 16
                + "mov.b32 $0, r;}",
    "prmt.b32": "{.reg .b32 r; mov.b32 r, $1;" + "prmt.b32 r, r, 0x12345678, 0x5140;" * 16 + "mov.b32 $0, r;}",
    "mul.rn.f16x2": "{.reg .b32 r, c; mov.b32 c, 0x3C013C01; mov.b32 r, $1;" + "mul.rn.f16x2 r, r, c;" * 16
                    + "mov.b32 $0, r;}",
    "fma.rn.f32": "{.reg .f32 r; mov.b32 r, $1;" + "fma.rn.f32 r, r, 0f3F800001, 0f3F800000;" * 16 + "mov.b32 $0, r;}",
    "shf.l.wrap.b32": "{.reg .b32 r; mov.b32 r, $1;" + "shf.l.wrap.b32 r, r, r, 3;" * 16 + "mov.b32 $0, r;}",
    "ex2.approx.ftz.f32": "{.reg .f32 r; mov.b32 r, $1;" + "ex2.approx.ftz.f32 r, r;" * 16 + "mov.b32 $0, r;}",
    "ex2.approx.f16x2": "{.reg .b32 r; mov.b32 r, $1;" + "ex2.approx.f16x2 r, r;" * 16 + "mov.b32 $0, r;}",
    "cvt.rn.f16x2.f32": "{.reg .f32 f; .reg .b32 r; mov.b32 r, $1;"
                        + "mov.b32 f, r; cvt.rn.f16x2.f32 r, f, f;" * 16 + "mov.b32 $0, r;}",
}
PAIRS = [("cvt.rn.f16x2.e4m3x2", "ex2.approx.ftz.f32"), ("cvt.rn.f16x2.e4m3x2", "cvt.rn.f16x2.f32"),
         ("ex2.approx.ftz.f32", "cvt.rn.f16x2.f32"), ("cvt.rn.f16x2.e4m3x2", "lop3.b32"),
         ("cvt.rn.f16x2.e4m3x2", "prmt.b32"), ("lop3.b32", "prmt.b32"), ("lop3.b32", "shf.l.wrap.b32"),
         ("ex2.approx.f16x2", "ex2.approx.ftz.f32"),
         ("ex2.approx.ftz.f32", "fma.rn.f32"), ("mul.rn.f16x2", "fma.rn.f32"), ("cvt.rn.f16x2.e4m3x2", "mul.rn.f16x2")]
PER_ASM = 16  # instructions per inline-asm block
ITERS = 256
BLOCK = 1024


@triton.jit
def _chain_kernel(x_ptr, y_ptr, ITERS: tl.constexpr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in range(ITERS):
        x = tl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1)
    tl.store(y_ptr + offs, x)


@triton.jit
def _pair_kernel(x_ptr, y_ptr, ITERS: tl.constexpr, ASM_A: tl.constexpr, ASM_B: tl.constexpr, BLOCK: tl.constexpr):
    """Two chains per thread, one through each block: the instructions of both are in flight together."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    z = x ^ 0x11
    for _ in range(ITERS):
        x = tl.inline_asm_elementwise(ASM_A, "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1)
        z = tl.inline_asm_elementwise(ASM_B, "=r,r", [z], dtype=tl.uint32, is_pure=True, pack=1)
    tl.store(y_ptr + offs, x ^ z)


def _timed_ms(launch) -> float:
    """Median milliseconds of ``launch()`` (``triton.testing.do_bench``) after an untimed first launch (compile)."""
    launch()
    torch.cuda.synchronize()
    return triton.testing.do_bench(launch, warmup=50, rep=300)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    n = sms * 64 * BLOCK
    x = torch.randint(0, 2**31 - 1, (n,), device="cuda", dtype=torch.int32).view(torch.uint32)
    y = torch.empty_like(x)
    rows = {}
    for name, asm in CHAINS.items():
        for warps in (4, 8):
            ms = _timed_ms(lambda: _chain_kernel[(n // BLOCK,)](x, y, ITERS=ITERS, ASM=asm, BLOCK=BLOCK,
                                                                num_warps=warps))
            per_ns_per_sm = n * ITERS * PER_ASM / (ms * 1e6) / sms
            rows[f"{name}/warps{warps}"] = {"ms": ms, "thread_instructions_per_ns_per_sm": per_ns_per_sm}
            print(f"{name:22s} {warps} warps: {ms:.3f} ms, {per_ns_per_sm:.1f} per ns per SM", flush=True)
    pairs = {}
    for a, b in PAIRS:
        ms = _timed_ms(lambda: _pair_kernel[(n // BLOCK,)](x, y, ITERS=ITERS, ASM_A=CHAINS[a], ASM_B=CHAINS[b],
                                                            BLOCK=BLOCK, num_warps=8))
        parts = rows[f"{a}/warps8"]["ms"], rows[f"{b}/warps8"]["ms"]
        # Sharing one unit, the pair takes the sum of its parts' times; on two units, the longer part's.
        verdict = "one unit" if abs(ms - sum(parts)) < abs(ms - max(parts)) else "two units"
        pairs[f"{a} + {b}"] = {"ms": ms, "parts_ms": parts, "verdict": verdict}
        print(f"{a} + {b}: {ms:.3f} ms, parts {parts[0]:.3f} + {parts[1]:.3f}: {verdict}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pipes.json"), "w") as f:
        json.dump({"gpu": props.name, "sms": sms, "date": datetime.date.today().isoformat(),
                   "torch": torch.__version__, "triton": triton.__version__,
                   "command": f"python bench/bench_pipes.py --out {args.out}",
                   "threads": n, "instructions_per_thread": ITERS * PER_ASM, "rows": rows, "pairs": pairs}, f,
                  indent=1)


if __name__ == "__main__":
    main()
