"""``bench/bench_pipes.py`` on the CPU: its chains, compiled for sm_90, run the instruction they are named after, alone
and in each pair (every case is in a pair), so that a GPU run times what its table says."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_pipes  # noqa: E402
from gluon_compile import compile_triton_for_hopper, cuobjdump  # noqa: E402

# PTX instruction -> its SASS opcode on sm_90 (``mul.rn.f16x2`` may also be issued as ``HFMA2.MMA``, on the same unit)
SASS = {"cvt.rn.f16x2.e4m3x2": "F2FP.F16.E4M3.UNPACK_B", "lop3.b32": "LOP3.LUT", "prmt.b32": "PRMT",
        "mul.rn.f16x2": "HMUL2", "fma.rn.f32": "FFMA", "shf.l.wrap.b32": "SHF.L.W", "ex2.approx.ftz.f32": "MUFU.EX2",
        "ex2.approx.f16x2": "MUFU.EX2.F16",
        "cvt.rn.f16x2.f32": "F2FP.F16.F32.PACK_AB"}


def _compile(kernel, asm: dict):
    signature = {"x_ptr": "*u32", "y_ptr": "*u32", "ITERS": "constexpr", "BLOCK": "constexpr",
                 **{name: "constexpr" for name in asm}}
    return compile_triton_for_hopper(kernel, signature, {"ITERS": 4, "BLOCK": 1024, **asm}, {"num_warps": 8},
                                     divisible=())


def test_a_single_chain_runs_its_instruction_and_every_case_is_in_a_pair():
    assert set(bench_pipes.CHAINS) == set(SASS)
    assert {name for pair in bench_pipes.PAIRS for name in pair} == set(SASS)  # the pairs compile every case below
    sass = cuobjdump(_compile(bench_pipes._chain_kernel, {"ASM": bench_pipes.CHAINS["ex2.approx.ftz.f32"]}), "-sass")
    assert sass.count("MUFU.EX2") >= 16  # one asm block: 16 dependent instructions


@pytest.mark.parametrize("a, b", bench_pipes.PAIRS)
def test_every_pair_runs_both_instructions(a, b):
    sass = cuobjdump(_compile(bench_pipes._pair_kernel, {"ASM_A": bench_pipes.CHAINS[a],
                                                          "ASM_B": bench_pipes.CHAINS[b]}), "-sass")
    assert sass.count(SASS[a]) >= 16 and sass.count(SASS[b]) >= 16
