"""The dispatcher's GPU kernels at realistic shapes against the reference (run on the same GPU).

The CPU twin of this module is test_triton_kernels.py (the same kernels in Triton's interpreter, at
small shapes); here the NVIDIA path decodes tiles with inline PTX. Prefill outputs are compared on
a sample of tokens (the reference is per token), outputs are poisoned with NaN before each launch.
"""

import pytest
import torch

from sglang_nvfp4 import format as fmt
from sglang_nvfp4 import kernels
from sglang_nvfp4.reference import sparse_prefill_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")]

DEV = "cuda"


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def filled_cache(seq_lens, hkv, gen, k_scale=0.5, v_scale=2.0):
    """Requests of ``seq_lens`` tokens on shuffled pages, written with the Triton write kernel over
    random garbage; returns ``(cache, block_table)``."""
    blocks = [-(-n // fmt.PAGE_SIZE) for n in seq_lens]
    num_pages = sum(blocks) + 2
    cache = fmt.alloc_cache(num_pages, hkv, device=DEV).random_(0, 256, generator=gen)
    perm = torch.randperm(num_pages, device=DEV, generator=gen).int()
    block_table = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.int32, device=DEV)
    used = 0
    for r, n in enumerate(seq_lens):
        block_table[r, : blocks[r]] = perm[used : used + blocks[r]]
        used += blocks[r]
        tokens = torch.arange(n, device=DEV)
        slots = block_table[r].long()[tokens // fmt.PAGE_SIZE] * fmt.PAGE_SIZE + tokens % fmt.PAGE_SIZE
        chan = torch.exp(torch.randn(hkv, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.5)
        k = (torch.randn(n, hkv, fmt.HEAD_DIM, device=DEV, generator=gen) * chan * k_scale).bfloat16()
        v = (torch.randn(n, hkv, fmt.HEAD_DIM, device=DEV, generator=gen) * v_scale).bfloat16()
        kernels.write_kv(cache, slots, k, v, k_scale, v_scale)
    return cache, block_table


def random_selection(pos, last_block, hkv, width, gen, later=0.05, missing=0.1, duplicate=0.05):
    """Per KV head and token: the own block and random earlier ones, plus some later blocks up to
    the request's ``last_block`` (no effect), -1 slots and repeated ids. ``pos``, ``last_block`` [T]."""
    t = pos.shape[0]
    own = (pos.long() // fmt.PAGE_SIZE)[None, :, None]  # [1, T, 1]
    ids = (torch.rand(hkv, t, width, device=DEV, generator=gen) * (own + 1)).long()
    ids[:, :, 0] = own[:, :, 0]
    roll = torch.rand(hkv, t, width, device=DEV, generator=gen)
    ids = torch.where(roll < later, torch.minimum(own + 1 + ids, last_block.long()[None, :, None]), ids)
    ids = torch.where((roll > 1 - duplicate), ids[:, :, :1], ids)
    ids = torch.where((roll > later) & (roll < later + missing), -1, ids)
    return ids.int().contiguous()


@pytest.mark.parametrize("t, heads, kv_heads, width", [
    (4096, 64, 4, fmt.TOPK), (32768, 64, 4, fmt.TOPK), (8192, 16, 1, fmt.TOPK), (4096, 32, 4, fmt.TOPK),
    (32768, 64, 4, 32), (16384, 16, 1, fmt.MAX_TOPK),  # budgets above the default
])
def test_prefill_realistic(t, heads, kv_heads, width):
    gen = torch.Generator(device=DEV).manual_seed(t + heads)
    cache, block_table = filled_cache([t + 300, 700], kv_heads, gen)
    # The last t tokens of request 0 (a chunk that starts mid-page) and all of request 1.
    pos = torch.cat([torch.arange(300, t + 300), torch.arange(700)]).int().to(DEV)
    req = torch.cat([torch.zeros(t), torch.ones(700)]).int().to(DEV)
    last_block = torch.where(req == 0, (t + 299) // fmt.PAGE_SIZE, 699 // fmt.PAGE_SIZE)
    block_ids = random_selection(pos, last_block, kv_heads, width, gen)
    q = (torch.randn(t + 700, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    out = torch.full_like(q, float("nan"))
    kernels.sparse_prefill(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, fmt.HEAD_DIM**-0.5, out=out)
    assert not out.isnan().any()
    sample = torch.randperm(q.shape[0], device=DEV, generator=gen)[:512]
    want = sparse_prefill_reference(q[sample], cache, block_ids[:, sample].contiguous(), block_table, req[sample],
                                     pos[sample], 0.5, 2.0, fmt.HEAD_DIM**-0.5)
    assert rel_err(out[sample], want) < 6e-3  # bf16 output rounding dominates


@pytest.mark.parametrize("batch, ctx, width", [(256, 32768, fmt.TOPK), (3, 9000, fmt.TOPK), (1, 131072, fmt.TOPK),
                                               (32, 32768, fmt.MAX_TOPK)])
def test_decode_realistic(batch, ctx, width):
    heads, kv_heads = 64, 4
    gen = torch.Generator(device=DEV).manual_seed(batch)
    lens = [ctx - 37 * r for r in range(batch)]
    cache, block_table = filled_cache(lens, kv_heads, gen)
    pos = torch.tensor(lens, device=DEV).int() - 1
    req = torch.arange(batch, device=DEV).int()
    block_ids = random_selection(pos, pos // fmt.PAGE_SIZE, kv_heads, width, gen)
    k_scale, v_scale = torch.tensor(0.5, device=DEV), torch.tensor([2.0], device=DEV)
    q = (torch.randn(batch, heads, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    out = torch.full_like(q, float("nan"))
    kernels.sparse_decode(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, fmt.HEAD_DIM**-0.5, out=out)
    want = sparse_prefill_reference(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, fmt.HEAD_DIM**-0.5)
    assert not out.isnan().any()
    assert rel_err(out, want) < 6e-3


def _alone_vs_together(attend, args, groups):
    """Rows of each token group attended alone equal, bit for bit, their rows in the whole call."""
    q, cache, block_ids, block_table, req, pos, *rest = args
    whole = attend(*args)
    for tokens in groups:
        alone = attend(q[tokens].contiguous(), cache, block_ids[:, tokens].contiguous(), block_table,
                       req[tokens].contiguous(), pos[tokens].contiguous(), *rest)
        assert torch.equal(alone, whole[tokens]), (tokens[:4].tolist(), (alone.float() - whole[tokens].float()).abs().max())


def test_prefill_is_batch_invariant_on_gpu():
    """Three extends (1000, 777 and 333 tokens: tiles span requests) with random selections in random slot
    order: every request alone gives the bits it gets in the batch."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    lens, extends = [5000, 3000, 1500], [1000, 777, 333]
    cache, block_table = filled_cache(lens, 4, gen)
    pos = torch.cat([torch.arange(n - e, n) for n, e in zip(lens, extends)]).int().to(DEV)
    req = torch.cat([torch.full((e,), r) for r, e in enumerate(extends)]).int().to(DEV)
    last_block = torch.tensor([(n - 1) // fmt.PAGE_SIZE for n in lens], device=DEV)[req.long()]
    block_ids = random_selection(pos, last_block, 4, fmt.TOPK, gen)
    block_ids = torch.gather(block_ids, 2, torch.rand(block_ids.shape, device=DEV, generator=gen).argsort(dim=2))
    q = (torch.randn(pos.shape[0], 64, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()
    groups = [torch.nonzero(req == r)[:, 0] for r in range(3)]

    def attend(*args):
        return kernels.sparse_prefill(*args, 0.5, 2.0, fmt.HEAD_DIM**-0.5, out=torch.full_like(args[0], float("nan")))

    _alone_vs_together(attend, (q, cache, block_ids, block_table, req, pos), groups + [groups[1][3:500]])


def test_decode_is_batch_invariant_on_gpu():
    """A decode batch of 64 requests: each request alone, and batches of 1, 7 and 32 of them, give the bits
    they get in the batch of 64. On Hopper the Gluon decode's split count and prefetches follow the batch (8 splits and
    a register prefetch alone, 2 splits for 32, 1 for 64, with an L2 prefetch one page ahead), and its merge tree keeps
    the bits."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    lens = [9000 - 97 * r for r in range(64)]
    cache, block_table = filled_cache(lens, 4, gen)
    pos = torch.tensor(lens, device=DEV).int() - 1
    req = torch.arange(64, device=DEV).int()
    block_ids = random_selection(pos, pos // fmt.PAGE_SIZE, 4, fmt.TOPK, gen)
    q = (torch.randn(64, 64, fmt.HEAD_DIM, device=DEV, generator=gen) * 0.3).bfloat16()

    def attend(*args):
        return kernels.sparse_decode(*args, 0.5, 2.0, fmt.HEAD_DIM**-0.5, out=torch.full_like(args[0], float("nan")))

    groups = [torch.tensor([r], device=DEV) for r in range(0, 64, 9)] + [torch.arange(7, device=DEV) * 9,
                                                                          torch.arange(32, device=DEV)]
    _alone_vs_together(attend, (q, cache, block_ids, block_table, req, pos), groups)


def test_write_kv_bit_identical_on_gpu():
    gen = torch.Generator(device=DEV).manual_seed(3)
    cache = fmt.alloc_cache(96, 4, device=DEV).random_(0, 256, generator=gen)
    want = cache.cpu()
    others = torch.randperm(96 * 128, device=DEV, generator=gen)
    others = others[(others < 1000) | (others >= 1064)]
    # neighbour pairs in one call (aligned: whole bytes), a run from an odd slot at an even index, lone tokens
    others = others[(others < 2001) | (others >= 2101)]
    slots = torch.cat([torch.arange(1000, 1064, device=DEV), torch.arange(2001, 2101, device=DEV), others[:4836]])
    k = torch.randn(5000, 4, 128, device=DEV, generator=gen) * torch.exp(torch.randn(5000, 4, 128, device=DEV, generator=gen) * 3)
    v = torch.randn(5000, 4, 128, device=DEV, generator=gen).bfloat16()
    k_scale = torch.tensor([0.037], device=DEV)
    kernels.write_kv(cache, slots, k, v, k_scale, 3.0)
    fmt.write_kv(want, slots.cpu(), k.cpu(), v.cpu(), 0.037, 3.0)
    assert torch.equal(cache.cpu(), want)
    # a decode step's write in one launch: one token on each of 64 pages, even and odd rows
    step = torch.arange(64, device=DEV) * 128 + torch.randint(0, 128, (64,), device=DEV, generator=gen)
    kernels.write_kv(cache, step, k[:64], v[:64], k_scale, 3.0, one_token_per_byte=True)
    fmt.write_kv(want, step.cpu(), k[:64].cpu(), v[:64].cpu(), 0.037, 3.0, one_token_per_byte=True)
    assert torch.equal(cache.cpu(), want)


@pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int32])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_e4m3_decode_is_exact_for_all_codes(code_dtype, out_dtype):
    from e4m3_probe import check_e4m3_decode  # imports triton: only when this GPU test runs

    check_e4m3_decode(DEV, code_dtype, out_dtype)


def two_decode_requests(seed, dtype):
    """Two requests (5000 and 3000 tokens, 4 KV heads) decoding their last token with 64 query heads:
    ``(gen, cache, block_table, req, pos, block_ids, q)``."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    cache, block_table = filled_cache([5000, 3000], 4, gen)
    req = torch.tensor([0, 1], device=DEV).int()
    pos = torch.tensor([4999, 2999], device=DEV).int()
    block_ids = random_selection(pos, pos // fmt.PAGE_SIZE, 4, fmt.TOPK, gen)
    q = (torch.randn(2, 64, 128, device=DEV, generator=gen) * 0.3).to(dtype)
    return gen, cache, block_table, req, pos, block_ids, q


def test_kernels_replay_in_a_cuda_graph():
    gen, cache, block_table, req, pos, block_ids, q = two_decode_requests(4, torch.float16)
    k_new, v_new = torch.randn(2, 2, 4, 128, device=DEV, generator=gen)
    slots = torch.tensor([block_table[0, 39] * 128 + 8, block_table[1, 23] * 128 + 56], device=DEV)
    scales = torch.tensor([0.5], device=DEV), torch.tensor([2.0], device=DEV)
    outs = torch.empty(2, *q.shape, dtype=q.dtype, device=DEV)

    def step():
        kernels.write_kv(cache, slots, k_new, v_new, *scales)
        kernels.sparse_decode(q, cache, block_ids, block_table, req, pos, *scales, 0.1, out=outs[0])
        kernels.sparse_prefill(q, cache, block_ids, block_table, req, pos, *scales, 0.1, out=outs[1])

    step()  # compile outside the capture
    torch.cuda.synchronize()
    eager = outs.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    outs.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs, eager)
    assert rel_err(outs[0], outs[1]) < 1e-3  # decode and prefill kernels agree


def test_a_plan_made_outside_a_cuda_graph_serves_its_replays():
    """As the SGLang backend decodes: the plan is made before capture over static metadata buffers, the
    graph holds ``plan.run`` of one layer, and later batches rewrite the buffers in place and replay."""
    gen, cache, block_table, req, pos, block_ids, q = two_decode_requests(5, torch.bfloat16)
    out = torch.empty_like(q)
    plan = kernels.plan_attention("decode", block_table, req, pos, num_kv_heads=4)
    plan.run(q, cache, block_ids, 0.5, 2.0, 0.1, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, cache, block_ids, 0.5, 2.0, 0.1, out=out)
    for step in range(2):  # the next batches: other positions, selections and queries, same buffers
        pos.copy_(torch.tensor([3000 + 700 * step, 1500 + 300 * step], device=DEV))
        block_ids.copy_(random_selection(pos, pos // fmt.PAGE_SIZE, 4, fmt.TOPK, gen))
        q.copy_(torch.randn(q.shape, device=DEV, generator=gen) * 0.3)
        out.fill_(float("nan"))
        graph.replay()
        want = sparse_prefill_reference(q, cache, block_ids, block_table, req, pos, 0.5, 2.0, 0.1)
        assert rel_err(out, want) < 6e-3  # bf16 output rounding dominates
