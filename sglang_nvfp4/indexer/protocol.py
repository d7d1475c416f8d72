"""The :class:`BlockIndexer` protocol: what the SGLang backend asks of block selection.

The backend owns one indexer per model runner. It sizes the pool with the indexer's
:class:`StateBytes` before anything is allocated, builds the indexer beside the pool, tells it about
every cache write and token move, and asks it once per layer and forward for the block ids the
kernels attend (:mod:`sglang_nvfp4.reference` states their meaning). An indexer owns whatever it
keeps per page or per token (block summaries, a model's index keys); the pool and the kernels know
nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .. import format as fmt


@dataclass(frozen=True)
class StateBytes:
    """Memory an indexer keeps beside the NVFP4 cache, over all its layers: bytes per cache page and
    bytes per token slot. Known before allocation, so that the pool sizing counts it."""

    per_page: int = 0
    per_token: int = 0

    def per_slot(self) -> float:
        """Bytes per token slot, the page share included."""
        return self.per_token + self.per_page / fmt.PAGE_SIZE


@runtime_checkable
class BlockIndexer(Protocol):
    """Block selection behind the ``nvfp4_sparse`` backend.

    ``layer_id`` is the layer's index among the layers this process holds (0-based). ``cache`` is that
    layer's NVFP4 cache ``uint8 [pages, 2*Hkv, 128, 72]``; ``slots`` int32/int64 ``[N]`` are
    ``page * 128 + row``. ``model_inputs`` carries what a model-provided indexer needs beyond
    attention's tensors: the keyword arguments the model passes to its attention call (e.g.
    MiniMax-M3's ``idx_q``/``idx_k`` projections), which the backend forwards to both calls; the
    training-free :class:`~.summary.SummaryIndexer` ignores it. On the GPU, :meth:`on_kv_written` and
    :meth:`select` must be free of host syncs (decode runs them inside CUDA graphs).

    The backend's configuration (:meth:`sglang_nvfp4.sglang.config.SparseConfig.indexer_kind`) names
    the class and its options; it is built as ``cls(num_layers, num_pages, num_kv_heads, device,
    **options)`` and sized before that with :meth:`state_bytes`.
    """

    topk: int  # the most block ids per row that select() returns (its K)
    # Optional, so not a protocol member (absent = False): ``wants_key_tiles``, True when select() takes ``key_tiles``,
    # a long prefill's predecoded E4M3 key tiles of the layer (:meth:`sglang_nvfp4.kernels.AttentionPlan.predecode`),
    # which the backend then has its plan make (the fp8 ProxyIndexer); ``selection_run`` (absent = 1), how many
    # consecutive tokens of a prefill share one selection (the ProxyIndexer's ``share``), which the plan's choice to
    # predecode depends on (:func:`sglang_nvfp4.kernels.triton_predecode.pays`).

    @staticmethod
    def state_bytes(num_layers: int, num_kv_heads: int, **options) -> StateBytes:
        """The memory an instance built with these arguments will keep (pool sizing, before it exists)."""
        ...

    def state_nbytes(self) -> int:
        """Bytes of the state it holds (SGLang's KV memory accounting)."""
        ...

    def on_kv_written(self, layer_id: int, cache: torch.Tensor, slots: torch.Tensor, **model_inputs) -> None:
        """K/V of the tokens at ``slots`` were just written into ``cache``."""
        ...

    def save_tokens(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor | None:
        """Per-token state of ``slots`` for a move or a CPU offload (``None``: it keeps none)."""
        ...

    def restore_tokens(self, layer_id: int, cache: torch.Tensor, slots: torch.Tensor,
                       saved: torch.Tensor | None) -> None:
        """The tokens' bytes were put back at ``slots`` (a move or an offload restore), with what
        :meth:`save_tokens` returned for them."""
        ...

    def select(self, layer_id: int, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               req: torch.Tensor, pos: torch.Tensor, **model_inputs) -> torch.Tensor:
        """Block ids for ``q [T, H, 128]``: int32 ``[Hkv, T, K]`` with ``K <= topk``, logical blocks of
        request ``req[t]`` (``-1`` = none), none after the token's own block."""
        ...
