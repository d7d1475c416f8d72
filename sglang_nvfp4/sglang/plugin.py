"""SGLang plugin (entry point ``sglang.srt.plugins: nvfp4_sparse``): registers ``--attention-backend
nvfp4_sparse`` without a fork of SGLang 0.5.23.

SGLang runs :func:`register` through ``load_plugins()`` in every process (launcher, scheduler,
detokenizer, ``sglang.Engine``). It uses only SGLang's extension points:

* ``add_attention_backend_choices`` / ``register_attention_backend``: the name and its factory;
* ``register_resolution_hook("handle_attention_backend_compatibility")``: start-up rules on the
  server arguments (page size 128 set when unset, clear errors for what the backend cannot serve);
* ``HookRegistry`` AROUND hooks that act only while ``nvfp4_sparse`` is the configured backend:
  ``SRTPlatform.get_kv_pool_cls`` (install :class:`NVFP4TokenToKVPool` for MHA models),
  ``DefaultPoolConfigurator._compute_cell_size`` (size the pool at NVFP4 bytes per token plus the
  indexer's state and SGLang's per-token buffers beyond a stock pool's, so ``max_total_num_tokens`` grows
  ~3.5x over bf16), and
  ``models.utils.enable_fused_set_kv_buffer`` (models that would write bf16 K/V into the cache
  themselves go through the pool instead);
* for MiniMax-M3 (:mod:`.minimax_m3`), two more AROUND hooks that act while ``nvfp4_sparse`` is
  configured: ``KVCacheConfigurator._build_minimax_sparse_kv_pool`` builds the NVFP4 pool (over every
  layer; the index keys live in the learned indexer, sized into the same bytes per token) instead of
  SGLang's bf16 ``MiniMaxSparseKVPool``, and ``attention_registry.attn_backend_wrapper`` leaves this
  backend unwrapped (SGLang would route M3's sparse layers to its own Triton backend);
* one AROUND hook that acts whatever the backend: ``TokenizerManager._validate_one_request``
  (:func:`check_request_inputs`: requests that would crash SGLang 0.5.23's scheduler get HTTP 400).
"""

from __future__ import annotations

import logging
import math

from .. import format as fmt
from . import BACKEND_NAME

logger = logging.getLogger(__name__)
_registered = False


def backend_active() -> bool:
    """Whether the running SGLang process is configured with the ``nvfp4_sparse`` backend."""
    from sglang.srt.runtime_context import attention_backends

    try:
        return BACKEND_NAME in attention_backends()
    except (ValueError, AttributeError, RuntimeError):  # no published server config in this process
        return False


def create_backend(model_runner):
    from .backend import NVFP4SparseAttnBackend

    return NVFP4SparseAttnBackend(model_runner)


def apply_server_arg_rules(server_args) -> None:
    """Start-up rules for ``nvfp4_sparse`` on resolved server arguments: ``--page-size 128`` when
    unset, prefill CUDA graphs off unless breakable ones are chosen (full ones refused), and clear errors
    for what the backend cannot serve, the ``NVFP4_SPARSE_*`` settings included (checked against the
    checkpoint's config, before any weight)."""
    from sglang.srt.arg_groups.overrides import attention_backends_of, declare_resolution, resolved_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    view = resolved_view(server_args)
    prefill, decode = attention_backends_of(view)
    if BACKEND_NAME not in (prefill, decode):
        return
    if prefill != decode:
        raise ValueError(
            f"{BACKEND_NAME} must serve both prefill and decode (they share the NVFP4 KV cache); "
            f"got prefill={prefill!r}, decode={decode!r}"
        )
    if view.page_size is None:
        logger.info("%s: setting --page-size %d (one page = one sparse block)", BACKEND_NAME, fmt.PAGE_SIZE)
        declare_resolution(server_args, "sglang_nvfp4", page_size=fmt.PAGE_SIZE)
    elif view.page_size != fmt.PAGE_SIZE:
        raise ValueError(f"{BACKEND_NAME} needs --page-size {fmt.PAGE_SIZE} (one page = one block), got {view.page_size}")
    if view.speculative_algorithm is not None:
        raise ValueError(f"{BACKEND_NAME} does not support speculative decoding ({view.speculative_algorithm})")
    if view.kv_cache_dtype not in ("auto", None):
        raise ValueError(f"{BACKEND_NAME} stores K/V in NVFP4 itself; leave --kv-cache-dtype auto (got {view.kv_cache_dtype!r})")
    if view.enable_hierarchical_cache:
        raise ValueError(f"{BACKEND_NAME} does not support --enable-hierarchical-cache")
    if view.disaggregation_mode != "null":
        raise ValueError(f"{BACKEND_NAME} does not support PD disaggregation")
    if getattr(view, "enable_hisparse", False):
        raise ValueError(f"{BACKEND_NAME} does not support --enable-hisparse")
    # The NVFP4_SPARSE_* settings, also against the checkpoint's config (a MiniMax-M3 variant this backend
    # does not serve included): here, before any weight loads, a bad value ends the launcher with a clear
    # error (exit code 1).
    from .config import load_config

    config = load_config()
    hf_config = read_model_config(server_args.model_path, getattr(server_args, "trust_remote_code", False))
    if hf_config is not None:
        config.for_model(hf_config)
        shape = model_attention_shape(hf_config)
        if shape is not None:
            config.check_model(*shape)
    # Prefill CUDA graphs. SGLang's breakable backend captures the layers between attention calls and runs
    # attention eagerly on the live batch's metadata, which this backend serves. It stays off unless the user
    # chose it (--cuda-graph-backend-prefill breakable): on the H200 it has not been shown to pay (the one
    # comparison in a single call was not faster than eager), and its capture took 46-97 s of start-up
    # (bench/results/offline_h200.md). SGLang's full backend refreshes extend metadata out of the graph through
    # init_forward_metadata_out_graph, which this backend implements for decode only: refused when chosen.
    prefill_graphs = view.cuda_graph_config.prefill.backend
    chosen = (Phase.PREFILL, "backend") in getattr(server_args, "_cuda_graph_config_locked", set())
    if prefill_graphs == Backend.FULL and chosen:
        raise ValueError(
            f"{BACKEND_NAME} supports --cuda-graph-backend-prefill breakable or disabled (the default with this "
            "backend), not full (its extend metadata is not refreshed outside the graph)"
        )
    if prefill_graphs != Backend.DISABLED and not chosen:
        logger.info("%s: prefill CUDA graphs off (SGLang's default here: %s); --cuda-graph-backend-prefill "
                    "breakable turns them on", BACKEND_NAME, prefill_graphs)
        declare_resolution(
            server_args, "sglang_nvfp4",
            cuda_graph_config=with_phase(view.cuda_graph_config, Phase.PREFILL, backend=Backend.DISABLED),
        )


def read_model_config(model_path: str, trust_remote_code: bool = False):
    """The checkpoint's Hugging Face config (no weights), or ``None`` when it cannot be read at this point;
    the backend checks the built model again."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception:  # not a local checkpoint, or a config transformers cannot parse
        return None


def model_attention_shape(hf_config) -> tuple[int, int, int | None] | None:
    """``(num_layers, head_dim, query heads per KV head or None)`` of a Hugging Face config, or ``None`` when it
    does not say."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers, heads = getattr(text, "num_hidden_layers", None), getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    heads_per_kv = heads // kv_heads if heads and kv_heads and heads % kv_heads == 0 else None
    return (layers, head_dim, heads_per_kv) if layers and head_dim else None


def kv_pool_class_override(kind: str):
    """:class:`NVFP4TokenToKVPool` for MHA models while the backend is active, else ``None``."""
    if kind == "mha" and backend_active():
        from .kv_pool import NVFP4TokenToKVPool

        return NVFP4TokenToKVPool
    return None


# SGLang 0.5.23 allocates, after sizing the pool and with no reserve for them, GPU buffers of one entry per
# pool token: the eager runner's input_ids, positions and out_cache_loc (int64 each) and mrope_positions
# (3 x int64), 48 bytes (model_executor/runner/eager_runner.py, cuda_graph_buffer_registry.py), and the
# paged allocator's free-page list (int64 per page; mem_cache/allocator/paged.py). Stock SGLang leaves those of
# its own pool to the memory outside --mem-fraction-static; the NVFP4 pool holds ~3.5x the tokens, so the
# buffers of the tokens beyond a stock pool's count are charged to the pool (:func:`cell_size_override`).
SGLANG_BYTES_PER_POOL_TOKEN = 6 * 8 + 8 / fmt.PAGE_SIZE


def cell_size_override(kvc, num_layers: int, stock_cell_size: float):
    """Pool bytes per token while the backend is active, else ``None``.

    ``c`` = the NVFP4 cache + the indexer's state per token, ``b`` = SGLang's buffers per pool token
    (:data:`SGLANG_BYTES_PER_POOL_TOKEN`), ``d = stock_cell_size`` = what SGLang's own sizing charges per
    token for this model (its bf16 pool). With ``M`` bytes for the pool, a stock pool holds ``M / d`` tokens
    and leaves their buffers, ``b M / d``, to the memory outside the pool. This pool takes the same share
    from there and charges the buffers of every further token to itself: ``N (c + b) = M + b M / d``, so
    the cost per token is ``(c + b) d / (d + b)``. The memory left for activations is then what stock SGLang
    leaves with its own pool."""
    if not backend_active():
        return None
    from sglang.srt.runtime_context import get_parallel

    from .config import startup_config
    from .kv_pool import bytes_per_token

    parallel = get_parallel()
    heads = kvc.model_config.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size)
    config = startup_config().for_model(kvc.model_config.hf_config)
    state = config.indexer_state_bytes(num_layers, heads, kvc.layer_info.start_layer)
    with_buffers = bytes_per_token(heads, num_layers, state) + SGLANG_BYTES_PER_POOL_TOKEN
    if stock_cell_size <= 0:
        raise ValueError(f"{BACKEND_NAME}: SGLang sized this model's KV cache at {stock_cell_size} bytes per token")
    return math.ceil(with_buffers * stock_cell_size / (stock_cell_size + SGLANG_BYTES_PER_POOL_TOKEN))


def check_request_inputs(obj, input_ids, vocab_size: int) -> None:
    """Requests that crash SGLang 0.5.23's scheduler whatever the attention backend (the server then dies):
    ``ValueError``, which SGLang answers with HTTP 400 naming the value. An empty prompt, a token id
    outside the vocabulary (text-only requests: multimodal ones carry placeholder ids), and
    ``top_logprobs_num`` above the vocabulary size."""
    multimodal = any(getattr(obj, f, None) is not None for f in ("image_data", "video_data", "audio_data"))
    if input_ids is not None and getattr(obj, "input_embeds", None) is None and not multimodal:
        if len(input_ids) == 0:
            raise ValueError("the prompt is empty: a request needs at least one input token")
        lo, hi = min(input_ids), max(input_ids)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})")
    top = getattr(obj, "top_logprobs_num", 0)
    if getattr(obj, "return_logprob", False) and isinstance(top, int) and top > vocab_size:
        raise ValueError(f"top_logprobs_num: {top} is more than the vocabulary's {vocab_size} tokens")


# HookRegistry AROUND hooks and the resolution hook: the plugin's way of applying the rules above.
def _resolve_server_args(server_args, previous) -> None:
    previous(server_args)
    apply_server_arg_rules(server_args)


def _kv_pool_cls(original, platform, *, kind):
    return kv_pool_class_override(kind) or original(platform, kind=kind)


def _cell_size(original, configurator, kvc, num_layers):
    stock = original(configurator, kvc, num_layers)
    override = cell_size_override(kvc, num_layers, stock)
    return stock if override is None else override


def _validate_request(original, manager, obj, input_ids):
    check_request_inputs(obj, input_ids, manager.model_config.vocab_size)
    return original(manager, obj, input_ids)


def _fused_kv_write(original, *args, **kwargs):
    return False if backend_active() else original(*args, **kwargs)


def _minimax_m3_pool(original, configurator, *, max_total_num_tokens):
    if not backend_active():
        return original(configurator, max_total_num_tokens=max_total_num_tokens)
    from .kv_pool import NVFP4TokenToKVPool

    return configurator._build_mha_kv_pool(max_total_num_tokens=max_total_num_tokens,
                                           mha_pool_class=NVFP4TokenToKVPool)


def _attn_backend_wrapper(original, runner, full_attn_backend):
    from .backend import NVFP4SparseAttnBackend

    if isinstance(full_attn_backend, NVFP4SparseAttnBackend):  # serves every layer of M3 itself
        return full_attn_backend
    return original(runner, full_attn_backend)


def register() -> None:
    """Register the backend, its start-up rules and its pool with SGLang (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_backend)
    register_resolution_hook("handle_attention_backend_compatibility")(_resolve_server_args)
    for target, hook in (
        ("sglang.srt.platforms.interface.SRTPlatform.get_kv_pool_cls", _kv_pool_cls),
        ("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size", _cell_size),
        ("sglang.srt.models.utils.enable_fused_set_kv_buffer", _fused_kv_write),
        ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_minimax_sparse_kv_pool",
         _minimax_m3_pool),
        ("sglang.srt.layers.attention.attention_registry.attn_backend_wrapper", _attn_backend_wrapper),
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", _validate_request),
    ):
        HookRegistry.register(target, hook, HookType.AROUND)
    _registered = True


def register_and_apply() -> None:
    """For entry points that parse arguments before SGLang loads plugins (benchmark CLIs)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()
