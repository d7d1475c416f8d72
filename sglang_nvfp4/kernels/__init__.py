"""Kernel dispatcher: the only entry point other modules call for attention and cache writes.

``sparse_prefill`` / ``sparse_decode`` follow :func:`sglang_nvfp4.reference.sparse_prefill_reference`
(same arguments and semantics, plus ``out=``); ``write_kv`` follows :func:`sglang_nvfp4.format.write_kv`
bit for bit. The implementation is picked by the tensors' device:

* CPU: the torch reference (exact, slow).
* CUDA and ROCm: the Triton kernels (``triton_prefill``, ``triton_decode``, ``triton_write``).
* ROCm gfx950: FlyDSL for ``sparse_prefill`` when ``sglang_nvfp4.kernels.flydsl`` imports and its
  ``is_available(device)`` is true, for the shapes its ``supports(q, cache, topk)`` accepts; other
  shapes, decode and cache writes stay on Triton.

``NVFP4_SPARSE_KERNEL=reference|triton|flydsl`` forces an implementation on any device (read at each
call). ``triton`` on CPU tensors runs the kernels in Triton's interpreter, which needs
``TRITON_INTERPRET=1`` set before the kernel modules are imported.

Arguments are validated once here: shapes, dtypes and devices, with no device sync on the kernel
paths (the reference path also range-checks the ids, which syncs). The kernels rely on the
reference's preconditions: ids below the block table's width, selected blocks mapped to valid
pages, distinct in-range write slots. Global scales may be floats or one-element tensors; the
kernels read a tensor scale through a pointer, so a fp32 scale on the cache's device keeps CUDA
graphs free of host syncs. Any top-k width ``K >= 1`` is accepted (the kernels pad it to a power of
two); the kernels are tuned for ``K = format.TOPK``.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import format as fmt
from ..reference import sparse_prefill_reference, validate_sparse_args

__all__ = ["sparse_prefill", "sparse_decode", "write_kv", "backend_name"]

FORCE_ENV = "NVFP4_SPARSE_KERNEL"
BACKENDS = ("reference", "triton", "flydsl")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def backend_name(device: torch.device | str) -> str:
    """Which implementation serves ``sparse_prefill`` on ``device``: ``"reference"``, ``"triton"`` or
    ``"flydsl"`` (``NVFP4_SPARSE_KERNEL`` overrides)."""
    device = torch.device(device)
    forced = os.environ.get(FORCE_ENV, "")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{FORCE_ENV}={forced!r}: expected one of {', '.join(BACKENDS)}")
        return forced
    if device.type == "cpu":
        return "reference"
    if device.type == "cuda" and torch.version.hip is None:
        return "triton"
    if device.type == "cuda":  # a ROCm device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return "flydsl" if _flydsl_serves(device) else "triton"
    raise ValueError(f"no sparse-attention kernel for device {device}")


def _check_out(out, q):
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: expected {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _check_scale(name, scale, device):
    """A float passes as is; a tensor must have one element and becomes fp32 on ``device``."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a float or a one-element float tensor, got {scale.dtype} {tuple(scale.shape)}")
        return scale.detach().reshape(1).to(device=device, dtype=torch.float32)
    return float(scale)


def _attention(kind, q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale, out):
    validate_sparse_args(q, cache, topk, block_table, req, pos)
    out = _check_out(out, q)
    impl = backend_name(q.device)
    if impl == "reference":
        out.copy_(sparse_prefill_reference(q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale))
        return out
    k_scale, v_scale = _check_scale("k_scale", k_scale, q.device), _check_scale("v_scale", v_scale, q.device)
    q_in = q if q.stride(-1) == 1 else q.contiguous()
    out_k = out if out.stride(-1) == 1 else torch.empty_like(q_in)
    args = (q_in, cache, topk, block_table, req, pos, k_scale, v_scale, float(sm_scale), out_k)
    if kind == "prefill" and impl == "flydsl":
        from . import flydsl

        impl = "flydsl" if flydsl.supports(q, cache, topk) else "triton"
    if kind == "prefill" and impl == "flydsl":
        flydsl.sparse_prefill(*args)
    elif kind == "prefill":
        from . import triton_prefill

        triton_prefill.launch(*args)
    else:
        from . import triton_decode

        triton_decode.launch(*args)
    if out_k is not out:
        out.copy_(out_k)
    return out


def sparse_prefill(q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale, out=None):
    """Sparse attention of ``q [T, H, 128]`` over the NVFP4 ``cache``; returns ``out [T, H, 128]`` (q's dtype)."""
    return _attention("prefill", q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale, out)


def sparse_decode(q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale, out=None):
    """One query token per request (``T`` = batch); same contract as :func:`sparse_prefill`."""
    return _attention("decode", q, cache, topk, block_table, req, pos, k_scale, v_scale, sm_scale, out)


def _validate_write_args(cache, slots, k, v) -> None:
    hkv = fmt.check_cache(cache)
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots: expected int32/int64 [N], got {slots.dtype} {tuple(slots.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != (slots.shape[0], hkv, fmt.HEAD_DIM) or t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected bf16/fp16/fp32 {(slots.shape[0], hkv, fmt.HEAD_DIM)}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("slots", slots), ("k", k), ("v", v)):
        if t.device != cache.device:
            raise ValueError(f"{name}: on {t.device}, cache on {cache.device}")


def write_kv(cache, slots, k, v, k_scale, v_scale) -> None:
    """Quantize ``k, v [N, Hkv, 128]`` into ``cache`` at ``slots [N]`` (see :func:`format.write_kv`)."""
    impl = backend_name(cache.device)
    if impl == "reference":
        fmt.write_kv(cache, slots, k, v, k_scale, v_scale)
        return
    _validate_write_args(cache, slots, k, v)
    from . import triton_write  # FlyDSL has no cache write: Triton serves it on every GPU

    triton_write.launch(
        cache, slots, k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous(),
        _check_scale("k_scale", k_scale, cache.device), _check_scale("v_scale", v_scale, cache.device),
    )
