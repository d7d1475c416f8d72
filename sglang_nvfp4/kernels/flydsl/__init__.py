"""FlyDSL kernel for AMD gfx950 (MI350/MI355): fused NVFP4 sparse prefill.

The dispatcher calls :func:`is_available` when it plans a forward, then per layer :func:`supports`
(the layer's selection width) and :func:`launch` (arguments already validated against
:func:`sglang_nvfp4.reference.sparse_prefill_reference`'s contract). ``flydsl``
is imported only when a kernel is built, so importing this package never needs it.

Status: compile-verified for gfx950 in this repository's CI (``compile_check``) and modelled
exactly by :mod:`.twin`, which is tested against the reference; not run on hardware here.

Preconditions the kernel relies on (the reference's, not checked on the GPU path): a request's
block table maps distinct blocks to distinct pages, and the block-table entry of every selected
block up to the token's own is a valid page. Selected blocks after the token's own are skipped
(they hold only future keys); -1 ids and duplicate ids are allowed.
"""

from __future__ import annotations

import functools

import torch

from ... import format as fmt
from ...reference import LOG2E
from .geometry import HG, TOK_PER_WG, TOPK

__all__ = ["is_available", "supports", "launch", "ARCH"]

ARCH = "gfx950"


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


def is_available(device) -> bool:
    """True on a ROCm device of arch gfx950 when ``flydsl`` is importable."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is None or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_arch(index) == ARCH and _flydsl_imports()


@functools.lru_cache(maxsize=None)
def _flydsl_imports() -> bool:
    try:
        import flydsl.compiler  # noqa: F401
        import flydsl.expr  # noqa: F401
    except Exception:  # absent, or broken against this torch / ROCm
        return False
    return True


def supports(num_q_heads: int, num_kv_heads: int, width: int) -> bool:
    """Whether the kernel serves this shape: 16 query heads per KV head, at most 16 ids per token."""
    return num_q_heads == HG * num_kv_heads and width <= TOPK


@functools.lru_cache(maxsize=None)
def _launcher(rounds: int, io_dtype: str):
    from .kernel import compile_nvfp4_sparse_prefill  # imports flydsl

    return compile_nvfp4_sparse_prefill(rounds, io_dtype)


@functools.lru_cache(maxsize=None)
def _cu_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale, out):
    """Sparse attention of ``q [T, H, 128]`` over the NVFP4 ``cache`` into ``out``; returns ``out``.

    bf16 and fp16 queries run natively; fp32 queries are rounded to fp16 (the reference's first
    step) and their output passes through fp16. CPU tensors get :func:`.twin.sparse_prefill_twin`."""
    if not supports(q.shape[1], cache.shape[1] // 2, block_ids.shape[2]):
        raise ValueError(
            f"FlyDSL sparse prefill needs H == {HG} * Hkv and <= {TOPK} ids per token, "
            f"got H={q.shape[1]}, Hkv={cache.shape[1] // 2}, K={block_ids.shape[2]}"
        )
    t_all, h = q.shape[0], q.shape[1]
    hkv = fmt.check_cache(cache)
    if t_all == 0:
        return out
    device = q.device
    if device.type == "cpu":  # no kernel to run: its numerics twin answers (slowly)
        from .twin import sparse_prefill_twin

        return out.copy_(sparse_prefill_twin(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale))
    if block_ids.shape[2] < TOPK:
        block_ids = torch.nn.functional.pad(block_ids, (0, TOPK - block_ids.shape[2]), value=-1)
    block_ids, block_table = block_ids.contiguous(), block_table.contiguous()
    req, pos = req.contiguous(), pos.contiguous()
    if q.dtype == torch.float32:
        q_io, out_io, io_dtype = q.half().contiguous(), torch.empty(q.shape, dtype=torch.float16, device=device), "f16"
    else:
        io_dtype = "bf16" if q.dtype == torch.bfloat16 else "f16"
        q_io = q.contiguous()
        out_io = out if out.is_contiguous() else torch.empty_like(q_io)
    ks = fmt.global_scale(k_scale, device, name="k_scale", as_tensor=True).contiguous()
    vs = fmt.global_scale(v_scale, device, name="v_scale", as_tensor=True).contiguous()

    # One workgroup per CU at most: Q^T in registers (rounds=1); otherwise two per CU (rounds=2).
    index = device.index if device.index is not None else torch.cuda.current_device()
    n_wg = -(-t_all // TOK_PER_WG) * hkv
    rounds = 1 if n_wg <= _cu_count(index) else 2
    _launcher(rounds, io_dtype)(
        q_io.data_ptr(), cache.data_ptr(), block_ids.data_ptr(), block_table.data_ptr(), req.data_ptr(),
        pos.data_ptr(), out_io.data_ptr(), ks.data_ptr(), vs.data_ptr(),
        t_all, h, hkv, block_ids.stride(0), block_table.stride(0), cache.stride(0), float(sm_scale) * LOG2E,
        torch.cuda.current_stream(device),
    )
    if out_io is not out:
        out.copy_(out_io)
    return out
