"""The learned (MiniMax-M3) indexer: its selections against a float64 model of SGLang's in-tree M3
semantics written independently here, one token at a time; its index-key state; its Triton kernels
against the torch path (this module re-runs itself under ``TRITON_INTERPRET=1`` on CPU, and runs the
kernels compiled on a GPU)."""

import importlib.util
import math
import os

import pytest
import torch

from problems import shuffled_block_table
from triton_interpreter import assert_module_passed, register_module
from sglang_nvfp4 import format as fmt
from sglang_nvfp4.indexer import IndexKeys, LearnedIndexer, StateBytes, select_blocks_learned
from sglang_nvfp4.indexer.fp8 import dequantize_rows, quantize_rows

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
register_module(__file__, expected_passed=18, timeout=900, run_s=40)  # the torch tests run there too
D = 128


def m3_selection_f64(idx_q, keys, table, req, pos, topk, init_blocks, m3_local_blocks):
    """SGLang 0.5.23's M3 selection (``flash_with_topk_idx.py``: scores, then its top-k), per index head
    and token in float64: block score = max over the block's keys at positions <= p of the scaled logits;
    the first ``init_blocks`` blocks get 1e30, the last ``m3_local_blocks`` visible ones (own included)
    1e29; the ``topk`` best (ties: lower id, this project's documented choice), ascending, -1 padded."""
    heads, t = idx_q.shape[1], idx_q.shape[0]
    out = torch.full((heads, t, topk), -1, dtype=torch.int32)
    for i in range(t):
        p = int(pos[i])
        nvis = p // fmt.PAGE_SIZE + 1
        slots = [int(table[int(req[i]), j // fmt.PAGE_SIZE]) * fmt.PAGE_SIZE + j % fmt.PAGE_SIZE for j in range(p + 1)]
        k = keys[slots].double()
        for h in range(heads):
            logits = (k @ idx_q[i, h].double()) * D**-0.5 * math.log2(math.e)
            score = [float(logits[b * fmt.PAGE_SIZE : (b + 1) * fmt.PAGE_SIZE].max()) for b in range(nvis)]
            for b in range(nvis):
                if b < init_blocks:
                    score[b] = 1e30
                if b >= max(0, nvis - m3_local_blocks):
                    score[b] = 1e29
            order = sorted(range(nvis), key=lambda b: (-score[b], b))[: min(topk, nvis)]
            out[h, i, : len(order)] = torch.tensor(sorted(order), dtype=torch.int32)
    return out


FP8 = torch.float8_e4m3fn


def learned_problem(seed, seq_lens, tokens_per_request, heads=2, spare_pages=3, values=3, dtype=torch.float16,
                    query_dtype=torch.float16, continuous=False):
    """Index keys and queries with small integer values (every logit exact in fp16/fp32 whatever the
    summation order, and equal block scores common; exact in fp8 keys too), or with ``continuous`` normal
    values; requests on shuffled pages; query tokens at random positions of each request (chunk and prefix
    offsets, partial own blocks). Keys are stored as ``dtype`` (written through :meth:`IndexKeys.write`),
    queries are ``query_dtype`` (that of the keys unless they are fp8). Returns
    (idx_q [T, heads, D], IndexKeys, block_table, req, pos)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_pages = shuffled_block_table(gen, seq_lens, spare_pages)
    keys = IndexKeys(num_pages, dtype=dtype)
    shape = keys.keys.shape
    raw = torch.randn(shape, generator=gen) if continuous else torch.randint(-values, values + 1, shape, generator=gen)
    query_dtype = query_dtype if dtype == FP8 else dtype
    keys.write(torch.arange(shape[0]), raw.to(query_dtype))
    req = torch.cat([torch.full((m,), r, dtype=torch.int32) for r, m in enumerate(tokens_per_request)])
    pos = torch.cat([torch.randint(0, n, (m,), generator=gen, dtype=torch.int32)
                     for n, m in zip(seq_lens, tokens_per_request)])
    idx_q = torch.randn(len(req), heads, D, generator=gen) if continuous else \
        torch.randint(-2, 3, (len(req), heads, D), generator=gen)
    return idx_q.to(query_dtype), keys, table, req, pos


def stored_values(keys: IndexKeys) -> torch.Tensor:
    return keys.values(torch.arange(keys.keys.shape[0]))


@pytest.mark.parametrize("topk, init_blocks, m3_local, dtype", [(16, 1, 1, torch.bfloat16), (4, 1, 1, torch.float16),
                                                                 (6, 2, 3, torch.bfloat16), (3, 0, 1, torch.float16),
                                                                 (16, 1, 1, FP8), (5, 2, 1, FP8)])
def test_selection_equals_the_in_tree_semantics_in_float64(topk, init_blocks, m3_local, dtype):
    idx_q, keys, table, req, pos = learned_problem(1, [1900, 700, 130], [40, 25, 9], dtype=dtype,
                                                   query_dtype=torch.bfloat16, continuous=dtype == FP8)
    got = select_blocks_learned(idx_q, keys, table, req, pos, topk=topk, sink_blocks=init_blocks,
                                local_blocks=m3_local - 1, impl="torch")
    assert torch.equal(got, m3_selection_f64(idx_q, stored_values(keys), table, req, pos, topk, init_blocks,
                                             m3_local))


def test_fp8_index_keys_hold_e4m3_codes_and_an_e8m0_exponent_per_key():
    rows = torch.zeros(4, D)
    rows[0, :4] = torch.tensor([3.0, -0.3, 0.0, 1e-3])  # largest 3: scaled by 2**6 into [128, 256)
    rows[1, 7] = 2.0**-125  # clamped: 2**126, exponent byte 1
    rows[2, 0] = -(2.0**100)  # 2**-93: exponent byte 220
    codes, exponents = quantize_rows(rows)  # row 3: zero, exponent of the scale 2**8
    assert exponents.tolist() == [127 - 6, 1, 220, 127 - 8]
    # 192 = 1.5 * 2**7: 0 1110 100; -19.2 rounds to -20 = -1.25 * 2**4: 1 1011 010; 0.064 = 1.024 * 2**-4 -> 1.0:
    # 0 0011 000
    assert codes[0, :4].view(torch.uint8).tolist() == [0x74, 0xDA, 0x00, 0x18]
    assert codes[1, 7].view(torch.uint8).item() == 0x40 and codes[2, 0].view(torch.uint8).item() == 0xF0  # 2, -128
    assert codes[3].view(torch.uint8).eq(0).all()
    back = dequantize_rows(codes, exponents)
    assert back[0, :4].tolist() == [3.0, -20 / 64, 0.0, 1 / 1024] and back[1, 7] == 2.0**-125
    assert back[2, 0] == -(2.0**100) and back[3].eq(0).all()
    # every value keeps E4M3's 4 significant bits (relative error <= 2**-4) down to 2**-13 of its key's largest
    keys = torch.randn(64, D) * torch.logspace(-30, 30, 64, base=2)[:, None]
    err = (dequantize_rows(*quantize_rows(keys)) - keys).abs()
    normal = keys.abs() >= keys.abs().amax(1, keepdim=True) * 2.0**-13
    assert (err[normal] <= keys.abs()[normal] * 2.0**-4).all()


def test_fp8_keys_change_selections_only_where_rounding_reorders_blocks():
    """The same continuous keys stored in bf16 and in fp8: each storage selects as the float64 model of its own
    stored values, and the fp8 storage selects differently from the bf16 one somewhere (the option is not a
    no-op) but for most (head, token) pairs identically (dropped from a long context, selections close to ties)."""
    sel = {}
    for dtype in (torch.bfloat16, FP8):
        idx_q, keys, table, req, pos = learned_problem(11, [4000, 3000], [60, 60], heads=2, dtype=dtype,
                                                       query_dtype=torch.bfloat16, continuous=True)
        sel[dtype] = select_blocks_learned(idx_q, keys, table, req, pos, topk=8, sink_blocks=1, local_blocks=0,
                                           impl="torch")
    same = (sel[torch.bfloat16] == sel[FP8]).all(-1).float().mean().item()
    assert 0.5 < same < 1.0, same


def test_blocks_after_the_token_are_never_scored():
    # a key at position 394 (block 3) that outscores everything: invisible to the token at 300 (own block 2),
    # chosen by the token at 599 (own block 4)
    idx_q, keys, table, req, pos = learned_problem(2, [600], [2], heads=1, values=1)
    pos[:] = torch.tensor([300, 599], dtype=torch.int32)
    keys.keys[int(table[0, 3]) * fmt.PAGE_SIZE + 10] = 100.0
    idx_q[:] = 1.0
    sel = select_blocks_learned(idx_q, keys, table, req, pos, topk=2, sink_blocks=0, local_blocks=0, impl="torch")
    assert sel[0, 0, 1] == 2 and sel[0, 0, 0] in (0, 1)
    assert sel[0, 1].tolist() == [3, 4]


def test_short_contexts_select_every_block():
    idx_q, keys, table, req, pos = learned_problem(3, [2048, 1000], [30, 30])
    sel = select_blocks_learned(idx_q, keys, table, req, pos, topk=16, sink_blocks=1, local_blocks=0, impl="torch")
    own = pos.long() // fmt.PAGE_SIZE
    want = torch.where(torch.arange(16)[None, :] <= own[:, None], torch.arange(16)[None, :], -1).int()
    assert torch.equal(sel, want[None].expand(2, -1, -1))


def test_indexer_keeps_index_keys_of_its_sparse_layers():
    num_pages = 6
    ix = LearnedIndexer(3, num_pages, 2, "cpu", sparse_layers=(0, 2), topk=4, sink_blocks=1, local_blocks=0)
    assert ix.state_nbytes() == 2 * num_pages * 128 * D * 2
    assert LearnedIndexer.state_bytes(3, 2, sparse_layers=(0, 2)) == StateBytes(per_token=2 * D * 2)
    slots = torch.tensor([5, 130, 131, 700])
    idx_k = torch.randn(4, 1, D).bfloat16()
    cache = fmt.alloc_cache(num_pages, 2)
    ix.on_kv_written(0, cache, slots, idx_k=idx_k, idx_q=torch.zeros(4, 2, D))
    ix.on_kv_written(1, cache, slots)  # a dense layer: nothing kept, nothing needed
    assert torch.equal(ix.index_keys[0].keys[slots], idx_k[:, 0])
    saved = ix.save_tokens(0, slots)
    ix.index_keys[0].keys[slots] = 0
    ix.restore_tokens(0, cache, slots, saved)
    assert torch.equal(ix.index_keys[0].keys[slots], idx_k[:, 0])
    assert ix.save_tokens(1, slots) is None
    with pytest.raises(ValueError, match="idx_k"):
        ix.on_kv_written(2, cache, slots)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="idx_q"):
        ix.select(0, None, cache, table, one, one)
    with pytest.raises(ValueError, match="not a sparse layer"):
        ix.select(1, None, cache, table, one, one, idx_q=torch.zeros(1, 2, D).bfloat16())
    with pytest.raises(ValueError, match="one index head per"):
        ix.select(0, None, cache, table, one, one, idx_q=torch.zeros(1, 4, D).bfloat16())
    with pytest.raises(ValueError, match="sparse_layers"):
        LearnedIndexer(2, num_pages, 2, "cpu", sparse_layers=(2,))
    empty = select_blocks_learned(torch.zeros(0, 2, D).bfloat16(), ix.index_keys[0], table,
                                  one[:0], one[:0], topk=4)
    assert empty.shape == (2, 0, 4)


def test_fp8_index_keys_are_stored_saved_and_restored_exactly():
    num_pages = 6
    ix = LearnedIndexer(3, num_pages, 2, "cpu", sparse_layers=(0, 2), topk=4, key_dtype=FP8)
    assert ix.state_nbytes() == 2 * num_pages * 128 * (D + 1)
    assert LearnedIndexer.state_bytes(3, 2, sparse_layers=(0, 2), key_dtype=FP8) == StateBytes(per_token=2 * (D + 1))
    slots = torch.tensor([5, 130, 131, 700])
    idx_k = (torch.randn(4, 1, D) * torch.tensor([1e-3, 1.0, 30.0, 1e4])[:, None, None]).bfloat16()
    cache = fmt.alloc_cache(num_pages, 2)
    ix.on_kv_written(0, cache, slots, idx_k=idx_k)
    keys = ix.index_keys[0]
    want = dequantize_rows(*quantize_rows(idx_k[:, 0]))
    assert torch.equal(keys.values(slots), want)
    assert keys.values(torch.tensor([6])).eq(0).all()  # never written: zero
    saved = ix.save_tokens(0, slots)
    assert saved.dtype == torch.uint8 and saved.shape == (4, D + 1)
    keys.keys[slots] = torch.ones(4, D).to(FP8)
    keys.exponents[slots] = 200
    ix.restore_tokens(0, cache, slots[[2, 3, 0, 1]], saved[[2, 3, 0, 1]])
    assert torch.equal(keys.values(slots), want)
    with pytest.raises(ValueError, match="index keys are stored as"):
        IndexKeys(1, dtype=torch.float32)
    with pytest.raises(ValueError, match="idx_q: expected bf16/fp16"):
        select_blocks_learned(torch.zeros(1, 2, D).to(FP8), keys, table_of(1), *([torch.zeros(1, dtype=torch.int32)] * 2))


def table_of(pages: int) -> torch.Tensor:
    return torch.arange(pages, dtype=torch.int32)[None]


# ---- Triton kernels -------------------------------------------------------------------------------------
def on_device(keys: IndexKeys, device) -> IndexKeys:
    keys.keys = keys.keys.to(device)
    keys.exponents = None if keys.exponents is None else keys.exponents.to(device)
    return keys


def check_kernel_on_exact_ties(device, dtype=torch.float16, query_dtype=torch.float16, continuous=False):
    # prefill tiles within and across requests, 2, 3 and 8 index heads (tiles of 32, 32 and 16 tokens), and
    # decode-like batches (one token per request): up to 22 blocks, so several score programs per token
    # (continuous: normal values, no ties; the fp8 keys' powers of two then differ from key to key)
    cases = [(4, [1900, 700, 130], [40, 25, 9], 2), (5, [5000], [70], 3), (8, [1500, 900], [20, 20], 8),
             (6, [300] * 5, [1] * 5, 2), (7, [2800, 2500, 1300], [1, 1, 1], 4)]
    for seed, seq_lens, tokens, heads in cases:
        idx_q, keys, table, req, pos = learned_problem(seed, seq_lens, tokens, heads=heads, dtype=dtype,
                                                       query_dtype=query_dtype, continuous=continuous)
        if tokens[0] == 1:
            pos = torch.tensor(seq_lens, dtype=torch.int32) - 1  # decode: the last position of each request
        on_device(keys, device)
        args = [x.to(device) for x in (idx_q, table, req, pos)]
        for topk, sink, local in [(16, 1, 0), (5, 2, 1)]:
            want = select_blocks_learned(args[0], keys, *args[1:], topk=topk, sink_blocks=sink, local_blocks=local,
                                         impl="torch")
            got = select_blocks_learned(args[0], keys, *args[1:], topk=topk, sink_blocks=sink, local_blocks=local,
                                        impl="triton")
            assert torch.equal(got, want), (seed, topk)


def check_kernel_in_token_chunks(device):
    # a score budget of a few tokens: the prefill is scored in several chunks, ids land in the right columns
    from sglang_nvfp4.kernels.triton_indexer import select_learned_blocks

    idx_q, keys, table, req, pos = learned_problem(7, [2600, 900], [50, 30])
    args = [x.to(device) for x in (idx_q, keys.keys, table, req, pos)]
    want = select_learned_blocks(*args, 8, 1, 0)
    chunked = select_learned_blocks(*args, 8, 1, 0, score_bytes=4 * 2 * table.shape[1] * 40)
    assert torch.equal(chunked, want)


def check_decode_merge_steps(device):
    # one-token programs merging 4 blocks at a time (many merge steps) and 256 (one step) agree with torch
    from sglang_nvfp4.kernels.triton_indexer import select_learned_blocks

    idx_q, keys, table, req, _ = learned_problem(9, [2800, 2500, 1300], [1, 1, 1], heads=4)
    pos = torch.tensor([2799, 2499, 1299], dtype=torch.int32)
    keys.keys = keys.keys.to(device)
    args = [x.to(device) for x in (idx_q, table, req, pos)]
    want = select_blocks_learned(args[0], keys, *args[1:], topk=16, sink_blocks=1, local_blocks=0, impl="torch")
    for step in (4, 256):
        assert torch.equal(select_learned_blocks(args[0], keys.keys, *args[1:], 16, 1, 0, decode_blocks_per_step=step),
                           want), step


def check_fp8_key_arguments(device):
    # fp8 keys without their exponents, or model-dtype keys with some: refused, not read as something else
    from sglang_nvfp4.kernels.triton_indexer import learned_block_scores

    idx_q, keys, table, req, pos = learned_problem(3, [300], [4], dtype=FP8)
    on_device(keys, device)
    idx_q, table, req, pos = (x.to(device) for x in (idx_q, table, req, pos))
    scores = torch.empty(2, 4, table.shape[1], device=device)
    with pytest.raises(ValueError, match="fp8 keys need their exponents"):
        learned_block_scores(idx_q, keys.keys, table, req, pos, scores, 1, 4)
    with pytest.raises(ValueError, match="fp8 keys need their exponents"):
        learned_block_scores(idx_q, idx_q[:, 0].contiguous(), table, req, pos, scores, 1, 4,
                             key_exponents=keys.exponents)


def check_fp8_write(device):
    # the write kernel against quantize_rows, bit for bit: zero, tiny (clamped), huge and subnormal-code
    # keys, values halfway between E4M3 neighbours (ties to even), 37 keys (a partial program), shuffled slots;
    # slots outside the call keep their poison
    from sglang_nvfp4.kernels.triton_indexer import write_fp8_index_keys

    gen = torch.Generator().manual_seed(21)
    keys = torch.randn(37, D, generator=gen) * torch.logspace(-20, 20, 37, base=2, dtype=torch.float64)[:, None].float()
    keys[3] = 0.0
    keys[5] = 0.0
    keys[5, 9] = 2.0**-126  # largest magnitude 2**-126: exponent clamped to 1
    keys[7, :4] = torch.tensor([2.0**100, -(2.0**99), 2.0**80, 1.0])  # 2**80 * 2**-93: an E4M3 subnormal
    keys[9, :6] = torch.tensor([128.0, 136.0, 152.0, -168.0, 4.5, 0.0625 * 17])  # 136, 152, 168: ties
    for dtype in (torch.float32, torch.bfloat16):
        idx_k = keys.to(dtype)
        slots = torch.randperm(64, generator=gen)[:37]
        codes = torch.full((64, D), 0x7E, dtype=torch.uint8).view(FP8).to(device)  # 0x7E: 448, poison
        exponents = torch.full((64,), 255, dtype=torch.uint8, device=device)
        write_fp8_index_keys(codes, exponents, slots.to(device), idx_k.to(device))
        want_codes, want_exponents = quantize_rows(idx_k)
        assert torch.equal(codes.cpu()[slots].view(torch.uint8), want_codes.view(torch.uint8)), dtype
        assert torch.equal(exponents.cpu()[slots], want_exponents), dtype
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[slots] = False
        assert (codes.cpu()[untouched].view(torch.uint8) == 0x7E).all() and (exponents.cpu()[untouched] == 255).all()
    write_fp8_index_keys(codes, exponents, slots[:0].to(device), idx_k[:0].to(device))  # nothing to write


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from sglang_nvfp4.kernels.triton_indexer import _fp16_query_rows

    @triton.jit
    def _fp16_rows_kernel(x_ptr, out_ptr, unscale_ptr, ROWS: tl.constexpr, D: tl.constexpr):
        offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
        q, unscale = _fp16_query_rows(tl.load(x_ptr + offs))
        tl.store(out_ptr + offs, q)
        tl.store(unscale_ptr + tl.arange(0, ROWS), unscale)


def check_fp16_query_rows(device):
    # The fp8-key score programs multiply fp16 codes with query rows scaled into fp16 by a power of two per row
    # (_fp16_query_rows): hand-picked magnitudes, from 2**-116 (the scale clamped) to near bf16's largest, a zero row,
    # and a row whose small elements fall below fp16's subnormals (rounded, by under 2**-39 of the row's largest)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, D, generator=gen)
    x[4] = (1 + torch.rand(D, generator=gen)) * torch.randn(D, generator=gen).sign()  # no bf16 subnormal below
    x *= torch.tensor([1.0, 2.0**100, 2.0**-100, 0.0, 2.0**-116, 1.0, 2.0**15, 2.0**124])[:, None]
    x[5] = 2.0**-40  # below fp16's subnormals once the row's largest is in [2**14, 2**15)
    x[5, 7] = -1.0
    x = x.bfloat16()
    out = torch.full((8, D), float("nan"), dtype=torch.float16, device=device)  # poison
    unscale = torch.full((8,), float("nan"), device=device)
    _fp16_rows_kernel[(1,)](x.to(device), out, unscale, ROWS=8, D=D)
    out, unscale = out.cpu().float(), unscale.cpu()
    back = out * unscale[:, None]
    exact = [0, 1, 2, 3, 4, 6, 7]
    assert torch.equal(back[exact], x.float()[exact])
    assert torch.equal(unscale[3:5], torch.tensor([2.0**-15, 2.0**-126]))  # zero row; a tiny row's scale is clamped
    largest = out.abs().amax(1)
    assert ((largest >= 2**14) & (largest < 2**15))[[0, 1, 2, 5, 6, 7]].all()
    assert torch.equal(back[5, 7], torch.tensor(-1.0)) and (back[5] - x[5].float()).abs().max() <= 2.0**-39


if INTERPRETED:

    def test_fp16_query_rows_scale_exactly():
        check_fp16_query_rows("cpu")

    def test_fp8_index_key_write_kernel_matches_torch_bit_for_bit():
        check_fp8_write("cpu")

    def test_learned_kernel_matches_torch_on_exact_ties():
        check_kernel_on_exact_ties("cpu")

    def test_learned_kernel_on_fp8_keys_matches_torch():
        check_kernel_on_exact_ties("cpu", FP8, continuous=True)  # a power of two per key (the GPU test: ties too)
        check_fp8_key_arguments("cpu")

    def test_learned_kernel_scores_long_prefills_in_chunks():
        check_kernel_in_token_chunks("cpu")

    def test_learned_decode_kernel_merges_in_steps():
        check_decode_merge_steps("cpu")

else:

    @pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
    def test_learned_kernels_under_the_triton_interpreter():
        assert_module_passed(__file__)

    @pytest.mark.gpu
    @pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
    def test_compiled_learned_kernels_match_torch():
        for dtype in (torch.float16, torch.bfloat16):  # bf16: the dtype SGLang serves M3 in
            check_kernel_on_exact_ties("cuda", dtype)
        for continuous in (False, True):  # fp8 keys under bf16 queries (NVFP4_SPARSE_INDEX_KEYS=fp8)
            check_kernel_on_exact_ties("cuda", FP8, torch.bfloat16, continuous)
        check_fp8_key_arguments("cuda")
        check_fp16_query_rows("cuda")
        check_fp8_write("cuda")
        ix = LearnedIndexer(1, 4, 1, "cuda", sparse_layers=(0,), key_dtype=FP8)  # the write path on a GPU: the kernel
        idx_k = torch.randn(9, 1, D, device="cuda").bfloat16()
        slots = torch.tensor([3, 200, 129, 7, 400, 8, 9, 10, 511], device="cuda")
        ix.on_kv_written(0, None, slots, idx_k=idx_k)
        assert torch.equal(ix.index_keys[0].values(slots), dequantize_rows(*quantize_rows(idx_k[:, 0])))
        check_kernel_in_token_chunks("cuda")
        check_decode_merge_steps("cuda")
