"""FlashInfer 0.7.2 (the version SGLang 0.5.23 pins) as dense peers of ``bench_kernels.py``: paged prefill
and decode over bf16 K/V (backends ``fa2`` and, for prefill on Hopper, ``fa3``) and over FlashInfer's own
NVFP4 KV cache (``fa2``, the NVFP4 path FlashInfer runs on SM80+).

The caches hold the values of the project's NVFP4 cache (dequantized): the NVFP4 peer re-quantizes them
with :func:`sglang_nvfp4.format.quantize_nvfp4`, which reproduces the same codes and E4M3 scales per 16
dims and token (FlashInfer's NHD layout: codes ``uint8 [pages, 128, Hkv, 64]``, even dim in the low
nibble, scales ``float8_e4m3fn [pages, 128, Hkv, 8]``). So every peer attends the same numbers as ours,
densely, and :func:`max_abs_diff` between peers checks the set-up.

FlashInfer compiles each kernel module with nvcc on first use, when a wrapper plans (cached under
``FLASHINFER_WORKSPACE_BASE``): :class:`FlashInferPeers` records the wall time of every peer's first plan
and run in ``first_call_s`` (the compile included when the module was not in the cache).
"""

from __future__ import annotations

import importlib.util
import time

import torch
from timing import bench_ms, graph_ms

from sglang_nvfp4 import format as fmt

WORKSPACE_BYTES = 256 << 20
PREFILL_PEERS = (("fa2", "bf16"), ("fa3", "bf16"), ("fa2", "nvfp4"))
DECODE_PEERS = (("fa2", "bf16"), ("fa2", "nvfp4"))
QUANTIZE_CHUNK = 1 << 18


def unavailable_reason() -> str | None:
    """Why the FlashInfer peers cannot run here (None: they can)."""
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def paged_caches(k: torch.Tensor, v: torch.Tensor, kinds: set) -> dict:
    """bf16 ``k, v [tokens, Hkv, 128]`` (a multiple of 128 tokens) -> FlashInfer NHD paged caches, pages in
    token order: ``{"bf16": ((k, v), None), "nvfp4": ((k_codes, v_codes), (k_scales, v_scales))}`` for the
    kinds asked for (global scales 1.0; quantized in chunks of ``QUANTIZE_CHUNK`` tokens)."""
    pages = k.shape[0] // fmt.PAGE_SIZE
    shape = (pages, fmt.PAGE_SIZE, k.shape[1])
    out = {}
    if "bf16" in kinds:
        out["bf16"] = ((k.view(*shape, fmt.HEAD_DIM), v.view(*shape, fmt.HEAD_DIM)), None)
    if "nvfp4" in kinds:
        codes, scales = [], []
        for x in (k, v):
            c = torch.empty(*x.shape[:2], fmt.CODE_BYTES, dtype=torch.uint8, device=x.device)
            s = torch.empty(*x.shape[:2], fmt.NUM_GROUPS, dtype=torch.uint8, device=x.device)
            for start in range(0, x.shape[0], QUANTIZE_CHUNK):
                part = slice(start, start + QUANTIZE_CHUNK)
                c[part], s[part] = fmt.quantize_nvfp4(x[part], 1.0)
            codes.append(c.view(*shape, fmt.CODE_BYTES))
            scales.append(s.view(torch.float8_e4m3fn).view(*shape, fmt.NUM_GROUPS))
        out["nvfp4"] = (tuple(codes), tuple(scales))
    return out


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


class FlashInferPeers:
    """The FlashInfer wrappers of one benchmark run, sharing one workspace; ``first_call_s`` maps
    ``"prefill fa3 bf16"``-style names to the wall time of their first plan + run."""

    def __init__(self, device: str = "cuda"):
        import flashinfer

        self.fi = flashinfer
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.first_call_s: dict = {}

    def _first(self, name: str, plan, run) -> None:
        """``plan()`` (FlashInfer compiles here on a cache miss) and one ``run()``, synchronized; the wall
        time goes to ``first_call_s[name]`` the first time."""
        t0 = time.perf_counter()
        plan()
        run()
        torch.cuda.synchronize()
        self.first_call_s.setdefault(name, time.perf_counter() - t0)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, peers=PREFILL_PEERS) -> dict:
        """Causal prefill of one request: ``q [T, H, 128]``, ``k, v [T, Hkv, 128]`` bf16. Returns
        ``{"fa3_bf16": {"ms": ..., "out": tensor}, ...}``; a peer that fails has ``{"error": ...}``."""
        t, heads, hkv = q.shape[0], q.shape[1], k.shape[1]
        pages = t // fmt.PAGE_SIZE
        i32 = dict(dtype=torch.int32, device=self.device)
        caches = paged_caches(k, v, {kind for _, kind in peers})
        results = {}
        for backend, kind in peers:
            name = f"{backend}_{kind}"
            try:
                wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=backend)
                kv, sf = caches[kind]
                plan = lambda: wrapper.plan(  # noqa: E731
                    torch.tensor([0, t], **i32), torch.tensor([0, pages], **i32), torch.arange(pages, **i32),
                    torch.tensor([fmt.PAGE_SIZE], **i32), heads, hkv, fmt.HEAD_DIM, fmt.PAGE_SIZE, causal=True,
                    q_data_type=torch.bfloat16, kv_data_type=torch.uint8 if kind == "nvfp4" else torch.bfloat16,
                    o_data_type=torch.bfloat16)
                out = torch.empty_like(q)
                run = lambda: wrapper.run(q, kv, out=out, kv_cache_sf=sf)  # noqa: E731
                self._first(f"prefill {backend} {kind}", plan, run)
                results[name] = {"ms": bench_ms(run), "out": out}
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is recorded, the others go on
                results[name] = {"error": repr(exc)[:500]}
        return results

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, peers=DECODE_PEERS) -> dict:
        """Dense decode of ``batch`` requests of ``ctx`` tokens each: ``q [batch, H, 128]``, ``k, v
        [batch * ctx, Hkv, 128]`` bf16 (request ``b`` owns tokens ``[b * ctx, (b + 1) * ctx)``), tensor-core
        decode (SGLang's choice for 16 query heads per KV head), timed as CUDA-graph replays."""
        heads, hkv = q.shape[1], k.shape[1]
        pages = k.shape[0] // fmt.PAGE_SIZE
        i32 = dict(dtype=torch.int32, device=self.device)
        indptr = torch.arange(0, pages + 1, pages // batch, **i32)
        caches = paged_caches(k, v, {kind for _, kind in peers})
        results = {}
        for backend, kind in peers:
            name = f"{backend}_{kind}"
            try:
                wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True,
                                                                     backend=backend)
                kv, sf = caches[kind]
                plan = lambda: wrapper.plan(  # noqa: E731
                    indptr, torch.arange(pages, **i32), torch.full((batch,), fmt.PAGE_SIZE, **i32), heads, hkv,
                    fmt.HEAD_DIM, fmt.PAGE_SIZE, q_data_type=torch.bfloat16,
                    kv_data_type=torch.uint8 if kind == "nvfp4" else torch.bfloat16, o_data_type=torch.bfloat16)
                out = torch.empty_like(q)
                run = lambda: wrapper.run(q, kv, out=out, kv_cache_sf=sf)  # noqa: E731
                self._first(f"decode {backend} {kind}", plan, run)
                results[name] = {"ms": graph_ms(run), "out": out}
            except Exception as exc:  # noqa: BLE001
                results[name] = {"error": repr(exc)[:500]}
        return results
