"""CPU compile check of every Triton kernel the dispatcher sends to an AMD MI355 (gfx950): prefill (the fallback of
the FlyDSL kernel), decode and its split combine, the cache write, and the indexers' kernels.

The kernels are compiled the way a ROCm launch would compile them: each public launcher runs on CPU tensors (which,
like a ROCm device, take the portable path: no inline PTX) with its kernels' launches captured instead of run, and
every captured launch is compiled for gfx950 from its own arguments, with Triton's specialization of them (pointers
16-byte aligned, integers divisible by 16 marked so, integers equal to 1 made constants). Compiled, not run: nobody
here has an MI355. A kernel that no longer compiles for gfx950, or that spills registers to scratch memory there,
fails."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from sglang_nvfp4 import format as fmt
from sglang_nvfp4.indexer import IndexKeys
from sglang_nvfp4.kernels import triton_decode, triton_indexer, triton_prefill, triton_write

GFX950 = GPUTarget("hip", "gfx950", 64)
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
          torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages")


@contextlib.contextmanager
def captured_launches():
    """Within the block, ``kernel[grid](*args, **kwargs)`` records ``(kernel, args, kwargs)`` into the yielded list
    instead of launching."""
    launches = []
    getitem = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda kernel, grid: lambda *args, **kwargs: launches.append((kernel, args, kwargs))
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = getitem


def compile_source(kernel: JITFunction, args: tuple, kwargs: dict) -> tuple[ASTSource, dict]:
    """The ``ASTSource`` and options a launch of ``kernel`` with these arguments compiles."""
    values = dict(zip(kernel.arg_names, args), **{k: v for k, v in kwargs.items() if k not in _OPTIONS})
    signature, constants, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name] if param.name in values else param.default
        if param.is_constexpr or value is None or (type(value) is int and value == 1):
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif type(value) is int:
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{kernel.fn.__name__}: no signature for {param.name} = {value!r}")
    return ASTSource(kernel, signature, constants, attrs), {k: kwargs[k] for k in _OPTIONS if k in kwargs}


def _problem(tokens: int):
    """A small request on shuffled pages: 64 query / 4 KV heads, 8 pages, ``tokens`` tokens of one request."""
    hkv, pages = 4, 8
    cache = fmt.alloc_cache(pages, hkv)
    block_table = torch.randperm(pages, dtype=torch.int32)[None, :].repeat(2, 1)
    req = torch.zeros(tokens, dtype=torch.int32)
    pos = torch.arange(pages * fmt.PAGE_SIZE - tokens, pages * fmt.PAGE_SIZE, dtype=torch.int32)
    q = torch.zeros(tokens, 16 * hkv, fmt.HEAD_DIM, dtype=torch.bfloat16)
    return q, cache, block_table, req, pos


def _launches() -> list[tuple[str, JITFunction, tuple, dict]]:
    """Every kernel launch of the launchers ROCm uses, on problems that take each of their branches."""
    with captured_launches() as launches:
        for tokens, width in ((300, 16), (300, 32), (2, 16), (2, 32)):
            q, cache, block_table, req, pos = _problem(tokens)
            hkv = cache.shape[1] // 2
            ids = torch.zeros(hkv, tokens, width, dtype=torch.int32)
            scale = torch.ones(1)
            if tokens > 2:
                triton_prefill.launch(q, cache, ids, block_table, req, pos, 1.0, 1.0, 0.1, torch.empty_like(q))
            else:
                triton_decode.launch(q, cache, ids, block_table, req, pos, scale, scale, 0.1, torch.empty_like(q))
            if width == 16:
                kv = torch.zeros(tokens, hkv, fmt.HEAD_DIM, dtype=torch.bfloat16)
                triton_write.launch(cache, pos.long(), kv, kv, scale, scale)
                pages = cache.shape[0]
                for bounds in (None, torch.zeros(pages, hkv, 2, fmt.HEAD_DIM, dtype=torch.float16)):
                    triton_indexer.summarize_pages(cache, pos.long(), torch.full((pages,), -1, dtype=torch.int32),
                                                   torch.zeros(pages, hkv, fmt.HEAD_DIM, dtype=torch.float16), bounds,
                                                   torch.zeros(pages, dtype=torch.int32))
                queries = torch.zeros(tokens, hkv, fmt.HEAD_DIM, dtype=torch.float16)
                triton_indexer.select_top_blocks(queries, torch.zeros(pages, hkv, fmt.HEAD_DIM, dtype=torch.float16),
                                                 block_table, req, pos, fmt.TOPK, 1, 1)
                keys = torch.zeros(pages * fmt.PAGE_SIZE, fmt.HEAD_DIM, dtype=torch.bfloat16)
                triton_indexer.select_learned_blocks(torch.zeros(tokens, 4, fmt.HEAD_DIM), keys, block_table, req,
                                                     pos, fmt.TOPK, 1, 1)
                fp8_keys = IndexKeys(pages, dtype=torch.float8_e4m3fn)  # NVFP4_SPARSE_INDEX_KEYS=fp8
                triton_indexer.select_learned_blocks(torch.zeros(tokens, 4, fmt.HEAD_DIM, dtype=torch.bfloat16),
                                                     fp8_keys.keys, block_table, req, pos, fmt.TOPK, 1, 1,
                                                     key_exponents=fp8_keys.exponents)
                triton_indexer.write_fp8_index_keys(fp8_keys.keys, fp8_keys.exponents, pos.long(),
                                                    torch.zeros(tokens, fmt.HEAD_DIM, dtype=torch.bfloat16))
                for fp8 in (False, True):
                    triton_indexer.select_proxy_blocks(queries, cache, block_table, req, pos, fmt.TOPK, 1, 1, fp8=fp8)
    compiled = {}
    for kernel, args, kwargs in launches:
        source, options = compile_source(kernel, args, kwargs)
        key = (kernel.fn.__name__, str(source.signature), str(source.constants), str(options))
        compiled.setdefault(key, (kernel.fn.__name__, source, options))
    return list(compiled.values())


LAUNCHES = _launches()


def test_every_rocm_kernel_is_captured():
    """The launchers above reach every kernel the dispatcher and the indexers send to ROCm."""
    names = {name for name, _, _ in LAUNCHES}
    assert names == {"_plan_tiles_kernel", "_sparse_prefill_kernel", "_sparse_decode_kernel", "_combine_splits_kernel",
                     "_write_kv_kernel", "_summarize_kernel", "_select_kernel", "_key_scores_kernel",
                     "_select_scored_kernel", "_write_fp8_index_keys_kernel"}, names


@pytest.mark.parametrize("name, source, options", LAUNCHES,
                         ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(LAUNCHES)])
def test_compiles_for_gfx950_without_scratch(name, source, options):
    isa = triton.compile(source, target=GFX950, options=options).asm["amdgcn"]
    assert '.amdgcn_target "amdgcn-amd-amdhsa--gfx950' in isa
    scratch = int(re.search(r"\.private_segment_fixed_size:\s+(\d+)", isa).group(1))
    spilled = int(re.search(r"\.vgpr_spill_count:\s+(\d+)", isa).group(1))
    assert scratch == 0 and spilled == 0, f"{name}: {scratch} bytes of scratch, {spilled} VGPRs spilled"
