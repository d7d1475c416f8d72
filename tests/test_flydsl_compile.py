"""CPU compile check of the FlyDSL gfx950 kernel (both ``rounds`` variants, bf16 and fp16 I/O).

Needs the toolchain from ``scripts/setup_flydsl.sh``; without it these tests fail (CI installs it),
they do not skip. The kernel is compile-verified here, not run: nobody here has an MI355."""

import pytest

from sglang_nvfp4.kernels.flydsl import compile_check as cc


@pytest.fixture(scope="module")
def reports():
    problem = cc.toolchain_problem()
    if problem:
        pytest.fail(f"FlyDSL toolchain missing: {problem}", pytrace=False)
    return cc.check_all()


def test_toolchain_present():
    problem = cc.toolchain_problem()
    assert problem is None, f"FlyDSL toolchain missing: {problem}"


def test_every_variant_compiles_within_the_design(reports, capsys):
    with capsys.disabled():
        print()
        for rep in reports:
            print(f"  flydsl gfx950 {rep.summary()}")
    assert [(r.rounds, r.io_dtype) for r in reports] == cc.VARIANTS
    failures = [f"{r.name}: {v}" for r in reports for v in r.violations]
    assert not failures, "\n".join(failures)
    by_rounds = {r.rounds: r for r in reports}
    assert by_rounds[2].lds <= cc.LDS_PER_CU // 2 < by_rounds[1].lds <= cc.LDS_PER_CU


# A minimal ISA / LLVM IR that passes; each case below breaks one rule and must be caught.
GOOD_ISA = """\t.amdgcn_target "amdgcn-amd-amdhsa--gfx950"
\tv_cvt_scalef32_pk_f16_fp4 v1, v2, 1.0
\tv_cvt_scalef32_pk_f16_fp8 v1, v2, 1.0
\tv_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], 0
amdhsa.kernels:
  - .agpr_count:     0
    .group_segment_fixed_size: 73728
    .private_segment_fixed_size: 0
    .sgpr_count:     65
    .sgpr_spill_count: 0
    .vgpr_count:     240
    .vgpr_spill_count: 0
"""
GOOD_IR = 'attributes #0 = { "amdgpu-flat-work-group-size"="256,256" "amdgpu-waves-per-eu"="2" }\n'
LDS_ERROR = "error: <unknown>:0:0: local memory (200000) exceeds limit (163840) in function 'k'"

BROKEN = {
    "LDS overflow reported on stderr": ("", LDS_ERROR, GOOD_IR, "compiler diagnostic"),
    "no mfma": ("v_mfma_f32_16x16x32_f16", "", GOOD_IR, "lacks v_mfma"),
    "no fp4 convert": ("v_cvt_scalef32_pk_f16_fp4", "", GOOD_IR, "lacks v_cvt_scalef32_pk_f16_fp4"),
    "gfx942 target": ("gfx950", "gfx942", GOOD_IR, "not for gfx950"),
    "scratch": ("private_segment_fixed_size: 0", "private_segment_fixed_size: 64", GOOD_IR, "spills"),
    "VGPR spill": ("vgpr_spill_count: 0", "vgpr_spill_count: 3", GOOD_IR, "spills"),
    "LDS over half a CU": ("group_segment_fixed_size: 73728", "group_segment_fixed_size: 90000", GOOD_IR, "LDS"),
    "too many VGPRs for 2 waves": ("vgpr_count:     240", "vgpr_count:     300", GOOD_IR, "waves per SIMD"),
    "libm call": ("\tv_mfma", "\ts_swappc_b64 __ocml_exp2_f32\n\tv_mfma", GOOD_IR, "__ocml"),
    "waves-per-eu": ("", "", GOOD_IR.replace('"2"', '"1"'), "waves-per-eu"),
    "work-group size": ("", "", GOOD_IR.replace("256,256", "1,1024"), "flat-work-group-size"),
}


def test_good_output_passes():
    assert cc.analyse(2, "bf16", "", GOOD_ISA, GOOD_IR).violations == []


@pytest.mark.parametrize("case", BROKEN)
def test_violations_are_caught(case):
    old, new, llvm_ir, expected = BROKEN[case]
    isa, output = GOOD_ISA, ""
    if old:
        isa = isa.replace(old, new)
    else:
        output = new
    violations = cc.analyse(2, "bf16", output, isa, llvm_ir).violations
    assert any(expected in v for v in violations), violations
