"""Kernel dispatcher: the only entry point other modules call for attention and cache writes.

``sparse_prefill`` / ``sparse_decode`` follow :func:`sglang_nvfp4.reference.sparse_prefill_reference`
(same arguments and semantics, plus ``out=``); ``write_kv`` follows :func:`sglang_nvfp4.format.write_kv`
bit for bit. The implementation is picked by the tensors' device:

* CPU: the torch reference (exact, slow).
* CUDA / ROCm: Triton kernels (issue: Triton kernels), FlyDSL on gfx950 when ``flydsl`` imports.

Arguments are validated once here (shapes, dtypes, devices; no device sync on the GPU path), and the
global scales may be floats or one-element fp32 tensors (tensors keep CUDA graphs free of host syncs).
"""

from __future__ import annotations

import torch

from .. import format as fmt
from ..reference import sparse_prefill_reference, validate_sparse_args

__all__ = ["sparse_prefill", "sparse_decode", "write_kv", "backend_name"]


def backend_name(device: torch.device | str) -> str:
    """Which implementation serves tensors on ``device``: ``"reference"``, ``"triton"`` or ``"flydsl"``."""
    device = torch.device(device)
    if device.type == "cpu":
        return "reference"
    raise NotImplementedError(f"no kernel for device {device} yet: the Triton kernels land with their issue")


def _check_out(out, q):
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: expected {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def sparse_prefill(q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale, out=None):
    """Sparse attention of ``q [T, H, 128]`` over the NVFP4 ``cache``; returns ``out [T, H, 128]`` (q's dtype)."""
    validate_sparse_args(q, cache, topk, block_table, req, pos)
    out = _check_out(out, q)
    impl = backend_name(q.device)
    if impl == "reference":
        out.copy_(sparse_prefill_reference(q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale))
        return out
    raise AssertionError(impl)


def sparse_decode(q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale, out=None):
    """One query token per request (``T`` = batch); same contract as :func:`sparse_prefill`."""
    validate_sparse_args(q, cache, topk, block_table, req, pos)
    out = _check_out(out, q)
    impl = backend_name(q.device)
    if impl == "reference":
        out.copy_(sparse_prefill_reference(q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale))
        return out
    raise AssertionError(impl)


def write_kv(cache, slots, k, v, k_scale, v_scale) -> None:
    """Quantize ``k, v [N, Hkv, 128]`` into ``cache`` at ``slots [N]`` (see :func:`format.write_kv`)."""
    impl = backend_name(cache.device)
    if impl == "reference":
        fmt.write_kv(cache, slots, k, v, k_scale, v_scale)
        return
    raise AssertionError(impl)
