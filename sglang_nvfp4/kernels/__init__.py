"""Kernel dispatcher: the only entry point other modules call for attention and cache writes.

Attention is planned once per forward and run per layer, as FlashInfer's wrappers do:

    plan = kernels.plan_attention("prefill", block_table, req, pos, num_kv_heads=Hkv)
    for each layer:
        plan.run(q, cache, block_ids, k_scale, v_scale, sm_scale, out=out)

:func:`plan_attention` validates the metadata every layer shares (``block_table``, ``req``, ``pos``: see
:mod:`sglang_nvfp4.reference`) and resolves the implementation; :meth:`AttentionPlan.run` checks only
the layer's own tensors against the plan (host-side, no sync) and launches. :func:`sparse_prefill` /
:func:`sparse_decode` are the one-call forms (full validation, then plan and run), and :func:`write_kv`
follows :func:`sglang_nvfp4.format.write_kv` bit for bit (:func:`cache_writer` resolves it once, for the
KV pool).

Which implementation serves a plan (:func:`resolve_implementation`):

* CPU: the torch reference (exact, slow).
* CUDA and ROCm: the Triton kernels (``triton_prefill``, ``triton_decode``, ``triton_write``).
* NVIDIA Hopper (sm_90), when Triton's Gluon imports: the warp-specialized Gluon prefill
  (``gluon_prefill``) for the layers whose shape it serves (``gluon_prefill.supports``: 8-64 query heads
  per KV head, at most 32 ids per token) and the Gluon decode (``gluon_decode``, 1-32 query heads per KV
  head); other layers and cache writes stay on Triton.
* ROCm gfx950: FlyDSL for prefill when ``sglang_nvfp4.kernels.flydsl`` imports and reports itself
  available, for the layers whose shape it serves (``flydsl.supports``: 16 query heads per KV head,
  at most 16 ids per token); other layers, decode and cache writes stay on Triton.

Predecoding (Gluon prefill only, :mod:`.triton_predecode`): a plan whose forward has at least
``triton_predecode.MIN_TOKENS_PER_SLOT`` query tokens per block-table slot (``MIN_TOKENS_PER_SLOT_SHARED`` when
runs of tokens share their selections: a long prefill, or a chunk of one) decodes each visible
page once per layer into fp16 tiles (:meth:`AttentionPlan.predecode`, at the layer's first use), which the Gluon
prefill then copies instead of decoding each page once per tile that selected it; planned with ``key_tiles``, also
fp8 key tiles for the proxy indexer's Gluon scores, which the caller passes to its selection. Same output bits either
way. ``NVFP4_SPARSE_PREDECODE=auto`` (the default) lets the plan decide, ``off`` never predecodes; read when a plan
is made.

Token groups (Gluon prefill only, :func:`.triton_prefill.group_tokens`): with ``NVFP4_SPARSE_TOKEN_GROUPS=auto``
(the default), a plan of at least ``GROUP_MIN_TOKENS`` query tokens that select alone (``selection_run`` 1) has each
layer's tiles take tokens whose selections overlap, within windows of 64 tokens, instead of consecutive ones: fewer
union pages per tile, the same output bits. ``off`` keeps consecutive tiles; read when a plan is made.

``NVFP4_SPARSE_KERNEL=reference|triton|gluon|flydsl`` forces an implementation on any device; it is read
when a plan or a cache writer is made (the SGLang backend plans every forward, and once per captured
batch size for decode CUDA graphs; the pool makes its writer at start-up) and by each one-call
function. ``triton`` on CPU tensors runs the kernels in Triton's interpreter, which needs
``TRITON_INTERPRET=1`` set before the kernel modules are imported.

The kernel paths never sync with the device; the reference path also range-checks the ids. The
kernels rely on the reference's preconditions: ids below the block table's width, selected blocks
mapped to valid pages, distinct in-range write slots. Global scales are normalised by
:func:`sglang_nvfp4.format.global_scale` (a float, or a one-element fp32 tensor on the cache's device,
which the kernels read through a pointer and so keeps CUDA graphs free of host syncs). Any block-id
width ``K >= 1`` is accepted (the kernels pad it to a power of two); they are tuned for
``K = format.TOPK`` and tested up to ``format.MAX_TOPK``, the largest budget the configuration accepts.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from .. import format as fmt
from ..reference import (
    check_block_ids,
    check_queries,
    check_token_metadata,
    sparse_prefill_reference,
    validate_sparse_args,
)

__all__ = [
    "AttentionPlan",
    "plan_attention",
    "sparse_prefill",
    "sparse_decode",
    "write_kv",
    "cache_writer",
    "resolve_implementation",
    "gluon_unavailable",
    "forced_implementation",
    "FORCE_ENV",
    "IMPLEMENTATIONS",
    "PREDECODE_ENV",
    "predecode_setting",
    "TOKEN_GROUPS_ENV",
    "token_groups_setting",
]

logger = logging.getLogger(__name__)

FORCE_ENV = "NVFP4_SPARSE_KERNEL"
IMPLEMENTATIONS = ("reference", "triton", "gluon", "flydsl")
# Kernels that serve only some (implementation, kind) pairs and, within them, some layer shapes
# (``module.supports(heads, kv_heads, width)``); Triton serves the others.
_PARTIAL = {("gluon", "prefill"): "gluon_prefill", ("gluon", "decode"): "gluon_decode", ("flydsl", "prefill"): "flydsl"}
KINDS = ("prefill", "decode")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


PREDECODE_ENV = "NVFP4_SPARSE_PREDECODE"
PREDECODE_SETTINGS = ("auto", "off")  # the first is the default
TOKEN_GROUPS_ENV = "NVFP4_SPARSE_TOKEN_GROUPS"
TOKEN_GROUPS_SETTINGS = ("auto", "off")
# Fewest query tokens a forward regroups: 16 windows. Below, its attention takes tens of microseconds and the
# regrouping launch's few would be a visible share (a choice, not measured).
GROUP_MIN_TOKENS = 1024


def _choice(name: str, choices: tuple[str, ...], env) -> str:
    value = (os.environ if env is None else env).get(name, "").strip() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def predecode_setting(env=None) -> str:
    """``NVFP4_SPARSE_PREDECODE`` (``auto`` when unset): ``auto`` or ``off``; ``ValueError`` for another value.
    ``env`` defaults to ``os.environ``."""
    return _choice(PREDECODE_ENV, PREDECODE_SETTINGS, env)


def token_groups_setting(env=None) -> str:
    """``NVFP4_SPARSE_TOKEN_GROUPS`` (``auto`` when unset): ``auto`` or ``off``; ``ValueError`` for another value.
    ``env`` defaults to ``os.environ``."""
    return _choice(TOKEN_GROUPS_ENV, TOKEN_GROUPS_SETTINGS, env)


def forced_implementation(env=None) -> str | None:
    """The implementation ``NVFP4_SPARSE_KERNEL`` forces (``None`` when unset); ``ValueError`` for
    another value. ``env`` defaults to ``os.environ``."""
    forced = (os.environ if env is None else env).get(FORCE_ENV, "")
    if forced and forced not in IMPLEMENTATIONS:
        raise ValueError(f"{FORCE_ENV}={forced!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    return forced or None


@functools.lru_cache(maxsize=None)
def _flydsl_serves(device: torch.device) -> bool:
    """True on a ROCm gfx950 device when the FlyDSL package imports and reports itself available."""
    if not torch.cuda.get_device_properties(device).gcnArchName.startswith("gfx950"):
        return False
    try:
        from . import flydsl
    except ImportError:
        return False
    return bool(flydsl.is_available(device))


GLUON_MIN_TRITON = (3, 6)  # the oldest Triton the Gluon kernels are built and tested with (the GPU host's)


@functools.lru_cache(maxsize=None)
def gluon_unavailable() -> str | None:
    """Why this Triton cannot build the Gluon kernels, or ``None`` when it can: Triton older than
    ``GLUON_MIN_TRITON`` or without Gluon's Hopper API. Only these fall back to the Triton kernels; an error in the
    Gluon kernels' own modules is raised, never taken for "no Gluon"."""
    import triton

    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < GLUON_MIN_TRITON:
        return f"Triton {triton.__version__} is older than {'.'.join(map(str, GLUON_MIN_TRITON))}"
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma  # noqa: F401
    except ImportError as error:
        return f"Triton {triton.__version__} has no Gluon Hopper API ({error})"
    return None


@functools.lru_cache(maxsize=None)
def _gluon_serves(device: torch.device) -> bool:
    """True on an NVIDIA sm_90 device when this Triton builds the Gluon kernels (:func:`gluon_unavailable`); on
    such a device without them, a warning names why the slower Triton kernels serve."""
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available() \
            or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    reason = gluon_unavailable()
    if reason:
        logger.warning("%s: the Triton kernels serve attention on %s instead of the faster Gluon kernels",
                       reason, device)
        return False
    from . import gluon_decode, gluon_prefill  # noqa: F401  (an import error here is a bug: raised)
    return True


def resolve_implementation(device: torch.device | str) -> str:
    """Which implementation serves attention on ``device``: ``"reference"``, ``"triton"``, ``"gluon"``
    or ``"flydsl"`` (``NVFP4_SPARSE_KERNEL`` overrides)."""
    forced = forced_implementation()
    if forced:
        return forced
    device = torch.device(device)
    if device.type == "cpu":
        return "reference"
    if device.type == "cuda" and torch.version.hip is None:
        if device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return "gluon" if _gluon_serves(device) else "triton"
    if device.type == "cuda":  # a ROCm device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return "flydsl" if _flydsl_serves(device) else "triton"
    raise ValueError(f"no sparse-attention kernel for device {device}")


def _reference_launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out):
    return out.copy_(sparse_prefill_reference(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale))


class AttentionPlan:
    """Sparse attention planned for one forward: the shared metadata, validated, and the launcher.

    Built by :func:`plan_attention`; attributes ``kind``, ``implementation``, ``block_table``, ``req``,
    ``pos``, ``num_tokens``, ``num_kv_heads``, ``predecodes`` (whether the layers its kernel serves are
    predecoded, :meth:`predecode`), ``groups_tokens`` (whether those layers' tiles take regrouped tokens,
    :func:`.gluon_prefill.group_tokens`)."""

    def __init__(self, kind: str, implementation: str, block_table: torch.Tensor, req: torch.Tensor,
                 pos: torch.Tensor, num_kv_heads: int, key_tiles: bool = False, selection_run: int = 1):
        self.kind, self.implementation = kind, implementation
        self.block_table, self.req, self.pos = block_table, req, pos
        self.num_tokens, self.num_kv_heads = pos.shape[0], num_kv_heads
        if implementation == "gluon" and not _gluon_serves(block_table.device):
            raise ValueError(f"{FORCE_ENV}=gluon: the Gluon kernels need an NVIDIA sm_90 GPU and a Triton with "
                             f"Gluon's Hopper API; the plan is for {block_table.device}")
        self._launch = self._launcher(implementation)
        # Gluon and FlyDSL serve the layers whose shape they support; the others fall back to Triton.
        self._supports = None
        if (implementation, kind) in _PARTIAL:
            self._supports, self._fallback = self._module(implementation).supports, self._launcher("triton")
        # A long Gluon prefill predecodes its pages for the layers the Gluon kernel serves. The tiles are allocated
        # at the first such layer, so a forward whose layers all fall back allocates none.
        self.predecodes = False
        if (implementation, kind) == ("gluon", "prefill") and predecode_setting() == "auto":
            from . import triton_predecode

            self.predecodes = triton_predecode.pays(self.num_tokens, block_table, selection_run)
        # Tokens that share their selection already share their tiles' pages: nothing to regroup.
        self.groups_tokens = ((implementation, kind) == ("gluon", "prefill") and selection_run == 1
                              and self.num_tokens >= GROUP_MIN_TOKENS and token_groups_setting() == "auto")
        self._key_tiles = key_tiles
        self._predecoded = None  # the forward's tiles (triton_predecode.Predecoded), once allocated
        self._predecoded_cache = None  # the layer cache they hold

    def predecode(self, cache: torch.Tensor, heads: int, width: int):
        """The forward's predecoded tiles (:class:`.triton_predecode.Predecoded`) holding ``cache``'s pages, or
        ``None`` when this plan does not predecode or its kernel does not serve a layer of ``heads`` query heads
        and ``width`` ids per token. Decodes at the first call for a layer's cache (the same tensor object as
        :meth:`run` gets; the cache must not change between this call and the layer's :meth:`run`): a caller that
        selects with the key tiles calls it after the layer's cache write, and :meth:`run` decodes only for a
        cache not decoded yet."""
        if not self.predecodes or not self._supports(heads, self.num_kv_heads, width):
            return None
        return self._tiles_holding(cache)

    def _tiles_holding(self, cache: torch.Tensor):
        """The forward's tiles holding ``cache``'s pages: allocated at the first call, decoded once per cache."""
        from . import triton_predecode

        if self._predecoded is None:
            self._predecoded = triton_predecode.prepare(self.block_table, self.req, self.pos, self.num_kv_heads,
                                                        self._key_tiles)
        if cache is not self._predecoded_cache:
            triton_predecode.launch(cache, self.block_table, self._predecoded)
            self._predecoded_cache = cache
        return self._predecoded

    def _module(self, implementation: str):
        """The kernel module of ``implementation`` (not the reference) for this plan's kind."""
        name = _PARTIAL.get((implementation, self.kind)) or f"triton_{self.kind}"
        return importlib.import_module(f".{name}", __name__)

    def _launcher(self, implementation: str):
        return _reference_launch if implementation == "reference" else self._module(implementation).launch

    def run(self, q: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, k_scale, v_scale,
            sm_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """One layer: ``q [T, H, 128]`` over ``cache`` with ``block_ids`` int32 ``[Hkv, T, K]``; returns
        ``out [T, H, 128]`` in q's dtype. ``k_scale``/``v_scale`` as normalised by
        :func:`sglang_nvfp4.format.global_scale`. Checks only what differs per layer, on the host: the
        layer's tensors against the plan (the selection may come from any indexer)."""
        t, hkv, device = self.num_tokens, self.num_kv_heads, self.block_table.device
        if q.shape[0] != t or cache.shape[1] != 2 * hkv or q.device != device or cache.device != device:
            raise ValueError(f"run: planned for {t} tokens over {hkv} KV heads on {device}, got q {tuple(q.shape)} "
                             f"on {q.device}, cache {tuple(cache.shape)} on {cache.device}")
        _, h = check_queries(q, hkv)
        width = check_block_ids(block_ids, hkv, t, device)
        fmt.positive_fp32(sm_scale, "sm_scale")
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(scale, torch.Tensor):  # numbers: positive and finite; tensors: unchecked (no host sync)
                fmt.global_scale(scale, name=name)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out: expected {q.dtype} {tuple(q.shape)} on {q.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        launch, options = self._launch, {}
        if self._supports is not None and not self._supports(h, hkv, width):
            launch = self._fallback
        else:
            if self.predecodes:
                options["predecoded"] = self._tiles_holding(cache)
            if self.groups_tokens:
                options["token_groups"] = True
        if launch is _reference_launch:
            return launch(q, cache, block_ids, self.block_table, self.req, self.pos, k_scale, v_scale, sm_scale, out)
        q_in = q if q.stride(-1) == 1 else q.contiguous()
        out_k = out if out.stride(-1) == 1 else torch.empty_like(q_in)
        launch(q_in, cache, block_ids, self.block_table, self.req, self.pos, k_scale, v_scale, float(sm_scale), out_k,
               **options)
        if out_k is not out:
            out.copy_(out_k)
        return out


def plan_attention(kind: str, block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, *,
                   num_kv_heads: int, key_tiles: bool = False, selection_run: int = 1) -> AttentionPlan:
    """Plan sparse attention for one forward. ``kind``: ``"prefill"`` (any tokens) or ``"decode"`` (one
    query token per request); ``block_table`` int32 ``[R, S]``, ``req``/``pos`` int32 ``[T]`` on one
    device, ``req``/``pos`` contiguous (a plan keeps them: CUDA graphs captured with it read them in place;
    see :mod:`sglang_nvfp4.reference`); ``key_tiles``: predecode fp8 key tiles too, when predecoding (for the
    proxy indexer's fp8 scores, :meth:`AttentionPlan.predecode`); ``selection_run``: consecutive tokens that share
    one selection in this forward (1: per token), which sets how many tokens per block-table slot predecoding needs
    (:func:`.triton_predecode.pays`). A predecoding plan decodes each layer's cache
    once, at its first :meth:`~AttentionPlan.predecode` or :meth:`~AttentionPlan.run`, keyed on the cache tensor
    object: a caller must not rewrite a cache it already ran between that layer's calls."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads: must be >= 1, got {num_kv_heads}")
    check_token_metadata(block_table, req, pos, pos.numel(), block_table.device)
    if not (req.is_contiguous() and pos.is_contiguous()):
        raise ValueError("req/pos: must be contiguous (the plan keeps them, no copy)")
    if selection_run < 1:
        raise ValueError(f"selection_run: must be >= 1, got {selection_run}")
    return AttentionPlan(kind, resolve_implementation(block_table.device), block_table, req, pos, num_kv_heads,
                         key_tiles, selection_run)


def _attention(kind, q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out):
    _, _, hkv = validate_sparse_args(q, cache, block_ids, block_table, req, pos)
    k_scale = fmt.global_scale(k_scale, q.device, name="k_scale")
    v_scale = fmt.global_scale(v_scale, q.device, name="v_scale")
    plan = plan_attention(kind, block_table, req.contiguous(), pos.contiguous(), num_kv_heads=hkv)
    return plan.run(q, cache, block_ids, k_scale, v_scale, sm_scale, out)


def sparse_prefill(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out=None):
    """Sparse attention of ``q [T, H, 128]`` over the NVFP4 ``cache``; returns ``out [T, H, 128]`` (q's
    dtype). Validates everything, then plans and runs once."""
    return _attention("prefill", q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out)


def sparse_decode(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out=None):
    """One query token per request (``T`` = batch); same contract as :func:`sparse_prefill`."""
    return _attention("decode", q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out)


def _validate_write_args(cache, slots, k, v) -> None:
    hkv = fmt.check_cache(cache)
    fmt.check_slots(slots)
    for name, t in (("k", k), ("v", v)):
        if t.shape != (slots.shape[0], hkv, fmt.HEAD_DIM) or t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected bf16/fp16/fp32 {(slots.shape[0], hkv, fmt.HEAD_DIM)}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("slots", slots), ("k", k), ("v", v)):
        if t.device != cache.device:
            raise ValueError(f"{name}: on {t.device}, cache on {cache.device}")


def cache_writer(device: torch.device | str):
    """The cache write for ``device``, resolved once (the KV pool asks at start-up): a function
    ``(cache, slots, k, v, k_scale, v_scale, *, one_token_per_byte=False)`` with
    :func:`sglang_nvfp4.format.write_kv`'s contract, the reference itself or the Triton kernel behind the same
    argument checks (it takes ``one_token_per_byte`` on trust: one launch instead of two)."""
    return fmt.write_kv if resolve_implementation(device) == "reference" else _triton_write_kv


def _triton_write_kv(cache, slots, k, v, k_scale, v_scale, *, one_token_per_byte: bool = False) -> None:
    _validate_write_args(cache, slots, k, v)
    from . import triton_write  # FlyDSL has no cache write: Triton serves it on every GPU

    triton_write.launch(
        cache, slots, k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous(),
        fmt.global_scale(k_scale, cache.device, name="k_scale"), fmt.global_scale(v_scale, cache.device, name="v_scale"),
        one_token_per_byte,
    )


def write_kv(cache, slots, k, v, k_scale, v_scale, *, one_token_per_byte: bool = False) -> None:
    """Quantize ``k, v [N, Hkv, 128]`` into ``cache`` at ``slots [N]`` (see :func:`format.write_kv`)."""
    cache_writer(cache.device)(cache, slots, k, v, k_scale, v_scale, one_token_per_byte=one_token_per_byte)
