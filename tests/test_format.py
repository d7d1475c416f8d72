"""NVFP4 number formats and the cache layout, byte for byte."""

import math

import pytest
import torch

from sglang_nvfp4 import format as fmt

E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_decode_hand_table():
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor(E2M1_TABLE + [-v for v in E2M1_TABLE])
    got = fmt.e2m1_decode(codes)
    assert torch.equal(got, want)
    assert torch.signbit(got[8])  # code 8 is -0


@pytest.mark.parametrize(
    "x, code",
    [
        (0.0, 0), (-0.0, 8), (0.1, 0), (-0.1, 8), (0.25, 0), (0.26, 1), (0.5, 1), (0.75, 2), (1.0, 2),
        (1.25, 2), (1.3, 3), (1.5, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.6, 5), (3.0, 5), (3.5, 6),
        (4.0, 6), (5.0, 6), (5.1, 7), (6.0, 7), (100.0, 7), (float("inf"), 7), (-1.75, 12), (-7.0, 15),
    ],
)
def test_e2m1_encode_rounds_to_nearest_ties_to_even(x, code):
    assert int(fmt.e2m1_encode(torch.tensor([x]))[0]) == code


def test_e2m1_encode_is_nearest_on_a_dense_grid():
    x = torch.linspace(-7, 7, 28001)
    got = fmt.e2m1_decode(fmt.e2m1_encode(x))
    table = torch.tensor(E2M1_TABLE + [-v for v in E2M1_TABLE[1:]])
    best = (x[:, None] - table[None, :]).abs().min(dim=1).values
    assert torch.all((got - x).abs() <= best + 1e-6)


@pytest.mark.parametrize(
    "code, value",
    [(0x00, 0.0), (0x01, 2.0**-9), (0x07, 7 * 2.0**-9), (0x08, 2.0**-6), (0x38, 1.0), (0x3C, 1.5),
     (0x7E, 448.0), (0x80, -0.0), (0xB8, -1.0), (0xFE, -448.0)],
)
def test_e4m3_hand_table(code, value):
    got = fmt.e4m3_decode(torch.tensor([code], dtype=torch.uint8))[0]
    assert float(got) == value and math.copysign(1, float(got)) == math.copysign(1, value)
    assert int(fmt.e4m3_encode(torch.tensor([value]))[0]) == code


def test_e4m3_nan_codes():
    got = fmt.e4m3_decode(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))
    assert torch.isnan(got).all()
    assert fmt.e4m3_encode(torch.tensor([float("nan")])).item() == 0x7F
    assert fmt.e4m3_encode(torch.tensor([-float("nan")])).item() == 0xFF


def test_e4m3_decode_matches_torch_on_all_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = fmt.e4m3_decode(codes)
    theirs = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.nan_to_num(ours, 1234.0), torch.nan_to_num(theirs, 1234.0))


def test_e4m3_encode_matches_torch_rne_and_saturates():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen) * torch.exp(torch.randn(200_000, generator=gen) * 5)
    # exact midpoints between neighbouring codes exercise ties-to-even
    grid = fmt.e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8))
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x, mids, -mids, torch.tensor([449.0, 464.0, 1e6, -1e6, float("inf"), -float("inf"), 2.0**-10])])
    ours = fmt.e4m3_encode(x)
    theirs = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)
    assert ours[-3:-1].tolist() == [0x7E, 0xFE]


def test_quantize_roundtrip_exact_on_representable_values():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (64, 128), generator=gen, dtype=torch.uint8)
    codes[:, ::16] = 7  # each group's amax is exactly 6 * scale
    scales = torch.randint(0x10, 0x70, (64, 8), generator=gen, dtype=torch.uint8)
    gs = 0.5
    x = fmt.dequantize_nvfp4(fmt.pack_nibbles(codes), scales, gs)
    packed, sc = fmt.quantize_nvfp4(x, gs)
    assert torch.equal(sc, scales)
    # -0 and +0 decode alike; compare values, then codes with the zero sign folded
    assert torch.equal(fmt.dequantize_nvfp4(packed, sc, gs), x)
    got = fmt.unpack_nibbles(packed)
    fold = lambda c: torch.where((c & 7) == 0, torch.zeros_like(c), c)  # noqa: E731
    assert torch.equal(fold(got), fold(codes))


def test_quantize_error_bounds_on_random_data():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 128, generator=gen) * 3
    for gs in (1.0, 0.01, 7.0):
        dq = fmt.dequantize_nvfp4(*fmt.quantize_nvfp4(x, gs), gs)
        amax = x.reshape(-1, 8, 16).abs().amax(-1, keepdim=True)
        err = (dq - x).reshape(-1, 8, 16).abs()
        assert torch.all(err <= amax * (1 / 6) * (1 + 2**-3) + 1e-6)  # half a step at the top + scale rounding
        rel = (dq - x).norm() / x.norm()
        assert 0.05 < rel < 0.15, rel  # NVFP4's ~9.5% relative error on Gaussian data


def test_zero_block_gives_zero_scale_and_codes():
    x = torch.randn(3, 128)
    x[1, 16:32] = 0
    packed, sc = fmt.quantize_nvfp4(x, 1.0)
    assert sc[1, 1] == 0 and torch.all(packed[1, 8:16] == 0)
    tiny = torch.full((1, 128), 1e-30)  # scale underflows to 0 -> codes 0, no inf/NaN
    packed, sc = fmt.quantize_nvfp4(tiny, 1.0)
    assert torch.all(sc == 0) and torch.all(packed == 0)


def _poisoned_cache(pages, hkv, seed):
    cache = fmt.alloc_cache(pages, hkv)
    return cache.random_(0, 256, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("row", [0, 1, 37, 126, 127])
def test_write_one_token_changes_exactly_its_bytes(row):
    hkv, page = 2, 3
    cache = _poisoned_cache(5, hkv, seed=row)
    before = cache.clone()
    gen = torch.Generator().manual_seed(10 + row)
    k = torch.randn(1, hkv, 128, generator=gen)
    v = torch.randn(1, hkv, 128, generator=gen)
    fmt.write_kv(cache, torch.tensor([page * 128 + row]), k, v, 0.5, 2.0)

    expect = before.clone()
    kp, ks = fmt.quantize_nvfp4(k[0], 0.5)
    vp, vs = fmt.quantize_nvfp4(v[0], 2.0)
    vcodes = fmt.unpack_nibbles(vp)  # [Hkv, 128 dims]
    for h in range(hkv):
        expect[page, h, row, :64] = kp[h]
        expect[page, h, row, 64:] = ks[h]
        for d in range(128):
            byte = int(expect[page, hkv + h, d, row // 2])
            if row % 2 == 0:
                byte = (byte & 0xF0) | int(vcodes[h, d])
            else:
                byte = (byte & 0x0F) | (int(vcodes[h, d]) << 4)
            expect[page, hkv + h, d, row // 2] = byte
        for g in range(8):
            expect[page, hkv + h, 16 * g + row // 8, 64 + row % 8] = vs[h, g]
    assert torch.equal(cache, expect)
    changed = (cache != before).sum().item()
    assert 0 < changed <= hkv * (72 + 128 + 8)


def test_neighbour_nibbles_survive_and_pair_writes_commute():
    hkv = 1
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, hkv, 128, generator=gen)
    v = torch.randn(2, hkv, 128, generator=gen)
    slots = torch.tensor([128 + 10, 128 + 11])  # one V byte per dim shared by the pair
    a = _poisoned_cache(2, hkv, seed=4)
    b = a.clone()
    fmt.write_kv(a, slots, k, v, 1.0, 1.0)
    fmt.write_kv(b, slots[1:], k[1:], v[1:], 1.0, 1.0)
    fmt.write_kv(b, slots[:1], k[:1], v[:1], 1.0, 1.0)
    assert torch.equal(a, b)
    kk, vv = fmt.read_kv(a, torch.tensor([1]), 1.0, 1.0)
    want_v = fmt.dequantize_nvfp4(*fmt.quantize_nvfp4(v, 1.0), 1.0)
    assert torch.equal(vv[0, :, 10:12].transpose(0, 1), want_v)
    # writing only token 10 leaves token 11's nibbles as they were
    c = _poisoned_cache(2, hkv, seed=4)
    odd_before = c[1, hkv:, :, 5] >> 4
    fmt.write_kv(c, slots[:1], k[:1], v[:1], 1.0, 1.0)
    assert torch.equal(c[1, hkv:, :, 5] >> 4, odd_before)


def test_read_kv_inverts_write_kv_on_shuffled_slots():
    hkv, pages = 2, 4
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(pages * 128, generator=gen)[:300]
    k = torch.randn(300, hkv, 128, generator=gen) * 4
    v = torch.randn(300, hkv, 128, generator=gen)
    cache = _poisoned_cache(pages, hkv, seed=6)
    fmt.write_kv(cache, slots.int(), k, v, 2.0, 0.25)
    kr, vr = fmt.read_kv(cache, torch.arange(pages), 2.0, 0.25)
    page, row = slots // 128, slots % 128
    assert torch.equal(kr[page, :, row], fmt.dequantize_nvfp4(*fmt.quantize_nvfp4(k, 2.0), 2.0))
    assert torch.equal(vr[page, :, row], fmt.dequantize_nvfp4(*fmt.quantize_nvfp4(v, 0.25), 0.25))


def test_alloc_cache_shape():
    c = fmt.alloc_cache(3, 4)
    assert c.shape == (3, 8, 128, 72) and c.dtype == torch.uint8 and int(c.sum()) == 0
    assert fmt.BYTES_PER_TOKEN_PER_HEAD * 3.5 < fmt.BF16_BYTES_PER_TOKEN_PER_HEAD < fmt.BYTES_PER_TOKEN_PER_HEAD * 3.6


@pytest.mark.parametrize(
    "slots, match",
    [([512], "slots"), ([-1], "slots"), ([3, 3], "distinct")],
)
def test_write_kv_rejects_bad_slots_without_touching_the_cache(slots, match):
    cache = _poisoned_cache(4, 1, seed=7)
    before = cache.clone()
    n = len(slots)
    with pytest.raises(ValueError, match=match):
        fmt.write_kv(cache, torch.tensor(slots), torch.zeros(n, 1, 128), torch.zeros(n, 1, 128), 1.0, 1.0)
    assert torch.equal(cache, before)


def test_write_kv_checks_the_one_token_per_byte_promise():
    # slots 4 and 5 share V bytes: the reference refuses the kernels' one-launch promise, cache untouched
    cache = fmt.alloc_cache(1, 1).random_(0, 256, generator=torch.Generator().manual_seed(2))
    before = cache.clone()
    k, v = torch.randn(2, 2, 1, 128)
    with pytest.raises(ValueError, match="share a V byte"):
        fmt.write_kv(cache, torch.tensor([4, 5]), k, v, 1.0, 1.0, one_token_per_byte=True)
    assert torch.equal(cache, before)
    fmt.write_kv(cache, torch.tensor([4, 7]), k, v, 1.0, 1.0, one_token_per_byte=True)
    assert not torch.equal(cache, before)


def test_write_kv_rejects_bad_shapes():
    cache = fmt.alloc_cache(2, 2)
    with pytest.raises(ValueError, match="k:"):
        fmt.write_kv(cache, torch.tensor([0]), torch.zeros(1, 1, 128), torch.zeros(1, 2, 128), 1.0, 1.0)
    with pytest.raises(ValueError, match="cache"):
        fmt.write_kv(torch.zeros(2, 4, 128, 64, dtype=torch.uint8), torch.tensor([0]),
                     torch.zeros(1, 2, 128), torch.zeros(1, 2, 128), 1.0, 1.0)


def test_token_records_roundtrip_and_move_exactly():
    hkv = 2
    gen = torch.Generator().manual_seed(8)
    cache = _poisoned_cache(4, hkv, seed=9)
    src = torch.tensor([5, 6, 130, 200, 511])
    k, v = torch.randn(2, 5, hkv, 128, generator=gen)
    fmt.write_kv(cache, src, k, v, 1.0, 1.0)
    records = fmt.read_token_records(cache, src)
    assert records.shape == (5, hkv, fmt.TOKEN_RECORD_BYTES)
    kp, ks = fmt.quantize_nvfp4(k, 1.0)
    vp, vs = fmt.quantize_nvfp4(v, 1.0)
    assert torch.equal(records, torch.cat((kp, ks, vp, vs), dim=-1))
    # move the tokens to other slots: each destination reads back the source token, nothing else changes
    dst = torch.tensor([300, 7, 8, 131, 0])
    before = cache.clone()
    fmt.write_token_records(cache, dst, records)
    assert torch.equal(fmt.read_token_records(cache, dst), records)
    assert torch.equal(fmt.read_token_records(cache, src), records)
    kr, vr = fmt.read_kv(cache, torch.tensor([2]), 1.0, 1.0)
    assert torch.equal(vr[0, :, 300 - 256], fmt.dequantize_nvfp4(vp[0], vs[0], 1.0))
    others = torch.tensor([s for s in range(512) if s not in set(dst.tolist())])
    assert torch.equal(fmt.read_token_records(cache, others), fmt.read_token_records(before, others))
    with pytest.raises(ValueError, match="records"):
        fmt.write_token_records(cache, dst, records[:, :, :100])


def test_global_scale_is_the_fp32_value_the_kernels_use():
    import numpy as np

    assert fmt.global_scale(0.1) == float(np.float32(0.1)) != 0.1
    assert fmt.global_scale(np.float32(0.5)) == 0.5 and fmt.global_scale(2) == 2.0
    t = fmt.global_scale(torch.tensor(0.1, dtype=torch.float64), "cpu")
    assert t.dtype == torch.float32 and t.shape == (1,) and float(t) == fmt.global_scale(0.1)
    assert torch.equal(fmt.global_scale(0.1, as_tensor=True), t)
    for bad in (True, "0.1", torch.ones(2), torch.ones(1, dtype=torch.int32), 0.0, -0.5, float("inf"), float("nan"),
                1e-46, 1e40):  # the last two round to 0 and inf in fp32
        with pytest.raises(ValueError, match="k_scale"):
            fmt.global_scale(bad, name="k_scale")
