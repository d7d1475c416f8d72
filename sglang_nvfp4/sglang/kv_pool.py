"""NVFP4 KV pool for SGLang: one ``uint8 [pages, 2*Hkv, 128, 72]`` cache per layer plus the indexer's
block summaries, behind SGLang's ``MHATokenToKVPool`` interface.

Slots keep SGLang's meaning (``slot = page * 128 + row``; the page size must be 128). K/V handed to
:meth:`set_kv_buffer` are quantized on the way in with the layer's fp32 global scales
(``layer.k_scale_float`` / ``layer.v_scale_float`` when the checkpoint provides them, else 1.0).
There is no bf16 view of this cache: ``get_key_buffer`` & co raise, so nothing can read packed bytes as
if they were bf16; attention reads the cache through :meth:`layer_cache`.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from .. import format as fmt
from .. import kernels
from ..indexer import BlockSummaries, SummaryIndexer
from .config import load_config

logger = logging.getLogger(__name__)


def layer_scales(layer) -> tuple[float, float]:
    """A layer's fp32 global K/V scales: the checkpoint's when it has them, else 1.0."""
    k = getattr(layer, "k_scale_float", None)
    v = getattr(layer, "v_scale_float", None)
    return (1.0 if k is None else float(k)), (1.0 if v is None else float(v))


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors an object holds as attributes (block summaries)."""
    return sum(t.nbytes for t in vars(obj).values() if isinstance(t, torch.Tensor))


def bytes_per_token(num_kv_heads: int, num_layers: int, indexer_method: str) -> float:
    """Pool bytes per token slot, cache plus block summaries (for SGLang's memory planner)."""
    one_page = BlockSummaries(1, num_kv_heads, "cpu", minmax=indexer_method == "quest")
    return num_layers * (num_kv_heads * fmt.BYTES_PER_TOKEN_PER_HEAD + _tensor_bytes(one_page) / fmt.PAGE_SIZE)


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
        config = load_config()
        self.num_pages = -(-(self.size + self.page_size) // fmt.PAGE_SIZE)
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.kv_cache = [fmt.alloc_cache(self.num_pages, self.head_num, self.device) for _ in range(self.layer_num)]
            self.indexer = SummaryIndexer(
                self.layer_num, self.num_pages, self.head_num, self.device, method=config.indexer,
                topk=config.topk, sink_blocks=config.sink_blocks, local_blocks=config.local_blocks,
            )
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

    def layer_cache(self, layer_id: int) -> torch.Tensor:
        """The layer's NVFP4 cache ``uint8 [pages, 2*Hkv, 128, 72]``."""
        return self.kv_cache[layer_id - self.start_layer]

    def get_kv_size_bytes(self):
        k_bytes, v_bytes = super().get_kv_size_bytes()
        return k_bytes + sum(_tensor_bytes(s) for s in self.indexer.summaries), v_bytes

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None):
        """Quantize ``cache_k/cache_v [N, Hkv*128]`` (or ``[N, Hkv, 128]``) into the slots of ``loc_info``.

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
        kernels.write_kv(cache, loc, k, v, ks, vs)
        self.indexer.on_kv_written(layer_id - self.start_layer, cache, loc, k)

    def _no_plain_view(self, *_args, **_kwargs):
        raise NotImplementedError(
            "nvfp4_sparse: the KV cache is stored as packed NVFP4 ([pages, 2*Hkv, 128, 72] uint8); "
            "there is no bf16 K/V view. Use NVFP4TokenToKVPool.layer_cache(layer_id)."
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = _no_plain_view
    _get_key_buffer = _get_value_buffer = _no_plain_view

    # Whole-token moves and retraction offload copy exact bytes (no requantization).
    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        records = [fmt.read_token_records(cache, src_loc) for cache in self.kv_cache]
        self._put_records(tgt_loc, records)

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        return [fmt.read_token_records(cache, indices).cpu() for cache in self.kv_cache]

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        self._put_records(indices, kv_cache_cpu)

    def _put_records(self, slots: torch.Tensor, records_per_layer) -> None:
        for local_id, (cache, records) in enumerate(zip(self.kv_cache, records_per_layer)):
            fmt.write_token_records(cache, slots, records)
            # The original K is gone: indexers see the stored K (without the layer's global scale).
            k = fmt.dequantize_nvfp4(records[..., : fmt.SCALE_OFFSET], records[..., fmt.SCALE_OFFSET : fmt.ROW_BYTES], 1.0)
            self.indexer.on_kv_written(local_id, cache, slots, k.to(cache.device))

    def get_contiguous_buf_infos(self):
        raise NotImplementedError("nvfp4_sparse does not support PD disaggregation KV transfer")
