"""Pure-torch stand-in for the ``sgl_kernel`` CPU helpers SGLang 0.5.23 uses when serving on CPU.

Only on ``PYTHONPATH`` when the real ``sgl_kernel`` is not installed (see ``sglang_nvfp4.cpu_compat``).
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = `` request i's run of ``out_cache_loc``."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every buffer (raw pointer, row stride in bytes): copy row ``src_loc[i]`` to ``tgt_loc[i]``."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            ctypes.memmove(ptr + tgt * stride, ptr + src * stride, stride)


def __getattr__(name: str):
    """Other CPU kernels SGLang imports at start-up (speculative decoding, quantization) but never
    calls when serving a plain model: importable, and a call fails loudly."""
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*_args, **_kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available: this is the pure-torch CPU stand-in")

    unavailable.__name__ = name
    return unavailable
