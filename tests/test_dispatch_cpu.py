"""The dispatcher on CPU serves the reference and validates its arguments at the boundary."""

import pytest
import torch

from problems import make_problem, random_block_ids
from sglang_nvfp4 import format as fmt
from sglang_nvfp4 import kernels
from sglang_nvfp4.reference import sparse_prefill_reference


def test_cpu_dispatch_is_the_reference_and_fills_out():
    p = make_problem(30, [700, 260], [100, 33], num_kv_heads=2)
    block_ids = random_block_ids(p, seed=0)
    args = (p.q, p.cache, block_ids, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, p.sm_scale)
    want = sparse_prefill_reference(*args)
    out = torch.full_like(p.q, float("nan"))
    assert kernels.sparse_prefill(*args, out=out) is out
    assert torch.equal(out, want)
    assert torch.equal(kernels.sparse_decode(*args), want)
    assert kernels.resolve_implementation("cpu") == "reference"


def test_out_is_validated():
    p = make_problem(31, [200], [4])
    block_ids = random_block_ids(p, seed=0)
    with pytest.raises(ValueError, match="out"):
        kernels.sparse_prefill(p.q, p.cache, block_ids, p.block_table, p.req, p.pos, 1.0, 1.0, 0.1,
                               out=torch.empty(4, 16, 128, dtype=torch.float16))


def test_cpu_write_kv_is_format_write_kv():
    a = fmt.alloc_cache(3, 2).random_(0, 256, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 50, 2, 128, generator=gen)
    slots = torch.randperm(384, generator=gen)[:50]
    kernels.write_kv(a, slots, k, v, 0.5, 2.0)
    fmt.write_kv(b, slots, k, v, 0.5, 2.0)
    assert torch.equal(a, b)


def test_a_plan_validates_once_and_runs_every_layer():
    """plan_attention checks the shared metadata once; run() serves several layers (own caches, own
    selections, own scales) and equals the one-call path on each."""
    p = make_problem(32, [700, 260], [100, 33], num_kv_heads=2)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.arange(n) for n in p.seq_lens]
    slots = torch.cat([p.block_table[r].long()[t // 128] * 128 + t % 128 for r, t in enumerate(tokens)])
    second = p.cache.clone()  # another layer: same pages, other K/V
    fmt.write_kv(second, slots, *torch.randn(2, len(slots), 2, 128, generator=gen), 1.0, 1.0)
    plan = kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=2)
    assert plan.implementation == "reference" and plan.num_tokens == p.q.shape[0]
    for q, cache, seed in ((p.q, p.cache, 0), (torch.randn(p.q.shape, generator=gen).to(p.q.dtype), second, 1)):
        block_ids = random_block_ids(p, seed=seed)
        want = sparse_prefill_reference(q, cache, block_ids, p.block_table, p.req, p.pos, 0.5, 2.0, 0.1)
        out = torch.full_like(q, float("nan"))
        assert plan.run(q, cache, block_ids, 0.5, 2.0, 0.1, out=out) is out
        assert torch.equal(out, want) and not out.isnan().any()
    with pytest.raises(ValueError, match="planned"):
        plan.run(p.q[:-1], p.cache, random_block_ids(p, seed=0)[:, :-1], 1.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="planned"):
        plan.run(p.q, fmt.alloc_cache(4, 1), random_block_ids(p, seed=0), 1.0, 1.0, 0.1)
    for bad in (0.0, -0.1, float("nan"), 1e-46, True, "0.1"):  # the kernels take the row max of unscaled scores
        with pytest.raises(ValueError, match="sm_scale"):
            plan.run(p.q, p.cache, random_block_ids(p, seed=0), 1.0, 1.0, bad)
    with pytest.raises(ValueError, match="k_scale"):
        plan.run(p.q, p.cache, random_block_ids(p, seed=0), -1.0, 1.0, 0.1)


@pytest.mark.parametrize("kw, match", [
    (dict(kind="extend"), "kind"),
    (dict(req="int64"), "req"),
    (dict(pos="int64"), "pos"),
    (dict(num_kv_heads=0), "num_kv_heads"),
])
def test_bad_plans_are_refused(kw, match):
    p = make_problem(34, [300], [10])
    args = dict(kind="prefill", block_table=p.block_table, req=p.req, pos=p.pos, num_kv_heads=1)
    args.update(kw)
    if kw.get("req") == "int64":
        args["req"] = p.req.long()
    if kw.get("pos") == "int64":
        args["pos"] = p.pos.long()
    with pytest.raises(ValueError, match=match):
        kernels.plan_attention(args.pop("kind"), **args)


def test_forced_implementation_is_read_when_a_forward_is_planned(monkeypatch):
    p = make_problem(35, [300], [10])
    monkeypatch.setenv(kernels.FORCE_ENV, "bogus")
    with pytest.raises(ValueError, match=kernels.FORCE_ENV):
        kernels.plan_attention("decode", p.block_table, p.req, p.pos, num_kv_heads=1)
    monkeypatch.setenv(kernels.FORCE_ENV, "reference")
    plan = kernels.plan_attention("decode", p.block_table, p.req, p.pos, num_kv_heads=1)
    monkeypatch.setenv(kernels.FORCE_ENV, "bogus")  # read when planned, not by run()
    block_ids = random_block_ids(p, seed=0)
    assert torch.equal(plan.run(p.q, p.cache, block_ids, 1.0, 1.0, 0.1),
                       sparse_prefill_reference(p.q, p.cache, block_ids, p.block_table, p.req, p.pos, 1.0, 1.0, 0.1))
    monkeypatch.setenv(kernels.FORCE_ENV, "flydsl")
    plan = kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=1)
    assert plan.implementation == "flydsl"
    calls = []
    plan._fallback = lambda *args: calls.append(args[2].shape[2])  # stands for Triton: record the width
    plan.run(p.q, p.cache, random_block_ids(p, seed=0, width=20), 1.0, 1.0, 0.1)  # wider than FlyDSL's 16
    assert calls == [20]
    got = plan.run(p.q, p.cache, random_block_ids(p, seed=0), 1.0, 1.0, 0.1)  # FlyDSL (its CPU twin here)
    assert calls == [20] and not got.isnan().any()


@pytest.mark.parametrize("bad, match", [
    (lambda b: b.long(), "block_ids"),
    (lambda b: b[:, :, :0], "block_ids"),
    (lambda b: b[:1], "block_ids"),
])
def test_run_checks_each_layers_selection(bad, match):
    """A selection comes from any indexer, per layer: run() refuses one the kernels would misread."""
    p = make_problem(36, [300], [10], num_kv_heads=2)
    plan = kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=2)
    with pytest.raises(ValueError, match=match):
        plan.run(p.q, p.cache, bad(random_block_ids(p, seed=0)), 1.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="q"):
        plan.run(p.q.int(), p.cache, random_block_ids(p, seed=0), 1.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.plan_attention("prefill", p.block_table, p.req, torch.stack([p.pos, p.pos], 1)[:, 0],
                               num_kv_heads=2)


@pytest.fixture
def cuda_capability(monkeypatch):
    """Makes the dispatcher see an NVIDIA GPU of the capability passed to the returned setter."""
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kernels._gluon_serves.cache_clear()
    kernels.gluon_unavailable.cache_clear()
    yield lambda capability: monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    kernels._gluon_serves.cache_clear()
    kernels.gluon_unavailable.cache_clear()


@pytest.mark.parametrize("capability, want", [((9, 0), "gluon"), ((8, 0), "triton"), ((10, 0), "triton")])
def test_hopper_picks_the_gluon_kernels(cuda_capability, capability, want):
    cuda_capability(capability)
    assert kernels.resolve_implementation(torch.device("cuda", 0)) == want


def test_hopper_without_gluon_falls_back_with_a_warning(cuda_capability, monkeypatch, caplog):
    """Only a Triton that cannot build the Gluon kernels falls back to Triton's, and says so."""
    import triton

    cuda_capability((9, 0))
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.resolve_implementation(torch.device("cuda", 0)) == "triton"
    assert "Triton 3.5.1 is older than 3.6" in caplog.text and "faster Gluon kernels" in caplog.text


def test_gluon_unavailable_names_the_reason(cuda_capability, monkeypatch):
    import sys

    import triton

    assert kernels.gluon_unavailable() is None  # CI's Triton has Gluon's Hopper API
    kernels.gluon_unavailable.cache_clear()
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon.language.nvidia.hopper", None)
    assert "no Gluon Hopper API" in kernels.gluon_unavailable()
    kernels.gluon_unavailable.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.10.0")  # compared as numbers, not strings
    assert "no Gluon Hopper API" in kernels.gluon_unavailable()


def test_a_broken_gluon_module_is_raised_not_skipped(cuda_capability, monkeypatch):
    """With a Triton that builds the Gluon kernels, an error importing them is a bug to see, not a silent
    fallback to the slower Triton kernels."""
    import sys

    from sglang_nvfp4.kernels import triton_indexer

    cuda_capability((9, 0))
    for name in ("gluon_prefill", "gluon_decode", "gluon_proxy"):
        monkeypatch.setitem(sys.modules, f"sglang_nvfp4.kernels.{name}", None)
        monkeypatch.delattr(kernels, name, raising=False)
    with pytest.raises(ImportError):
        kernels.resolve_implementation(torch.device("cuda", 0))
    with pytest.raises(ImportError):
        triton_indexer._gluon_proxy_scores(torch.device("cuda", 0), 4096, 1, 16)


def test_forced_gluon_needs_hopper_and_falls_back_per_layer(monkeypatch):
    p = make_problem(36, [300], [10], num_heads=16, num_kv_heads=1)
    monkeypatch.setenv(kernels.FORCE_ENV, "gluon")
    with pytest.raises(ValueError, match="sm_90"):  # a CPU plan
        kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=1)
    monkeypatch.setattr(kernels, "_gluon_serves", lambda device: True)
    plan = kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=1)
    assert plan.implementation == "gluon"
    calls = []
    plan._fallback = lambda *args: calls.append(args[2].shape[2])  # stands for Triton: record the width
    plan.run(p.q, p.cache, random_block_ids(p, seed=0, width=64), 1.0, 1.0, 0.1)  # wider than Gluon serves
    assert calls == [64]
    from sglang_nvfp4.kernels import gluon_decode, triton_decode

    decode = kernels.plan_attention("decode", p.block_table, p.req, p.pos, num_kv_heads=1)
    assert decode._launch is gluon_decode.launch and decode._fallback is triton_decode.launch
    served, fallen_back = [], []
    decode._launch = lambda *args: served.append(args[0].shape[1])  # record the query heads
    decode._fallback = lambda *args: fallen_back.append(args[0].shape[1])
    decode.run(p.q, p.cache, random_block_ids(p, seed=0), 1.0, 1.0, 0.1)
    many_heads = torch.zeros(p.q.shape[0], 2 * gluon_decode.MAX_GROUP, fmt.HEAD_DIM)
    decode.run(many_heads, p.cache, random_block_ids(p, seed=0), 1.0, 1.0, 0.1)
    assert served == [16] and fallen_back == [2 * gluon_decode.MAX_GROUP]


def test_predecode_setting_is_validated(monkeypatch):
    monkeypatch.delenv(kernels.PREDECODE_ENV, raising=False)
    assert kernels.predecode_setting() == "auto"
    assert kernels.predecode_setting({kernels.PREDECODE_ENV: "off"}) == "off"
    assert kernels.predecode_setting({kernels.PREDECODE_ENV: " auto "}) == "auto"
    with pytest.raises(ValueError, match="NVFP4_SPARSE_PREDECODE='on'"):
        kernels.predecode_setting({kernels.PREDECODE_ENV: "on"})
    monkeypatch.setenv(kernels.PREDECODE_ENV, "bogus")  # read when a forward is planned on a GPU, not on CPU
    p = make_problem(33, [300], [20])
    assert not kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=1).predecodes


def test_token_groups_setting_is_validated():
    assert kernels.token_groups_setting({}) == "auto"
    assert kernels.token_groups_setting({kernels.TOKEN_GROUPS_ENV: " off "}) == "off"
    with pytest.raises(ValueError, match="NVFP4_SPARSE_TOKEN_GROUPS='on'"):
        kernels.token_groups_setting({kernels.TOKEN_GROUPS_ENV: "on"})


@pytest.mark.parametrize("setting, tokens, run, heads, width, want", [
    ("auto", 1024, 1, 16, 16, True),
    (None, 1024, 1, 16, 16, True),  # the default
    ("auto", 1023, 1, 16, 16, False),  # fewer than GROUP_MIN_TOKENS
    ("auto", 1024, 1, 16, 33, None),  # wider than the Gluon prefill serves: Triton, consecutive tiles
    ("auto", 1024, 1, 64, 64, True),  # 64 heads per KV head: 2-token tiles
    ("auto", 1024, 8, 16, 16, False),  # runs of 8 tokens share their selection: nothing to regroup
    ("off", 1024, 1, 16, 16, False),
])
def test_dispatcher_regroups_tokens_that_select_alone(monkeypatch, setting, tokens, run, heads, width, want):
    """With ``NVFP4_SPARSE_TOKEN_GROUPS=auto`` (the default) the Gluon prefill's layers get ``token_groups`` when
    at least ``GROUP_MIN_TOKENS`` tokens select alone; the layers it falls back on, shorter forwards and shared
    selections run as before."""
    assert kernels.GROUP_MIN_TOKENS == 1024
    p = make_problem(37, [tokens + 5], [tokens], num_heads=heads, num_kv_heads=1)
    monkeypatch.setenv(kernels.FORCE_ENV, "gluon")
    monkeypatch.setenv(kernels.PREDECODE_ENV, "off")  # (predecoding would launch a kernel here)
    if setting is None:
        monkeypatch.delenv(kernels.TOKEN_GROUPS_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.TOKEN_GROUPS_ENV, setting)
    monkeypatch.setattr(kernels, "_gluon_serves", lambda device: True)
    plan = kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=1, selection_run=run)
    served, fallen_back = [], []
    plan._launch = lambda *args, **options: served.append(options)
    plan._fallback = lambda *args, **options: fallen_back.append(options)
    plan.run(p.q, p.cache, random_block_ids(p, seed=0, width=width), 1.0, 1.0, 0.1)
    if want is None:
        assert served == [] and fallen_back == [{}]
    else:
        assert served == [{"token_groups": True} if want else {}] and fallen_back == []


@pytest.mark.parametrize("tokens, rows, width, run, want", [
    (32768, 1, 256, 8, True),  # a 32K prompt in one forward: 128 tokens per slot
    (4096, 1, 256, 8, True),  # exactly 16 tokens per slot, selections shared by runs of 8
    (4095, 1, 256, 8, False),
    (4095, 1, 256, 2, False),  # any sharing run: 16
    (8192, 1, 1000, 8, False),  # an 8K chunk over a 120K prefix: 8 per slot
    (8192, 1, 1000, 1, True),  # the same with per-token selections (MiniMax-M3's): from 4 per slot
    (4096, 1, 1024, 1, True),  # exactly 4
    (4095, 1, 1024, 1, False),
    (32768, 8, 32, 8, True),  # 8 prompts of 4K
    (0, 0, 0, 1, False),
])
def test_predecoding_pays_from_4_tokens_per_slot_or_16_with_shared_selections(tokens, rows, width, run, want):
    from sglang_nvfp4.kernels import triton_predecode

    assert triton_predecode.pays(tokens, torch.zeros(rows, width, dtype=torch.int32), run) is want


def test_plan_refuses_a_selection_run_below_1():
    p = make_problem(34, [300], [20])
    with pytest.raises(ValueError, match="selection_run: must be >= 1, got 0"):
        kernels.plan_attention("prefill", p.block_table, p.req, p.pos, num_kv_heads=1, selection_run=0)
