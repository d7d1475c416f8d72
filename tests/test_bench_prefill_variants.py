"""``bench/bench_prefill_variants.py`` on the CPU: its arguments and problems, as rehearsed before a device call. A
tree without the cluster mode (main) runs the ``CLUSTER`` 1 variants only, and says which it skipped."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_prefill_variants  # noqa: E402


def test_rehearsal_builds_every_problem_and_skips_cluster_variants_without_the_mode(tmp_path, capsys):
    out = tmp_path / "variants.json"
    bench_prefill_variants.main(["--out", str(out), "--t", "1024", "--device", "cpu", "--variants", "1:8", "2:4",
                                 "--patterns", "random", "shared16", "indexer"])
    printed = capsys.readouterr().out
    assert "variants [(2, 4)] not run" in printed
    names = [line.split(":")[0] for line in printed.splitlines() if line.startswith("prefill_")]
    assert names == ["prefill_T1024_64x4_random", "prefill_T1024_64x4_shared16", "prefill_T1024_64x4_indexer",
                     "prefill_T1024_16x1_random"]
    record = json.loads(out.read_text())
    assert record["gpu"] == "cpu" and record["rows"] == []


def test_shared_runs_repeat_one_selection_per_run():
    problems = {name: ids for name, _, _, ids, *_ in bench_prefill_variants.problems(1024, "cpu", ["shared16"])}
    ids = problems["prefill_T1024_64x4_shared16"]
    runs = ids.view(ids.shape[0], -1, 16, ids.shape[2])
    assert torch.equal(runs, runs[:, :, :1].expand_as(runs))
    assert len({tuple(run.flatten().tolist()) for run in runs[:, :, 0].transpose(0, 1)}) > 8  # not one selection
