"""Backend configuration from environment variables (prefix ``NVFP4_SPARSE_``), resolved once per process
(:func:`startup_config`) and handed to the pool sizing and the backend.

==================================  =======  ==========================================================
variable                            default  meaning
==================================  =======  ==========================================================
``NVFP4_SPARSE_TOPK``               16       blocks of 128 keys attended per KV head and token (1..64;
                                             above 16, FlyDSL layers fall back to Triton)
``NVFP4_SPARSE_SINK_BLOCKS``        1        leading blocks every token always attends
``NVFP4_SPARSE_LOCAL_BLOCKS``       1        blocks just before the token's own that it always attends
``NVFP4_SPARSE_INDEXER``            proxy    training-free block scoring: ``proxy`` (queries against every
                                             cached key, max-pooled per block: MiniMax-M3's scoring
                                             without its learned projection), ``quest`` (per-dim min/max
                                             bound per block) or ``mean`` (mean key per block)
``NVFP4_SPARSE_PROXY_GROUPS``       all      ``proxy`` only: queries per KV head, each the mean of a run of
                                             consecutive query heads (a block scores the max over them);
                                             ``all``: every query head is one
``NVFP4_SPARSE_PROXY_PRECISION``    fp8      ``proxy`` only: operands of its score products, ``fp8`` or
                                             ``fp16`` (fp8: E4M3-rounded queries and keys, fp8 tensor cores)
``NVFP4_SPARSE_PROXY_SHARE``        8        ``proxy`` only: in prefill, runs of this many consecutive
                                             positions of a request select once: 1 (every token selects
                                             alone), 2, 4, ... 128
``NVFP4_SPARSE_PROXY_SHARE_SCORE``  last     ``proxy`` with ``PROXY_SHARE`` > 1: ``last`` (the run selects as
                                             its last token alone) or ``max`` (every token of a run scored, a
                                             block scores the max over them)
``NVFP4_SPARSE_INDEX_KEYS``         model    MiniMax-M3 only: its index keys in the ``model`` dtype (bf16 or fp16,
                                             256 bytes a token and sparse layer, as SGLang keeps them) or
                                             ``fp8`` (E4M3 and one exponent byte per key, 129 bytes;
                                             :func:`sglang_nvfp4.indexer.fp8.quantize_rows`)
``NVFP4_SPARSE_DENSE_LAYERS``       (none)   comma-separated layer ids that attend every visible block
                                             (dense attention over the NVFP4 cache), or ``all``
``NVFP4_SPARSE_KERNEL``             (auto)   force ``reference``, ``triton``, ``gluon`` (Hopper prefill and decode) or
                                             ``flydsl`` kernels; validated here, read by the pool's cache
                                             writer at start-up and by the kernel dispatcher when a forward
                                             is planned
``NVFP4_SPARSE_PREDECODE``          auto     ``auto``: a long Gluon prefill predecodes each layer's pages once
                                             (:mod:`sglang_nvfp4.kernels.triton_predecode`; same bits);
                                             ``off``: never
``NVFP4_SPARSE_TOKEN_GROUPS``       auto     ``auto``: a Gluon prefill of 1024 or more tokens that select alone
                                             gives its tiles tokens whose selections overlap
                                             (:func:`sglang_nvfp4.kernels.triton_prefill.group_tokens`; same
                                             bits); ``off``: consecutive tokens
==================================  =======  ==========================================================

The defaults (top-16, ``proxy``, every head) are the cheapest setting measured that keeps the trained retrieval
model's answers within 3 points of dense ``triton`` at 4K-32K on both task families: at most 1.0 point below
(``pair`` at 32K) over 200 prompts per length, where the previous default (top-32 ``quest``) lost 25 (``single``) and
43 (``pair``) points at 32K. Its fp8 scores gave the same correctness as fp16 on those 800 prompts. The score is every
query head against every key (``bench/results/quality_selection_model_h200.md``), so in prefill runs of 8 positions
select once, as their last token would (since 2026-12-06): the same answers as every token selecting alone on two
sets of 800 prompts (-0.1 and +0.0 points against dense, like per-token selection), 1/8 of the score products, and
8 tokens that attend the same pages, which the prefill kernels decode once per tile of 8 tokens. Selection +
attention at 32K (64/4 heads, random data, one H100) 1.3 + 4.6 ms against 8.4 + 13.8 per token (dense SDPA 28),
and ``one_batch`` prefill 1.99x FlashInfer end to end (``bench/results/shared_selection_h100.md``). Decode selects per
token.

A token's own block is always selected, and a token with at most ``TOPK`` visible blocks attends
all of them, so prompts up to ``TOPK * 128`` tokens are exactly dense in every layer. Bad values
raise ``ValueError`` naming the variable where SGLang resolves the server arguments (the plugin's
start-up rules, in the launcher, before any weight loads: exit code 1), checked against the
checkpoint's config too (:meth:`SparseConfig.check_model`); the backend checks the built model again.

MiniMax-M3 checkpoints bring their own selection (:mod:`.minimax_m3`, :meth:`SparseConfig.for_model`):
their learned indexer, top-k and forced blocks come from the checkpoint, so setting ``TOPK``,
``SINK_BLOCKS``, ``LOCAL_BLOCKS``, ``INDEXER`` or any ``PROXY_*`` variable for one is a start-up
error; ``DENSE_LAYERS`` and ``KERNEL`` apply as for any model. ``INDEX_KEYS`` applies to them alone (other models
keep no index keys: setting it for one is a start-up error).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from .. import format as fmt
from .. import kernels
from ..indexer import METHODS, BlockIndexer, ProxyIndexer, StateBytes, SummaryIndexer
from ..indexer.proxy import PRECISIONS
from ..indexer.rules import SHARE_SCORES, SHARES
from .minimax_m3 import INDEX_KEY_STORAGE, M3Sparsity, m3_sparsity

_PREFIX = "NVFP4_SPARSE_"
# A model's own indexer replaces these.
_SELECTION_VARIABLES = ("TOPK", "SINK_BLOCKS", "LOCAL_BLOCKS", "INDEXER", "PROXY_GROUPS", "PROXY_PRECISION",
                        "PROXY_SHARE", "PROXY_SHARE_SCORE")
INDEXERS = (*METHODS, "proxy")  # NVFP4_SPARSE_INDEXER: the summary methods, or the token-level proxy
# The selection when no variable is set (the module docstring says why). format.TOPK is the kernels' narrowest
# width (FlyDSL's only one); DEFAULT_PROXY_GROUPS None: one query per query head.
DEFAULT_TOPK = 16
DEFAULT_INDEXER = "proxy"
DEFAULT_PROXY_GROUPS: int | None = None
DEFAULT_PROXY_PRECISION = "fp8"
DEFAULT_PROXY_SHARE = 8
DEFAULT_PROXY_SHARE_SCORE = "last"


@dataclass(frozen=True)
class SparseConfig:
    topk: int = DEFAULT_TOPK
    sink_blocks: int = 1
    local_blocks: int = 1
    indexer: str = DEFAULT_INDEXER
    proxy_groups: int | None = DEFAULT_PROXY_GROUPS  # queries per KV head of the proxy indexer; None: every head
    proxy_precision: str = DEFAULT_PROXY_PRECISION  # operands of the proxy's score products (PRECISIONS)
    proxy_share: int = DEFAULT_PROXY_SHARE  # positions per shared selection of the proxy indexer in prefill (SHARES)
    proxy_share_score: str = DEFAULT_PROXY_SHARE_SCORE  # how a run of shared selection scores (SHARE_SCORES)
    dense_layers: frozenset[int] | None = frozenset()  # None: every layer
    index_keys: str = "model"  # storage of a learned indexer's keys (INDEX_KEY_STORAGE)
    explicit: frozenset[str] = frozenset()  # the selection variables set in the environment
    model: M3Sparsity | None = None  # a checkpoint's own selection (MiniMax-M3), from for_model()

    def for_model(self, hf_config) -> SparseConfig:
        """This configuration for a checkpoint: with its own selection when it has one (MiniMax-M3;
        ``ValueError`` for an unsupported variant, for selection variables it would ignore, or for index-key
        storage asked of a model without index keys)."""
        model = m3_sparsity(hf_config, self.index_keys)
        if model is not None and self.explicit:
            names = ", ".join(_PREFIX + name for name in sorted(self.explicit))
            raise ValueError(f"{names}: MiniMax-M3 selects blocks with its learned indexer and its checkpoint's "
                             "sparse_attention_config; unset these variables")
        if model is None and self.index_keys != "model":
            raise ValueError(f"{_PREFIX}INDEX_KEYS={self.index_keys}: only MiniMax-M3 checkpoints keep index keys "
                             "(their learned indexer's); unset it for this model")
        return dataclasses.replace(self, model=model)

    def is_dense_layer(self, layer_id: int) -> bool:
        """Whether a layer attends every visible block: ``DENSE_LAYERS``, or a layer of a model with its own
        selection that the model keeps dense."""
        if self.dense_layers is None or layer_id in self.dense_layers:
            return True
        return self.model is not None and layer_id not in self.model.sparse_layers

    def check_model(self, num_layers: int, head_dim: int, heads_per_kv: int | None = None) -> None:
        """Settings that depend on the model: ``ValueError`` for a head_dim the cache layout does not hold, for
        dense layer ids the model does not have (a typo would leave every layer sparse), and for proxy query
        groups that do not divide the query heads per KV head (when ``heads_per_kv`` is known)."""
        if head_dim != fmt.HEAD_DIM:
            raise ValueError(f"nvfp4_sparse: head_dim {head_dim} is not supported, only {fmt.HEAD_DIM}")
        if self.indexer == "proxy" and self.proxy_groups and heads_per_kv and heads_per_kv % self.proxy_groups:
            raise ValueError(f"{_PREFIX}PROXY_GROUPS={self.proxy_groups}: must divide the model's {heads_per_kv} "
                             "query heads per KV head")
        beyond = sorted(x for x in self.dense_layers or () if x >= num_layers)
        if beyond:
            raise ValueError(f"{_PREFIX}DENSE_LAYERS: layer ids {beyond} are beyond the model's {num_layers} layers "
                             f"(0..{num_layers - 1})")

    def indexer_kind(self, start_layer: int, num_layers: int) -> tuple[type, dict]:
        """The indexer of a process's layers ``start_layer .. start_layer + num_layers - 1``: its class and
        the options it is built and sized with (one place, so that the pool sizing and the build agree)."""
        if self.model is not None:
            return self.model.indexer_kind(start_layer, num_layers, self.dense_layers)
        selection = {"topk": self.topk, "sink_blocks": self.sink_blocks, "local_blocks": self.local_blocks}
        if self.indexer == "proxy":
            return ProxyIndexer, {**selection, "groups": self.proxy_groups, "precision": self.proxy_precision,
                                  "share": self.proxy_share, "share_score": self.proxy_share_score}
        return SummaryIndexer, {"method": self.indexer, **selection}

    def indexer_state_bytes(self, num_layers: int, num_kv_heads: int, start_layer: int = 0) -> StateBytes:
        """Memory of the indexer :meth:`build_indexer` makes, known before it is built (pool sizing)."""
        cls, options = self.indexer_kind(start_layer, num_layers)
        return cls.state_bytes(num_layers, num_kv_heads, **options)

    def build_indexer(self, num_layers: int, num_pages: int, num_kv_heads: int, device,
                      start_layer: int = 0) -> BlockIndexer:
        """The configured indexer for one process's layers and pool pages."""
        cls, options = self.indexer_kind(start_layer, num_layers)
        return cls(num_layers, num_pages, num_kv_heads, device, **options)


def _int(env, name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{_PREFIX}{name}={raw!r}: expected an integer") from None
    if not lo <= value <= hi:
        raise ValueError(f"{_PREFIX}{name}={value}: expected {lo}..{hi}")
    return value


def _proxy_variable(env, name: str, indexer: str) -> str:
    """The stripped value of ``NVFP4_SPARSE_<name>`` ('' when unset), a ``PROXY_*`` variable: ``ValueError`` when it
    is set for another indexer than ``proxy``."""
    raw = (env.get(_PREFIX + name) or "").strip()
    if raw and indexer != "proxy":
        raise ValueError(f"{_PREFIX}{name}={raw}: applies to {_PREFIX}INDEXER=proxy only (got {indexer!r})")
    return raw


def load_config(env=None) -> SparseConfig:
    """Read and validate the ``NVFP4_SPARSE_*`` variables from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    topk = _int(env, "TOPK", DEFAULT_TOPK, 1, fmt.MAX_TOPK)
    sink = _int(env, "SINK_BLOCKS", 1, 0, topk - 1)
    local = _int(env, "LOCAL_BLOCKS", 1, 0, topk - 1 - sink)
    indexer = env.get(_PREFIX + "INDEXER") or DEFAULT_INDEXER
    if indexer not in INDEXERS:
        raise ValueError(f"{_PREFIX}INDEXER={indexer!r}: expected one of {INDEXERS}")
    raw_groups = _proxy_variable(env, "PROXY_GROUPS", indexer)
    if raw_groups == "all" or not raw_groups:
        proxy_groups = None if raw_groups == "all" else DEFAULT_PROXY_GROUPS
    elif not raw_groups.isdigit():
        raise ValueError(f"{_PREFIX}PROXY_GROUPS={raw_groups!r}: expected 'all' or an integer 1..64")
    else:
        proxy_groups = _int(env, "PROXY_GROUPS", 1, 1, 64)
    precision = _proxy_variable(env, "PROXY_PRECISION", indexer)
    if precision and precision not in PRECISIONS:
        raise ValueError(f"{_PREFIX}PROXY_PRECISION={precision!r}: expected one of {PRECISIONS}")
    _proxy_variable(env, "PROXY_SHARE", indexer)
    share = _int(env, "PROXY_SHARE", DEFAULT_PROXY_SHARE, 1, fmt.PAGE_SIZE)
    if share not in SHARES:
        raise ValueError(f"{_PREFIX}PROXY_SHARE={share}: expected one of {SHARES}")
    share_score = _proxy_variable(env, "PROXY_SHARE_SCORE", indexer)
    if share_score and share == 1:
        raise ValueError(f"{_PREFIX}PROXY_SHARE_SCORE={share_score}: applies to {_PREFIX}PROXY_SHARE > 1 only")
    if share_score and share_score not in SHARE_SCORES:
        raise ValueError(f"{_PREFIX}PROXY_SHARE_SCORE={share_score!r}: expected one of {SHARE_SCORES}")
    raw_dense = (env.get(_PREFIX + "DENSE_LAYERS") or "").strip()
    if raw_dense == "all":
        dense = None
    else:
        try:
            dense = frozenset(int(x) for x in raw_dense.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{_PREFIX}DENSE_LAYERS={raw_dense!r}: expected 'all' or comma-separated layer ids") from None
        if any(x < 0 for x in dense):
            raise ValueError(f"{_PREFIX}DENSE_LAYERS={raw_dense!r}: layer ids must be >= 0")
    index_keys = (env.get(_PREFIX + "INDEX_KEYS") or "").strip() or "model"
    if index_keys not in INDEX_KEY_STORAGE:
        raise ValueError(f"{_PREFIX}INDEX_KEYS={index_keys!r}: expected one of {tuple(INDEX_KEY_STORAGE)}")
    kernels.forced_implementation(env)  # a bad NVFP4_SPARSE_KERNEL fails here, not at the first forward
    kernels.predecode_setting(env)  # and a bad NVFP4_SPARSE_PREDECODE
    kernels.token_groups_setting(env)  # or NVFP4_SPARSE_TOKEN_GROUPS
    explicit = frozenset(name for name in _SELECTION_VARIABLES if env.get(_PREFIX + name))
    # PROXY_SHARE=1: every token selects alone, and scores every token ("max" of one)
    share_score = share_score or (DEFAULT_PROXY_SHARE_SCORE if share > 1 else "max")
    return SparseConfig(topk, sink, local, indexer, proxy_groups, precision or DEFAULT_PROXY_PRECISION, share,
                        share_score, dense, index_keys, explicit)


@functools.cache
def startup_config() -> SparseConfig:
    """The process's configuration: :func:`load_config` of the environment, read once (pool sizing and
    the backend share it)."""
    return load_config()
