"""The synthetic long-context retrieval task: key-value records hidden in a stream of filler tokens.

A document is ``<bos>`` followed by random filler words with two kinds of events at random gaps:

* a *record* ``<k> KEY VALUE`` (every key at most once per document; records are spread over the whole
  document), and
* a *query* ``<q> KEY VALUE`` repeating the value of an earlier record.

Each key owns its own ``VALUES_PER_KEY`` value words (``v{key}_{j}``), so the record's value token alone
tells which key it answers: one attention layer that matches the query key against value tokens can
solve the task, with no two-layer induction circuit. (The first design drew values from one shared pool;
that needs a previous-token head composed with a lookup head, and two GPU training runs of ~4,000 steps
each sat at the copy-any-value plateau.) The answer still exists only at the record's position, anywhere
earlier in the context: a cache or an indexer that loses the record's block shows up as a wrong answer.
Training supervises only the query values.

An evaluation prompt is a document whose last two tokens are ``<q> KEY`` for a target record placed at a
chosen depth; the expected greedy next token is its value. No earlier query in it asks for that key.

Everything is word-level (one word per token) and seeded, so prompts and labels are reproducible.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<k>", "<q>")
NUM_KEYS, VALUES_PER_KEY, NUM_FILLER = 32, 8, 256
NUM_VALUES = NUM_KEYS * VALUES_PER_KEY
MEAN_EVENT_GAP = 64  # filler tokens between events, uniform in [GAP_MIN, 2 * MEAN - GAP_MIN]
GAP_MIN = 8
IGNORE = -100  # label of positions that are not supervised


def vocabulary() -> list[str]:
    """Token strings in id order: specials, keys ``k0..``, values ``v{key}_{j}``, filler ``w0..``."""
    return [*SPECIAL_TOKENS, *(f"k{i}" for i in range(NUM_KEYS)),
            *(f"v{i}_{j}" for i in range(NUM_KEYS) for j in range(VALUES_PER_KEY)),
            *(f"w{i}" for i in range(NUM_FILLER))]


BOS, EOS, PAD, RECORD, QUERY = range(len(SPECIAL_TOKENS))
KEY0 = len(SPECIAL_TOKENS)
VALUE0 = KEY0 + NUM_KEYS
FILLER0 = VALUE0 + NUM_VALUES
VOCAB_SIZE = FILLER0 + NUM_FILLER


@dataclass
class Document:
    """``tokens``: int64 ids; ``labels``: the value id at each query's ``KEY`` position (the token that
    predicts it), ``IGNORE`` elsewhere; ``records``: ``(position of <k>, key id, value id)`` in order."""

    tokens: np.ndarray
    labels: np.ndarray
    records: list[tuple[int, int, int]]


def make_document(rng: np.random.Generator, length: int, mean_gap: int = MEAN_EVENT_GAP) -> Document:
    """A document of exactly ``length`` tokens (``length >= 4``); filler gaps between events are uniform
    in ``[min(GAP_MIN, mean_gap), 2 * mean_gap - that]`` (training draws denser documents than the
    evaluation's default)."""
    if length < 4:
        raise ValueError(f"length must be >= 4, got {length}")
    tokens = rng.integers(FILLER0, FILLER0 + NUM_FILLER, size=length)
    labels = np.full(length, IGNORE, dtype=np.int64)
    tokens[0] = BOS
    lo = min(GAP_MIN, mean_gap)
    hi = 2 * mean_gap - lo
    starts = []
    pos = 1 + int(rng.integers(lo, hi + 1))
    while pos + 3 <= length:
        starts.append(pos)
        pos += 3 + int(rng.integers(lo, hi + 1))
    # Up to half of the events are records (the first always), at random event slots over the document.
    num_records = min(NUM_KEYS, (len(starts) + 1) // 2)
    is_record = np.zeros(len(starts), dtype=bool)
    if starts:
        is_record[0] = True
        is_record[1 + rng.choice(len(starts) - 1, num_records - 1, replace=False)] = True
    keys = rng.permutation(NUM_KEYS)[:num_records]
    records: list[tuple[int, int, int]] = []
    for pos, record in zip(starts, is_record):
        if record:
            k = int(keys[len(records)])
            key, value = KEY0 + k, VALUE0 + k * VALUES_PER_KEY + int(rng.integers(VALUES_PER_KEY))
            tokens[pos:pos + 3] = (RECORD, key, value)
            records.append((pos, key, value))
        else:
            _, key, value = records[int(rng.integers(len(records)))]
            tokens[pos:pos + 3] = (QUERY, key, value)
            labels[pos + 1] = value
    return Document(tokens, labels, records)


@dataclass
class Prompt:
    """One evaluation prompt: ``tokens`` end with ``<q> KEY``; ``answer`` is the value id;
    ``depth`` is the target record's position / prompt length."""

    tokens: np.ndarray
    answer: int
    length: int
    depth: float
    target_depth: float


def make_prompt(rng: np.random.Generator, length: int, depth: float) -> Prompt:
    """A prompt of ``length`` tokens (``length >= 2 * MEAN_EVENT_GAP``) whose target record is the one
    nearest to ``depth``; earlier queries for the target key are overwritten with filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if length < 2 * MEAN_EVENT_GAP:
        raise ValueError(f"length must be >= {2 * MEAN_EVENT_GAP}, got {length}")
    body_len = length - 2
    doc = make_document(rng, body_len)
    while not doc.records:
        doc = make_document(rng, body_len)
    pos, key, value = min(doc.records, key=lambda r: abs(r[0] - depth * body_len))
    tokens = doc.tokens.copy()
    for q in np.flatnonzero((tokens[:-1] == QUERY) & (tokens[1:] == key)):
        tokens[q:q + 3] = rng.integers(FILLER0, FILLER0 + NUM_FILLER, size=3)
    tokens = np.concatenate([tokens, np.array([QUERY, key])])
    return Prompt(tokens, value, length, pos / length, depth)


def make_prompts(seed: int, lengths, depths, per_cell: int) -> list[Prompt]:
    """``per_cell`` prompts for every (length, depth) pair, reproducible from ``seed``."""
    prompts = []
    for length in lengths:
        for depth in depths:
            rng = np.random.default_rng([seed, length, int(round(depth * 1000))])
            prompts.extend(make_prompt(rng, length, depth) for _ in range(per_cell))
    return prompts


def to_text(tokens) -> str:
    """The words of ``tokens`` separated by spaces (the tokenizer splits on whitespace)."""
    vocab = vocabulary()
    return " ".join(vocab[int(t)] for t in tokens)


def write_tokenizer(out_dir: str) -> None:
    """A word-level ``tokenizers`` tokenizer over :func:`vocabulary` (ids as above, whitespace split, no
    added special tokens) saved with ``PreTrainedTokenizerFast.save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<pad>")
    fast.save_pretrained(out_dir)
    # SGLang reads the chat template only for chat requests; none is needed for /generate.
    with open(os.path.join(out_dir, "task.json"), "w") as f:
        json.dump({"task": "key-value retrieval", "num_keys": NUM_KEYS, "num_values": NUM_VALUES,
                   "num_filler": NUM_FILLER, "mean_event_gap": MEAN_EVENT_GAP}, f, indent=1)
