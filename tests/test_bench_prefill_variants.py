"""``bench/bench_prefill_variants.py`` on the CPU: its arguments and problems, as rehearsed before a device call. A
tree without the cluster mode (main) runs the ``CLUSTER`` 1 variants only, and says which it skipped."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_prefill_variants  # noqa: E402


def test_rehearsal_builds_every_problem_and_skips_cluster_variants_without_the_mode(tmp_path, capsys):
    out = tmp_path / "variants.json"
    bench_prefill_variants.main(["--out", str(out), "--t", "1024", "--device", "cpu", "--variants", "1:8", "2:4",
                                 "--patterns", "random", "shared16", "indexer"])
    printed = capsys.readouterr().out
    assert "variants ['2:4'] not run" in printed
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


def test_a_chunk_is_the_whole_prompts_last_tokens_with_their_selections():
    whole = {name: case for name, *case in bench_prefill_variants.problems(1024, "cpu", ["random", "indexer"])}
    chunks = {name: case for name, *case in bench_prefill_variants.problems(1024, "cpu", ["random", "indexer"], 256)}
    assert list(chunks) == [name.replace("T1024_", "T1024_C256_") for name in whole]
    for name, (q, cache, ids, table, req, pos) in whole.items():
        cq, ccache, cids, ctable, creq, cpos = chunks[name.replace("T1024_", "T1024_C256_")]
        assert torch.equal(cq, q[-256:]) and torch.equal(cids, ids[:, -256:]) and torch.equal(cpos, pos[-256:])
        assert torch.equal(creq, req[-256:]) and torch.equal(ccache, cache) and torch.equal(ctable, table)
        assert int(cpos[0]) == 768  # an extend over a prefix of 768 tokens


def test_a_chunk_must_be_a_multiple_of_8_within_the_prompt(capsys):
    for chunk in ("12", "2048"):
        with pytest.raises(SystemExit):
            bench_prefill_variants.parse_args(["--out", "x.json", "--t", "1024", "--chunk", chunk])
        assert f"--chunk {chunk}: expected a multiple of 8" in capsys.readouterr().err
