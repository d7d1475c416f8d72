"""The quality harness's building blocks: the retrieval task's invariants, the tokenizer, and the PyTorch
model's Hugging Face export (fast, CPU)."""

import json

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
