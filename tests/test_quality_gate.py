"""Quality regression gate (CPU, real SGLang servers) at a length where the default selection is sparse.

The trained retrieval model in ``tests/fixtures/retrieval_model`` (``sglang_nvfp4.quality``, trained on an
H200 to 32K tokens, see its ``training.json``) answers key-value questions about shared documents
(:func:`~sglang_nvfp4.quality.task.make_shared_prompts`): each document records about 24 keys at depths spread
over it, some twice (``pair`` prompts: both values must be the two most likely next tokens), and every prompt is
its document followed by ``<q> KEY``. The documents are served first, so each prompt is a two-token extend over
the document's cached pages (the radix-cache path is the one under test).

* **Selection**, four documents of 8192 tokens (64 blocks; 98 prompts): the query token's selection takes 16
  of its 65 blocks under the default (top-16, ``proxy`` scoring with every query head). The baseline is every
  block attended through the same NVFP4 cache (``DENSE_LAYERS=all``), so the difference is the selection alone.
  Dense ``torch_native`` is not run at this length: it recomputes the whole prompt's attention for every
  two-token extend (minutes per setting on two cores).
* **Storage**, four documents of 2048 tokens (16 blocks; 46 prompts): every block through NVFP4
  (``DENSE_LAYERS=all``) against dense bf16 ``torch_native``.

Margins (accuracy points):

* default settings (no ``NVFP4_SPARSE_*`` variable) at most 3 below every-block at 8K. With 98 prompts and a
  baseline near 1.0, a true loss of 5 points (4.9 more misses expected) fails the gate with probability 0.87
  (Poisson tail, 3 or more);
* own block only (``TOPK=1``, no sink or local block) at least 30 below every-block at 8K (the first two
  documents): the prompts really need retrieval, so the gate can fail;
* every block through NVFP4 at most 1 below dense at 2K (here: no prompt lost).

About 3 minutes on 2 otherwise idle CPU cores (2026-12-05: every block at 8K about 1 minute, the default about 1.1,
the 2K storage check 0.7, own block only 0.4; most of it prefilling the 8K documents through the reference kernels).

Every server run is deterministic (CPU, greedy), so the margins are not statistical allowances.
"""

import os

import pytest

from sglang_nvfp4.quality import task
from sglang_nvfp4.quality.evaluate import Setting, accuracy, run_setting

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "retrieval_model")
SELECTION_LENGTH, STORAGE_LENGTH = 8192, 2048
LONG = [task.make_shared_prompts(seed, SELECTION_LENGTH) for seed in range(4)]
SHORT = [task.make_shared_prompts(seed, STORAGE_LENGTH) for seed in range(4)]

pytestmark = pytest.mark.timeout(1500)


def _prompts(documents):
    return [p for _, prompts in documents for p in prompts]


def _run(name, backend, documents, tmp_path, **env):
    setting = Setting(name, backend, {f"NVFP4_SPARSE_{k}": str(v) for k, v in env.items()})
    return run_setting(FIXTURE, setting, _prompts(documents), out_dir=str(tmp_path), batch=4,
                       prefixes=[tokens for tokens, _ in documents])


def _at(rows, length):
    return [r for r in rows if r["length"] == length]


@pytest.fixture(scope="module")
def every_block_rows(tmp_path_factory):
    return _run("every_block", "nvfp4_sparse", SHORT + LONG, tmp_path_factory.mktemp("every_block"),
                DENSE_LAYERS="all")


def test_prompts_are_sparse_for_the_default_and_cover_both_families():
    from sglang_nvfp4.sglang.config import DEFAULT_TOPK

    long, short = _prompts(LONG), _prompts(SHORT)
    assert len(long) >= 95 and len(short) >= 40
    assert (SELECTION_LENGTH + 2 + 127) // 128 >= 2 * DEFAULT_TOPK, "the default would attend most blocks"
    assert sum(p.family == "pair" for p in long) >= 15
    assert min(p.depth for p in long) < 0.1 and max(p.depth for p in long) > 0.9


def test_every_block_through_nvfp4_within_1_point_of_dense(every_block_rows, tmp_path):
    dense = _run("dense", "torch_native", SHORT, tmp_path)
    assert accuracy(dense) >= 0.95, "the fixture model no longer solves the task densely"
    nvfp4 = _at(every_block_rows, STORAGE_LENGTH)
    assert accuracy(nvfp4) >= accuracy(dense) - 0.01, (accuracy(nvfp4), accuracy(dense))


def test_fixture_model_solves_the_long_prompts(every_block_rows):
    assert accuracy(_at(every_block_rows, SELECTION_LENGTH)) >= 0.9


def test_default_selection_within_3_points(every_block_rows, tmp_path):
    rows = _run("default", "nvfp4_sparse", LONG, tmp_path)
    baseline = _at(every_block_rows, SELECTION_LENGTH)
    assert accuracy(rows) >= accuracy(baseline) - 0.03, (accuracy(rows), accuracy(baseline))


def test_own_block_only_loses_the_records(every_block_rows, tmp_path):
    # one block, the forced own one, so no score is read: the cheapest indexer (quest) instead of the default proxy
    rows = _run("own_block", "nvfp4_sparse", LONG[:2], tmp_path, TOPK=1, SINK_BLOCKS=0, LOCAL_BLOCKS=0,
                INDEXER="quest")
    baseline = _at(every_block_rows, SELECTION_LENGTH)[:len(rows)]  # rows come in prompt order
    assert accuracy(rows) <= accuracy(baseline) - 0.30, (accuracy(rows), accuracy(baseline))
