"""NVFP4 KV pool for SGLang: one ``uint8 [pages, 2*Hkv, 128, 72]`` cache per layer behind SGLang's
``MHATokenToKVPool`` interface.

Slots keep SGLang's meaning (``slot = page * 128 + row``; the page size must be 128). K/V handed to
:meth:`set_kv_buffer` are quantized on the way in with the layer's fp32 global scales
(``layer.k_scale_float`` / ``layer.v_scale_float`` when the checkpoint provides them, else 1.0).
There is no bf16 view of this cache: ``get_key_buffer`` & co raise, so nothing can read packed bytes as
if they were bf16; attention reads the cache through :meth:`layer_cache`.

The pool knows nothing of block selection. The backend has its indexer built beside the pool by
:meth:`attach_indexer` (in the pool's KV-cache memory region); the pool then tells it about every write,
move and offload restore, and counts its memory in :meth:`get_kv_size_bytes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from .. import format as fmt
from .. import kernels
from ..indexer import BlockIndexer, StateBytes

logger = logging.getLogger(__name__)


def layer_scales(layer) -> tuple[float, float]:
    """A layer's fp32 global K/V scales: the checkpoint's when it has them, else 1.0."""
    k = getattr(layer, "k_scale_float", None)
    v = getattr(layer, "v_scale_float", None)
    return (1.0 if k is None else float(k)), (1.0 if v is None else float(v))


def bytes_per_token(num_kv_heads: int, num_layers: int, indexer_state: StateBytes) -> float:
    """Pool bytes per token slot, NVFP4 cache plus the indexer's state (for SGLang's memory planner)."""
    return num_layers * num_kv_heads * fmt.BYTES_PER_TOKEN_PER_HEAD + indexer_state.per_slot()


@dataclass
class TokenBackup:
    """What :meth:`NVFP4TokenToKVPool.get_cpu_copy` saves of some tokens, per layer: their exact cache
    bytes (:func:`sglang_nvfp4.format.read_token_records`) and the indexer's per-token state."""

    records: list[torch.Tensor]
    indexer_state: list[torch.Tensor | None]


class NVFP4TokenToKVPool(MHATokenToKVPool):
    """SGLang KV pool storing K/V in the :mod:`sglang_nvfp4.format` layout."""

    def _create_buffers(self):
        if self.head_dim != fmt.HEAD_DIM or self.v_head_dim != fmt.HEAD_DIM:
            raise ValueError(
                f"nvfp4_sparse: head_dim {self.head_dim} / v_head_dim {self.v_head_dim} is not supported "
                f"(the NVFP4 cache layout is for head_dim {fmt.HEAD_DIM})"
            )
        if self.page_size != fmt.PAGE_SIZE:
            raise ValueError(f"nvfp4_sparse: page size {self.page_size} is not supported, use --page-size {fmt.PAGE_SIZE}")
        self.num_pages = -(-(self.size + self.page_size) // fmt.PAGE_SIZE)
        self._indexer: BlockIndexer | None = None  # set by attach_indexer()
        self._write_kv = kernels.cache_writer(self.device)  # resolved once: reference or Triton
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.kv_cache = [fmt.alloc_cache(self.num_pages, self.head_num, self.device) for _ in range(self.layer_num)]
        # K and V halves of each page, for SGLang's size accounting; never read as tokens.
        self.k_buffer = [c[:, : self.head_num] for c in self.kv_cache]
        self.v_buffer = [c[:, self.head_num :] for c in self.kv_cache]
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        self.data_ptrs = self.data_strides = None
        self._kv_buffer_descs = []
        self._log_capacity()

    def _log_capacity(self):
        cache_bytes = sum(c.numel() for c in self.kv_cache)
        bf16_tokens = cache_bytes // (fmt.BF16_BYTES_PER_TOKEN_PER_HEAD * self.head_num * max(self.layer_num, 1))
        logger.info(
            "nvfp4_sparse KV pool: %d tokens (%d pages of %d) in %.2f GiB for %d layers x %d KV heads; "
            "a bf16 pool would hold %d tokens in the same memory (%.2fx)",
            self.size, self.num_pages, fmt.PAGE_SIZE, cache_bytes / 2**30, self.layer_num, self.head_num,
            bf16_tokens, self.size / max(bf16_tokens, 1),
        )

    def attach_indexer(self, build: Callable[[], BlockIndexer]) -> BlockIndexer:
        """The indexer this pool tells about every write, move and restore. The first call runs ``build()``
        in the pool's KV-cache memory region (SGLang's memory saver releases it with the cache); later
        calls return the same indexer, so the backends of one pool share it (two-batch overlap builds
        several)."""
        if self._indexer is None:
            with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
                self._indexer = build()
            # SGLang logged the pool's size and set mem_usage (GB) before the indexer existed.
            state_bytes = self._indexer.state_nbytes()
            self.mem_usage += state_bytes / 2**30
            logger.info("nvfp4_sparse indexer %s: %.3f GiB beside the KV cache",
                        type(self._indexer).__name__, state_bytes / 2**30)
        return self._indexer

    def layer_cache(self, layer_id: int) -> torch.Tensor:
        """The layer's NVFP4 cache ``uint8 [pages, 2*Hkv, 128, 72]``."""
        return self.kv_cache[layer_id - self.start_layer]

    def get_kv_size_bytes(self):
        """(K bytes + the indexer's state, V bytes): SGLang's KV memory accounting."""
        k_bytes, v_bytes = super().get_kv_size_bytes()
        return k_bytes + (self._indexer.state_nbytes() if self._indexer is not None else 0), v_bytes

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None, model_inputs=None, one_token_per_byte=False):
        """Quantize ``cache_k/cache_v [N, Hkv*128]`` (or ``[N, Hkv, 128]``) into the slots of ``loc_info``
        and tell the indexer, with ``model_inputs`` (a dict the backend forwards from the model's attention
        call, e.g. MiniMax-M3's index keys) and ``one_token_per_byte`` (the backend's promise for a decode
        step that no two slots share a V byte: :func:`sglang_nvfp4.kernels.write_kv`); both beyond SGLang's
        signature.

        ``k_scale``/``v_scale`` are ignored: the pool always uses the layer's global scales
        (:func:`layer_scales`) so that writes and attention agree."""
        if dcp_kv_mask is not None:
            raise NotImplementedError("nvfp4_sparse does not support decode context parallelism")
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        ks, vs = layer_scales(layer)
        cache = self.layer_cache(layer_id)
        k = cache_k.view(-1, self.head_num, fmt.HEAD_DIM)
        v = cache_v.view(-1, self.head_num, fmt.HEAD_DIM)
        self._write_kv(cache, loc, k, v, ks, vs, one_token_per_byte=one_token_per_byte)
        if self._indexer is not None:
            self._indexer.on_kv_written(layer_id - self.start_layer, cache, loc, **(model_inputs or {}))

    def _no_plain_view(self, *_args, **_kwargs):
        raise NotImplementedError(
            "nvfp4_sparse: the KV cache is stored as packed NVFP4 ([pages, 2*Hkv, 128, 72] uint8); "
            "there is no bf16 K/V view. Use NVFP4TokenToKVPool.layer_cache(layer_id)."
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = _no_plain_view
    _get_key_buffer = _get_value_buffer = _no_plain_view

    # Whole-token moves and retraction offload copy exact bytes (no requantization).
    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        self._restore(tgt_loc, self._backup(src_loc, to_cpu=False))

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None) -> TokenBackup:
        return self._backup(indices, to_cpu=True)

    def load_cpu_copy(self, kv_cache_cpu: TokenBackup, indices, mamba_indices=None, req_pool_index=None):
        self._restore(indices, kv_cache_cpu)

    def _backup(self, slots: torch.Tensor, *, to_cpu: bool) -> TokenBackup:
        records, state = [], []
        for local_id, cache in enumerate(self.kv_cache):
            records.append(fmt.read_token_records(cache, slots))
            state.append(self._indexer.save_tokens(local_id, slots) if self._indexer is not None else None)
        if to_cpu:
            records = [r.cpu() for r in records]
            state = [None if s is None else s.cpu() for s in state]
        return TokenBackup(records, state)

    def _restore(self, slots: torch.Tensor, backup: TokenBackup) -> None:
        slots = slots.to(self.kv_cache[0].device)
        for local_id, (cache, records, state) in enumerate(zip(self.kv_cache, backup.records, backup.indexer_state)):
            fmt.write_token_records(cache, slots, records)
            if self._indexer is not None:
                self._indexer.restore_tokens(local_id, cache, slots, None if state is None else state.to(cache.device))

    def get_contiguous_buf_infos(self):
        raise NotImplementedError("nvfp4_sparse does not support PD disaggregation KV transfer")
