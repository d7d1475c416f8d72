"""``bench/ncu_partitions.py`` splits an ncu source-page export per warp-specialized partition: a hand-made export
of two launches, each with a wgmma partition and a decoder partition."""

import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import ncu_partitions  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
          "stall_wait", "stall_long_sb (Not Issued)"]


def _launch(writer, consumer_wait, decoder_fence):
    """One launch: a wgmma partition (60 instructions, the first a branch with ``consumer_wait`` long-scoreboard
    samples) and a decoder partition (a fence with ``decoder_fence`` of them, then 59 conversions with one "wait"
    sample each), each opened by a USETMAXREG. Columns: address, source, samples, executed, long_sb, wait."""
    writer.writerow(["Kernel Name", "_ws_prefill_kernel"])
    writer.writerow(HEADER)
    rows = [("0x0", "USETMAXREG.DEALLOC.CTAPOOL 0x78", 0, 0, 0, 0),
            ("0x1", "@!P0 BRA 0x40", consumer_wait, 10, consumer_wait, 0)]
    rows += [(hex(2 + i), "HGMMA.64x128x16.F32 R24, gdesc[UR8], R24", 0, 10, 0, 0) for i in range(59)]
    rows += [("0x100", "USETMAXREG.TRY_ALLOC.CTAPOOL 0xc0", 0, 0, 0, 0),
             ("0x101", "FENCE.VIEW.ASYNC.S", decoder_fence, 100, decoder_fence, 0)]
    rows += [(hex(0x102 + i), "F2FP.F16.E4M3.UNPACK_B R5, R3.H1", 1, 100, 0, 1) for i in range(59)]
    for address, source, samples, executed, long_sb, wait in rows:
        writer.writerow([address, source, samples, executed, long_sb, wait, 999])


def test_partitions_shares_reasons_and_mix(tmp_path):
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        _launch(writer, consumer_wait=141, decoder_fence=59)  # decoder: 59 + 59 one-sample F2FP rows
        _launch(writer, consumer_wait=82, decoder_fence=0)
    first, second = ncu_partitions.summarize(str(path), top=2)
    wgmma, decoder = first
    assert (wgmma["kind"], decoder["kind"]) == ("wgmma (HGMMA)", "decoder (F2FP.F16.E4M3)")
    assert (wgmma["address"], decoder["address"]) == ("0x0", "0x100")  # each starts at its USETMAXREG
    assert wgmma["share"] == pytest.approx(141 / 259) and decoder["share"] == pytest.approx(118 / 259)
    assert decoder["reasons"] == [("long_sb", 0.5), ("wait", 0.5)]  # "Not Issued" columns are not reasons
    assert decoder["top"][0] == (0.5, "FENCE.VIEW.ASYNC.S")
    mix = dict(decoder["mix"])
    assert decoder["executed"] == 6000 and (mix["F2FP"], mix["FENCE"]) == pytest.approx((59 / 60, 1 / 60))
    assert dict(wgmma["mix"])["BRA"] == pytest.approx(1 / 60)
    assert [p["share"] for p in second] == pytest.approx([82 / 141, 59 / 141])
