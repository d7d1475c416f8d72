"""``bench/prefill_error.py`` on the CPU: its comparison of two trees' saved outputs against the reference (hand-made
tensors with known errors) and its arguments."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import prefill_error  # noqa: E402


def test_compare_reports_each_trees_error_and_their_difference(tmp_path):
    torch.save(torch.tensor([1.0, 2.0, -4.0]), tmp_path / "ref_case.pt")
    torch.save(torch.tensor([1.0, 2.5, -4.0], dtype=torch.bfloat16), tmp_path / "main_case.pt")
    torch.save(torch.tensor([1.25, 2.0, -4.0], dtype=torch.bfloat16), tmp_path / "new_case.pt")
    torch.save(torch.tensor([9.0]), tmp_path / "other_file.pt")  # not a reference: ignored
    (row,) = prefill_error.compare(str(tmp_path), "main", "new")
    assert row["case"] == "case" and row["identical"] is False
    assert row["main_max"] == 0.5 and row["main_mean"] == pytest.approx(0.5 / 3)
    assert row["new_max"] == 0.25 and row["new_mean"] == pytest.approx(0.25 / 3)
    assert row["difference_max"] == 0.5 and row["difference_mean"] == pytest.approx(0.75 / 3)
    assert row["reference_mean_abs"] == pytest.approx(7 / 3)


def test_the_two_forms_are_exclusive(capsys):
    assert prefill_error.parse_args(["--tag", "a", "--dir", "d"]).t == 4096
    assert prefill_error.parse_args(["--compare", "d", "a", "b"]).compare == ["d", "a", "b"]
    for bad in ([], ["--tag", "a"], ["--compare", "d", "a", "b", "--tag", "a"]):
        with pytest.raises(SystemExit):
            prefill_error.parse_args(bad)
    assert "either --tag and --dir" in capsys.readouterr().err
