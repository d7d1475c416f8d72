"""``bench/prefill_timeline.py`` on the CPU: its per-step means from hand-made ``clock64`` stamps, and its arguments,
as rehearsed before a device call (the stamps themselves come from a GPU run of the probe tree)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import prefill_timeline  # noqa: E402


def _stamps():
    """Consumer 0 runs products on entries 0 and 2 (steps of 10, 20, 30, 40, 50 cycles), waits 70 for K on entry 1;
    consumer 1 runs products on entry 1 only; the producer waits 5, decodes K in 100, V^T in 200."""
    stamps = torch.zeros(3, 256, 8, dtype=torch.int64)
    clock = {0: 1000, 1: 1000}
    for half, mine in ((0, (0, 2)), (1, (1,))):
        for u in range(3):
            t = clock[half]
            if u in mine:
                points = [t, t + 10, t + 30, t + 60, t + 100, t + 150]
            else:
                points = [t, t + 70, 0, 0, t + 75, 0]
            stamps[half, u, :6] = torch.tensor(points)
            clock[half] = max(points) + 5  # 5 cycles to the next entry
    for u in range(3):
        stamps[2, u, :4] = torch.tensor([1000 + 400 * u, 1005 + 400 * u, 1105 + 400 * u, 1305 + 400 * u])
    return stamps


def test_summary_means_each_step_over_the_entries_with_products():
    summary = prefill_timeline.summarize(_stamps(), 3)
    c0, c1, producer = summary["consumer0"], summary["consumer1"], summary["producer"]
    assert c0["entries with products"] == 2 and c1["entries with products"] == 1
    assert (c0["wait K"], c0["S"], c0["softmax"], c0["wait V^T"], c0["P.V"]) == (10, 20, 30, 40, 50)
    assert c0["wait K, other entries"] == 70 and c0["to the next entry"] == 5
    assert c1["wait K"] == 10 and c1["wait K, other entries"] == 70
    assert (producer["wait slot"], producer["K"], producer["V^T"]) == (5, 100, 200)
    assert producer["to the next entry"] == 95  # V^T hand-off at 1305 + 400 u, next entry at 1400 + 400 u
    # consumer 0: entries of 155 + 80 + 155 cycles (with the gaps), its last stamp point 4 at 1000 + 155 + 80 + 100
    assert c0["span"] == 335 and summary["cycles per entry"] == pytest.approx(335 / 3)


def test_entries_past_the_union_are_ignored():
    stamps = _stamps()
    stamps[:, 3:, :] = 10**9  # stamps of a longer union left from another launch
    assert prefill_timeline.summarize(stamps, 3) == prefill_timeline.summarize(_stamps(), 3)


def test_arguments_parse_and_bad_ctas_are_refused(capsys):
    assert prefill_timeline.parse_args(["--out", "x.json"]).ctas == [(1000, 0), (2000, 0), (3000, 0)]
    assert prefill_timeline.parse_args(["--out", "x.json", "--ctas", "5:1"]).ctas == [(5, 1)]
    for bad in (["5"], ["a:b"], ["5:-1"], ["1:2:3"]):
        with pytest.raises(SystemExit):
            prefill_timeline.parse_args(["--out", "x.json", "--ctas", *bad])
    assert "--ctas" in capsys.readouterr().err
