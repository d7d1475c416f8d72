"""Numerics twin of the gfx950 FlyDSL kernel: its lane arithmetic in torch, on CPU.

The kernel cannot run without an MI350/MI355, so this model carries the algorithm's tests: same
workgroups (4 tokens x one KV head), same page union (first lane of each distinct selected page,
in lane order), the same per-lane bytes (gathered with the kernel's own maps from
:mod:`.geometry`), the same fp16 rounding points (Q, dequantized K/V, P), the per-wave online
softmax over its 32 keys of each page, and the cross-wave combine in the kernel's order.

Each ``v_mfma_f32_16x16x32_f16`` is modelled as an fp32 matmul of the operand matrices its lanes
hold (fp16 products are exact in fp32; only the hardware's summation order within one mfma is
not modelled), ``v_exp_f32`` as fp32 ``exp2`` and ``fma`` as a float64 multiply-add rounded once.
"""

from __future__ import annotations


import torch

from ... import format as fmt
from ...reference import LOG2E, validate_sparse_args, validate_sparse_values
from .geometry import (
    BLK,
    HG,
    KPW,
    NDT,
    NKS,
    NW,
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


_LANE = torch.arange(64)
_N, _G = _LANE % 16, _LANE // 16  # lane (n, g)
_W = torch.arange(NW)


# --------------------------------------------------------------------------- mfma operand layouts


def _a_matrix(regs):
    """Lane registers ``[..., 64, 8]`` -> A ``[..., 16, 32]``: lane (n, g) holds A[n, 8g:8g+8]."""
    return regs.unflatten(-2, (4, 16)).transpose(-3, -2).flatten(-2)


def _b_matrix(regs):
    """Lane registers ``[..., 64, 8]`` -> B ``[..., 32, 16]``: lane (n, g) holds B[8g:8g+8, n]."""
    return regs.unflatten(-2, (4, 16)).transpose(-1, -2).flatten(-3, -2)


def _c_lanes(c):
    """C ``[..., 16, 16]`` -> lane registers ``[..., 64, 4]``: lane (n, g) holds C[4g:4g+4, n]."""
    return c.unflatten(-2, (4, 4)).permute(*range(c.dim() - 2), -3, -1, -2).flatten(-3, -2)


def _lanes_c(regs):
    """Inverse of :func:`_c_lanes`."""
    return regs.unflatten(-2, (4, 16)).permute(*range(regs.dim() - 2), -3, -1, -2).flatten(-3, -2)


def mfma_16x16x32(a_regs, b_regs, acc_regs):
    """``acc + A.B`` in fp32 from per-lane fp16 operands (``[..., 64, 8]``) and acc (``[..., 64, 4]``)."""
    return _c_lanes(_lanes_c(acc_regs) + _a_matrix(a_regs).float() @ _b_matrix(b_regs).float())


def xlane4(x, op):
    """Reduce ``[..., 64]`` over the 4 lanes sharing a head: ``(x0 op x1) op (x2 op x3)``."""
    x = x.unflatten(-1, (4, 16))
    r = op(op(x[..., 0, :], x[..., 1, :]), op(x[..., 2, :], x[..., 3, :]))
    return r.repeat(*([1] * (r.dim() - 1)), 4)


def _fma(a, b, c):
    return (a.double() * b.double() + c.double()).float()


# --------------------------------------------------------------------------- per-page lane data


def _nibbles(b):
    """bytes ``[..., k]`` -> E2M1 values ``[..., 2k]`` (low nibble first), fp32."""
    return fmt.e2m1_decode(fmt.unpack_nibbles(b))


def _gather(pages_bytes, offsets, width):
    """``pages_bytes [P, page_bytes]`` at ``offsets [...]`` + ``0..width-1`` -> ``[P, ..., width]``."""
    idx = offsets.unsqueeze(-1) + torch.arange(width)
    return pages_bytes[:, idx.flatten()].reshape(pages_bytes.shape[0], *idx.shape)


def page_operands(cache, kvh):
    """What every lane of every wave loads from every page, decoded.

    Returns ``kf [P, w, st, ks, 64, 8]`` (fp16 K operands), ``v_codes [P, w, dt, 64, 8]`` (E2M1
    values of the V operands) and ``v_scales [P, w, 64, 8]`` (E4M3 values, possibly NaN): V is
    scaled per workgroup, after the scales of keys nobody sees are zeroed."""
    hkv = fmt.check_cache(cache)
    pages = cache.reshape(cache.shape[0], -1)
    w, n, g = _W[:, None], _N[None, :], _G[None, :]
    st = torch.arange(2)[None, :, None]
    k_codes = _gather(pages, k_code_byte(kvh, w[:, None], n[:, None], g[:, None], st), 16)  # [P, w, st, 64, 16]
    k_sc = fmt.e4m3_decode(_gather(pages, k_scale_byte(kvh, w[:, None], n[:, None], g[:, None], st), 2))
    k_vals = _nibbles(k_codes).unflatten(-1, (NKS, 8))  # [P, w, st, 64, ks, 8]: dims q_dim(g, ks, j)
    # k-step ks lies in scale group 2g + ks // 2: scale byte ks // 2 of the lane's two.
    k_scale = k_sc[..., torch.arange(NKS) // 2, None]  # [P, w, st, 64, ks, 1]
    kf = (k_vals.half() * k_scale.half()).movedim(-2, 3)  # [P, w, st, ks, 64, 8]

    dt = torch.arange(NDT)[None, :, None]
    v_codes = _nibbles(_gather(pages, v_code_byte(hkv, kvh, w[:, None], n[:, None], g[:, None], dt), 4))
    v_scales = fmt.e4m3_decode(_gather(pages, v_scale_byte(hkv, kvh, w, n, g), 8))
    return kf, v_codes, v_scales


# --------------------------------------------------------------------------- the model


def _io_dtype(q_dtype):
    """The kernel variant's q/out type: fp32 queries run the fp16 variant."""
    return torch.bfloat16 if q_dtype == torch.bfloat16 else torch.float16


def lane_pages(block_ids, block_table, req, pos, t_all):
    """``[Hkv, WG, 64]``: the page each lane of each workgroup selected, -1 for none.

    Blocks after the token's own hold only future keys and are dropped, like -1."""
    hkv = block_ids.shape[0]
    n_wg = -(-t_all // TOK_PER_WG)
    blk = torch.full((hkv, n_wg * TOK_PER_WG, TOPK), -1, dtype=torch.long)
    blk[:, :t_all, : block_ids.shape[2]] = block_ids.long()
    own = torch.full((n_wg * TOK_PER_WG,), -1, dtype=torch.long)
    own[:t_all] = pos.long() // BLK
    rows = torch.zeros(n_wg * TOK_PER_WG, dtype=torch.long)
    rows[:t_all] = req.long()
    ok = (blk >= 0) & (blk <= own[None, :, None])
    page = block_table.long()[rows[None, :, None], blk.clamp(min=0)]
    return torch.where(ok, page, -1).reshape(hkv, n_wg, TOK_PER_WG * TOPK)


def page_union(lane_page):
    """``(union [..., 64], n_u [...])``: each distinct page once, in order of its first lane, -1 padded."""
    same = lane_page[..., :, None] == lane_page[..., None, :]
    earlier = torch.ones(64, 64, dtype=torch.bool).tril(-1)  # [lane, j]: j < lane
    first = (lane_page >= 0) & ~(same & earlier).any(-1)
    order = torch.sort((~first).int() * 64 + _LANE, dim=-1).indices
    union = torch.where(torch.gather(first, -1, order), torch.gather(lane_page, -1, order), -1)
    return union, first.sum(-1)


def sparse_prefill_twin(q, cache, block_ids, block_table, req, pos, k_scale, v_scale, sm_scale):
    """What the FlyDSL kernel computes for these arguments (same contract as the reference).

    Preconditions of the kernel are the reference's: a request's blocks map to distinct pages.
    Needs ``H == 16 * Hkv`` and at most 16 ids per token."""
    t_all, h, hkv = validate_sparse_args(q, cache, block_ids, block_table, req, pos)
    validate_sparse_values(block_ids, block_table, req, pos)
    if h != HG * hkv or block_ids.shape[2] > TOPK:
        raise ValueError(f"the FlyDSL kernel needs H == {HG} * Hkv and <= {TOPK} ids per token")
    io = _io_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=q.dtype)
    if t_all == 0:
        return out
    q, cache, block_ids, block_table, req, pos = (x.cpu() for x in (q, cache, block_ids, block_table, req, pos))
    c = torch.tensor(sm_scale * LOG2E, dtype=torch.float32) * fmt.global_scale(k_scale, "cpu", as_tensor=True)[0]
    v_gs = fmt.global_scale(v_scale, "cpu", as_tensor=True)[0]

    n_wg = -(-t_all // TOK_PER_WG)
    n_pad = n_wg * TOK_PER_WG
    tok = torch.arange(n_pad).clamp(max=t_all - 1).reshape(n_wg, TOK_PER_WG)
    own_off = (pos.long() % BLK)[tok]  # [WG, t]
    diag = block_table.long()[req.long(), pos.long() // BLK][tok]  # page of each token's own block
    q16 = q.to(io).half().float()
    lanes_all = lane_pages(block_ids, block_table, req, pos, t_all)  # [Hkv, WG, 64]

    for kvh in range(hkv):
        kf_pages, v_codes_pages, v_scales_pages = page_operands(cache, kvh)
        lane_page = lanes_all[kvh]
        union, n_u = page_union(lane_page)
        # Q^T operands: lane (n, g) holds dims q_dim(g, ks, 0..7) of head n, per token and k-step.
        dims = q_dim(_G[None, :, None], torch.arange(NKS)[:, None, None], torch.arange(8))  # [ks, 64, 8]
        qf = q16[tok][:, :, kvh * HG + _N[None, :, None], dims]  # [WG, t, ks, 64, 8]

        m = torch.full((n_wg, TOK_PER_WG, NW, 64), float("-inf"))
        l_run = torch.zeros(n_wg, TOK_PER_WG, NW, 64)
        o = torch.zeros(n_wg, TOK_PER_WG, NW, NDT, 64, 4)
        w_, g_ = _W[:, None, None, None], _G[None, :, None, None]
        key = score_key(w_, g_, torch.arange(2)[:, None], torch.arange(4))  # [w, 64, st, e]
        key_in_wave = (key - KPW * w_).flatten(-2)  # [w, 64, 8]: a[i] is key 8g + i of the wave
        lane_key0 = score_key(_W[:, None], _G[None, :], 0, 0)  # [w, 64]: the lane's first P.V key
        for u in range(int(n_u.max())):
            active = u < n_u  # [WG]
            page = union[:, u].clamp(min=0)
            hit = active[:, None] & (lane_page.unflatten(-1, (TOK_PER_WG, TOPK)) == union[:, u, None, None]).any(-1)
            t_vis = torch.where(page[:, None] == diag, own_off, BLK - 1)  # [WG, t]: last key t sees
            vis = torch.where(hit, t_vis, -1).amax(-1)  # last key some token using the page sees
            lim = t_vis[:, :, None] - KPW * _W  # [WG, t, w]: the same, counted in the wave's keys

            # Phase K: S = K.Q^T per subtile, masked, online softmax.
            kf = kf_pages[page]  # [WG, w, st, ks, 64, 8]
            acc = torch.zeros(n_wg, TOK_PER_WG, NW, 2, 64, 4)
            for ks in range(NKS):
                acc = mfma_16x16x32(kf[:, None, :, :, ks], qf[:, :, None, None, ks], acc)
            a = acc.permute(0, 1, 2, 4, 3, 5).flatten(-2)  # [WG, t, w, 64, 8]: a[i] = key 8g + i
            a = torch.where(key_in_wave <= lim[..., None, None], a, float("-inf"))
            mx = xlane4(a.amax(-1), torch.maximum)
            m_new = torch.fmax(m, mx * c)
            m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp2(m - m_use)
            p = torch.exp2(_fma(a, c, -m_use[..., None]))
            ps = p[..., 0]
            for i in range(1, 8):
                ps = ps + p[..., i]
            pf = p.half()
            upd = hit[:, :, None, None]
            l_new = l_run * alpha + ps
            # The kernel rescales only when some max grew; alpha is exactly 1 everywhere else.
            o_scaled = o * alpha[:, :, :, None, :, None]

            # Phase V: O^T += V^T.P with the scales of keys nobody using the page sees zeroed.
            keep = lane_key0[..., None] + torch.arange(8) <= vis[:, None, None, None]  # [WG, w, 64, 8]
            v_sc = torch.where(keep, v_scales_pages[page], 0.0)
            vf = v_codes_pages[page].half() * v_sc[:, :, None].half()  # [WG, w, dt, 64, 8]
            o_new = mfma_16x16x32(vf[:, None], pf[:, :, :, None], o_scaled)

            m = torch.where(upd, m_new, m)
            l_run = torch.where(upd, l_new, l_run)
            o = torch.where(upd[..., None, None], o_new, o)

        # Combine the waves: per lane, in wave order, then the 4 lanes of a head.
        big = m.amax(2, keepdim=True)
        big = torch.where(big == float("-inf"), 0.0, big)
        wt = torch.exp2(m - big)  # [WG, t, w, 64]
        l_tot = torch.zeros(n_wg, TOK_PER_WG, 64)
        acc = torch.zeros(n_wg, TOK_PER_WG, NDT, 64, 4)
        for ww in range(NW):
            l_tot = l_tot + l_run[:, :, ww] * wt[:, :, ww]
            acc = acc + o[:, :, ww] * wt[:, :, ww, None, :, None]
        l_tot = xlane4(l_tot, torch.add)
        inv = torch.where(l_tot > 0, v_gs / l_tot, 0.0)
        res = (acc * inv[:, :, None, :, None]).to(io)  # [WG, t, dt, 64 lanes (n, g), 4 e]
        # The kernel stores element e of d-tile dt of lane (n, g) as dim out_dim(g, e, dt) of head n.
        dims = out_dim(_G[:, None], torch.arange(4), torch.arange(NDT)[:, None, None])  # [dt, 64, e]
        head_out = torch.empty(n_wg, TOK_PER_WG, HG, fmt.HEAD_DIM, dtype=io)
        head_out[:, :, _N[:, None], dims] = res
        out[:, kvh * HG : (kvh + 1) * HG] = head_out.flatten(0, 1)[:t_all].to(q.dtype)
    return out
