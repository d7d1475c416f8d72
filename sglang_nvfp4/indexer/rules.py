"""The selection rule every indexer applies to its block scores, and the all-visible selection of
dense layers.

Token ``t`` with own block ``own = pos[t] // 128`` sees blocks ``0..own``. The own block, the first
``sink_blocks`` blocks and the ``local_blocks`` blocks before the own block are always selected (if
visible); the remaining slots go to the visible blocks in the order (score descending, block id
ascending): **equal scores select the lower block id**. NaN scores rank as the lowest finite score,
+-inf as +-FLT_MAX; a visible block always beats an empty slot. A token with at most ``topk`` visible
blocks therefore selects all of them (dense). Output rows hold the selected ids in ascending order,
then ``-1`` padding.

**Shared selections** (the proxy indexer's ``share``, :func:`token_runs`): in a batch with more tokens than
block-table rows (prefill, extend), consecutive tokens of one request whose positions have the same ``pos //
share`` form a run, and a run selects once: each block scores the max of its tokens' scores (``share_score``
``"max"``) or its last token's score (``"last"``), and the rule above chooses for the run's last position.
``share`` divides 128, so a run's tokens have one own block, the same sink and local blocks and the same visible
blocks: every token of the run gets exactly the run's selection. A batch of at most one token per row (decode)
selects per token.
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import format as fmt

FLT_MAX = torch.finfo(torch.float32).max


def check_selection_settings(topk: int, sink_blocks: int, local_blocks: int) -> None:
    """``topk >= 1`` slots must hold the own block and the forced sink and local blocks."""
    if topk < 1:
        raise ValueError(f"topk: must be >= 1, got {topk}")
    if sink_blocks < 0 or local_blocks < 0:
        raise ValueError(f"sink_blocks/local_blocks: must be >= 0, got {sink_blocks}, {local_blocks}")
    if sink_blocks + local_blocks + 1 > topk:
        raise ValueError(f"topk: {topk} slots cannot hold the own block + {sink_blocks} sink_blocks + "
                         f"{local_blocks} local_blocks")


SHARES = (1, 2, 4, 8, 16, 32, 64, 128)  # tokens per shared selection: powers of two dividing the block
SHARE_SCORES = ("max", "last")  # how a run scores a block: the max over its tokens, or its last token's score


def check_share(share: int, share_score: str = "max") -> None:
    """``ValueError`` unless ``share`` is one of :data:`SHARES` and ``share_score`` one of :data:`SHARE_SCORES`."""
    if share not in SHARES:
        raise ValueError(f"share={share}: expected one of {SHARES} (a power of two dividing {fmt.PAGE_SIZE})")
    if share_score not in SHARE_SCORES:
        raise ValueError(f"share_score={share_score!r}: expected one of {SHARE_SCORES}")


def shares_selections(share: int, num_tokens: int, num_rows: int) -> bool:
    """Whether a batch of ``num_tokens`` tokens over a block table of ``num_rows`` rows selects per run of tokens
    (module docstring): ``share`` > 1 and more tokens than rows."""
    return share > 1 and num_tokens > num_rows


def max_runs(num_tokens: int, num_rows: int, share: int) -> int:
    """An upper bound on the runs of a batch whose requests each hold consecutive tokens at consecutive positions
    (SGLang's batches): a request of ``n`` tokens spans at most ``(n - 1) // share + 2`` runs."""
    return min(num_tokens, num_tokens // share + 2 * num_rows)


def token_runs(req: torch.Tensor, pos: torch.Tensor, share: int, runs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs of a batch (module docstring), without a host sync: ``(run, run_pos)``, int64 ``run [T]`` the run of
    each token (0, 1, ... in batch order) and int32 ``run_pos [runs]`` the position of each run's last token (0 for
    the unused ones). ``runs``: the buffer size, :func:`max_runs`; in a batch that holds more runs (a request's tokens
    out of order or split), the tokens past it join the last run, which changes their selections but keeps them
    within the blocks their kernels read (blocks past a token's position are skipped)."""
    starts = torch.ones(pos.shape[0], dtype=torch.bool, device=pos.device)
    key = pos.long() // share
    starts[1:] = (req[1:] != req[:-1]) | (key[1:] != key[:-1])
    run = (torch.cumsum(starts, 0) - 1).clamp_(max=runs - 1)
    return run, at_run_ends(run, pos.int(), runs)


def at_run_ends(run: torch.Tensor, values: torch.Tensor, runs: int) -> torch.Tensor:
    """``values [T]`` at each run's last token: ``[runs]`` (zeros for the unused runs), for the runs ``run [T]`` of
    :func:`token_runs` (consecutive tokens). A run has one last token, so this is a scatter with no two writes to
    one slot: deterministic and without atomics (a scatter-max over every token of runs of 16 took 88 us at 32K
    tokens on an H100); each token that ends no run writes to a spare slot of its own, dropped."""
    t = run.shape[0]
    ends = torch.ones(t, dtype=torch.bool, device=run.device)
    ends[:-1] = run[1:] != run[:-1]
    slot = torch.where(ends, run, runs + torch.arange(t, device=run.device))
    return values.new_zeros(runs + t).scatter_(0, slot, values)[:runs]


def max_into_runs(run_scores: torch.Tensor, run: torch.Tensor, scores: torch.Tensor) -> None:
    """``run_scores[:, run[i]] = max(run_scores[:, run[i]], scores[:, i])`` for the tokens ``i`` of ``scores [H, n,
    B]`` (``run [n]``; ``run_scores [H, runs, B]``, fp32), in place, without a host sync. ``Tensor.index_reduce_``
    has been marked beta since torch 1.12 and warns once per process; its result does not depend on the order of
    the maxima, so the warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")
        run_scores.index_reduce_(1, run, scores, "amax")


def check_index_values(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, num_pages: int) -> None:
    """Range checks on the metadata (syncs with the device): rows, positions, and a valid page for every
    visible block."""
    if int(req.min()) < 0 or int(req.max()) >= block_table.shape[0]:
        raise ValueError(f"req: rows must be in [0, {block_table.shape[0]}), got {int(req.min())}..{int(req.max())}")
    if int(pos.min()) < 0:
        raise ValueError(f"pos: positions must be >= 0, got min {int(pos.min())}")
    if int(pos.max()) // fmt.PAGE_SIZE >= block_table.shape[1]:
        raise ValueError(f"pos: block {int(pos.max()) // fmt.PAGE_SIZE} is beyond the block table's "
                         f"{block_table.shape[1]} columns")
    own = pos.long() // fmt.PAGE_SIZE
    visible = torch.arange(block_table.shape[1], device=pos.device)[None, :] <= own[:, None]
    pages = block_table[req.long()]
    if bool((visible & ((pages < 0) | (pages >= num_pages))).any()):
        raise ValueError(f"block_table: a visible block maps to a page outside [0, {num_pages})")


def forced_blocks(own: torch.Tensor, num_blocks: int, sink_blocks: int, local_blocks: int) -> torch.Tensor:
    """bool ``[C, num_blocks]``: the own block, the first ``sink_blocks`` and the ``local_blocks``
    before the own block, of tokens whose own blocks are ``own [C]`` (visible ones only)."""
    blocks = torch.arange(num_blocks, device=own.device)[None, :]
    own = own[:, None]
    return (blocks <= own) & ((blocks == own) | (blocks < sink_blocks) | (blocks >= own - local_blocks))


def rank_blocks(scores: torch.Tensor, own: torch.Tensor, topk: int, forced: torch.Tensor) -> torch.Tensor:
    """The selection rule on ``scores [..., C, B]`` (column ``b`` = block ``b``) of tokens whose own
    blocks are ``own [C]``, with ``forced [C, B]`` always kept: int32 ``[..., C, topk]``, ascending
    ids then ``-1``. Visible = ``b <= own``; others rank by (score desc, id asc)."""
    visible = torch.arange(scores.shape[-1], device=scores.device)[None, :] <= own[:, None]
    s = scores.nan_to_num(nan=-FLT_MAX, posinf=FLT_MAX, neginf=-FLT_MAX)
    s = torch.where(forced, math.inf, s)
    s = torch.where(visible, s, -math.inf)
    width = min(topk, s.shape[-1])
    sorted_scores, order = torch.sort(s, dim=-1, descending=True, stable=True)  # ties: lower id first
    empty = torch.iinfo(torch.int32).max
    chosen = torch.where(sorted_scores[..., :width] > -math.inf, order[..., :width], empty)
    chosen = torch.sort(chosen, dim=-1).values
    out = torch.full((*s.shape[:-1], topk), -1, dtype=torch.int32, device=s.device)
    out[..., :width] = torch.where(chosen == empty, -1, chosen).int()
    return out


def all_visible_blocks(pos: torch.Tensor, width: int) -> torch.Tensor:
    """The selection of a dense layer: int32 ``[1, T, width]``, block ``b`` where ``b <= pos[t] // 128``,
    else ``-1`` (expand the first dim to the KV heads; the kernels read it through strides)."""
    ids = torch.arange(width, dtype=torch.int32, device=pos.device)
    own = (pos // fmt.PAGE_SIZE)[:, None]
    return torch.where(ids[None, :] <= own, ids[None, :], -1)[None]
