"""Where dense attention really puts its weight, per block: the yardstick of block selection
(evaluation only; nothing here runs while serving).

:func:`block_attention_mass` is the dense causal softmax mass of each token on each block of 128 keys;
:func:`oracle_blocks` picks the blocks of largest mass, the best any ``topk`` selection can do. Used by
``bench/eval_indexer.py`` and the indexer tests.
"""

from __future__ import annotations

import math

import torch

from .. import format as fmt
from ..indexer.rules import check_index_values, rank_blocks
from ..reference import check_queries, check_token_metadata


def block_attention_mass(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    k_scale,
    sm_scale: float,
) -> torch.Tensor:
    """True attention mass per block: float64 ``[Hkv, T, S]`` (``S`` = block-table columns). Entry
    ``[h, t, b]`` sums, over the G query heads of KV head ``h``, the dense causal softmax weight (fp32
    logits over the dequantized K) of token ``t`` on the keys of block ``b``; each row sums to G.
    Blocks after the token's own get 0. Arguments as in :mod:`sglang_nvfp4.reference`."""
    hkv = fmt.check_cache(cache)
    t, h = check_queries(q, hkv)
    check_token_metadata(block_table, req, pos, t, q.device)
    check_index_values(block_table, req, pos, cache.shape[0])
    group = h // hkv
    mass = torch.zeros(hkv, t, block_table.shape[1], dtype=torch.float64, device=q.device)
    for r in torch.unique(req).tolist():
        tokens = (req == r).nonzero()[:, 0]
        num_blocks = int(pos[tokens].max()) // fmt.PAGE_SIZE + 1
        k = fmt.read_kv(cache, block_table[r, :num_blocks], k_scale, 1.0)[0]  # [B, Hkv, 128, 128]
        k = k.transpose(0, 1).reshape(hkv, num_blocks * fmt.PAGE_SIZE, fmt.HEAD_DIM)
        key_pos = torch.arange(num_blocks * fmt.PAGE_SIZE, device=q.device)
        for tok in tokens.split(64):
            qq = q[tok].float().view(len(tok), hkv, group, fmt.HEAD_DIM)
            logits = torch.einsum("tngd,nkd->tngk", qq, k) * sm_scale
            logits = logits.masked_fill(key_pos[None, None, None, :] > pos[tok].long()[:, None, None, None], -math.inf)
            p = torch.softmax(logits.double(), dim=-1).sum(dim=2)  # [C, Hkv, keys]
            per_block = p.view(len(tok), hkv, num_blocks, fmt.PAGE_SIZE).sum(dim=-1)
            mass[:, tok, :num_blocks] = per_block.transpose(0, 1)
    return mass


def oracle_blocks(mass: torch.Tensor, pos: torch.Tensor, topk: int = fmt.TOPK) -> torch.Tensor:
    """The ``topk`` blocks of largest ``mass`` (:func:`block_attention_mass`, ``[Hkv, T, S]``) per KV head
    and token of positions ``pos [T]``; equal masses select the lower id, nothing is forced: int32
    ``[Hkv, T, topk]``, ascending ids then ``-1``."""
    if topk < 1:
        raise ValueError(f"topk: must be >= 1, got {topk}")
    own = pos.long() // fmt.PAGE_SIZE
    return rank_blocks(mass, own, topk, torch.zeros(mass.shape[1:], dtype=torch.bool, device=mass.device))
