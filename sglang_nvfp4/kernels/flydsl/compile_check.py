"""CPU compile check of the gfx950 kernel: builds every variant for gfx950 and checks its ISA.

    python -m sglang_nvfp4.kernels.flydsl.compile_check      # exit status 1 on any violation

Needs FlyDSL 0.4.2 and an ``ld.lld`` >= 19 under ``$ROCM_PATH/llvm/bin`` (``scripts/setup_flydsl.sh``
installs both and makes the repo-local ``.rocm``); no GPU. Each variant compiles in its own
subprocess (an instruction-selection failure aborts the process) with ``COMPILE_ONLY=1
ARCH=gfx950 FLYDSL_GPU_ARCH=gfx950`` (without them FlyDSL silently targets gfx942) and FlyDSL's
caches and dumps in a temporary directory. A variant passes when its ISA has the f16 mfma and the
scaled fp4/fp8 -> f16 converts, no libm (``__ocml``) call, no spill, LDS within the CU's 160 KiB
(half of it for ``rounds=2``, which promises two workgroups per CU), registers within the
designed occupancy, and the designed ``amdgpu-waves-per-eu`` / flat-work-group-size attributes.
LLVM reports an LDS overflow as an error but still exits 0, so diagnostics are parsed too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLYDSL_VERSION = "0.4.2"
LLD_MIN_MAJOR = 19
ARCH = "gfx950"
LDS_PER_CU = 160 * 1024
REGS_PER_LANE = 512  # unified VGPR + AGPR file of a SIMD lane on gfx950
THREADS_PER_WG = 256
VARIANTS = [(rounds, io) for rounds in (2, 1) for io in ("bf16", "f16")]
REQUIRED_INSTRUCTIONS = ("v_mfma_f32_16x16x32_f16", "v_cvt_scalef32_pk_f16_fp4", "v_cvt_scalef32_pk_f16_fp8")
REPO = Path(__file__).resolve().parents[3]
REPO_ROCM = REPO / ".rocm"
_MODULE = f"{__package__}.compile_check"
SETUP_HINT = "run scripts/setup_flydsl.sh [VENV] (installs flydsl==0.4.2, lld-19 and the repo-local .rocm)"


def rocm_path() -> Path:
    """The ROCm prefix whose ``llvm/bin/ld.lld`` links the code object: the repo-local ``.rocm``
    made by the setup script, else ``$ROCM_PATH``."""
    if (REPO_ROCM / "llvm" / "bin" / "ld.lld").exists() or "ROCM_PATH" not in os.environ:
        return REPO_ROCM
    return Path(os.environ["ROCM_PATH"])


def toolchain_problem() -> str | None:
    """Why the compile check cannot run here, or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        found = version("flydsl")
    except PackageNotFoundError:
        return f"flydsl is not installed; {SETUP_HINT}"
    if found != FLYDSL_VERSION:
        return f"flydsl {found} is installed, the check pins {FLYDSL_VERSION}; {SETUP_HINT}"
    lld = rocm_path() / "llvm" / "bin" / "ld.lld"
    if not lld.exists():
        return f"no {lld}; {SETUP_HINT}"
    try:
        banner = subprocess.run([str(lld), "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as exc:
        return f"{lld} does not run ({exc}); {SETUP_HINT}"
    match = re.search(r"LLD (\d+)\.", banner)
    if not match or int(match.group(1)) < LLD_MIN_MAJOR:
        return f"{lld} is not LLD >= {LLD_MIN_MAJOR} ({banner.strip()!r}); {SETUP_HINT}"
    return None


def compile_env(work: Path) -> dict:
    """Environment of one compile: gfx950, compile only, every FlyDSL file under ``work``."""
    env = dict(os.environ)
    env.update(
        COMPILE_ONLY="1",
        ARCH=ARCH,
        FLYDSL_GPU_ARCH=ARCH,
        ROCM_PATH=str(rocm_path()),
        FLYDSL_RUNTIME_ENABLE_CACHE="0",
        FLYDSL_RUNTIME_CACHE_DIR=str(work / "cache"),
        FLYDSL_DUMP_IR="1",  # stage dumps: the LLVM IR (attributes) and the final ISA
        FLYDSL_DUMP_DIR=str(work / "dump"),
        FLYDSL_KTRACE_DUMP_DIR=str(work / "ktrace"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    return env


@dataclasses.dataclass
class VariantReport:
    rounds: int
    io_dtype: str
    vgpr: int = -1  # unified count (arch VGPRs + AGPRs)
    agpr: int = -1
    sgpr: int = -1
    lds: int = -1
    scratch: int = -1
    vgpr_spill: int = -1
    sgpr_spill: int = -1
    waves_per_eu: str = "?"
    flat_wg_size: str = "?"
    seconds: float = 0.0
    violations: list = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"rounds={self.rounds} {self.io_dtype}"

    def summary(self) -> str:
        return (
            f"{self.name}: VGPR {self.vgpr} (AGPR {self.agpr}), SGPR {self.sgpr}, "
            f"LDS {self.lds} B ({self.lds / 1024:.1f} KiB), scratch {self.scratch} B, "
            f"spills VGPR {self.vgpr_spill} / SGPR {self.sgpr_spill}, "
            f"waves-per-eu {self.waves_per_eu}, flat-work-group-size {self.flat_wg_size}, "
            f"compiled in {self.seconds:.1f} s"
        )


def _meta(isa: str, key: str) -> int:
    match = re.search(rf"^[\s-]*\.{key}:\s+(\d+)", isa, re.M)
    return int(match.group(1)) if match else -1


def analyse(rounds: int, io_dtype: str, output: str, isa: str, llvm_ir: str) -> VariantReport:
    """Apply the design's checks to one variant's compiler output, ISA and LLVM IR."""
    rep = VariantReport(rounds, io_dtype)
    bad = rep.violations
    diagnostics = [line for line in output.splitlines() if re.search(r"\berror\b", line, re.I)]
    bad += [f"compiler diagnostic: {line.strip()}" for line in diagnostics]
    if not isa:
        bad.append("no ISA was produced")
        return rep
    if f"amdgcn-amd-amdhsa--{ARCH}" not in isa and f"amdgcn-amd-amdhsa-unknown-{ARCH}" not in isa:
        bad.append(f"ISA is not for {ARCH}")
    for instruction in REQUIRED_INSTRUCTIONS:
        if instruction not in isa:
            bad.append(f"ISA lacks {instruction}")
    if "__ocml" in isa or "__ocml" in llvm_ir:
        bad.append("calls __ocml_* (needs ROCm device bitcode)")

    rep.vgpr, rep.agpr, rep.sgpr = _meta(isa, "vgpr_count"), _meta(isa, "agpr_count"), _meta(isa, "sgpr_count")
    rep.lds, rep.scratch = _meta(isa, "group_segment_fixed_size"), _meta(isa, "private_segment_fixed_size")
    rep.vgpr_spill, rep.sgpr_spill = _meta(isa, "vgpr_spill_count"), _meta(isa, "sgpr_spill_count")
    if min(rep.vgpr, rep.agpr, rep.sgpr, rep.lds, rep.scratch, rep.vgpr_spill, rep.sgpr_spill) < 0:
        bad.append("ISA metadata incomplete")
    if rep.scratch != 0 or rep.vgpr_spill != 0 or rep.sgpr_spill != 0 or "scratch_" in isa:
        bad.append(f"spills: scratch {rep.scratch} B, VGPR {rep.vgpr_spill}, SGPR {rep.sgpr_spill}")
    lds_limit = LDS_PER_CU // rounds  # rounds=2 promises two workgroups per CU
    if not 0 <= rep.lds <= lds_limit:
        bad.append(f"LDS {rep.lds} B exceeds {lds_limit} B")
    if rep.vgpr > REGS_PER_LANE // rounds:
        bad.append(f"{rep.vgpr} VGPRs do not fit {rounds} waves per SIMD")

    kernel_attrs = re.findall(r"^attributes #\d+ = \{([^}]*)\}", llvm_ir, re.M)
    attrs = " ".join(a for a in kernel_attrs if "amdgpu-flat-work-group-size" in a)
    wpe = re.search(r'"amdgpu-waves-per-eu"="([^"]*)"', attrs)
    fwg = re.search(r'"amdgpu-flat-work-group-size"="([^"]*)"', attrs)
    rep.waves_per_eu = wpe.group(1) if wpe else "missing"
    rep.flat_wg_size = fwg.group(1) if fwg else "missing"
    if rep.waves_per_eu.split(",")[0] != str(rounds):
        bad.append(f'amdgpu-waves-per-eu is "{rep.waves_per_eu}", designed {rounds}')
    if rep.flat_wg_size != f"{THREADS_PER_WG},{THREADS_PER_WG}":
        bad.append(f'amdgpu-flat-work-group-size is "{rep.flat_wg_size}", designed {THREADS_PER_WG},{THREADS_PER_WG}')
    return rep


def _newest(folder: Path, pattern: str) -> str:
    files = sorted(folder.rglob(pattern))
    return files[-1].read_text() if files else ""


def check_variant(rounds: int, io_dtype: str, timeout: float = 600) -> VariantReport:
    """Compile one variant in a subprocess and analyse it."""
    with tempfile.TemporaryDirectory(prefix="flydsl-check-") as tmp:
        work = Path(tmp)
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", _MODULE, "--compile", str(rounds), io_dtype],
            env=compile_env(work), capture_output=True, text=True, timeout=timeout,
        )
        output = proc.stdout + proc.stderr
        dump = work / "dump"
        rep = analyse(rounds, io_dtype, output, _newest(dump, "*_final_isa.s"), _newest(dump, "*_llvm_ir.ll"))
        rep.seconds = time.monotonic() - start
        if proc.returncode != 0:
            tail = "\n".join(output.strip().splitlines()[-15:])
            rep.violations.insert(0, f"compile exited with {proc.returncode}:\n{tail}")
        return rep


def check_all(jobs: int = 2) -> list[VariantReport]:
    """Compile and analyse every variant (``jobs`` at a time)."""
    problem = toolchain_problem()
    if problem:
        raise RuntimeError(problem)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda v: check_variant(*v), VARIANTS))


def _compile(rounds: int, io_dtype: str) -> None:
    """Subprocess body: build and 'launch' once, which under COMPILE_ONLY=1 only compiles."""
    import flydsl.expr as fx

    from .kernel import compile_nvfp4_sparse_prefill

    launch = compile_nvfp4_sparse_prefill(rounds, io_dtype)
    # Shapes are runtime arguments; the values only need the right types.
    launch(0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 16, 1, 64, 1, 18432, 0.125, fx.Stream(None))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", nargs=2, metavar=("ROUNDS", "IO_DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile:
        _compile(int(args.compile[0]), args.compile[1])
        return 0
    try:
        reports = check_all()
    except RuntimeError as exc:
        print(f"compile check cannot run: {exc}", file=sys.stderr)
        return 2
    for rep in reports:
        print(rep.summary())
        for violation in rep.violations:
            print(f"  VIOLATION: {violation}")
    return 1 if any(rep.violations for rep in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
