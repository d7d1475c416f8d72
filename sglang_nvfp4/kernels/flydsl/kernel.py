"""FlyDSL gfx950 kernel: fused NVFP4 sparse prefill (fp16 numerics matched to the reference).

One workgroup = 4 waves serves 4 query tokens x 16 query heads of one KV head. The 64 lanes of a
wave hold the 4 tokens' 16 selected blocks each; the deduplicated union of their pages (ballot /
readlane) is walked once, loading page ``u + 1`` while page ``u`` is computed. Per page, wave ``w``
dequantizes its 32 keys (fp4/fp8 -> fp16 by the gfx950 scaled converts), computes S = K.Q^T and
O^T += V^T.P with ``v_mfma_f32_16x16x32_f16`` for every token that selected the page, under an exp2
online softmax; the 4 waves' partial (max, sum, O) are combined through LDS at the end.

``rounds=2`` combines 2 tokens per round, halving the LDS so two workgroups share a CU; it stages
Q^T in LDS. ``rounds=1`` keeps Q^T in registers and combines all tokens at once (for grids of at
most one workgroup per CU). The lane maps are in :mod:`.geometry`, the arithmetic is modelled
exactly by :mod:`.twin`.
"""



import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, range_constexpr
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from .geometry import (
    BLK,
    D,
    HG,
    KPW,
    MAXU,
    NDT,
    NKS,
    NW,
    Q_ROW,
    RAW,
    TOK_PER_WG,
    TOPK,
    k_code_byte,
    k_scale_byte,
    out_dim,
    q_dim,
    score_key,
    v_code_byte,
    v_scale_byte,
)

IO_DTYPES = ("bf16", "f16")  # q / out element types the kernel reads and writes
ROW_BYTES_IO = D * 2  # one head's 128 bf16/fp16 values


# --------------------------------------------------------------------------- memory helpers


def global_i32_ptr(addr):
    """An i32 global pointer from a raw device address."""
    ptr_t = fx.PointerType.get(T.i32, address_space=fx.AddressSpace.Global, alignment=4)
    return fx.inttoptr(ptr_t, fx.Int64(addr))


def global_f32(addr):
    """The fp32 scalar at a raw device address."""
    ptr_t = fx.PointerType.get(T.f32, address_space=fx.AddressSpace.Global, alignment=4)
    return fx.Float32(fx.inttoptr(ptr_t, fx.Int64(addr))[0])


def buffer_rsrc(addr, num_bytes):
    """A raw buffer descriptor over ``[addr, addr + num_bytes)``; loads outside it return 0 and
    stores outside it are dropped (so ``num_bytes = 0`` disables an access without a branch)."""
    ptr_t = fx.PointerType.get(T.i8, address_space=fx.AddressSpace.Global, alignment=16)
    buf = fx.rocdl.make_buffer_ptr(fx.inttoptr(ptr_t, fx.Int64(addr)), num_records_bytes=fx.Int64(num_bytes))
    return fx.rocdl.get_buffer_rsrc(buf)


def buffer_load(rsrc, byte_offset, ir_type):
    """One buffer load of ``ir_type`` (i16, i32 or a vector of i32) at a per-lane byte offset."""
    return fx.rocdl.raw_ptr_buffer_load(ir_type, rsrc, fx.Int32(byte_offset), fx.Int32(0), 0)


def buffer_store(words, rsrc, byte_offset):
    """Store a ``Vec`` of i32 at a per-lane byte offset."""
    fx.rocdl.raw_ptr_buffer_store(
        fx.as_ir_value(words), rsrc, fx.as_ir_value(fx.Int32(byte_offset)), fx.as_ir_value(fx.Int32(0))
    )


def lds_load16(base, tile):
    """16-byte tile ``tile`` of an LDS i32 array as 4 x i32."""
    return Vec(fx.ptr_load(base + tile * 4, T.i32x4))


def lds_store16(base, tile, words):
    fx.ptr_store(fx.as_ir_value(words), base + tile * 4)


# --------------------------------------------------------------------------- lane arithmetic


def readfirstlane(x):
    return fx.Int32(fx.rocdl.readfirstlane(T.i32, fx.as_ir_value(fx.Int32(x))))


def readlane(x, lane):
    return fx.Int32(fx.rocdl.readlane(T.i32, fx.as_ir_value(x), fx.as_ir_value(fx.Int32(lane))))


def ballot(pred):
    return fx.Int64(fx.rocdl.ballot(T.i64, fx.as_ir_value(pred)))


def lowest_lane(mask):
    return fx.Int32(fx.math.cttz(mask))


def maxf_nn(a, b):
    """max that ignores a NaN operand (``v_max_f32``): -inf entries of masked keys never win."""
    return fx.Float32(fx.arith.maxnumf(a, b))


def exp2(x):
    """``v_exp_f32``: no libm call, so no ROCm device bitcode is needed."""
    return fx.Float32(fx.rocdl.exp2(T.f32, fx.as_ir_value(fx.Float32(x))))


def xlane4(x, op):
    """Reduce over the 4 lanes (n, n+16, n+32, n+48) sharing a head: ``(x0 op x1) op (x2 op x3)``."""
    x = op(x, fx.Float32(fx.gpu.shuffle_xor(x, 16, 64)))
    return op(x, fx.Float32(fx.gpu.shuffle_xor(x, 32, 64)))


def pk_f16(a, b):
    """Two fp32 -> one dword of fp16 (round to nearest even)."""
    return Vec.from_elements([a, b], fx.Float32).to(fx.Float16).bitcast(fx.Int32)[0]


def pk_bf16(a, b):
    """Two fp32 -> one dword of bf16 (round to nearest even)."""
    return Vec.from_elements([a, b], fx.Float32).to(fx.BFloat16).bitcast(fx.Int32)[0]


def _bf16_to_f16(words):
    """4 dwords of bf16 pairs -> 4 dwords of fp16 pairs (round to nearest even, like ``q.half()``)."""
    return Vec(words).bitcast(fx.BFloat16).to(fx.Float32).to(fx.Float16).bitcast(fx.Int32)


def cvt_fp4x2_f16(word, byte):
    """E2M1 codes of byte ``byte`` of ``word`` -> fp16 pair (low nibble first), unscaled."""
    return Vec(fx.rocdl.cvt_scalef32_pk_f16_fp4(T.f16x2, fx.as_ir_value(word), fx.as_ir_value(fx.Float32(1.0)), byte))


def cvt_fp8x2_f16(word, high):
    """E4M3 bytes 0, 1 (or 2, 3 when ``high``) of ``word`` -> fp16 pair, unscaled."""
    return Vec(
        fx.rocdl.cvt_scalef32_pk_f16_fp8(T.f16x2, fx.as_ir_value(word), fx.as_ir_value(fx.Float32(1.0)), high)
    )


def dequant_words(codes, scales):
    """A dword of 8 E2M1 codes and 4 fp16 scale pairs (one per code byte) -> 4 dwords of fp16.

    ``e2m1 * e4m3`` is exact in fp16, so this matches the reference's dequantization bit for bit."""
    return Vec.from_elements(
        [(cvt_fp4x2_f16(codes, i) * scales[i]).bitcast(fx.Int32)[0] for i in range_constexpr(4)], fx.Int32
    )


def mfma_16x16x32(a_words, b_words, acc):
    """``v_mfma_f32_16x16x32_f16``: operands are 4 dwords = 8 fp16 per lane, acc 4 x fp32."""
    a = Vec(a_words).bitcast(fx.Float16)
    b = Vec(b_words).bitcast(fx.Float16)
    return Vec(fx.rocdl.mfma_f32_16x16x32_f16(T.f32x4, [fx.as_ir_value(a), fx.as_ir_value(b), fx.as_ir_value(acc)]))


def kv_lane_loader(cache_addr, page_bytes, kvh, hkv, w, n, g):
    """``load_page(page) -> RAW dwords``: the K rows, V^T columns and scales lane (w, n, g) needs.

    dwords ``[4st, 4st + 4)``: K codes of subtile ``st``; ``8``: K scales (subtile 0 low half,
    subtile 1 high half); ``9 + dt``: V codes of d-tile ``dt``; ``17, 18``: the 8 V scales.
    A negative page loads nothing (zeros), which keeps the prefetch past the last page free."""
    k_code = [k_code_byte(kvh, w, n, g, st) for st in range_constexpr(2)]
    k_scale = [k_scale_byte(kvh, w, n, g, st) for st in range_constexpr(2)]
    v_code = [v_code_byte(hkv, kvh, w, n, g, dt) for dt in range_constexpr(NDT)]
    v_scale = v_scale_byte(hkv, kvh, w, n, g)

    def load_page(page):
        valid = page >= 0
        base = fx.Int64(cache_addr) + fx.Int64(valid.select(page, fx.Int32(0))) * fx.Int64(page_bytes)
        rsrc = buffer_rsrc(base, valid.select(page_bytes, fx.Int32(0)))
        raw = []
        for st in range_constexpr(2):
            k4 = Vec(buffer_load(rsrc, k_code[st], T.i32x4))
            raw += [k4[i] for i in range_constexpr(4)]
        lo, hi = (fx.Int32(fx.Int16(buffer_load(rsrc, k_scale[st], T.i16)).to(fx.Uint16)) for st in range_constexpr(2))
        raw.append(lo | (hi << 16))  # 2-byte reads: a K row's scales are only 2-byte aligned
        raw += [fx.Int32(buffer_load(rsrc, v_code[dt], T.i32)) for dt in range_constexpr(NDT)]
        vs = Vec(buffer_load(rsrc, v_scale, T.i32x2))
        raw += [vs[0], vs[1]]
        return raw

    return load_page


def dequant_k(raw):
    """fp16 K operands ``kf[st][ks]`` of a page."""
    kf = []
    for st in range_constexpr(2):
        ksc = cvt_fp8x2_f16(raw[8], st == 1)  # groups 2g, 2g+1
        # k-step ks holds dims 32g + 8ks .. +7: scale group 2g + ks // 2 for all 8.
        kf.append(
            [
                dequant_words(raw[st * 4 + ks], [Vec.from_elements([ksc[ks // 2]] * 2, fx.Float16)] * 4)
                for ks in range_constexpr(NKS)
            ]
        )
    return kf


def dequant_v(raw, v_scale_keep):
    """fp16 V^T operands ``vf[dt]`` of a page.

    ``v_scale_keep`` masks the lane's 8 V scale bytes: keys that no token using this page can see
    may hold any bytes (NaN scales too), and a zero P would not cancel a NaN in the mfma."""
    vs = []
    for h in range_constexpr(2):
        word = raw[17 + h] & v_scale_keep[h]
        vs += [cvt_fp8x2_f16(word, False), cvt_fp8x2_f16(word, True)]
    # A V byte holds two consecutive keys: already the fp16 pair order of the P operand.
    return [dequant_words(raw[9 + dt], vs) for dt in range_constexpr(NDT)]


def keep_bytes(n_keep):
    """Byte mask keeping the low ``n_keep`` (0..4) bytes of a dword (no shift by 32: LLVM poison)."""
    return (n_keep >= 4).select(fx.Int32(-1), (fx.Int32(1) << (8 * (n_keep & 3))) - 1)


# --------------------------------------------------------------------------- the kernel


def compile_nvfp4_sparse_prefill(rounds: int = 2, io_dtype: str = "bf16"):
    """Build the launcher for one variant.

    Args:
        rounds: rounds of the cross-wave combine. 2 halves its LDS so two workgroups share a CU
            (Q^T staged in LDS, 2 waves per SIMD); 1 keeps Q^T in registers and combines all
            tokens at once (1 wave per SIMD: grids of at most one workgroup per CU).
        io_dtype: ``"bf16"`` or ``"f16"``, the element type of q and out.
    """
    assert rounds in (1, 2), rounds
    assert io_dtype in IO_DTYPES, io_dtype
    tpr = TOK_PER_WG // rounds  # tokens per combine round
    wpe = rounds  # waves per SIMD (EU)
    name = f"nvfp4_sparse_prefill_gfx950_r{rounds}_{io_dtype}"
    o_tiles = NW * tpr * NDT * 64  # 16-byte partial-O tiles per round: (wave, token, d-tile, lane)

    @fx.struct
    class Shared:
        # Q^T during the page loop (rounds=2), then the partial O per (wave, token, d-tile, lane).
        o: fx.Array[fx.Int32, o_tiles * 4, 16]
        # (max, sum) per (wave, token, lane).
        ml: fx.Array[fx.Float32, NW * TOK_PER_WG * 2 * 64, 16]

    def to_f16_words(words):
        return _bf16_to_f16(words) if const_expr(io_dtype == "bf16") else Vec(words)

    def pack_out(a, b):
        return pk_bf16(a, b) if const_expr(io_dtype == "bf16") else pk_f16(a, b)

    @flyc.kernel(name=name, known_block_size=[64 * NW, 1, 1])
    def kernel(
        arg_q: fx.Int64,  # [T, H, 128] io_dtype
        arg_cache: fx.Int64,  # [pages, 2 * Hkv, 128, 72] uint8
        arg_block_ids: fx.Int64,  # [Hkv, T, 16] int32 logical blocks, -1 = none
        arg_bt: fx.Int64,  # [reqs, stride] int32
        arg_req: fx.Int64,  # [T] int32
        arg_pos: fx.Int64,  # [T] int32
        arg_out: fx.Int64,  # [T, H, 128] io_dtype
        arg_ks: fx.Int64,  # fp32 global K scale
        arg_vs: fx.Int64,  # fp32 global V scale
        i32_T: fx.Int32,
        i32_H: fx.Int32,
        i32_hkv: fx.Int32,
        i32_block_ids_hs: fx.Int32,  # block_ids stride over KV heads
        i32_bt_s: fx.Int32,
        i32_page_bytes: fx.Int32,
        f32_c: fx.Float32,  # sm_scale * log2(e)
    ):
        smem = fx.SharedAllocator().allocate(Shared).peek()
        lds_o = smem.o.ptr
        lds_ml = smem.ml.ptr
        tx = fx.Int32(fx.thread_idx.x)
        bidx, kvh = fx.Int32(fx.block_idx.x), fx.Int32(fx.block_idx.y)
        lane = tx % 64
        w = readfirstlane(tx // 64)
        n, g = lane % 16, lane // 16

        block_ids = global_i32_ptr(arg_block_ids)
        bt = global_i32_ptr(arg_bt)
        req_p = global_i32_ptr(arg_req)
        pos_p = global_i32_ptr(arg_pos)
        c = f32_c * global_f32(arg_ks)  # logits in base-2 units per unit of S
        v_gs = global_f32(arg_vs)
        neg_inf = fx.Float32(float("-inf"))
        tok0 = bidx * TOK_PER_WG

        # q / out of this workgroup: 4 tokens from its first one, heads from its KV head's first.
        # The descriptor ends at the tensor's end, so the last workgroup's missing tokens read 0
        # and their stores are dropped.
        io_base = (fx.Int64(tok0) * fx.Int64(i32_H) + fx.Int64(kvh * HG)) * ROW_BYTES_IO
        n_tok = (i32_T - tok0 < TOK_PER_WG).select(i32_T - tok0, fx.Int32(TOK_PER_WG))
        io_bytes = (n_tok * i32_H - kvh * HG) * ROW_BYTES_IO
        q_rsrc = buffer_rsrc(fx.Int64(arg_q) + io_base, io_bytes)
        out_rsrc = buffer_rsrc(fx.Int64(arg_out) + io_base, io_bytes)

        def io_byte(t, head, dim):
            return (t * i32_H + head) * ROW_BYTES_IO + dim * 2

        if const_expr(rounds == 2):
            # Q^T in LDS; thread (token, head, quarter) stages dims [32 quarter, 32 quarter + 32).
            tq, hq, qq = tx // 64, (tx // 4) % HG, tx % 4
            for i in range_constexpr(4):
                q4 = to_f16_words(Vec(buffer_load(q_rsrc, io_byte(tq, hq, q_dim(qq, i, 0)), T.i32x4)))
                lds_store16(lds_o, (tq * HG + hq) * Q_ROW + qq * 4 + i, q4)

        # Per token: the page of its own block, its position in that page, and (rounds=1)
        # its Q^T operands: lane (n, g) holds dims 32g + 8ks .. +7 of head n in k-step ks.
        diag, own_off, q_regs = [], [], []
        for t in range_constexpr(TOK_PER_WG):
            tc = (tok0 + t < i32_T).select(tok0 + t, tok0)
            pos = readfirstlane(pos_p[tc])
            req = readfirstlane(req_p[tc])
            diag.append(readfirstlane(bt[req * i32_bt_s + pos // BLK]))
            own_off.append(pos % BLK)
            if const_expr(rounds == 1):
                q_regs.append(
                    [
                        to_f16_words(Vec(buffer_load(q_rsrc, io_byte(tc - tok0, n, q_dim(g, ks, 0)), T.i32x4)))
                        for ks in range_constexpr(NKS)
                    ]
                )

        def q_frags(t):
            """Token t's Q^T, one B operand per k-step."""
            if const_expr(rounds == 1):
                return q_regs[t]
            return [lds_load16(lds_o, (t * HG + n) * Q_ROW + g * 4 + ks) for ks in range_constexpr(NKS)]

        load_page = kv_lane_loader(arg_cache, i32_page_bytes, kvh, i32_hkv, w, n, g)

        # Lane (token lane // 16, slot lane % 16): the page it selected, -1 for none. A block after
        # the token's own holds only future keys, so it is dropped here rather than masked.
        lane_tok = tok0 + lane // TOPK
        lane_tok_ok = lane_tok < i32_T
        lane_tc = lane_tok_ok.select(lane_tok, tok0)
        blk = fx.Int32(block_ids[kvh * i32_block_ids_hs + lane_tc * TOPK + lane % TOPK])
        lane_own = fx.Int32(pos_p[lane_tc]) // BLK
        lane_blk_ok = lane_tok_ok & (blk >= 0) & (blk <= lane_own)
        lane_page = fx.Int32(bt[fx.Int32(req_p[lane_tc]) * i32_bt_s + lane_blk_ok.select(blk, fx.Int32(0))])
        lane_page = lane_blk_ok.select(lane_page, fx.Int32(-1))

        def page_at(mask):
            """Page of the lowest lane left in ``mask``; -1 when it is empty."""
            pg = readlane(lane_page, (mask != fx.Int64(0)).select(lowest_lane(mask), fx.Int32(0)))
            return (mask != fx.Int64(0)).select(pg, fx.Int32(-1))

        # The union's first page is the lowest valid lane's: issue its loads before the dedup's
        # 63 readlanes (the scheduling barrier keeps them there) so the two overlap.
        raw0 = load_page(page_at(ballot(lane_page >= 0)))
        fx.rocdl.sched_barrier(0)

        # Union: the first lane of each distinct page.
        n_dup = fx.Int32(0)
        for j in range_constexpr(MAXU - 1):
            pj = readlane(lane_page, j)
            n_dup = n_dup + ((lane_page == pj) & (lane > j)).select(fx.Int32(1), fx.Int32(0))
        umask = ballot((lane_page >= 0) & (n_dup == 0))
        n_u = fx.Int32(fx.math.ctpop(umask))

        zero4 = Vec.filled(4, 0.0, fx.Float32)
        zero_words = Vec.filled(4, 0, fx.Int32)
        lane_key0 = score_key(w, g, 0, 0)  # page offset of the lane's first P.V key

        if const_expr(rounds == 2):
            fx.gpu.barrier()  # Q^T staged

        # Iteration u computes page u from registers and loads page u + 1.
        init = [umask]
        init += [neg_inf for _ in range_constexpr(TOK_PER_WG)]
        init += [fx.Float32(0.0) for _ in range_constexpr(TOK_PER_WG)]
        init += [zero4 for _ in range_constexpr(TOK_PER_WG * NDT)]
        init += raw0
        n_st = 1 + 2 * TOK_PER_WG + TOK_PER_WG * NDT
        results = init
        for u, st_ in range(0, n_u, 1, init=[fx.as_ir_value(x) for x in init]):
            rem = fx.Int64(st_[0])
            m = [fx.Float32(st_[1 + t]) for t in range_constexpr(TOK_PER_WG)]
            l_run = [fx.Float32(st_[1 + TOK_PER_WG + t]) for t in range_constexpr(TOK_PER_WG)]
            o = [
                [Vec(st_[1 + 2 * TOK_PER_WG + t * NDT + dt]) for dt in range_constexpr(NDT)]
                for t in range_constexpr(TOK_PER_WG)
            ]
            raw = [fx.Int32(st_[n_st + i]) for i in range_constexpr(RAW)]

            page = page_at(rem)
            rem = rem & (rem - fx.Int64(1))
            raw_next = load_page(page_at(rem))

            # Which tokens selected the page (lanes [16t, 16t + 16) are token t's).
            hits = ballot(lane_page == page)
            lane_bits = fx.Int64((1 << TOPK) - 1)
            hit = [(hits.shrui(fx.Int64(TOPK * t)) & lane_bits) != fx.Int64(0) for t in range_constexpr(TOK_PER_WG)]
            # The last key of the page that one of those tokens sees; the lane's V scales of later
            # keys are zeroed (see dequant_v).
            vis = fx.Int32(-1)
            for t in range_constexpr(TOK_PER_WG):
                t_vis = (page == diag[t]).select(own_off[t], fx.Int32(BLK - 1))
                vis = (hit[t] & (t_vis > vis)).select(t_vis, vis)
            n_vis = vis - lane_key0 + 1
            n_vis = (n_vis < 0).select(fx.Int32(0), (n_vis > 8).select(fx.Int32(8), n_vis))
            keep = [
                keep_bytes((n_vis > 4).select(fx.Int32(4), n_vis)),
                keep_bytes((n_vis < 4).select(fx.Int32(0), n_vis - 4)),
            ]

            # Phase K: scores and softmax of every token that selected the page; P waits in
            # registers so that the K operands are dead before the V operands are built.
            kf = dequant_k(raw)
            pf = []
            for t in range_constexpr(TOK_PER_WG):
                m_t, l_t, o_t, pf_t = m[t], l_run[t], o[t], zero_words
                if hit[t]:
                    qf = q_frags(t)
                    a = []
                    for st in range_constexpr(2):
                        acc = zero4
                        for ks in range_constexpr(NKS):
                            acc = mfma_16x16x32(kf[st][ks], qf[ks], acc)
                        a += [acc[e] for e in range_constexpr(4)]
                    # a[i] is key 8g + i of this wave (geometry.score_key). The limit depends on
                    # the page, which keeps these compares in the loop instead of 32 hoisted masks.
                    lim = (page == diag[t]).select(own_off[t] - w * KPW, fx.Int32(KPW - 1))
                    a = [
                        (score_key(0, g, i // 4, i % 4) <= lim).select(a[i], neg_inf) for i in range_constexpr(8)
                    ]
                    mx = a[0]
                    for i in range_constexpr(1, 8):
                        mx = maxf_nn(mx, a[i])
                    # The running max is kept in scaled units (c > 0).
                    m_new = maxf_nn(m_t, xlane4(mx, maxf_nn) * c)
                    m_use = (m_new == neg_inf).select(fx.Float32(0.0), m_new)
                    alpha = exp2(m_t - m_use)
                    p = [exp2(fx.Float32(fx.math.fma(x, c, -m_use))) for x in a]
                    ps = p[0]
                    for i in range_constexpr(1, 8):
                        ps = ps + p[i]
                    l_t = l_t * alpha + ps
                    # P rounded to fp16: the B operand of O^T += V^T.P, keys 8g .. 8g+7 in order.
                    pf_t = Vec.from_elements([pk_f16(p[2 * j], p[2 * j + 1]) for j in range_constexpr(4)], fx.Int32)
                    # alpha is exactly 1 unless some row's max grew.
                    if ballot(m_new != m_t) != fx.Int64(0):
                        av = Vec.filled(4, alpha, fx.Float32)
                        o_t = [x * av for x in o_t]
                    m_t = m_new
                m[t], l_run[t], o[t] = m_t, l_t, o_t
                pf.append(pf_t)

            # Phase V: O^T += V^T.P for the same tokens.
            vf = dequant_v(raw, keep)
            for t in range_constexpr(TOK_PER_WG):
                o_t = o[t]
                if hit[t]:
                    o_t = [mfma_16x16x32(vf[dt], pf[t], o_t[dt]) for dt in range_constexpr(NDT)]
                o[t] = o_t

            state = [rem] + m + l_run + [x for token_o in o for x in token_o] + raw_next
            results = yield [fx.as_ir_value(x) for x in state]

        # Combine the waves' partials, tpr tokens per round; wave w finalizes token w in round w // tpr.
        if const_expr(rounds == 2):
            fx.gpu.barrier()  # every wave is done reading Q^T
        for t in range_constexpr(TOK_PER_WG):
            lds_ml[((w * TOK_PER_WG + t) * 2) * 64 + lane] = fx.Float32(results[1 + t])
            lds_ml[((w * TOK_PER_WG + t) * 2 + 1) * 64 + lane] = fx.Float32(results[1 + TOK_PER_WG + t])
        for rnd in range_constexpr(rounds):
            for tt in range_constexpr(tpr):
                for dt in range_constexpr(NDT):
                    o_part = Vec(results[1 + 2 * TOK_PER_WG + (tpr * rnd + tt) * NDT + dt]).bitcast(fx.Int32)
                    lds_store16(lds_o, ((w * tpr + tt) * NDT + dt) * 64 + lane, o_part)
            fx.gpu.barrier()
            if w // tpr == rnd:
                t = w  # this wave's token
                ms = [fx.Float32(lds_ml[((ww * TOK_PER_WG + t) * 2) * 64 + lane]) for ww in range_constexpr(NW)]
                big = ms[0]
                for ww in range_constexpr(1, NW):
                    big = maxf_nn(big, ms[ww])
                big = (big == neg_inf).select(fx.Float32(0.0), big)
                wt = [exp2(ms[ww] - big) for ww in range_constexpr(NW)]
                l_tot = fx.Float32(0.0)
                for ww in range_constexpr(NW):
                    l_tot = l_tot + fx.Float32(lds_ml[((ww * TOK_PER_WG + t) * 2 + 1) * 64 + lane]) * wt[ww]
                l_tot = xlane4(l_tot, lambda x, y: x + y)
                inv = (l_tot > fx.Float32(0.0)).select(v_gs / l_tot, fx.Float32(0.0))
                acc = [zero4 for _ in range_constexpr(NDT)]
                for ww in range_constexpr(NW):
                    wv = Vec.filled(4, wt[ww], fx.Float32)
                    for dt in range_constexpr(NDT):
                        o_tile = ((ww * tpr + t - tpr * rnd) * NDT + dt) * 64 + lane
                        acc[dt] = acc[dt] + lds_load16(lds_o, o_tile).bitcast(fx.Float32) * wv
                # Element e of d-tile dt of lane (n, g) is dim out_dim(g, e, dt) of head n: 8 in a row.
                for e in range_constexpr(4):
                    words = Vec.from_elements(
                        [pack_out(acc[2 * j][e] * inv, acc[2 * j + 1][e] * inv) for j in range_constexpr(4)],
                        fx.Int32,
                    )
                    buffer_store(words, out_rsrc, io_byte(t, n, out_dim(g, e, 0)))
            fx.gpu.barrier()

    @flyc.jit
    def launch(
        arg_q: fx.Int64,
        arg_cache: fx.Int64,
        arg_block_ids: fx.Int64,
        arg_bt: fx.Int64,
        arg_req: fx.Int64,
        arg_pos: fx.Int64,
        arg_out: fx.Int64,
        arg_ks: fx.Int64,
        arg_vs: fx.Int64,
        i32_T: fx.Int32,
        i32_H: fx.Int32,
        i32_hkv: fx.Int32,
        i32_block_ids_hs: fx.Int32,
        i32_bt_s: fx.Int32,
        i32_page_bytes: fx.Int32,
        f32_c: fx.Float32,
        stream: fx.Stream,
    ):
        kernel(
            arg_q, arg_cache, arg_block_ids, arg_bt, arg_req, arg_pos, arg_out, arg_ks, arg_vs,
            i32_T, i32_H, i32_hkv, i32_block_ids_hs, i32_bt_s, i32_page_bytes, f32_c,
            value_attrs={"rocdl.waves_per_eu": wpe, "rocdl.flat_work_group_size": f"{64 * NW},{64 * NW}"},
        ).launch(
            grid=((i32_T + TOK_PER_WG - 1) // TOK_PER_WG, i32_hkv, 1),
            block=(64 * NW, 1, 1),
            stream=stream,
        )

    launch.kernel_name = name
    return launch
