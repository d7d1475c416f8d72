"""Block selection: which blocks of 128 keys each token attends, per KV head.

* :mod:`.protocol`: :class:`BlockIndexer`, what the SGLang backend asks of any indexer, and
  :class:`StateBytes`, the memory an indexer states before it is built (pool sizing).
* :mod:`.rules`: the selection rule shared by indexers (forced own/sink/local blocks, ranking, ``-1``
  padding) and the all-visible selection of dense layers.
* :mod:`.summary`: the training-free :class:`SummaryIndexer` (per-page key summaries, quest or mean
  scoring), torch on CPU, Triton kernels (:mod:`sglang_nvfp4.kernels.triton_indexer`) on GPUs.
* :mod:`.learned`: :class:`LearnedIndexer`, selection from a model's own index projections
  (MiniMax-M3's learned indexer), keeping the model's index keys per token slot.
* :mod:`.proxy`: the training-free :class:`ProxyIndexer`, M3's scoring with the head-mean query against
  every cached key (no state of its own).
* :mod:`.fp8`: the one fp8 rounding of both (E4M3 rows, each with a power-of-two scale): the proxy's fp8
  queries, the learned indexer's fp8 index keys.

Evaluation-only code (true attention mass per block, oracle selections) lives in
:mod:`sglang_nvfp4.quality.block_mass`.
"""

from .protocol import BlockIndexer, StateBytes
from .rules import all_visible_blocks, forced_blocks, rank_blocks
from .learned import IndexKeys, LearnedIndexer, select_blocks_learned
from .proxy import ProxyIndexer, select_blocks_proxy
from .summary import METHODS, BlockSummaries, SummaryIndexer, aggregate_queries, select_blocks

__all__ = [
    "BlockIndexer",
    "StateBytes",
    "SummaryIndexer",
    "LearnedIndexer",
    "IndexKeys",
    "select_blocks_learned",
    "ProxyIndexer",
    "select_blocks_proxy",
    "BlockSummaries",
    "METHODS",
    "select_blocks",
    "aggregate_queries",
    "forced_blocks",
    "rank_blocks",
    "all_visible_blocks",
]
