"""``bench/bench_decode_variants.py`` on the CPU: its arguments, as rehearsed before a device call, and the record
it writes (``timing.write_tree_record``, shared with ``bench_prefill_variants.py``)."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_decode_variants  # noqa: E402
import timing  # noqa: E402


def test_variants_parse_to_prefetch_l2_pages_and_splits():
    args = bench_decode_variants.parse_args(["--out", "x.json", "--variants", "auto:auto", "on:0", "off:3", "auto:1:4",
                                             "on:auto:auto"])
    assert args.variants == [("auto", None, None), ("on", 0, None), ("off", 3, None), ("auto", 1, 4),
                             ("on", None, None)]
    assert args.batch == [1, 32, 256] and args.ctx == 32768 and args.topk == 16


@pytest.mark.parametrize("bad", ["maybe:1", "on", "on:-1", "auto:two", "auto:1:3", "auto:1:0", "auto:1:2:2", "auto:1:"])
def test_a_malformed_variant_is_refused_with_its_value(bad, capsys):
    with pytest.raises(SystemExit):
        bench_decode_variants.parse_args(["--out", "x.json", "--variants", bad])
    assert repr(bad) in capsys.readouterr().err


def test_the_tree_record_names_command_tree_and_rows(tmp_path):
    out = tmp_path / "record.json"
    rows = [{"case": "c", "hash": timing.output_hash(torch.arange(4, dtype=torch.int32))}]
    timing.write_tree_record(str(out), "bench_decode_variants.py", ["--batch", "1"], "TREE/__init__.py", rows, "cpu")
    record = json.loads(out.read_text())
    assert record["command"] == "PYTHONPATH=TREE python bench/bench_decode_variants.py --batch 1"
    assert record["tree"] == "TREE/__init__.py" and record["gpu"] == "cpu" and record["rows"] == rows
    # The hash is of the bytes: the same values in another dtype hash differently, the same bits equally.
    assert rows[0]["hash"] == timing.output_hash(torch.arange(4, dtype=torch.int32).clone())
    assert rows[0]["hash"] != timing.output_hash(torch.arange(4, dtype=torch.int64))
