"""Work split and lane maps of the gfx950 sparse-prefill kernel, shared with its numerics twin.

A workgroup serves ``TOK_PER_WG`` consecutive query tokens of one KV head: 4 waves of 64 lanes.
Wave ``w`` owns keys ``[KPW*w, KPW*w + KPW)`` of every page the 4 tokens selected. In
``v_mfma_f32_16x16x32_f16`` lane ``(n, g) = (lane % 16, lane // 16)`` holds k-elements
``8g .. 8g+7`` of row ``n`` of A and of column ``n`` of B, and rows ``4g .. 4g+3`` of column ``n``
of the result. The maps below are the ones the kernel's loads and the twin's gathers both use
(they only use ``+ * // %``, so they take Python ints, torch tensors or FlyDSL integers alike);
why the cache layout fits them is derived in :mod:`sglang_nvfp4.format`.
"""

from __future__ import annotations

from ... import format as fmt

TOK_PER_WG = 4  # query tokens per workgroup; they share the union of their selected pages
NW = 4  # waves per workgroup
HG = 16  # query heads per KV head: the N of both mfmas
D = fmt.HEAD_DIM  # 128
BLK = fmt.PAGE_SIZE  # 128 keys per page (one logical block)
TOPK = fmt.TOPK  # 16 blocks per token: lanes [16t, 16t + 16) of every wave hold token t's
KPW = BLK // NW  # 32 keys per wave: the k of one P.V mfma
MFMA_K = 32  # k of v_mfma_f32_16x16x32_f16
NKS = D // MFMA_K  # 4 k-steps of S = K.Q^T
NDT = D // 16  # 8 d-tiles of O^T = V^T.P
MAXU = TOK_PER_WG * TOPK  # 64 selections per workgroup, one per lane: the most distinct pages
RAW = 2 * NKS + 1 + NDT + 2  # dwords a lane loads per page: K codes, K scales, V codes, V scales
Q_ROW = D // 8 + 1  # 16-byte tiles per staged Q^T row; the pad tile staggers the 16 heads' banks

HEAD_BYTES = BLK * fmt.ROW_BYTES  # one K (or V^T) block of a KV head inside a page


def k_row(w, n, st):
    """Key (page row) that lane row ``n`` feeds to subtile ``st`` of the S mfma of wave ``w``.

    Keys are permuted so that S leaves lane group ``g`` holding keys ``8g .. 8g+7`` in order
    (:func:`score_key`), which is exactly the B operand layout P needs for O^T += V^T.P."""
    return KPW * w + 8 * (n // 4) + 4 * st + n % 4


def score_key(w, g, st, e):
    """Key of element ``e`` of the S accumulator of subtile ``st`` in lane group ``g``."""
    return KPW * w + 8 * g + 4 * st + e


def q_dim(g, ks, j):
    """Dim held in half ``j`` of k-step ``ks`` of the S operands by lane group ``g``: 32 per lane."""
    return MFMA_K * g + 8 * ks + j


def v_dim(n, dt):
    """Dim of row ``n`` of d-tile ``dt`` of V^T: a lane's 8 d-tiles share one scale group."""
    return 32 * (n // 4) + 8 * (n % 4) + dt


def out_dim(g, e, dt):
    """Dim of element ``e`` of d-tile ``dt`` of O^T in lane group ``g``: ``[32g, 32g + 32)``."""
    return 32 * g + 8 * e + dt


def k_code_byte(kvh, w, n, g, st):
    """Page byte of the lane's 16 K code bytes of subtile ``st``: dims ``q_dim(g, 0..3, 0..7)``."""
    return kvh * HEAD_BYTES + k_row(w, n, st) * fmt.ROW_BYTES + q_dim(g, 0, 0) // 2


def k_scale_byte(kvh, w, n, g, st):
    """Page byte of the lane's 2 K scales of subtile ``st``: groups ``2g, 2g + 1``."""
    return kvh * HEAD_BYTES + k_row(w, n, st) * fmt.ROW_BYTES + fmt.SCALE_OFFSET + q_dim(g, 0, 0) // fmt.SCALE_GROUP


def v_code_byte(hkv, kvh, w, n, g, dt):
    """Page byte of the lane's 4 V code bytes of d-tile ``dt``: keys ``score_key(w, g, *, *)``."""
    return (hkv + kvh) * HEAD_BYTES + v_dim(n, dt) * fmt.ROW_BYTES + score_key(w, g, 0, 0) // 2


def v_scale_byte(hkv, kvh, w, n, g):
    """Page byte of the lane's 8 V scales: its 8 keys in the scale group of its d-tiles."""
    group = v_dim(n, 0) // fmt.SCALE_GROUP
    row = fmt.V_SCALE_ROWS_PER_GROUP * group + score_key(w, g, 0, 0) // 8
    return (hkv + kvh) * HEAD_BYTES + row * fmt.ROW_BYTES + fmt.SCALE_OFFSET
