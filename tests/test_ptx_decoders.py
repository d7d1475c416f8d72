"""The inline-PTX page decoders, run on the CPU by a small emulator of the PTX instructions they use.

The Hopper kernels decode pages with hand-written PTX (``triton_common._E2M1_WORD_PTX``; the Gluon kernels'
``gluon_common._WORD_PTX``, ``_K_SCALE_PTX`` and ``_VT_SCALES_PTX``), which only a GPU executes. These tests execute
the same instruction text, with each instruction's PTX ISA semantics written out below, on every E2M1 code at every
position of a word and on random words and scale bytes, and compare with :mod:`sglang_nvfp4.format`'s decoders:
a wrong shift, mask, byte selector or output order fails here, on any host.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sglang_nvfp4 import format as fmt

triton = pytest.importorskip("triton")
from sglang_nvfp4.kernels import triton_common  # noqa: E402  (needs triton)

MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """``prmt.b32`` default mode: byte ``i`` of the result is byte ``selector[4i+2:4i]`` of ``{b, a}``,
    or that byte's sign replicated when bit ``4i+3`` is set."""
    source = (b << 32) | a
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """``lop3.b32``: bit ``i`` of the result is bit ``(a_i << 2 | b_i << 1 | c_i)`` of ``lut``, in PTX's
    convention of the operand tables ``a = 0xF0, b = 0xCC, c = 0xAA``."""
    out = 0
    for i in range(32):
        index = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> index) & 1) << i
    return out


def _f16x2(word: int) -> np.ndarray:
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)


def _bits(halves: np.ndarray) -> int:
    low, high = halves.astype(np.float16).view(np.uint16)
    return int(low) | int(high) << 16


def _e4m3x2(pair: int) -> int:
    """``cvt.rn.f16x2.e4m3x2``: the low byte to the low half (exact; E4M3 NaN codes give NaN)."""
    codes = torch.tensor([pair & 0xFF, pair >> 8], dtype=torch.uint8)
    return _bits(fmt.e4m3_decode(codes).numpy().astype(np.float16))


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute straight-line PTX over 32-bit (and 16-bit) registers; ``inputs`` names ``$8``... operands."""
    regs = dict(inputs)

    def value(token: str) -> int:
        token = token.strip()
        return regs[token] if token in regs else int(token, 0)

    for statement in text.strip().removeprefix("{").removesuffix("}").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack: {lo, hi}, word
            lo, hi, src = re.match(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", rest).groups()
            regs[lo], regs[hi] = value(src) & 0xFFFF, value(src) >> 16
            continue
        dst, *args = [x.strip() for x in rest.split(",")]
        a = [value(x) for x in args]
        if op == "mov.b32":
            regs[dst] = a[0]
        elif op == "shl.b32":
            regs[dst] = (a[0] << a[1]) & MASK32
        elif op == "shr.b32":
            regs[dst] = a[0] >> a[1]
        elif op == "and.b32":
            regs[dst] = a[0] & a[1]
        elif op == "lop3.b32":
            regs[dst] = _lop3(*a)
        elif op == "prmt.b32":
            regs[dst] = _prmt(*a)
        elif op == "cvt.rn.f16x2.e4m3x2":
            regs[dst] = _e4m3x2(a[0])
        elif op == "mul.rn.f16x2":
            regs[dst] = _bits(_f16x2(a[0]) * _f16x2(a[1]))
        else:
            raise NotImplementedError(op)
    return regs


def _outputs(regs: dict[str, int]) -> np.ndarray:
    return np.array([regs[f"${i}"] for i in range(8)], dtype=np.uint16).view(np.float16).astype(np.float64)


def _words() -> list[int]:
    """Every code at every position of a word (the other positions hold other codes), then random words."""
    words = [sum(((code + 3 * i + shift) % 16) << (4 * i) for i in range(8)) for code in range(16) for shift in (0, 7)]
    return words + [int(w) for w in torch.randint(0, 2**32, (64,), generator=torch.Generator().manual_seed(0),
                                                   dtype=torch.int64)]


def _codes(word: int) -> torch.Tensor:
    return torch.tensor([(word >> (4 * i)) & 0xF for i in range(8)], dtype=torch.uint8)


def test_code_decoder_gives_e2m1_times_tile_scale_in_code_order():
    """The Triton kernels' word decoder (``_E2M1_WORD_PTX``): code ``i`` of the word -> output ``$i`` =
    ``e2m1 / TILE_SCALE`` exactly, both signs (``-0`` included)."""
    for word in _words():
        got = _outputs(run_ptx(triton_common._E2M1_WORD_PTX.value, {"$8": word}))
        want = fmt.e2m1_decode(_codes(word)).double().numpy() / triton_common.TILE_SCALE.value
        np.testing.assert_array_equal(got, want, err_msg=hex(word))
        assert np.array_equal(np.signbit(got), _codes(word).numpy() >= 8), hex(word)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_gluon_word_decoders_apply_each_codes_scale(kind):
    """The Gluon decoders (``gluon_common``): a K scale byte (``_K_SCALE_PTX``) becomes one operand for all code
    pairs of its words; a V^T octet's scale words (``_VT_SCALES_PTX``) become 4 operands, pair ``p`` taking bytes
    ``2p``, ``2p + 1``. The word decoder (``_WORD_PTX``) multiplies code pair ``p`` by operand ``p``. Outputs are
    ``e2m1 * e4m3 / TILE_SCALE``, exact, for random scale bytes over E4M3's whole non-NaN range (subnormals and
    448 included)."""
    gluon_common = pytest.importorskip("sglang_nvfp4.kernels.gluon_common")
    gen = torch.Generator().manual_seed(1)
    for word in _words():
        scale_bytes = torch.randint(0, 0x7F, (8,), generator=gen, dtype=torch.int64).tolist()  # 0x7F: NaN
        if kind == "k":
            # The other bytes of the scale's word are garbage the operand must ignore.
            operand = run_ptx(gluon_common._K_SCALE_PTX.value, {"$1": scale_bytes[0] | 0xA5C3E700})["$0"]
            operands = [operand] * 4
            scales = [scale_bytes[0]] * 8
        else:
            lo = sum(b << (8 * i) for i, b in enumerate(scale_bytes[:4]))
            hi = sum(b << (8 * i) for i, b in enumerate(scale_bytes[4:]))
            regs = run_ptx(gluon_common._VT_SCALES_PTX.value, {"$4": lo, "$5": hi})
            operands, scales = [regs[f"${p}"] for p in range(4)], scale_bytes
        inputs = {"$8": word, **{f"${9 + p}": operands[p] for p in range(4)}}
        got = _outputs(run_ptx(gluon_common._WORD_PTX.value, inputs))
        scale_values = fmt.e4m3_decode(torch.tensor(scales, dtype=torch.uint8)).double()
        want = (fmt.e2m1_decode(_codes(word)).double() * scale_values).numpy() / triton_common.TILE_SCALE.value
        np.testing.assert_array_equal(got, want, err_msg=f"{hex(word)} {scales}")
