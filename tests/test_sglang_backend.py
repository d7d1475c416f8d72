"""The nvfp4_sparse SGLang backend and pool on CPU: regression tests against dense attention
(SGLang's attention unit-test kit and torch_native on the same pool data), radix-shared pages,
chunked prefill, decode, CUDA-graph metadata, and start-up validation."""

from __future__ import annotations

import json
import math
import unittest
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("sglang.srt")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit  # noqa: E402

from sglang_nvfp4 import format as fmt  # noqa: E402
from sglang_nvfp4.reference import sparse_prefill_reference  # noqa: E402
from sglang_nvfp4.sglang import plugin  # noqa: E402
from sglang_nvfp4.sglang.backend import NVFP4SparseAttnBackend, check_layer_supported  # noqa: E402
from sglang_nvfp4.indexer import StateBytes, all_visible_blocks  # noqa: E402
from sglang_nvfp4.sglang.config import SparseConfig, load_config, startup_config  # noqa: E402
from sglang_nvfp4.sglang.kv_pool import NVFP4TokenToKVPool, bytes_per_token  # noqa: E402

plugin.register()


@pytest.fixture(autouse=True)
def fresh_startup_config():
    """The backend reads its configuration once per process; each test starts a new 'process'."""
    startup_config.cache_clear()
    yield
    startup_config.cache_clear()


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------------------------------------
# A minimal runner: the pools and model facts the backend reads, nothing else.
# ---------------------------------------------------------------------------------------------
class Harness:
    def __init__(self, num_heads=16, num_kv_heads=1, max_context_len=4096, num_reqs=4, num_pages=None, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        num_pages = num_pages or num_reqs * max_context_len // fmt.PAGE_SIZE + 2
        self.req_to_token_pool = ReqToTokenPool(size=num_reqs, max_context_len=max_context_len, device="cpu",
                                                enable_memory_saver=False)
        self.pool = NVFP4TokenToKVPool(size=(num_pages - 1) * fmt.PAGE_SIZE, page_size=fmt.PAGE_SIZE,
                                       dtype=torch.bfloat16, head_num=num_kv_heads, head_dim=fmt.HEAD_DIM,
                                       layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        self.runner = SimpleNamespace(
            device="cpu", req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.pool,
            model_config=SimpleNamespace(context_len=max_context_len, head_dim=128, v_head_dim=128,
                                         is_encoder_decoder=False, num_hidden_layers=1),
            spec_algorithm=SpeculativeAlgorithm.NONE, model=None, is_hybrid_swa=False, sliding_window_size=None,
        )
        self.backend = NVFP4SparseAttnBackend(self.runner)
        self.layer = RadixAttention(num_heads, fmt.HEAD_DIM, fmt.HEAD_DIM**-0.5, num_kv_heads, layer_id=0)
        self.free_pages = torch.randperm(num_pages - 1, generator=self.gen) + 1  # page 0 stays the dummy page

    def take_pages(self, n: int) -> list[int]:
        pages, self.free_pages = self.free_pages[:n].tolist(), self.free_pages[n:]
        return pages

    def map_request(self, row: int, pages: list[int], length: int) -> None:
        pos = torch.arange(length)
        slots = torch.tensor(pages)[pos // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + pos % fmt.PAGE_SIZE
        self.req_to_token_pool.req_to_token[row, :length] = slots.int()

    def qkv(self, n: int):
        h, hkv = self.layer.tp_q_head_num, self.layer.tp_k_head_num
        q = (torch.randn(n, h * 128, generator=self.gen) * 0.5).bfloat16()
        k = torch.randn(n, hkv * 128, generator=self.gen).bfloat16()
        v = torch.randn(n, hkv * 128, generator=self.gen).bfloat16()
        return q, k, v

    def batch(self, mode, rows, seq_lens, extend_lens=None) -> ForwardBatch:
        """A batch whose requests (req_to_token rows) end at ``seq_lens``; the last ``extend_lens``
        tokens are new (decode: one each)."""
        extend_lens = [1] * len(rows) if mode.is_decode() else list(extend_lens)
        prefix = [s - e for s, e in zip(seq_lens, extend_lens)]
        r2t = self.req_to_token_pool.req_to_token
        out_loc = torch.cat([r2t[r, p:s] for r, p, s in zip(rows, prefix, seq_lens)]).long()
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq_lens)])
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(rows), input_ids=torch.zeros(len(out_loc), dtype=torch.long),
            req_pool_indices=torch.tensor(rows, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32), out_cache_loc=out_loc,
            seq_lens_sum=sum(seq_lens), positions=positions,
        )
        if not mode.is_decode():
            fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
            fb.extend_prefix_lens_cpu = prefix
            fb.extend_seq_lens = torch.tensor(extend_lens, dtype=torch.int32)
            fb.extend_seq_lens_cpu = extend_lens
            fb.extend_num_tokens = sum(extend_lens)
        return fb

    def forward(self, fb, q, k, v):
        self.backend.init_forward_metadata(fb)
        with torch.no_grad():
            return self.backend.forward(q, k, v, self.layer, fb)

    def reference(self, fb, q, block_table, req, pos):
        """Independent expectation: the contract's reference, fed metadata built from the test's own
        page lists and the indexer's selection for it."""
        cache = self.pool.layer_cache(0)
        q3 = q.view(-1, self.layer.tp_q_head_num, 128)
        block_ids = self.backend.indexer.select(0, q3, cache, block_table, req, pos)
        return sparse_prefill_reference(q3, cache, block_ids, block_table, req, pos, 1.0, 1.0,
                                        self.layer.scaling).view(len(q), -1)


def table(page_lists) -> torch.Tensor:
    width = max(len(p) for p in page_lists)
    return torch.tensor([p + [0] * (width - len(p)) for p in page_lists], dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# SGLang's attention unit-test kit: dense cases (<= 16 blocks) on shuffled / interleaved pages.
# ---------------------------------------------------------------------------------------------
KIT_CASES = [
    ("extend_prefix_not_aligned", ForwardMode.EXTEND, 16, 2, (130, 0), (50, 300)),
    ("extend_page_edges", ForwardMode.EXTEND, 16, 1, (0, 0, 128), (127, 128, 129)),
    ("extend_gqa8", ForwardMode.EXTEND, 8, 1, (200,), (100,)),
    ("decode_page_boundary", ForwardMode.DECODE, 16, 2, (127, 128, 255), ()),
]


# The kit's third layout, non_monotonic_extend, stores tokens off their in-page offset; SGLang's paged
# allocator (page size 128 here) never does, and the block table relies on slot % 128 == pos % 128.
@pytest.mark.parametrize("layout", ["shuffled_pages", "interleaved_pages"])
@pytest.mark.parametrize("name, mode, heads, kv_heads, prefix, extend", KIT_CASES)
def test_kit_dense_cases_match_dense_attention(layout, name, mode, heads, kv_heads, prefix, extend):
    case = kit.DenseAttentionCase(name=name, backend=plugin.BACKEND_NAME, forward_mode=mode, num_heads=heads,
                                  num_kv_heads=kv_heads, page_size=fmt.PAGE_SIZE, prefix_lens=prefix,
                                  extend_lens=extend)
    with torch.no_grad(), mock.patch.object(kit, "MHATokenToKVPool", NVFP4TokenToKVPool):
        fx = kit.build_dense_attention_fixture(unittest.TestCase(), case, head_dim=128, hidden_size=64,
                                               max_context_len=1024, dtype=torch.bfloat16, device="cpu",
                                               loc_layout=layout)
        assert isinstance(fx.backend, NVFP4SparseAttnBackend)
        # The kit's own end-to-end check, at NVFP4 tolerance (exact dense attention on bf16 K/V).
        out = kit.run_dense_fixture_eager(fx)
        assert rel_err(out, kit.expected_dense_fixture_output(fx)) < 0.2
        # Same pool data: torch_native over the dequantized cache must agree to fp16 rounding.
        q, k, v = fx.actual_module.project_qkv(fx.input_hidden)
        ours = fx.backend.forward(q, k, v, fx.actual_module.attn, fx.forward_batch)
        ks, vs = fmt.read_kv(fx.runner.token_to_kv_pool.layer_cache(0),
                             torch.arange(fx.runner.token_to_kv_pool.num_pages), 1.0, 1.0)
        plain = SimpleNamespace(
            get_key_buffer=lambda _: ks.transpose(1, 2).reshape(-1, kv_heads, 128),
            get_value_buffer=lambda _: vs.transpose(1, 2).reshape(-1, kv_heads, 128),
        )
        native = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=fx.runner.req_to_token_pool,
                                                        token_to_kv_pool=plain))
        native.init_forward_metadata(fx.forward_batch)
        dense = native.forward(q.float(), None, None, fx.actual_module.attn, fx.forward_batch, save_kv_cache=False)
    assert rel_err(ours, dense) < 1e-2


# ---------------------------------------------------------------------------------------------
# Sparse selection, radix-shared pages, chunked prefill, decode.
# ---------------------------------------------------------------------------------------------
def test_sparse_prefill_with_prefix_matches_reference_on_independent_metadata(monkeypatch):
    monkeypatch.setenv("NVFP4_SPARSE_TOPK", "16")  # 21 blocks: a sparse selection
    h = Harness(num_kv_heads=2, seed=1)
    lens, prefixes = [2600, 900], [1000, 0]
    pages = [h.take_pages(-(-n // 128)) for n in lens]
    for row, (p, n) in enumerate(zip(pages, lens)):
        h.map_request(row, p, n)
    q0, k0, v0 = h.qkv(prefixes[0])  # the cached prefix (radix hit / earlier chunk)
    h.forward(h.batch(ForwardMode.EXTEND, [0], [prefixes[0]], [prefixes[0]]), q0, k0, v0)
    fb = h.batch(ForwardMode.EXTEND, [0, 1], lens, [n - p for n, p in zip(lens, prefixes)])
    q, k, v = h.qkv(int(fb.extend_num_tokens))
    out = h.forward(fb, q, k, v)
    req = torch.cat([torch.full((n - p,), r) for r, (n, p) in enumerate(zip(lens, prefixes))]).int()
    pos = torch.cat([torch.arange(p, n) for n, p in zip(lens, prefixes)]).int()
    want = h.reference(fb, q, table(pages), req, pos)
    assert torch.equal(out, want)
    assert (h.backend.indexer.select(0, q.view(-1, 16, 128), h.pool.layer_cache(0), table(pages), req, pos) >= 0).sum(-1).max() == 16


def test_radix_shared_prefix_pages_read_identical_data():
    h = Harness(num_kv_heads=1, seed=2)
    shared = h.take_pages(3)  # 384 tokens of prefix, cached once
    h.map_request(0, shared, 384)
    h.forward(h.batch(ForwardMode.EXTEND, [0], [384], [384]), *h.qkv(384))
    tails = [h.take_pages(2), h.take_pages(2)]
    for row, tail in ((1, tails[0]), (2, tails[1])):
        h.map_request(row, shared + tail, 384 + 200)
    q, k, v = h.qkv(200)
    fb = h.batch(ForwardMode.EXTEND, [1, 2], [584, 584], [200, 200])
    out = h.forward(fb, torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]))
    assert rel_err(out[:200], out[200:]) < 2e-3  # same data; only float summation order differs
    assert torch.isfinite(out.float()).all() and out.abs().sum() > 0


def test_chunked_prefill_equals_one_shot_prefill():
    n, cut = 2300, 1000  # the second chunk starts mid-page
    one, chunked = Harness(num_kv_heads=2, seed=3), Harness(num_kv_heads=2, seed=3)
    q, k, v = one.qkv(n)
    for h in (one, chunked):
        h.map_request(0, h.take_pages(-(-n // 128)), n)
    full = one.forward(one.batch(ForwardMode.EXTEND, [0], [n], [n]), q, k, v)
    first = chunked.forward(chunked.batch(ForwardMode.EXTEND, [0], [cut], [cut]), q[:cut], k[:cut], v[:cut])
    second = chunked.forward(chunked.batch(ForwardMode.EXTEND, [0], [n], [n - cut]), q[cut:], k[cut:], v[cut:])
    assert torch.equal(one.pool.layer_cache(0), chunked.pool.layer_cache(0))
    torch.testing.assert_close(torch.cat([first, second]), full, rtol=0, atol=2e-2)


@pytest.mark.parametrize("dense_layers", ["", "0"])
def test_decode_after_prefill_matches_reference_and_graph_metadata_path(monkeypatch, dense_layers):
    monkeypatch.setenv("NVFP4_SPARSE_DENSE_LAYERS", dense_layers)
    h = Harness(num_kv_heads=2, seed=4)
    lens = [2100, 300, 127]  # 17 blocks for the first request (dense != sparse); the last crosses a block
    pages = [h.take_pages(-(-(n + 2) // 128)) for n in lens]
    for row, (p, n) in enumerate(zip(pages, lens)):
        h.map_request(row, p, n + 2)
        h.forward(h.batch(ForwardMode.EXTEND, [row], [n], [n]), *h.qkv(n))
    h.backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    for step in range(2):  # the second step reuses the batch size's graph metadata, refreshed in place
        seq_lens = [n + 1 + step for n in lens]
        fb = h.batch(ForwardMode.DECODE, [0, 1, 2], seq_lens)
        q, k, v = h.qkv(3)
        cache_before = h.pool.layer_cache(0).clone()
        eager = h.forward(fb, q, k, v)
        pos = torch.tensor(seq_lens).int() - 1
        if dense_layers:
            ids = all_visible_blocks(pos, table(pages).shape[1]).expand(2, -1, -1)
            want = sparse_prefill_reference(q.view(3, 16, 128), h.pool.layer_cache(0), ids, table(pages),
                                            torch.arange(3).int(), pos, 1.0, 1.0, h.layer.scaling).view(3, -1)
        else:
            want = h.reference(fb, q, table(pages), torch.arange(3).int(), pos)
        assert torch.equal(eager, want)
        # CUDA-graph metadata path (static buffers refreshed in place), padded to 4 rows.
        h.pool.layer_cache(0).copy_(cache_before)
        padded = h.batch(ForwardMode.DECODE, [0, 1, 2, 0], seq_lens + [1])
        padded.req_pool_indices[3] = 0
        padded.out_cache_loc[3] = 0  # SGLang's padded rows write the dummy slot 0 (page 0 is never handed out)
        h.backend.init_forward_metadata_out_graph(padded, in_capture=False)
        with torch.no_grad():
            graphed = h.backend.forward(torch.cat([q, q[:1]]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]]),
                                        h.layer, padded)
        assert torch.equal(graphed[:3], eager)
    assert h.backend.get_cuda_graph_seq_len_fill_value() == 1


def test_dense_layers_attend_every_visible_block(monkeypatch):
    monkeypatch.setenv("NVFP4_SPARSE_DENSE_LAYERS", "0")
    monkeypatch.setenv("NVFP4_SPARSE_TOPK", "16")
    h = Harness(num_kv_heads=1, seed=5)
    n = 2700  # 22 blocks: more than TOPK
    pages = h.take_pages(22)
    h.map_request(0, pages, n)
    q, k, v = h.qkv(n)
    out = h.forward(h.batch(ForwardMode.EXTEND, [0], [n], [n]), q, k, v)
    pos = torch.arange(n).int()
    ids = torch.arange(22).int()
    dense = torch.where(ids[None] <= (pos // 128)[:, None], ids[None], -1)[None].contiguous()
    want = sparse_prefill_reference(q.view(n, 16, 128), h.pool.layer_cache(0), dense, table([pages]),
                                    torch.zeros(n, dtype=torch.int32), pos, 1.0, 1.0, h.layer.scaling)
    assert torch.equal(out, want.view(n, -1))


# ---------------------------------------------------------------------------------------------
# Pool: capacity accounting, no bf16 view, exact moves and offload.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["mean", "quest", "proxy"])
def test_pool_bytes_per_token_and_capacity_vs_bf16(method, monkeypatch):
    per_token = bytes_per_token(4, 3, load_config({"NVFP4_SPARSE_INDEXER": method}).indexer_state_bytes(3, 4))
    assert 3 * 4 * 144 <= per_token < 3 * 4 * 151
    assert 3 * 4 * 512 / per_token >= 3.4
    monkeypatch.setenv("NVFP4_SPARSE_INDEXER", method)
    h = Harness(num_kv_heads=2)
    k_bytes, v_bytes = h.pool.get_kv_size_bytes()
    assert v_bytes == h.pool.num_pages * 2 * 128 * 72  # Hkv=2
    assert k_bytes == v_bytes + h.backend.indexer.state_nbytes()  # K also counts the summaries
    assert (k_bytes > v_bytes) == (method != "proxy")  # the proxy keeps none: it scores the cached keys


def test_pool_sizing_leaves_stock_sglangs_memory_outside_the_pool(monkeypatch):
    """SGLang sizes the pool with this cost per token; its buffers of 48 B per pool token (and the allocator's
    free-page list) come after the pool. Stock SGLang leaves its own pool's to the memory outside the pool; the
    NVFP4 pool holds ~3.5x the tokens and charges the buffers of the extra tokens to itself (a 2-layer,
    1-KV-head model ran out of memory at start-up on the H200 when none were charged): pool plus buffers take
    no more than stock SGLang's pool plus buffers."""
    from sglang.srt import runtime_context

    monkeypatch.setenv("NVFP4_SPARSE_INDEXER", "quest")  # an indexer with per-page state, charged per token too
    monkeypatch.setattr(plugin, "backend_active", lambda: True)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: SimpleNamespace(attn_tp_size=1, attn_dcp_size=1))
    kvc = SimpleNamespace(model_config=SimpleNamespace(get_num_kv_heads=lambda tp, dcp: 1,
                                                       hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])),
                          layer_info=SimpleNamespace(start_layer=0))
    cache_and_summaries = 2 * 144 + 2 * (128 * 2 * 3 + 8) / 128  # 2 layers, 1 KV head, quest summaries
    buffers, stock = 48 + 8 / 128, 2 * 512  # SGLang's per-token buffers; its bf16 cost for this model
    cell = plugin.cell_size_override(kvc, 2, stock)
    assert cell == math.ceil((cache_and_summaries + buffers) * stock / (stock + buffers))
    budget = 10 * 2**30  # bytes SGLang gives the pool
    tokens, stock_tokens = budget // cell, budget // stock
    assert tokens * (cache_and_summaries + buffers) <= budget + stock_tokens * buffers  # what stock SGLang takes
    assert tokens > budget // math.ceil(cache_and_summaries + buffers)  # more than charging every token's buffers
    with pytest.raises(ValueError, match="bytes per token"):
        plugin.cell_size_override(kvc, 2, 0)
    monkeypatch.setattr(plugin, "backend_active", lambda: False)
    assert plugin.cell_size_override(kvc, 2, stock) is None


def test_pool_has_no_plain_kv_view():
    h = Harness()
    for fn in (h.pool.get_key_buffer, h.pool.get_value_buffer, h.pool.get_kv_buffer):
        with pytest.raises(NotImplementedError, match="no bf16"):
            fn(0)


def test_pool_moves_and_offload_copy_exact_bytes(monkeypatch):
    monkeypatch.setenv("NVFP4_SPARSE_INDEXER", "quest")  # an indexer with per-page state that must move too
    h = Harness(num_kv_heads=2, seed=6)
    h.map_request(0, h.take_pages(2), 200)
    h.forward(h.batch(ForwardMode.EXTEND, [0], [200], [200]), *h.qkv(200))
    src = h.req_to_token_pool.req_to_token[0, :200].long()
    dst_page = h.take_pages(2)
    dst = (torch.tensor(dst_page)[torch.arange(200) // 128] * 128 + torch.arange(200) % 128).long()
    h.pool.move_kv_cache(dst, src)
    cache = h.pool.layer_cache(0)
    assert torch.equal(fmt.read_token_records(cache, dst), fmt.read_token_records(cache, src))
    summaries = h.backend.indexer.summaries[0]
    assert torch.equal(summaries.mean[dst_page[0]], summaries.mean[int(src[0]) // 128])
    saved = h.pool.get_cpu_copy(src)
    cache[int(src[0]) // 128].zero_()
    h.pool.load_cpu_copy(saved, src)
    assert torch.equal(fmt.read_token_records(cache, src), saved.records[0])


class SlotStampIndexer:
    """A model-provided indexer in miniature: per-token state (a stamp per slot, from the model's own
    ``idx_k`` input) that must follow its tokens through moves and offload; selects block 0 and the own
    block, and records the model inputs it was given."""

    def __init__(self, num_layers, num_pages, num_kv_heads, device, *, topk):
        self.topk = topk
        self.stamp = torch.zeros(num_pages * fmt.PAGE_SIZE, dtype=torch.int32, device=device)
        self.seen_inputs = []

    @staticmethod
    def state_bytes(num_layers, num_kv_heads, **options):
        return StateBytes(per_token=4)

    def state_nbytes(self) -> int:
        return self.stamp.nbytes

    def on_kv_written(self, layer_id, cache, slots, **model_inputs):
        self.seen_inputs.append(("write", sorted(model_inputs)))
        self.stamp[slots.long()] = model_inputs["idx_k"]

    def save_tokens(self, layer_id, slots):
        return self.stamp[slots.long()].clone()

    def restore_tokens(self, layer_id, cache, slots, saved):
        self.stamp[slots.long()] = saved

    def select(self, layer_id, q, cache, block_table, req, pos, **model_inputs):
        self.seen_inputs.append(("select", sorted(model_inputs)))
        own = (pos // fmt.PAGE_SIZE)[None, :, None]
        ids = torch.cat([torch.zeros_like(own), own], dim=-1)
        return torch.where((ids == 0) & (own > 0), ids, torch.where(ids == own, ids, -1)).int().expand(
            fmt.check_cache(cache), -1, -1).contiguous()


def test_a_model_indexer_plugs_in_without_touching_pool_or_kernels(monkeypatch):
    """Configured as the indexer kind, a model-provided indexer is sized into the pool, built by the backend
    (and shared by a second backend of the pool), gets the model's attention inputs on writes and selections,
    sees its per-token state follow moves and offload, and the kernels attend its selection."""
    monkeypatch.setattr(SparseConfig, "indexer_kind", lambda self, *layers: (SlotStampIndexer, {"topk": 2}))
    config = load_config({})
    assert bytes_per_token(1, 2, config.indexer_state_bytes(2, 1)) == 2 * 144 + 4
    h = Harness(num_kv_heads=1, seed=9)
    stamp = h.backend.indexer
    assert isinstance(stamp, SlotStampIndexer) and NVFP4SparseAttnBackend(h.runner).indexer is stamp
    n = 300
    pages = h.take_pages(3)
    h.map_request(0, pages, n)
    q, k, v = h.qkv(n)
    fb = h.batch(ForwardMode.EXTEND, [0], [n], [n])
    h.backend.init_forward_metadata(fb)
    idx_k = torch.arange(n, dtype=torch.int32) + 7
    with torch.no_grad():
        idx_o, out = h.backend.forward(q, k, v, h.layer, fb, idx_q=torch.zeros(n, 4, 128), idx_k=idx_k, idx_v=None)
    assert idx_o is None  # an attention call with idx_q (MiniMax-M3) gets (idx_o, output) back
    assert stamp.seen_inputs == [("write", ["idx_k", "idx_q"]), ("select", ["idx_k", "idx_q"])]
    src = h.req_to_token_pool.req_to_token[0, :n].long()
    assert torch.equal(stamp.stamp[src], idx_k)
    pos = torch.arange(n, dtype=torch.int32)
    ids = stamp.select(0, None, h.pool.layer_cache(0), None, None, pos)
    ids = torch.nn.functional.pad(ids, (0, fmt.TOPK - 2), value=-1)  # what the backend hands the kernels
    want = sparse_prefill_reference(q.view(n, 16, 128), h.pool.layer_cache(0), ids, table([pages]),
                                    torch.zeros(n, dtype=torch.int32), pos, 1.0, 1.0, h.layer.scaling)
    assert torch.equal(out, want.view(n, -1))
    dst_pages = h.take_pages(3)
    dst = (torch.tensor(dst_pages)[torch.arange(n) // 128] * 128 + torch.arange(n) % 128).long()
    h.pool.move_kv_cache(dst, src)
    assert torch.equal(stamp.stamp[dst], idx_k)
    saved = h.pool.get_cpu_copy(src)
    stamp.stamp[src] = 0
    h.pool.load_cpu_copy(saved, src)
    assert torch.equal(stamp.stamp[src], idx_k)
    assert h.pool.get_kv_size_bytes()[0] == h.pool.num_pages * 128 * 72 + stamp.stamp.nbytes


class KeyTileIndexer(SlotStampIndexer):
    """:class:`SlotStampIndexer` asking for predecoded key tiles (as the fp8 ProxyIndexer does); records them."""

    wants_key_tiles = True
    selection_run = 4  # as a ProxyIndexer with share 4

    def select(self, layer_id, q, cache, block_table, req, pos, key_tiles=None, **model_inputs):
        self.seen_inputs.append(("select key_tiles", key_tiles))
        return super().select(layer_id, q, cache, block_table, req, pos, **model_inputs)


def test_predecoded_key_tiles_reach_an_indexer_that_wants_them(monkeypatch):
    """The backend plans a forward with key tiles when its indexer wants them and with its selection runs, has the
    plan predecode each layer after the layer's cache write (the tiles then hold the written keys), and hands the
    layer's key tiles to the selection. CPU plans never predecode, so the plan's ``predecode`` is replaced by one that
    records its call."""
    from sglang_nvfp4 import kernels

    monkeypatch.setattr(SparseConfig, "indexer_kind", lambda self, *layers: (KeyTileIndexer, {"topk": 2}))
    plan_attention, seen, tiles = kernels.plan_attention, {}, torch.empty(0)

    def recording_plan(*args, key_tiles=False, selection_run=1, **kwargs):
        plan = plan_attention(*args, key_tiles=key_tiles, selection_run=selection_run, **kwargs)
        seen["planned_with_key_tiles"], seen["selection_run"] = key_tiles, selection_run

        def predecode(cache, heads, width):
            seen.setdefault("cache_at_predecode", cache.clone())  # the first call's
            seen["heads"], seen["width"] = heads, width
            return SimpleNamespace(key_tiles=tiles)

        plan.predecode = predecode
        return plan

    monkeypatch.setattr(kernels, "plan_attention", recording_plan)
    h = Harness(num_kv_heads=1, seed=10)
    n = 300
    h.map_request(0, h.take_pages(3), n)
    q, k, v = h.qkv(n)
    fb = h.batch(ForwardMode.EXTEND, [0], [n], [n])
    h.backend.init_forward_metadata(fb)
    with torch.no_grad():
        h.backend.forward(q, k, v, h.layer, fb, idx_q=torch.zeros(n, 4, 128), idx_k=torch.arange(n, dtype=torch.int32))
    assert seen["planned_with_key_tiles"] is True and seen["selection_run"] == 4
    assert torch.equal(seen["cache_at_predecode"], h.pool.layer_cache(0))  # the keys were written before
    assert (seen["heads"], seen["width"]) == (16, fmt.TOPK)
    given = [value for name, value in h.backend.indexer.seen_inputs if name == "select key_tiles"]
    assert len(given) == 1 and given[0] is tiles


# ---------------------------------------------------------------------------------------------
# Start-up validation and configuration.
# ---------------------------------------------------------------------------------------------
def test_backend_refuses_a_plain_pool():
    h = Harness()
    runner = SimpleNamespace(**{**vars(h.runner), "token_to_kv_pool": object()})
    with pytest.raises(ValueError, match="NVFP4TokenToKVPool"):
        NVFP4SparseAttnBackend(runner)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(logit_cap=30.0), "logit"), (dict(sliding_window_size=512), "sliding"), (dict(is_cross_attention=True), "causal")],
)
def test_unsupported_layers_fail_at_startup(kwargs, match):
    layer = RadixAttention(16, 128, 0.1, 1, layer_id=3, **kwargs)
    with pytest.raises(ValueError, match=match):
        check_layer_supported(layer)


def test_unsupported_head_dim_fails_at_startup():
    h = Harness()
    runner = SimpleNamespace(**{**vars(h.runner), "model_config": SimpleNamespace(
        context_len=4096, head_dim=64, v_head_dim=64, is_encoder_decoder=False, num_hidden_layers=1)})
    with pytest.raises(ValueError, match="head_dim"):
        NVFP4SparseAttnBackend(runner)


@pytest.mark.parametrize(
    "env, match",
    [({"NVFP4_SPARSE_TOPK": "65"}, r"TOPK=65: expected 1\.\.64"), ({"NVFP4_SPARSE_TOPK": "0"}, "TOPK"),
     ({"NVFP4_SPARSE_TOPK": "x"}, "TOPK"),
     ({"NVFP4_SPARSE_INDEXER": "oracle"}, "INDEXER"), ({"NVFP4_SPARSE_SINK_BLOCKS": "32"}, "SINK"),
     ({"NVFP4_SPARSE_DENSE_LAYERS": "1,a"}, "DENSE_LAYERS"), ({"NVFP4_SPARSE_KERNEL": "bogus"}, "KERNEL"),
     ({"NVFP4_SPARSE_PREDECODE": "on"}, "PREDECODE='on'"), ({"NVFP4_SPARSE_TOKEN_GROUPS": "on"}, "GROUPS='on'")],
)
def test_bad_configuration_names_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        load_config(env)


def test_budgets_up_to_64_blocks():
    config = load_config({"NVFP4_SPARSE_TOPK": "64", "NVFP4_SPARSE_SINK_BLOCKS": "2", "NVFP4_SPARSE_LOCAL_BLOCKS": "8"})
    assert (config.topk, config.sink_blocks, config.local_blocks) == (64, 2, 8)
    assert config.indexer_kind(0, 2)[1]["topk"] == 64


def test_settings_checked_against_the_model():
    load_config({"NVFP4_SPARSE_DENSE_LAYERS": "0,1"}).check_model(num_layers=2, head_dim=128)
    with pytest.raises(ValueError, match=r"DENSE_LAYERS: layer ids \[2, 99\] are beyond the model's 2 layers"):
        load_config({"NVFP4_SPARSE_DENSE_LAYERS": "1,2,99"}).check_model(num_layers=2, head_dim=128)
    with pytest.raises(ValueError, match="head_dim 64"):
        load_config({}).check_model(num_layers=2, head_dim=128 // 2)
    proxy4 = load_config({"NVFP4_SPARSE_INDEXER": "proxy", "NVFP4_SPARSE_PROXY_GROUPS": "4"})
    proxy4.check_model(num_layers=2, head_dim=128, heads_per_kv=16)
    with pytest.raises(ValueError, match="PROXY_GROUPS=4: must divide the model's 6 query heads per KV head"):
        proxy4.check_model(num_layers=2, head_dim=128, heads_per_kv=6)


@pytest.mark.parametrize("env, config_edit, match", [
    ({"NVFP4_SPARSE_TOPK": "0"}, {}, "NVFP4_SPARSE_TOPK=0"),
    ({"NVFP4_SPARSE_TOPK": "abc"}, {}, "NVFP4_SPARSE_TOPK='abc'"),
    ({"NVFP4_SPARSE_INDEXER": "bogus"}, {}, "NVFP4_SPARSE_INDEXER='bogus'"),
    ({"NVFP4_SPARSE_SINK_BLOCKS": "32"}, {}, "NVFP4_SPARSE_SINK_BLOCKS=32"),
    ({"NVFP4_SPARSE_DENSE_LAYERS": "-1"}, {}, "NVFP4_SPARSE_DENSE_LAYERS"),
    ({"NVFP4_SPARSE_DENSE_LAYERS": "99"}, {}, "beyond the model's 2 layers"),
    ({"NVFP4_SPARSE_KERNEL": "bogus"}, {}, "NVFP4_SPARSE_KERNEL='bogus'"),
    ({}, {"head_dim": 64}, "head_dim 64"),
    ({"NVFP4_SPARSE_INDEXER": "proxy", "NVFP4_SPARSE_PROXY_GROUPS": "3"}, {}, "PROXY_GROUPS=3: must divide"),
])
def test_bad_settings_fail_when_the_server_arguments_resolve(tmp_path, monkeypatch, env, config_edit, match):
    """Where SGLang resolves the server arguments: in the launcher, before any weight is loaded."""
    from sglang.srt.server_args import prepare_server_args

    from sglang_nvfp4.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path), weights=False)
    with open(f"{model}/config.json") as f:
        hf_config = {**json.load(f), **config_edit}
    with open(f"{model}/config.json", "w") as f:
        json.dump(hf_config, f)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        args = prepare_server_args(["--model-path", model, "--device", "cpu", "--attention-backend", "nvfp4_sparse"])
        args.resolve_once()


@pytest.mark.parametrize("choice, expected", [
    ([], "disabled"),
    (["--cuda-graph-backend-prefill", "breakable"], "breakable"),
    (["--cuda-graph-config", '{"prefill": {"backend": "breakable"}}'], "breakable"),
    (["--cuda-graph-backend-prefill", "disabled"], "disabled"),
    (["--disable-prefill-cuda-graph"], "disabled"),
    (["--cuda-graph-backend-prefill", "full"], ValueError),
])
def test_prefill_cuda_graphs_off_by_default_breakable_when_chosen_full_refused(tmp_path, monkeypatch, choice,
                                                                               expected):
    """SGLang's default on CUDA (breakable; stood in for here, this host has no CUDA) is turned off; a breakable
    or disabled choice is kept (breakable runs attention eagerly between captured segments); full graphs, which
    refresh extend metadata through a hook this backend serves for decode only, are refused at start-up."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.model_executor import cuda_graph_config
    from sglang.srt.server_args import prepare_server_args

    from sglang_nvfp4.tiny_model import make_tiny_model

    monkeypatch.setattr(cuda_graph_config, "default_prefill_backend", lambda: cuda_graph_config.Backend.BREAKABLE)
    model = make_tiny_model(str(tmp_path), weights=False)

    def resolve(backend):
        args = prepare_server_args(["--model-path", model, "--device", "cpu", "--attention-backend", backend,
                                    *choice])
        args.resolve_once()
        return resolved_view(args).cuda_graph_config.prefill.backend

    if not choice:  # the stand-in takes effect: a dense backend keeps SGLang's default
        assert resolve("triton") == "breakable"
    if expected is ValueError:
        with pytest.raises(ValueError, match="not full"):
            resolve("nvfp4_sparse")
    else:
        assert resolve("nvfp4_sparse") == expected


def test_request_inputs_that_crash_sglang_are_refused():
    text = SimpleNamespace(input_embeds=None, image_data=None, return_logprob=True, top_logprobs_num=5)
    plugin.check_request_inputs(text, [0, 511], vocab_size=512)
    for ids, match in (([], "empty"), ([3, 512], "token id 512"), ([-1, 3], "token id -1")):
        with pytest.raises(ValueError, match=match):
            plugin.check_request_inputs(text, ids, vocab_size=512)
    with pytest.raises(ValueError, match="top_logprobs_num: 513"):
        plugin.check_request_inputs(SimpleNamespace(**{**vars(text), "top_logprobs_num": 513}), [1], vocab_size=512)
    plugin.check_request_inputs(SimpleNamespace(**{**vars(text), "image_data": ["x"]}), [10**6], vocab_size=512)
    plugin.check_request_inputs(SimpleNamespace(**{**vars(text), "input_embeds": [[0.0]]}), None, vocab_size=512)


def test_configuration_defaults_and_values():
    cfg = load_config({})
    assert (cfg.topk, cfg.sink_blocks, cfg.local_blocks, cfg.indexer, cfg.proxy_groups) == (16, 1, 1, "proxy", None)
    assert (cfg.proxy_precision, cfg.proxy_share, cfg.proxy_share_score) == ("fp8", 8, "last")
    assert not cfg.is_dense_layer(0)
    cfg = load_config({"NVFP4_SPARSE_TOPK": "8", "NVFP4_SPARSE_DENSE_LAYERS": "0,2", "NVFP4_SPARSE_INDEXER": "mean"})
    assert cfg.topk == 8 and cfg.is_dense_layer(2) and not cfg.is_dense_layer(1) and cfg.indexer == "mean"
    assert load_config({"NVFP4_SPARSE_DENSE_LAYERS": "all"}).is_dense_layer(7)


def test_tensor_parallel_head_shards_concatenate_to_the_single_rank_output():
    """Each TP rank holds H/tp query heads and Hkv/tp KV heads with its own pool and indexer state;
    sharding one layer two ways must reproduce the single-rank output head for head."""
    n, tp = 2600, 2  # 21 blocks: the indexer really selects
    full = Harness(num_heads=32, num_kv_heads=2, seed=7)
    ranks = [Harness(num_heads=16, num_kv_heads=1, seed=7) for _ in range(tp)]
    pages = full.take_pages(21)
    q, k, v = full.qkv(n)
    fb_args = (ForwardMode.EXTEND, [0], [n], [n])
    full.map_request(0, pages, n)
    want = full.forward(full.batch(*fb_args), q, k, v).view(n, 32, 128)
    outs = []
    for rank, h in enumerate(ranks):
        h.map_request(0, pages, n)
        heads = slice(rank * 16 * 128, (rank + 1) * 16 * 128)
        kv = slice(rank * 128, (rank + 1) * 128)
        outs.append(h.forward(h.batch(*fb_args), q[:, heads].contiguous(), k[:, kv].contiguous(),
                              v[:, kv].contiguous()).view(n, 16, 128))
    assert torch.equal(torch.cat(outs, dim=1), want)


# ---------------------------------------------------------------------------------------------
# MiniMax-M3: the learned indexer behind the backend, the (idx_o, out) return of sparse layers.
# ---------------------------------------------------------------------------------------------
def test_m3_sparse_layers_select_with_their_index_keys_and_return_idx_o_and_output(monkeypatch):
    from sglang_nvfp4.indexer import IndexKeys, LearnedIndexer, select_blocks_learned
    from sglang_nvfp4.sglang import backend as backend_module
    from sglang_nvfp4.sglang.minimax_m3 import M3Sparsity

    m3 = M3Sparsity(sparse_layers=frozenset({0}), topk=4, init_blocks=1, local_blocks=2)
    monkeypatch.setattr(backend_module, "startup_config", lambda: SparseConfig(model=m3))
    h = Harness(num_heads=32, num_kv_heads=2, seed=4)
    assert isinstance(h.backend.indexer, LearnedIndexer) and h.backend.dense_layer == [False]
    n = 700  # 6 blocks: more than the 4 selected
    pages = h.take_pages(6)
    h.map_request(0, pages, n)
    q, k, v = h.qkv(n)
    idx_q = torch.randn(n, 2, 128, generator=h.gen).bfloat16()
    idx_k = torch.randn(n, 1, 128, generator=h.gen).bfloat16()
    # expectation built beside the backend: index keys written by the test, the learned selection (tested on its
    # own against a float64 model in test_learned_indexer.py), the contract's reference: checks the wiring
    keys = IndexKeys(h.pool.num_pages)
    keys.write(h.req_to_token_pool.req_to_token[0, :n].long(), idx_k)
    table = torch.tensor([pages], dtype=torch.int32)

    def expected(tokens):
        pos = torch.arange(tokens.start, tokens.stop, dtype=torch.int32)
        req = torch.zeros(len(pos), dtype=torch.int32)
        ids = select_blocks_learned(idx_q[tokens], keys, table, req, pos, topk=4, sink_blocks=1, local_blocks=1)
        padded = torch.nn.functional.pad(ids, (0, fmt.TOPK - 4), value=-1)
        out = sparse_prefill_reference(q[tokens].view(len(pos), 32, 128), h.pool.layer_cache(0), padded, table, req,
                                       pos, 1.0, 1.0, h.layer.scaling)
        return ids, out.view(len(pos), -1)

    m = n - 1
    for fb, tokens in ((h.batch(ForwardMode.EXTEND, [0], [m], [m]), slice(0, m)),
                       (h.batch(ForwardMode.DECODE, [0], [n]), slice(m, n))):
        h.backend.init_forward_metadata(fb)
        with torch.no_grad():
            idx_o, out = h.backend.forward(q[tokens], k[tokens], v[tokens], h.layer, fb, idx_q=idx_q[tokens],
                                           idx_k=idx_k[tokens], idx_v=None)
        ids, want = expected(tokens)
        assert idx_o is None and torch.equal(out, want)
        assert (ids >= 0).sum(-1).max() == 4 and (ids[..., 3] > 3).any()  # really sparse: 4 of up to 6 blocks
    # idle batches: the shape the model unpacks; M3's dense layers pass no idx_q and get the output alone
    idle = SimpleNamespace(forward_mode=ForwardMode.IDLE)
    got = h.backend.forward(q[:0], None, None, h.layer, idle, idx_q=idx_q[:0], idx_k=idx_k[:0], idx_v=None)
    assert got[0] is None and got[1].shape == (0, 32 * 128)
    assert h.backend.forward(q[:0], None, None, h.layer, idle).shape == (0, 32 * 128)
