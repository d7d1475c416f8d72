"""The synthetic long-context retrieval task: key-value records hidden in a stream of filler tokens.

A document is ``<bos>`` followed by random filler words with two kinds of events at random gaps:

* a *record* ``<k> KEY VALUE`` (records are spread over the whole document), and
* a *query* ``<q> KEY VALUE`` repeating the value of an earlier record.

Each key owns its own ``VALUES_PER_KEY`` value words (``v{key}_{j}``), so the record's value token alone
tells which key it answers: one attention layer that matches the query key against value tokens can
solve the task, with no two-layer induction circuit. (The first design drew values from one shared pool;
that needs a previous-token head composed with a lookup head, and two GPU training runs of ~4,000 steps
each sat at the copy-any-value plateau.) The answer still exists only at the record's position, anywhere
earlier in the context: a cache or an indexer that loses the record's block shows up as a wrong answer.
Training supervises only the query values.

Evaluation prompts come in two families, both a document whose last two tokens are ``<q> KEY`` for a
target record placed at a chosen depth, with no earlier query for that key:

* ``single``: the key is recorded once; correct when the greedy next token is its value.
* ``pair``: the key is recorded twice with two different values (``<k> KEY Va`` ... ``<k> KEY Vb``, at
  least ``PAIR_MIN_DISTANCE`` tokens apart, hence in different 128-token blocks); correct when the two
  most likely next tokens are exactly ``{Va, Vb}``. One query token then needs *two* retrieved blocks,
  and a sparse attention that drops either record's block fails it. The family exists so that sparse
  defaults (top-k, indexer scoring) are not tuned to one retrieval per token, which is all that
  ``single`` asks for.

Training documents record a key twice with probability ``pair_fraction`` (see :func:`make_document`);
a query after both records is supervised with both values.

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
FAMILIES = ("single", "pair")  # evaluation prompt families (see the module docstring)
PAIR_MIN_DISTANCE = 256  # tokens between a pair prompt's two records: two 128-token blocks
PAIR_MIN_LENGTH = 4 * PAIR_MIN_DISTANCE  # leaves room for the second record at every target depth


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
    """``tokens``: int64 ids; ``labels``: at each query's ``KEY`` position (the token that predicts the
    value), the value of the key's first record, ``IGNORE`` elsewhere; ``labels2``: at the ``KEY`` position
    of a query whose key has two earlier records, the second record's value (the query is supervised with
    both), ``IGNORE`` elsewhere; ``records``: ``(position of <k>, key id, value id)`` in position order (a
    key appears twice when recorded twice)."""

    tokens: np.ndarray
    labels: np.ndarray
    labels2: np.ndarray
    records: list[tuple[int, int, int]]


def _filler_out_queries(rng: np.random.Generator, tokens: np.ndarray, keys) -> np.ndarray:
    """Overwrite every query ``<q> KEY VALUE`` of ``keys`` in ``tokens`` (in place, in position order) with random
    filler; returns the queries' positions."""
    starts = np.flatnonzero((tokens[:-2] == QUERY) & np.isin(tokens[1:-1], keys))
    for q in starts:
        tokens[q:q + 3] = rng.integers(FILLER0, FILLER0 + NUM_FILLER, size=3)
    return starts


def _free_triples(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Whether three filler tokens start at each of ``starts`` (room for an event)."""
    is_filler = tokens >= FILLER0
    return is_filler[starts] & is_filler[starts + 1] & is_filler[starts + 2]


def _another_value(rng: np.random.Generator, value: int) -> int:
    """A value id of the key that owns ``value``, uniform over that key's other value words."""
    first_of_key = VALUE0 + (value - VALUE0) // VALUES_PER_KEY * VALUES_PER_KEY
    return first_of_key + (value - first_of_key + 1 + int(rng.integers(VALUES_PER_KEY - 1))) % VALUES_PER_KEY


def make_document(rng: np.random.Generator, length: int, mean_gap: int = MEAN_EVENT_GAP,
                  pair_fraction: float = 0.0) -> Document:
    """A document of exactly ``length`` tokens (``length >= 4``); filler gaps between events are uniform
    in ``[min(GAP_MIN, mean_gap), 2 * mean_gap - that]`` (training draws denser documents than the
    evaluation's default).

    Every record slot after the first is, with probability ``pair_fraction``, a second record of an
    earlier key recorded once so far (another of that key's value words); the others record new keys.
    ``pair_fraction=0`` draws nothing extra: the document is the one-record-per-key document."""
    if length < 4:
        raise ValueError(f"length must be >= 4, got {length}")
    tokens = rng.integers(FILLER0, FILLER0 + NUM_FILLER, size=length)
    labels = np.full(length, IGNORE, dtype=np.int64)
    labels2 = np.full(length, IGNORE, dtype=np.int64)
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
    values: dict[int, list[int]] = {}  # key id -> its recorded value ids, in order
    for pos, record in zip(starts, is_record):
        if record:
            once = [key for key, vals in values.items() if len(vals) == 1]
            if pair_fraction > 0 and once and rng.random() < pair_fraction:
                key = once[int(rng.integers(len(once)))]
                value = _another_value(rng, values[key][0])
            else:
                k = int(keys[len(values)])
                key, value = KEY0 + k, VALUE0 + k * VALUES_PER_KEY + int(rng.integers(VALUES_PER_KEY))
            tokens[pos:pos + 3] = (RECORD, key, value)
            records.append((pos, key, value))
            values.setdefault(key, []).append(value)
        else:
            _, key, value = records[int(rng.integers(len(records)))]
            tokens[pos:pos + 3] = (QUERY, key, value)
            labels[pos + 1] = values[key][0]
            if len(values[key]) == 2:
                labels2[pos + 1] = values[key][1]
    return Document(tokens, labels, labels2, records)


LATE_TAIL = 0.1  # the share of a document at its end where :func:`with_late_queries` asks its held-out keys


def with_late_queries(rng: np.random.Generator, doc: Document, num_keys: int,
                      tail: float = LATE_TAIL) -> tuple[Document, np.ndarray]:
    """Training documents that ask for far records, as evaluation prompts do.

    In a :func:`make_document` document a key is queried again and again, and each query repeats its value, so
    the nearest copy of a value is rarely more than a few thousand tokens back: 32K documents with mean gaps up to
    64 had no supervised query 16K tokens from its nearest copy. This takes up to ``num_keys`` keys recorded (once
    or twice) before the document's last ``tail`` share, turns every query of them into filler, and asks each once
    more at a random place in that last share (three filler tokens, or over another key's query):
    ``<q> KEY VALUE``, labelled like any query (two-hot for a key recorded twice). Their only sources are then
    their records, anywhere before. A tail with no room left asks fewer keys. Returns the new document and a bool
    mask of the new queries' label positions (the ``KEY`` tokens)."""
    tokens, labels, labels2 = doc.tokens.copy(), doc.labels.copy(), doc.labels2.copy()
    length = len(tokens)
    start = int(length * (1.0 - tail))
    values: dict[int, list[int]] = {}
    for pos, key, value in doc.records:
        values.setdefault(key, []).append(value)
    early = sorted({key for pos, key, _ in doc.records} - {key for pos, key, _ in doc.records if pos + 3 > start})
    late = np.zeros(length, dtype=bool)
    if not early or num_keys < 1:
        return Document(tokens, labels, labels2, list(doc.records)), late
    held = rng.choice(early, min(num_keys, len(early)), replace=False)
    dropped = _filler_out_queries(rng, tokens, held)
    labels[dropped + 1] = labels2[dropped + 1] = IGNORE
    spots = np.arange(start, length - 2)
    for key in held:
        # three filler tokens, or another key's query (dense documents may have no free three tokens)
        other_query = (tokens[spots] == QUERY) & ~late[spots + 1]
        candidates = spots[_free_triples(tokens, spots) | other_query]
        if not candidates.size:  # a short tail taken by records: fewer late queries
            break
        q = int(rng.choice(candidates))
        recorded = values[int(key)]
        tokens[q:q + 3] = (QUERY, key, recorded[int(rng.integers(len(recorded)))])
        labels[q + 1] = recorded[0]
        labels2[q + 1] = recorded[1] if len(recorded) == 2 else IGNORE
        late[q + 1] = True
    return Document(tokens, labels, labels2, list(doc.records)), late


@dataclass
class Prompt:
    """One evaluation prompt: ``tokens`` end with ``<q> KEY``; ``answers`` are the expected next-token
    ids (``single``: the value; ``pair``: the target record's value, then the other record's), ``answer``
    is ``answers[0]``; ``depth`` is the target record's position / prompt length and ``second_depth`` the
    other record's (``None`` for ``single``); ``target_depth`` is the requested depth."""

    tokens: np.ndarray
    answer: int
    length: int
    depth: float
    target_depth: float
    answers: tuple[int, ...]
    family: str
    second_depth: float | None


def make_prompt(rng: np.random.Generator, length: int, depth: float, family: str = "single") -> Prompt:
    """A prompt of ``length`` tokens (``length >= 2 * MEAN_EVENT_GAP``; ``pair``: ``>= PAIR_MIN_LENGTH``)
    whose target record is the one nearest to ``depth``; earlier queries for the target key are
    overwritten with filler. ``pair`` then writes a second record of the target key with another of its
    value words over filler, at a position uniform over the document among those at least
    ``PAIR_MIN_DISTANCE`` tokens from the target record (so the two records share no 128-token block)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    min_length = PAIR_MIN_LENGTH if family == "pair" else 2 * MEAN_EVENT_GAP
    if length < min_length:
        raise ValueError(f"length must be >= {min_length} for {family} prompts, got {length}")
    body_len = length - 2
    while True:
        doc = make_document(rng, body_len)
        if not doc.records:
            continue
        pos, key, value = min(doc.records, key=lambda r: abs(r[0] - depth * body_len))
        tokens = doc.tokens.copy()
        _filler_out_queries(rng, tokens, [key])
        if family == "single":
            answers, second_depth = (value,), None
            break
        # Second-record positions: three filler tokens, far enough from the target record.
        starts = np.arange(1, body_len - 2)
        candidates = starts[_free_triples(tokens, starts) & (np.abs(starts - pos) >= PAIR_MIN_DISTANCE)]
        if candidates.size:
            second = int(rng.choice(candidates))
            value2 = _another_value(rng, value)
            tokens[second:second + 3] = (RECORD, key, value2)
            answers, second_depth = (value, value2), second / length
            break
    return Prompt(np.concatenate([tokens, np.array([QUERY, key])]), value, length, pos / length, depth, answers,
                  family, second_depth)


def make_prompts(seed: int, lengths, depths, per_cell: int, family: str = "single") -> list[Prompt]:
    """``per_cell`` prompts of ``family`` for every (length, depth) pair, reproducible from ``seed``
    (the ``pair`` family draws from its own streams: ``single`` prompts do not depend on it)."""
    tag = [] if family == "single" else [FAMILIES.index(family)]
    prompts = []
    for length in lengths:
        for depth in depths:
            rng = np.random.default_rng([seed, length, int(round(depth * 1000)), *tag])
            prompts.extend(make_prompt(rng, length, depth, family) for _ in range(per_cell))
    return prompts


def make_shared_prompts(seed: int, length: int, pair_fraction: float = 0.25) -> tuple[np.ndarray, list[Prompt]]:
    """One document of ``length`` tokens and one prompt per key it records, all sharing it as their prefix.

    The document is :func:`make_document` (``pair_fraction`` of its record slots record an earlier key a
    second time) with every query overwritten by filler, so no key is queried before its prompt. A key's
    prompt is the document followed by ``<q> KEY``: ``single`` for a key recorded once, ``pair`` for a key
    recorded twice at least ``PAIR_MIN_DISTANCE`` tokens apart (a key recorded twice closer than that is
    left out: one block could answer it). Served after the document alone, every prompt is a two-token
    extend over the document's cached pages; ``depth`` is the (first) record's position / ``length``,
    ``target_depth`` the same rounded to 0.1. Returns ``(document tokens, prompts in key order)``."""
    if length < PAIR_MIN_LENGTH:
        raise ValueError(f"length must be >= {PAIR_MIN_LENGTH}, got {length}")
    rng = np.random.default_rng([seed, length, 1 + FAMILIES.index("pair")])
    doc = make_document(rng, length, pair_fraction=pair_fraction)
    tokens = doc.tokens.copy()
    _filler_out_queries(rng, tokens, np.arange(KEY0, KEY0 + NUM_KEYS))
    records: dict[int, list[tuple[int, int]]] = {}  # key -> [(position, value)] in position order
    for pos, key, value in doc.records:
        records.setdefault(key, []).append((pos, value))
    prompts = []
    for key in sorted(records):
        (pos, value), *second = records[key]
        if second and second[0][0] - pos < PAIR_MIN_DISTANCE:
            continue
        answers = (value, second[0][1]) if second else (value,)
        prompts.append(Prompt(np.concatenate([tokens, np.array([QUERY, key])]), value, length, pos / length,
                              round(pos / length, 1), answers, "pair" if second else "single",
                              second[0][0] / length if second else None))
    return tokens, prompts


def is_correct(answers, ranked_ids) -> bool:
    """Whether a prediction answers a prompt: ``ranked_ids`` are the model's next-token ids, most likely
    first; the ``len(answers)`` most likely must be exactly ``answers`` (``single``: the argmax is the
    value; ``pair``: the top-2 set is ``{Va, Vb}``)."""
    return set(ranked_ids[:len(answers)]) == set(answers)


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
