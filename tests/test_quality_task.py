"""The quality harness's building blocks: the retrieval task's invariants, the tokenizer, and the PyTorch
model's Hugging Face export (fast, CPU)."""

import hashlib
import json
import os

import numpy as np
import pytest
import torch

from sglang_nvfp4.quality import task
from sglang_nvfp4.quality.model import ModelConfig, RetrievalLM, load_hf, save_hf


def _records_and_queries(tokens):
    records, queries = {}, []
    for i in range(len(tokens) - 2):
        if tokens[i] == task.RECORD:
            assert tokens[i + 1] not in records, "a key is recorded twice"
            records[tokens[i + 1]] = (i, tokens[i + 2])
        elif tokens[i] == task.QUERY:
            queries.append((i, tokens[i + 1], tokens[i + 2]))
    return records, queries


@pytest.mark.parametrize("length", [4, 130, 2048, 20000])
def test_document_invariants(length):
    doc = task.make_document(np.random.default_rng(length), length)
    tokens = doc.tokens.tolist()
    assert len(tokens) == len(doc.labels) == length and tokens[0] == task.BOS
    assert all(0 <= t < task.VOCAB_SIZE for t in tokens)
    records, queries = _records_and_queries(tokens)
    assert [(p, k, v) for k, (p, v) in records.items()] == doc.records
    for key, (_, value) in records.items():  # every key owns its value words
        assert (value - task.VALUE0) // task.VALUES_PER_KEY == key - task.KEY0
    for pos, key, value in queries:
        assert records[key][0] < pos and records[key][1] == value, "a query must repeat an earlier record's value"
        assert doc.labels[pos + 1] == value
    assert int((doc.labels != task.IGNORE).sum()) == len(queries)
    if length >= 2048:
        assert len(records) > 5 and len(queries) > 5
    if length >= 20000:  # records are spread over the document, not packed at its start
        assert len(records) == task.NUM_KEYS and max(p for p, _ in records.values()) > length // 2


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_answer_is_the_target_record_and_only_source(depth):
    p = task.make_prompt(np.random.default_rng(3), 4096, depth)
    tokens = p.tokens.tolist()
    assert len(tokens) == p.length == 4096 and tokens[-2] == task.QUERY
    key = tokens[-1]
    records, queries = _records_and_queries(tokens[:-2])
    assert records[key][1] == p.answer and records[key][0] / 4096 == p.depth
    assert abs(p.depth - depth) < 0.05
    assert all(k != key for _, k, _ in queries), "an earlier query leaks the answer"


def test_prompts_are_reproducible_and_validated():
    a = task.make_prompts(5, [1024], [0.0, 1.0], 3)
    b = task.make_prompts(5, [1024], [0.0, 1.0], 3)
    assert len(a) == 6 and all(np.array_equal(x.tokens, y.tokens) and x.answer == y.answer for x, y in zip(a, b))
    with pytest.raises(ValueError, match="depth"):
        task.make_prompt(np.random.default_rng(0), 1024, 1.5)
    with pytest.raises(ValueError, match="length"):
        task.make_prompt(np.random.default_rng(0), 16, 0.5)


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    task.write_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    p = task.make_prompt(np.random.default_rng(1), 1024, 0.5)
    assert tok(task.to_text(p.tokens))["input_ids"] == p.tokens.tolist()
    assert len(tok) == task.VOCAB_SIZE


def test_export_round_trip_and_config(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, intermediate_size=96)
    model = RetrievalLM(cfg).eval()
    save_hf(model, str(tmp_path), {"note": "test"})
    hf = json.load(open(tmp_path / "config.json"))
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (16, 1, 128)
    assert hf["architectures"] == ["GraniteForCausalLM"] and hf["vocab_size"] == task.VOCAB_SIZE
    loaded = load_hf(str(tmp_path))
    tokens = torch.from_numpy(task.make_document(np.random.default_rng(0), 300).tokens)[None]
    with torch.no_grad():
        want = model(tokens)
        got = loaded(tokens)
    # The checkpoint is bf16: logits agree to bf16 weight rounding.
    assert torch.allclose(got, want, atol=2e-2, rtol=0), (got - want).abs().max()
    assert json.load(open(tmp_path / "training.json"))["note"] == "test"


def test_rope_matches_relative_positions():
    """q·k after RoPE depends only on the distance: shifting both positions keeps the score."""
    from sglang_nvfp4.quality.model import apply_rope, rope_cos_sin

    cfg = ModelConfig()
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 128, generator=gen).unbind(0)
    scores = []
    for shift in (0, 1000):
        cos, sin = rope_cos_sin(cfg, torch.tensor([5 + shift, 2 + shift]))
        scores.append((apply_rope(q, cos[:1], sin[:1]) * apply_rope(k, cos[1:], sin[1:])).sum())
    assert torch.allclose(scores[0], scores[1], atol=1e-3)


def _digest(arrays) -> str:
    """First 16 hex digits of the sha256 of the arrays' int64 bytes, in order."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.asarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def test_single_prompts_and_documents_are_unchanged_by_the_pair_family():
    """Digests computed with the task code before the pair family existed: the CI gate's prompts
    (tests/test_quality_gate.py), evaluation prompts and plain documents must stay bit-identical."""
    gate = task.make_prompts(seed=11, lengths=[1536], depths=[0.0, 0.25, 0.5, 0.75, 1.0], per_cell=20)
    assert _digest([p.tokens for p in gate] + [[p.answer for p in gate]]) == "86f9b373579d3ff6"
    assert [p.answer for p in gate[:5]] == [57, 169, 104, 84, 80]
    assert gate[0].tokens[:8].tolist() == [0, 380, 356, 346, 417, 542, 359, 536]
    assert all(p.family == "single" and p.answers == (p.answer,) and p.second_depth is None for p in gate)
    evals = task.make_prompts(7, [2048, 4096], [0.0, 0.5, 1.0], 2)
    assert _digest([p.tokens for p in evals] + [[p.answer for p in evals]]) == "706ad4cec80b5ade"
    assert evals[2].depth == 0.50244140625
    for seed, length, gap, want in [(0, 2048, 64, "4723a15126ad2d35"), (1, 20000, 64, "279fd91ca60ffe4f"),
                                    (2, 4096, 3, "ed80c4de7ea24d8d")]:
        doc = task.make_document(np.random.default_rng(seed), length, gap, pair_fraction=0.0)
        assert _digest([doc.tokens, doc.labels, np.array(doc.records).ravel()]) == want
        assert (doc.labels2 == task.IGNORE).all()


def _records_of(tokens, key):
    return [(i, tokens[i + 2]) for i in range(len(tokens) - 2) if tokens[i] == task.RECORD and tokens[i + 1] == key]


@pytest.mark.parametrize("length", [1024, 4096])
def test_pair_prompts_have_two_far_records_of_the_key(length):
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    prompts = task.make_prompts(3, [length], depths, 4, family="pair")
    assert len(prompts) == 20
    for p in prompts:
        tokens = p.tokens.tolist()
        assert p.family == "pair" and len(tokens) == p.length == length and tokens[-2] == task.QUERY
        key = tokens[-1]
        records = dict(_records_of(tokens, key))  # position of <k> -> value
        pos_a, pos_b = round(p.depth * length), round(p.second_depth * length)
        assert sorted(records) == sorted([pos_a, pos_b]) and p.answers == (records[pos_a], records[pos_b])
        assert p.answer == p.answers[0] != p.answers[1]
        assert {(v - task.VALUE0) // task.VALUES_PER_KEY for v in p.answers} == {key - task.KEY0}
        assert abs(pos_a - pos_b) >= task.PAIR_MIN_DISTANCE
        assert not {i // 128 for i in range(pos_a, pos_a + 3)} & {i // 128 for i in range(pos_b, pos_b + 3)}
        assert all(not (tokens[i] == task.QUERY and tokens[i + 1] == key) for i in range(len(tokens) - 2))
        # Of the document's records (the second one is added afterwards), the target is the nearest to the depth.
        others = [i for i in range(len(tokens) - 2) if tokens[i] == task.RECORD and tokens[i + 1] != key]
        target = p.target_depth * (length - 2)
        assert all(abs(pos - target) >= abs(pos_a - target) for pos in others)
    seconds = np.array([p.second_depth for p in prompts])
    assert seconds.min() < 0.3 and seconds.max() > 0.7, "the second record is spread over the document"


def test_pair_prompts_are_reproducible_and_drawn_apart_from_single_ones():
    a = task.make_prompts(5, [2048], [0.5], 3, family="pair")
    b = task.make_prompts(5, [2048], [0.5], 3, family="pair")
    assert all(np.array_equal(x.tokens, y.tokens) and x.answers == y.answers for x, y in zip(a, b))
    single = task.make_prompts(5, [2048], [0.5], 3)
    assert not any(np.array_equal(x.tokens[:500], y.tokens[:500]) for x, y in zip(a, single))
    with pytest.raises(ValueError, match="length"):
        task.make_prompt(np.random.default_rng(0), 512, 0.5, family="pair")
    with pytest.raises(ValueError, match="family"):
        task.make_prompt(np.random.default_rng(0), 2048, 0.5, family="triple")


def test_pair_documents_have_two_hot_labels():
    pairs = 0
    for seed in range(4):
        doc = task.make_document(np.random.default_rng(seed), 4096, mean_gap=16, pair_fraction=0.5)
        tokens = doc.tokens.tolist()
        assert len(tokens) == len(doc.labels) == len(doc.labels2) == 4096
        records = [(i, tokens[i + 1], tokens[i + 2]) for i in range(len(tokens) - 2) if tokens[i] == task.RECORD]
        assert records == doc.records
        values: dict[int, list[int]] = {}
        for pos, key, value in doc.records:
            values.setdefault(key, []).append(value)
            assert (value - task.VALUE0) // task.VALUES_PER_KEY == key - task.KEY0
        assert all(len(v) == len(set(v)) <= 2 for v in values.values())
        pairs += sum(len(v) == 2 for v in values.values())
        supervised = np.flatnonzero(doc.labels != task.IGNORE)
        assert set(np.flatnonzero(doc.labels2 != task.IGNORE)) <= set(supervised)
        for i in supervised:
            key = tokens[i]
            assert tokens[i - 1] == task.QUERY
            earlier = [v for pos, k, v in doc.records if k == key and pos < i]
            assert doc.labels[i] == earlier[0] and tokens[i + 1] in earlier
            assert doc.labels2[i] == (earlier[1] if len(earlier) == 2 else task.IGNORE)
        assert (doc.labels2 != task.IGNORE).any()
    assert pairs >= 8


@pytest.mark.parametrize("seed", range(4))
def test_late_queries_are_the_only_queries_of_their_keys_and_their_source_is_a_record(seed):
    rng = np.random.default_rng(seed)
    doc = task.make_document(rng, 4096, mean_gap=16, pair_fraction=0.5)
    same, none = task.with_late_queries(rng, doc, 0)
    assert np.array_equal(same.tokens, doc.tokens) and not none.any()
    new, late = task.with_late_queries(rng, doc, 6)
    tokens = new.tokens.tolist()
    start = int(4096 * (1 - task.LATE_TAIL))
    asked = np.flatnonzero(late)
    assert 1 <= len(asked) <= 6 and len({tokens[i] for i in asked}) == len(asked)
    records = [(i, tokens[i + 1], tokens[i + 2]) for i in range(len(tokens) - 2) if tokens[i] == task.RECORD]
    assert records == doc.records  # records untouched
    for i in asked:
        key = tokens[i]
        assert tokens[i - 1] == task.QUERY and i - 1 >= start
        recorded = [v for pos, k, v in doc.records if k == key]
        assert all(pos + 3 <= start for pos, k, _ in doc.records if k == key)
        assert new.labels[i] == recorded[0] and tokens[i + 1] in recorded
        assert new.labels2[i] == (recorded[1] if len(recorded) == 2 else task.IGNORE)
        queries = [j for j in range(len(tokens) - 1) if tokens[j] == task.QUERY and tokens[j + 1] == key]
        assert queries == [i - 1]  # the nearest source of its value is a record
    held = {tokens[i] for i in asked}
    for j in np.flatnonzero(doc.labels != task.IGNORE):  # other keys' queries keep their labels (or became late ones)
        if doc.tokens[j] not in held and j not in set(asked):
            assert new.labels[j] == doc.labels[j] and new.labels2[j] == doc.labels2[j]
    assert set(np.flatnonzero(new.labels != task.IGNORE)) >= set(asked)


def test_late_queries_in_a_tail_without_room_are_fewer_not_an_error():
    # a 512-token document of one-token gaps: the last 51 tokens hold records and queries only, and a record there
    # leaves some keys without a place; the H200 training run of 16:41 UTC stopped on this
    rng = np.random.default_rng(0)
    fewer = 0
    for _ in range(200):
        doc = task.make_document(rng, 512, mean_gap=2, pair_fraction=0.25)
        new, late = task.with_late_queries(rng, doc, 8)
        fewer += int(late.sum()) < 8
        assert (new.tokens[np.flatnonzero(late) - 1] == task.QUERY).all()
    assert fewer > 0


def test_training_batch_marks_the_late_queries():
    from sglang_nvfp4.quality.train import batch

    tokens, labels, labels2, late = batch(np.random.default_rng(0), 2048, 3, "cpu", 16, 0.25, late_keys=4)
    assert tokens.shape == labels.shape == labels2.shape == late.shape == (3, 2048) and late.dtype == torch.bool
    assert late.sum(dim=1).tolist() == [4, 4, 4] and (labels[late] != task.IGNORE).all()
    assert (tokens[:, :-1][late[:, 1:]] == task.QUERY).all()


def test_two_hot_loss_and_accuracy():
    from sglang_nvfp4.quality.train import query_loss_and_accuracy

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.45, 0.1, 0.45], [0.2, 0.5, 0.3]]))
    labels, labels2 = torch.tensor([0, 0, 0]), torch.tensor([task.IGNORE, 2, 2])
    loss, acc = query_loss_and_accuracy(logits, labels, labels2)
    # -log 0.5; -(log 0.45 + log 0.45) / 2; -(log 0.2 + log 0.3) / 2, averaged over the three queries.
    want = (-np.log(0.5) - np.log(0.45) - 0.5 * (np.log(0.2) + np.log(0.3))) / 3
    assert abs(loss.item() - want) < 1e-5
    assert acc == pytest.approx(2 / 3)  # the third query's top-2 is {1, 2}, not {0, 2}
    single, _ = query_loss_and_accuracy(logits, labels, torch.full((3,), task.IGNORE))
    assert torch.allclose(single, torch.nn.functional.cross_entropy(logits, labels))


def test_wilson_interval_by_hand():
    from sglang_nvfp4.quality.stats import wilson_interval

    # z = 1.96, z^2 = 3.8416, n = 10: denominator 1 + z^2/n = 1.38416.
    # 0/10: centre 0 + z^2/20 = 0.19208, half 1.96 * sqrt((0 + 0.09604) / 10) = 0.19208 -> (0, 0.38416 / 1.38416).
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.277540), abs=1e-6)
    # 10/10: the mirror image.
    assert wilson_interval(10, 10) == pytest.approx((0.722460, 1.0), abs=1e-6)
    # 5/10: centre 0.69208, half 1.96 * sqrt((0.25 + 0.09604) / 10) = 0.364603 -> (0.327477, 1.056683) / 1.38416.
    assert wilson_interval(5, 10) == pytest.approx((0.236589, 0.763411), abs=1e-6)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_difference_interval_by_hand():
    from sglang_nvfp4.quality.stats import paired_difference_interval

    baseline = [1, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    setting = [1, 0, 1, 1, 1, 0, 0, 1, 0, 1]
    # Discordant: b = 1 (prompt 4: only the setting), c = 2 (prompts 1 and 6: only the baseline); n = 10.
    # d = (1 - 2) / 10 = -0.1; se = sqrt(3 - 1 / 10) / 10 = 0.170294; 1.96 se = 0.333776.
    d, lo, hi = paired_difference_interval(setting, baseline)
    assert (d, lo, hi) == pytest.approx((-0.1, -0.433776, 0.233776), abs=1e-6)
    assert paired_difference_interval(baseline, baseline) == (0.0, 0.0, 0.0)


def _rows(family, correct, length=2048, depths=(0.0, 1.0)):
    return [{"family": family, "length": length, "target_depth": depths[i % len(depths)], "depth": 0.5, "token": 7,
             "correct": bool(c), "answer_logprob": -float(i)} for i, c in enumerate(correct)]


def test_summarize_and_markdown_per_family():
    from sglang_nvfp4.quality.evaluate import markdown, summarize
    from sglang_nvfp4.quality.stats import wilson_interval

    dense = _rows("single", [1] * 10) + _rows("pair", [1, 1, 1, 1, 0, 0, 1, 1, 0, 1])
    sparse = _rows("single", [1] * 9 + [0]) + _rows("pair", [1, 0, 1, 1, 1, 0, 0, 1, 0, 1])
    summary = summarize({"dense": dense, "sparse": sparse}, "dense")
    single, pair = summary["sparse"]["families"]["single"], summary["sparse"]["families"]["pair"]
    assert summary["sparse"]["accuracy"] == 15 / 20 and summary["sparse"]["by_length"] == {"2048": 0.75}
    assert pair["accuracy"] == 0.6 and pair["ci95"] == list(wilson_interval(6, 10)) and pair["prompts"] == 10
    assert single["by_length"]["2048"]["accuracy"] == 0.9
    assert pair["by_length_depth"] == {"2048@0.0": 0.6, "2048@1.0": 0.6}
    vs = summary["sparse"]["vs_dense"]
    assert vs["accuracy_delta_points"] == -10.0 and vs["greedy_agreement"] == 1.0
    assert vs["families"]["pair"]["by_length"]["2048"] == {"delta_points": -10.0, "ci95_points": [-43.38, 23.38]}
    assert vs["families"]["single"]["delta_points"] == -10.0
    assert "vs_dense" not in summary["dense"]
    md = markdown(summary, "dense")
    assert "**single**" in md and "**pair**" in md and "| sparse | 0.600 [0.31, 0.83] | -10.0 [-43.4, +23.4] |" in md
    # Rows written before the pair family existed count as single prompts.
    old = summarize({"dense": [{k: v for k, v in r.items() if k != "family"} for r in dense[:10]]}, "dense")
    assert list(old["dense"]["families"]) == ["single"]
    with pytest.raises(ValueError, match="same prompts"):
        summarize({"dense": dense, "sparse": sparse[::-1]}, "dense")


def test_fixture_model_answers_both_families():
    """The committed fixture model (trained on both families, to 32K) in plain PyTorch at 1024 tokens; its
    ``training.json`` records 1.000 on both there."""
    from sglang_nvfp4.quality.train import dense_accuracy

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "retrieval_model")
    model = load_hf(fixture)
    for family in task.FAMILIES:
        prompts = task.make_prompts(11, [1024], [0.0, 0.25, 0.5, 0.75, 1.0], 4, family=family)
        assert dense_accuracy(model, prompts, "cpu") >= 0.9, family


@pytest.mark.parametrize("length", [1024, 8192])
def test_shared_prompts_ask_every_recorded_key_of_one_document(length):
    document, prompts = task.make_shared_prompts(3, length)
    assert len(document) == length and not (document == task.QUERY).any()
    records = {}
    for pos in np.flatnonzero(document == task.RECORD):
        records.setdefault(int(document[pos + 1]), []).append((int(pos), int(document[pos + 2])))
    asked = set()
    for p in prompts:
        key = int(p.tokens[-1])
        asked.add(key)
        assert np.array_equal(p.tokens[:-2], document) and p.tokens[-2] == task.QUERY and p.length == length
        (first, value), *second = records[key]
        assert p.answers[0] == p.answer == value and p.depth == first / length
        if p.family == "pair":
            assert len(second) == 1 and second[0][0] - first >= task.PAIR_MIN_DISTANCE
            assert p.answers == (value, second[0][1]) and p.second_depth == second[0][0] / length
        else:
            assert p.family == "single" and not second and p.answers == (value,)
    too_close = {k for k, r in records.items() if len(r) == 2 and r[1][0] - r[0][0] < task.PAIR_MIN_DISTANCE}
    assert asked == set(records) - too_close
    again, prompts_again = task.make_shared_prompts(3, length)
    assert np.array_equal(again, document) and [p.answers for p in prompts_again] == [p.answers for p in prompts]
    with pytest.raises(ValueError, match="length"):
        task.make_shared_prompts(3, task.PAIR_MIN_LENGTH - 1)
