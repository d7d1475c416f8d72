"""``bench/tile_unions.py`` counts the distinct pages of a tile (duplicates and -1 ids excluded) and refuses tile
sizes that do not divide the prompt. (Its 8-token unions agree with the GPU benchmark's ``gluon_union_mean``, the
planner's: ``bench/results/tile_unions_cpu.md``.)"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import tile_unions  # noqa: E402


def test_counts_distinct_selected_pages_per_tile():
    ids = torch.tensor([[[0, 1], [1, -1], [2, 2], [-1, -1]],
                        [[5, -1], [-1, -1], [3, 4], [4, 3]]], dtype=torch.int32)  # [Hkv 2, T 4, K 2]
    assert tile_unions.tile_unions(ids, 2).tolist() == [[2, 1], [1, 2]]
    assert tile_unions.tile_unions(ids, 4).tolist() == [[3], [3]]
    assert tile_unions.tile_unions(ids, 1).tolist() == [[2, 1, 1, 0], [1, 0, 2, 2]]


def test_tiles_must_divide_the_prompt():
    with pytest.raises(SystemExit):
        tile_unions.parse_args(["--out", "x", "--prefill-t", "1024", "--tiles", "8", "24"])

