"""Op 2 backward in Triton: gradients of causal EVA attention from the saved output and lse.

With logits s (natural log, `scale * q.k` plus the summary bias), P = exp(s - lse), the upstream
gradients dO and dlse, and delta_t = rowsum(dO_t * O_t) - dlse_t:

    dP = dO V^T,   dS = P * (dP - delta),   dV = P^T dO,   dK = scale dS^T Q,   dQ = scale dS K,
    d bias_c = sum over the query heads of a kv head and over the queries of dS[:, c].

Kernels, no atomics (two calls give bitwise-equal gradients):
- `_eva_bwd_delta`: delta, fp32 [B, H, Nq].
- `_eva_bwd_kv`: one program per (key tile of BLOCK_N exact keys or summaries, batch, kv head), one
  launch for both kinds (the long summary programs first). It holds its k/v tile and fp32 dK/dV
  accumulators and walks the G query heads of its kv head and the query tiles (BLOCK_M positions)
  that see some key of the tile, in one flat loop: exact key j is seen by positions [j, last(j)]
  (last(j) = W floor(j / W) + W - 1 block, C floor(j / C) + C + W - 2 sliding); summary c by every
  position from first(c) on (W ceil((c + 1) C / W) block, (c + 1) C + W - 1 sliding). P is
  recomputed from lse, every tile masked per element, or with config KV_SPLIT_LOOPS in three loops
  like the forward's: only the leading and trailing tiles that see the key tile in part take the
  mask, the middle ones (rows in [last key, last(first key)] for exact keys, from first(last
  summary) on for summaries) none (see `_kv_tile`). Keys and summaries nobody sees get zeros.
  Summary tiles also sum d bias, and their query walk may be cut into SUM_SPLITS pieces (fp32
  partial sums that `_eva_bwd_sum_splits` adds in order): an early summary is seen by nearly every
  query, so uncut they would be a few programs far longer than the rest.
- `_eva_bwd_dq`: one program per query tile of one (batch, head), walking the forward's key blocks
  (`_tile_blocks`: summaries, then exact keys; masks only on partly visible blocks).
- Config DS_STORE: the dK/dV kernel also stores each visible pair's dS (in q's dtype, as the dQ
  product rounds it) to a scratch [B, H, Nq, ~band + Nc] (a query's row: its window's keys by offset
  from start(t), then its summaries), and the dQ kernel reads it instead of recomputing P and dP: one
  product per pair instead of three, no exp, no q / dO / lse / delta loads, for a write and a read of
  the scratch (`ds_store_width`; above DS_STORE_MAX_BYTES it recomputes).

Rows a query cannot see may hold anything (NaN, unused cache): they are loaded, but every term they
could reach is selected away with `where` (never multiplied by zero). fp32 uses IEEE dot products.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashswitch._common import new_output
from flashswitch.kernels_triton.eva_attention import (BIAS_LOG_COUNT, BIAS_NONE, BIAS_TENSOR, MAX_GRID_Y,
                                                      MAX_HEAD_DIM, _add_summary_bias, _load_kv, _load_kv_block,
                                                      _nothing)
from flashswitch.kernels_triton.eva_tiles import LOG2E, _log2_count, _start, _tile_blocks
from flashswitch.kernels_triton.kernel_call import KernelCall

CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "BLOCK_M_DQ", "BLOCK_N_DQ", "num_warps_dq",
               "num_stages_dq")


@triton.jit
def _eva_bwd_delta(
    o_ptr, do_ptr, dlse_ptr, delta_ptr, H, Nq, D: tl.constexpr,
    stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm,
    stride_lb, stride_lh, stride_lm,
    HAS_DLSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO * O - dlse (fp32; delta is contiguous [B, H, Nq])."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_i < Nq
    mask = row_ok[:, None] & (offs_d < D)[None, :]
    rows = offs_i.to(tl.int64)
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :], mask=mask,
                other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + rows[:, None] * stride_dm + offs_d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        dl = tl.load(dlse_ptr + b * stride_lb + h * stride_lh + rows * stride_lm, mask=row_ok, other=0.0)
        delta -= dl.to(tl.float32)
    tl.store(delta_ptr + (b * H + h) * Nq + rows, delta, mask=row_ok)


@triton.jit
def _first_seer(c, C, W, SLIDING: tl.constexpr):
    """The first position whose queries see summary c (every later one sees it too)."""
    if SLIDING:
        t = (c + 1) * C + W - 1
    else:
        t = tl.cdiv((c + 1) * C, W) * W
    return t


@triton.jit
def _last_seer(j, C, W, SLIDING: tl.constexpr):
    """The last position whose queries see exact key j (positions j .. last see it)."""
    if SLIDING:
        t = (j // C) * C + C + W - 2
    else:
        t = (j // W) * W + W - 1
    return t


@triton.jit
def _kv_walk_range(n0, N, Nq, C, W, q_offset, SUMMARY: tl.constexpr, SLIDING: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query walk of the key tile [n0, n0 + BLOCK_N) of N keys (exact keys, or summaries), n0 < N:
    (t_lo, t_hi, n_tiles, i_a, i_b). Positions [t_lo, t_hi] are the queries that see some key of the tile,
    walked in n_tiles tiles of BLOCK_M from t_lo; every row of tiles [i_a, i_b) is a query that sees every
    key of the tile below N, the others see it in part. Rows past N may count as seen: they are zeros
    (k, v and bias read masked) whose gradients are never stored, and one row's terms reach no other row's.
    Elementwise on tensors too (the tests check it against the visibility rule of SPEC.md)."""
    t_last = q_offset + Nq - 1
    n_end = tl.minimum(n0 + BLOCK_N - 1, N - 1)
    if SUMMARY:
        t_lo = tl.maximum(_first_seer(n0, C, W, SLIDING), q_offset)
        t_hi = t_last
        full_lo = _first_seer(n_end, C, W, SLIDING)                         # sees summaries <= n_end
        full_hi = t_hi
    else:
        t_lo = tl.maximum(n0, q_offset)
        t_hi = tl.minimum(_last_seer(n_end, C, W, SLIDING), t_last)
        full_lo = n_end                                                     # causal: t >= every key
        full_hi = tl.minimum(_last_seer(n0, C, W, SLIDING), t_hi)           # start(t) <= n0
    n_tiles = tl.cdiv(tl.maximum(t_hi - t_lo + 1, 0), BLOCK_M)
    i_a = tl.minimum(tl.cdiv(tl.maximum(full_lo - t_lo, 0), BLOCK_M), n_tiles)
    i_b = tl.maximum(tl.maximum(full_hi - t_lo + 1, 0) // BLOCK_M, i_a)
    return t_lo, t_hi, n_tiles, i_a, i_b


@triton.jit
def _kv_walk(dk, dv, dbias, k, v, bias2, q_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, b, hkv, H, G, Nq, Nc, C, W,
             q_offset, it_lo, it_hi, n_seg, m_first, t_hi, offs_n, offs_m, offs_d, mask_d,
             stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm,
             stride_dsb, stride_dsh, stride_dsm, ds_col_e, ds_col0,
             qk_scale, SUMMARY: tl.constexpr, SLIDING: tl.constexpr, BIAS_MODE: tl.constexpr,
             EVEN_D: tl.constexpr, MASK: tl.constexpr, FROM_ZERO: tl.constexpr, DOT_PREC: tl.constexpr,
             DS_STORE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Add to dk, dv (and dbias) the (query head, query tile) pairs it in [it_lo, it_hi) of a run of n_seg
    query tiles from position m_first: head hkv * G + it // n_seg, tile m_first + (it % n_seg) * BLOCK_M.
    MASK: each element takes its visibility (rows past t_hi are no queries). Without MASK every row of
    every tile is a query that sees every key of the key tile: no compares, no `where`. FROM_ZERO: the
    loop counts from 0 (the split loops: from it_lo, Triton 3.6 serialized the summary path's wgmma).
    DS_STORE: dS also goes to the scratch the dQ kernel reads (`_dq_stored`): row t - q_offset of head h,
    column ds_col_e + n - start(t) for exact key n, ds_col0 + n for summary n. Whole key columns of
    each query row are stored (zeros where it does not see the key; each (row, column) belongs to one
    key, so one program), so that the store's mask is per row and its 16-bit values go out in vectors
    along the keys; `ds_store_width` pads the rows for it."""
    if FROM_ZERO:
        j_lo = 0
        j_hi = it_hi - it_lo
        base = it_lo
    else:
        j_lo = it_lo
        j_hi = it_hi
        base = 0
    for j in range(j_lo, j_hi):
        it = base + j
        h = hkv * G + it // n_seg
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_dob + h * stride_doh
        lse_base = lse_ptr + b * stride_lb + h * stride_lh
        delta_base = delta_ptr + (b * H + h) * Nq
        m0 = m_first + (it % n_seg) * BLOCK_M
        t_row = m0 + offs_m
        if MASK:
            row_ok = t_row <= t_hi
        i_row = (t_row - q_offset).to(tl.int64)
        q_ptrs = q_base + i_row[:, None] * stride_qm + offs_d[None, :]
        do_ptrs = do_base + i_row[:, None] * stride_dom + offs_d[None, :]
        if MASK:
            lmask = row_ok[:, None] & mask_d[None, :]
            q = tl.load(q_ptrs, mask=lmask, other=0.0)
            do = tl.load(do_ptrs, mask=lmask, other=0.0)
            lse2 = tl.load(lse_base + i_row * stride_lm, mask=row_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_base + i_row, mask=row_ok, other=0.0)
        else:
            if EVEN_D:
                q = tl.load(q_ptrs)
                do = tl.load(do_ptrs)
            else:
                q = tl.load(q_ptrs, mask=mask_d[None, :], other=0.0)
                do = tl.load(do_ptrs, mask=mask_d[None, :], other=0.0)
            lse2 = tl.load(lse_base + i_row * stride_lm) * 1.4426950408889634
            delta = tl.load(delta_base + i_row)

        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale   # [BLOCK_N, BLOCK_M], base 2
        if SUMMARY and BIAS_MODE != 0:
            sT += bias2[:, None]
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        if MASK:
            if SUMMARY:
                sc_row = tl.minimum(_start(t_row, C, W, SLIDING) // C, Nc)
                vis = (offs_n[:, None] < sc_row[None, :]) & row_ok[None, :]
            else:
                st_row = _start(t_row, C, W, SLIDING)
                vis = (offs_n[:, None] >= st_row[None, :]) & (offs_n[:, None] <= t_row[None, :]) & row_ok[None, :]
            pT = tl.exp2(tl.where(vis, sT, float("-inf")) - lse2[None, :])
            dsT = tl.where(vis, pT * (dpT - delta[None, :]), 0.0)
        else:
            pT = tl.exp2(sT - lse2[None, :])
            dsT = pT * (dpT - delta[None, :])
        if DS_STORE:
            if SUMMARY:
                col = offs_n[:, None] + ds_col0
            else:
                col = offs_n[:, None] + (ds_col_e - _start(t_row, C, W, SLIDING))[None, :]
            # int32 offsets within the (batch, head)'s rows: the launcher caps the scratch below 2^31 elements
            ds_ptrs = ds_ptr + (b * stride_dsb + h * stride_dsh) + ((t_row - q_offset)[None, :] * stride_dsm + col)
            if MASK:
                tl.store(ds_ptrs, dsT.to(ds_ptr.dtype.element_ty), mask=row_ok[None, :])
            else:
                tl.store(ds_ptrs, dsT.to(ds_ptr.dtype.element_ty))
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
        if SUMMARY and BIAS_MODE == 1:
            dbias += tl.sum(dsT, axis=1)
    return dk, dv, dbias


@triton.jit
def _kv_tile(
    pid_n, pid_bh, split, n_splits, q_ptr, k_ptr, v_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    dbias_ptr, ds_ptr, H, Hkv, G, Nq, Nk, Nc, N, D: tl.constexpr, C, W, q_offset,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_bb, stride_bh, stride_bc,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dsb, stride_dsh, stride_dsm, ds_col_e, ds_col0,
    qk_scale, scale,
    SUMMARY: tl.constexpr, SLIDING: tl.constexpr, BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr,
    SPLIT_LOOPS: tl.constexpr, DOT_PREC: tl.constexpr, DS_STORE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dK, dV of key tile pid_n of N keys (exact keys, or with SUMMARY the summaries: k_ptr/v_ptr are then
    k_sum/v_sum and N = Nc) of (batch, kv head) pid_bh; with SUMMARY and a tensor bias also d bias. The
    (query head, query tile) pairs that see the tile are cut into n_splits pieces; this one sums piece
    `split` (its caller points the gradients at that piece's partial sums).

    The query tiles are walked in one loop that masks every tile or, with SPLIT_LOOPS, in three: the
    leading tiles that see the key tile in part, the middle ones whose every row sees all of it (no
    mask), the trailing ones that see it in part (a sliding window's trailing edge, the last tile's
    rows past the queries). The n_splits pieces cut the pairs in that order: lead, middle, trail. A
    branch on "tile fully visible" inside one loop, with tensor values on both sides, makes Triton
    3.6's software pipeliner fail (or miscompile) it: the mask is a constexpr per loop."""
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = (pid_bh % Hkv).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    # the k, v rows of the tile (rows past N read as zeros)
    k_ptrs = k_ptr + b * stride_kb + hkv * stride_kh + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = v_ptr + b * stride_vb + hkv * stride_vh + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :]
    k, v = _load_kv(k_ptrs, v_ptrs, offs_n, N, mask_d, EVEN_D)

    bias2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    if SUMMARY:
        if BIAS_MODE == 1:
            bias = tl.load(bias_ptr + b * stride_bb + hkv * stride_bh + offs_n.to(tl.int64) * stride_bc,
                           mask=offs_n < N, other=0.0).to(tl.float32)
            bias2 = bias * 1.4426950408889634
        elif BIAS_MODE == 2:
            bias2 = _log2_count(offs_n, Nk, C)
    t_lo, t_hi, n_tiles, i_a, i_b = _kv_walk_range(n0, N, Nq, C, W, q_offset, SUMMARY, SLIDING, BLOCK_M, BLOCK_N)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_N], dtype=tl.float32)
    # this piece's share [lo, hi) of the (query head, query tile) pairs, in one fixed order
    lo = split * (G * n_tiles) // n_splits
    hi = (split + 1) * (G * n_tiles) // n_splits
    if SPLIT_LOOPS:
        # the pairs ordered as the leading tiles of every head, the middle ones, the trailing ones; each
        # loop takes the part of [lo, hi) that falls in its run
        n_lead = G * i_a
        n_mid = G * (i_b - i_a)
        n_trail = G * (n_tiles - i_b)
        dk, dv, dbias = _kv_walk(dk, dv, dbias, k, v, bias2, q_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, b, hkv, H,
                                 G, Nq, Nc, C, W, q_offset, tl.minimum(lo, n_lead), tl.minimum(hi, n_lead),
                                 tl.maximum(i_a, 1), t_lo, t_hi, offs_n, offs_m, offs_d, mask_d,
                                 stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                                 stride_lb, stride_lh, stride_lm, stride_dsb, stride_dsh, stride_dsm, ds_col_e,
                                 ds_col0, qk_scale, SUMMARY, SLIDING, BIAS_MODE, EVEN_D, True, True, DOT_PREC,
                                 DS_STORE, BLOCK_M)
        lo -= n_lead
        hi -= n_lead
        dk, dv, dbias = _kv_walk(dk, dv, dbias, k, v, bias2, q_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, b, hkv, H,
                                 G, Nq, Nc, C, W, q_offset, tl.minimum(tl.maximum(lo, 0), n_mid),
                                 tl.minimum(tl.maximum(hi, 0), n_mid), tl.maximum(i_b - i_a, 1),
                                 t_lo + i_a * BLOCK_M, t_hi, offs_n, offs_m, offs_d,
                                 mask_d, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                                 stride_lb, stride_lh, stride_lm, stride_dsb, stride_dsh, stride_dsm, ds_col_e,
                                 ds_col0, qk_scale, SUMMARY, SLIDING, BIAS_MODE, EVEN_D, False, True, DOT_PREC,
                                 DS_STORE, BLOCK_M)
        lo -= n_mid
        hi -= n_mid
        dk, dv, dbias = _kv_walk(dk, dv, dbias, k, v, bias2, q_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, b, hkv, H,
                                 G, Nq, Nc, C, W, q_offset, tl.minimum(tl.maximum(lo, 0), n_trail),
                                 tl.minimum(tl.maximum(hi, 0), n_trail), tl.maximum(n_tiles - i_b, 1),
                                 t_lo + i_b * BLOCK_M, t_hi, offs_n, offs_m, offs_d,
                                 mask_d, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                                 stride_lb, stride_lh, stride_lm, stride_dsb, stride_dsh, stride_dsm, ds_col_e,
                                 ds_col0, qk_scale, SUMMARY, SLIDING, BIAS_MODE, EVEN_D, True, True, DOT_PREC,
                                 DS_STORE, BLOCK_M)
    else:
        # one flat loop over (query head of the group, query tile): a single software pipeline
        dk, dv, dbias = _kv_walk(dk, dv, dbias, k, v, bias2, q_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, b, hkv, H,
                                 G, Nq, Nc, C, W, q_offset, lo, hi, n_tiles, t_lo, t_hi, offs_n, offs_m, offs_d,
                                 mask_d, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                                 stride_lb, stride_lh, stride_lm, stride_dsb, stride_dsh, stride_dsm, ds_col_e,
                                 ds_col0, qk_scale, SUMMARY, SLIDING, BIAS_MODE, EVEN_D, True, False, DOT_PREC,
                                 DS_STORE, BLOCK_M)

    nmask = (offs_n < N)[:, None] & mask_d[None, :]
    dk_ptrs = dk_ptr + b * stride_dkb + hkv * stride_dkh + offs_n.to(tl.int64)[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = dv_ptr + b * stride_dvb + hkv * stride_dvh + offs_n.to(tl.int64)[:, None] * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=nmask)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=nmask)
    if SUMMARY and BIAS_MODE == 1:  # dbias is contiguous fp32 [B, Hkv, Nc]
        tl.store(dbias_ptr + (b * Hkv + hkv) * N + offs_n, dbias, mask=offs_n < N)


@triton.jit
def _eva_bwd_kv(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dks_ptr, dvs_ptr,
    dbias_ptr, ds_ptr, H, Hkv, G, Nq, Nk, Nc, D: tl.constexpr, C, W, q_offset, n_sum_tiles, n_key_tiles, SUM_SPLITS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_bb, stride_bh, stride_bc,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dksb, stride_dksh, stride_dksn,
    stride_dvsb, stride_dvsh, stride_dvsn,
    stride_dkss, stride_dvss, stride_dbs,
    stride_dsb, stride_dsh, stride_dsm, ds_col_e, ds_col0,
    qk_scale, scale,
    SLIDING: tl.constexpr, BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
    DOT_PREC: tl.constexpr, DS_STORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One launch for summary tiles then exact-key tiles. Summary tile c0 is seen by every query from
    first(c0) on, so the early summaries are the longest programs: they come first, tile-major over the
    (batch, kv head)s, and the many short exact-key programs fill in behind them. With SUM_SPLITS > 1
    each summary tile's queries are cut into that many pieces, whose partial sums (fp32, one slice per
    piece: dks/dvs/dbias then point at scratch) `_eva_bwd_sum_splits` adds up in order."""
    pid = tl.program_id(0)
    BH = tl.num_programs(0) // (n_sum_tiles * SUM_SPLITS + n_key_tiles)
    n_sum_programs = n_sum_tiles * SUM_SPLITS * BH
    if pid < n_sum_programs:
        r = pid % (SUM_SPLITS * BH)
        split = r // BH
        _kv_tile(pid // (SUM_SPLITS * BH), r % BH, split, SUM_SPLITS, q_ptr, ks_ptr, vs_ptr, bias_ptr, do_ptr,
                 lse_ptr, delta_ptr, dks_ptr + split.to(tl.int64) * stride_dkss,
                 dvs_ptr + split.to(tl.int64) * stride_dvss, dbias_ptr + split.to(tl.int64) * stride_dbs, ds_ptr,
                 H, Hkv, G, Nq, Nk, Nc, Nc, D, C, W, q_offset,
                 stride_qb, stride_qh, stride_qm, stride_ksb, stride_ksh, stride_ksn,
                 stride_vsb, stride_vsh, stride_vsn, stride_bb, stride_bh, stride_bc,
                 stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm,
                 stride_dksb, stride_dksh, stride_dksn, stride_dvsb, stride_dvsh, stride_dvsn,
                 stride_dsb, stride_dsh, stride_dsm, ds_col_e, ds_col0,
                 qk_scale, scale, True, SLIDING, BIAS_MODE, EVEN_D, SPLIT_LOOPS, DOT_PREC, DS_STORE, BLOCK_M,
                 BLOCK_N, BLOCK_D)
    else:
        # neighbouring programs: neighbouring key tiles of one head, whose query ranges overlap (L2)
        p = pid - n_sum_programs
        _kv_tile(p % n_key_tiles, p // n_key_tiles, 0, 1, q_ptr, k_ptr, v_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr,
                 dk_ptr, dv_ptr, dbias_ptr, ds_ptr, H, Hkv, G, Nq, Nk, Nc, Nk, D, C, W, q_offset,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_bb, stride_bh, stride_bc,
                 stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm,
                 stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                 stride_dsb, stride_dsh, stride_dsm, ds_col_e, ds_col0,
                 qk_scale, scale, False, SLIDING, BIAS_MODE, EVEN_D, SPLIT_LOOPS, DOT_PREC, DS_STORE, BLOCK_M,
                 BLOCK_N, BLOCK_D)


@triton.jit
def _eva_bwd_sum_splits(
    pk_ptr, pv_ptr, pb_ptr, dks_ptr, dvs_ptr, dbias_ptr, R, Hkv, Nc, D: tl.constexpr, SPLITS,
    stride_dksb, stride_dksh, stride_dksn, stride_dvsb, stride_dvsh, stride_dvsn,
    HAS_DBIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dk_sum, dv_sum (and d bias) as the in-order sum of SPLITS partials: contiguous fp32
    [SPLITS, R, D] (and [SPLITS, R]) with rows r = (b * Hkv + hkv) * Nc + c."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_r < R
    mask = row_ok[:, None] & (offs_d < D)[None, :]
    acc_k = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(0, SPLITS):
        off = s * R + offs_r
        acc_k += tl.load(pk_ptr + off[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        acc_v += tl.load(pv_ptr + off[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        if HAS_DBIAS:
            acc_b += tl.load(pb_ptr + off, mask=row_ok, other=0.0)
    c = offs_r % Nc
    bh = offs_r // Nc
    b = bh // Hkv
    h = bh % Hkv
    k_off = b * stride_dksb + h * stride_dksh + c * stride_dksn
    v_off = b * stride_dvsb + h * stride_dvsh + c * stride_dvsn
    tl.store(dks_ptr + k_off[:, None] + offs_d[None, :], acc_k.to(dks_ptr.dtype.element_ty), mask=mask)
    tl.store(dvs_ptr + v_off[:, None] + offs_d[None, :], acc_v.to(dvs_ptr.dtype.element_ty), mask=mask)
    if HAS_DBIAS:
        tl.store(dbias_ptr + offs_r, acc_b, mask=row_ok)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
               e_lo, e_hi, origin, limit, lo_row, hi_row, Nk, C, qk_scale, offs_n, offs_d, mask_d,
               SUMMARY: tl.constexpr, MASK: tl.constexpr, BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr,
               DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add dS K of key blocks e in [e_lo, e_hi) (positions origin + e * BLOCK_N + [0, BLOCK_N)) to dq.
    MASK: row r sees position n iff lo_row[r] <= n <= hi_row[r]; only positions below `limit` are read.
    Without MASK every row sees the whole block."""
    for e in range(e_lo, e_hi):
        n0 = origin + e * BLOCK_N
        n = n0 + offs_n
        k, v = _load_kv_block(k_base, v_base, stride_kn, stride_vn, n0, n, limit, offs_n, offs_d, mask_d,
                              MASK, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale          # base-2 logits
        if SUMMARY:
            s = _add_summary_bias(s, n, limit, bias_base, stride_bc, Nk, C, MASK, BIAS_MODE)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        if MASK:
            vis = (n[None, :] >= lo_row[:, None]) & (n[None, :] <= hi_row[:, None])
            p = tl.exp2(tl.where(vis, s, float("-inf")) - lse2[:, None])
            ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        else:
            p = tl.exp2(s - lse2[:, None])
            ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _dq_stored(dq, ds_rows, shift, row_ok, k_base, stride_kn, e_lo, e_hi, origin, limit, lo_row, hi_row, offs_n,
               offs_d, mask_d, MASK: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
               ROW_LOADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add dS K of key blocks e in [e_lo, e_hi) to dq, dS read from the scratch the dK/dV kernel wrote
    (DS_STORE): row r's entry for position n at ds_rows[r] + n - shift[r]. MASK as `_dq_blocks`; rows
    past the queries read nothing. ROW_LOADS: the scratch's padding keeps every column of a walked block
    inside its row (`ds_store_width`), so a masked block loads whole rows (in vectors) and zeroes the
    entries its rows do not see (unwritten ones among them) with `where`; else it loads those alone."""
    for e in range(e_lo, e_hi):
        n0 = origin + e * BLOCK_N
        n = n0 + offs_n
        k_ptrs = k_base + n0.to(tl.int64) * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
        if MASK:
            kmask = (n < limit)[:, None]
            if not EVEN_D:
                kmask = kmask & mask_d[None, :]
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
            vis = (n[None, :] >= lo_row[:, None]) & (n[None, :] <= hi_row[:, None]) & row_ok[:, None]
        else:
            if EVEN_D:
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=mask_d[None, :], other=0.0)
            vis = row_ok[:, None]
        ds_ptrs = ds_rows[:, None] + (n[None, :] - shift[:, None])
        if MASK and ROW_LOADS:
            ds = tl.where(vis, tl.load(ds_ptrs, mask=row_ok[:, None], other=0.0), 0.0)
        else:
            ds = tl.load(ds_ptrs, mask=vis, other=0.0)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _eva_bwd_dq(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, ds_ptr,
    H, Hkv, G, Nq, Nk, Nc, D: tl.constexpr, C, W, q_offset,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_bb, stride_bh, stride_bc,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm,
    stride_dsb, stride_dsh, stride_dsm, ds_col_e, ds_col0,
    qk_scale, scale,
    SLIDING: tl.constexpr, BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
    DS_STORE: tl.constexpr, DS_ROW_LOADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dQ of one tile of BLOCK_M queries of one (batch, head): dS recomputed from q, dO, lse and delta,
    or with DS_STORE read from the scratch the dK/dV kernel filled."""
    n_row_blocks = tl.num_programs(0)
    pid_m = n_row_blocks - 1 - tl.program_id(0)     # the longest rows first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hkv = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    row_ok = offs_m < Nq
    t_row = q_offset + offs_m
    st_row = _start(t_row, C, W, SLIDING)
    sc_row = tl.minimum(st_row // C, Nc)
    t_min = q_offset + pid_m * BLOCK_M
    t_max = q_offset + tl.minimum(pid_m * BLOCK_M + BLOCK_M, Nq) - 1
    st_min, c_hi, nb_s_full, nb_s, nb_e, e_a, e_b = _tile_blocks(t_min, t_max, C, W, Nc, SLIDING, BLOCK_N)

    rows = offs_m.to(tl.int64)
    lmask = row_ok[:, None] & mask_d[None, :]
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    ks_base = ks_ptr + b * stride_ksb + hkv * stride_ksh
    zero_row = tl.zeros([BLOCK_M], dtype=tl.int32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if DS_STORE:
        ds_rows = ds_ptr + b * stride_dsb + h * stride_dsh + rows * stride_dsm
        # summaries (at columns ds_col0 + c), then exact keys (at ds_col_e + n - start(t)), in the walk
        # below's blocks
        dq = _dq_stored(dq, ds_rows, zero_row - ds_col0, row_ok, ks_base, stride_ksn, 0, nb_s_full, 0, c_hi,
                        zero_row, sc_row - 1, offs_n, offs_d, mask_d, False, EVEN_D, DOT_PREC, DS_ROW_LOADS,
                        BLOCK_N)
        dq = _dq_stored(dq, ds_rows, zero_row - ds_col0, row_ok, ks_base, stride_ksn, nb_s_full, nb_s, 0, c_hi,
                        zero_row, sc_row - 1, offs_n, offs_d, mask_d, True, EVEN_D, DOT_PREC, DS_ROW_LOADS,
                        BLOCK_N)
        shift = st_row - ds_col_e
        dq = _dq_stored(dq, ds_rows, shift, row_ok, k_base, stride_kn, 0, e_a, st_min, t_max + 1, st_row, t_row,
                        offs_n, offs_d, mask_d, True, EVEN_D, DOT_PREC, DS_ROW_LOADS,
                        BLOCK_N)
        dq = _dq_stored(dq, ds_rows, shift, row_ok, k_base, stride_kn, e_a, e_b, st_min, t_max + 1, st_row, t_row,
                        offs_n, offs_d, mask_d, False, EVEN_D, DOT_PREC, DS_ROW_LOADS,
                        BLOCK_N)
        dq = _dq_stored(dq, ds_rows, shift, row_ok, k_base, stride_kn, e_b, nb_e, st_min, t_max + 1, st_row, t_row,
                        offs_n, offs_d, mask_d, True, EVEN_D, DOT_PREC, DS_ROW_LOADS,
                        BLOCK_N)
    else:
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                    mask=lmask, other=0.0)
        do = tl.load(do_ptr + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :],
                     mask=lmask, other=0.0)
        lse2 = tl.load(lse_ptr + b * stride_lb + h * stride_lh + rows * stride_lm, mask=row_ok,
                       other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + (b * H + h) * Nq + rows, mask=row_ok, other=0.0)
        v_base = v_ptr + b * stride_vb + hkv * stride_vh
        vs_base = vs_ptr + b * stride_vsb + hkv * stride_vsh
        bias_base = bias_ptr + b * stride_bb + hkv * stride_bh
        # summaries every row sees, then the rest of them
        dq = _dq_blocks(dq, q, do, lse2, delta, ks_base, vs_base, stride_ksn, stride_vsn, bias_base, stride_bc,
                        0, nb_s_full, 0, c_hi, zero_row, sc_row - 1, Nk, C, qk_scale, offs_n, offs_d, mask_d,
                        True, False, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N)
        dq = _dq_blocks(dq, q, do, lse2, delta, ks_base, vs_base, stride_ksn, stride_vsn, bias_base, stride_bc,
                        nb_s_full, nb_s, 0, c_hi, zero_row, sc_row - 1, Nk, C, qk_scale, offs_n, offs_d, mask_d,
                        True, True, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N)
        # exact keys below start(t_max), those every row sees, those past t_min (the causal diagonal)
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
                        0, e_a, st_min, t_max + 1, st_row, t_row, Nk, C, qk_scale, offs_n, offs_d, mask_d,
                        False, True, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N)
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
                        e_a, e_b, st_min, t_max + 1, st_row, t_row, Nk, C, qk_scale, offs_n, offs_d, mask_d,
                        False, False, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N)
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
                        e_b, nb_e, st_min, t_max + 1, st_row, t_row, Nk, C, qk_scale, offs_n, offs_d, mask_d,
                        False, True, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N)
    dq_ptrs = dq_ptr + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=lmask)

# ---------------------------------------------------------------- launcher
def _block(cfg: dict, name: str) -> int:
    val = int(cfg[name])
    if val < 16 or val & (val - 1):
        raise ValueError(f"config {name} must be a power of two >= 16, got {val}")
    return val


def _sum_splits(config: dict, programs: int, longest: int, device: torch.device) -> int:
    """Pieces per summary tile (config SUM_SPLITS; 0 or absent: automatic). Each early summary tile is
    seen by nearly all queries: few, long programs. Automatic: enough pieces for ~4 summary programs per
    multiprocessor, each piece at least 16 query tiles long."""
    splits = int(config.get("SUM_SPLITS", 0))
    if splits < 0:
        raise ValueError(f"config SUM_SPLITS must be >= 0, got {splits}")
    if splits == 0:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        splits = max(1, min(16, -(-4 * sms // max(programs, 1)), longest // 16))
    return splits


def launch(q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, dq, dk, dv, dk_sum, dv_sum, dbias, *, chunk_size,
           window_size, sliding, scale, q_offset, log_count, config):
    """Fill dq [B, H, Nq, D], dk, dv [B, Hkv, Nk, D], dk_sum, dv_sum [B, Hkv, Nc, D] and, when a tensor
    `bias` is given, dbias (contiguous fp32 [B, Hkv, Nc]); dbias and dlse may be None.

    Inputs as the forward's `launch` takes them, plus its outputs o and lse, the upstream gradients
    do [B, H, Nq, D] and dlse [B, H, Nq] (unit last strides). The gradient tensors may have any
    strides with a unit last stride. config: BLOCK_M, BLOCK_N, num_warps, num_stages of the dK/dV
    kernel (query tiles x key tiles) and BLOCK_M_DQ, BLOCK_N_DQ, num_warps_dq, num_stages_dq of the
    dQ kernel, all required; SUM_SPLITS (pieces each summary tile's queries are cut into; 0 or absent:
    automatic), KV_SPLIT_LOOPS (the dK/dV kernel walks its query tiles in three loops, the fully
    visible ones unmasked; default off) and DS_STORE (the dK/dV kernel stores dS, which the dQ kernel
    reads instead of recomputing it; default off; `ds_store_width`) optional.
    """
    tensors = (q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, dq, dk, dv, dk_sum, dv_sum, dbias)
    prepare(*tensors, chunk_size=chunk_size, window_size=window_size, sliding=sliding, scale=scale,
            q_offset=q_offset, log_count=log_count, config=config)(*tensors)


def _strides(shape) -> tuple:
    return torch.empty(shape, device="meta").stride()


DS_STORE_MAX_BYTES = 4 << 30  # larger dS scratch (long sequences, many heads): the dQ kernel recomputes dS


def ds_store_width(Nk: int, Nc: int, chunk_size: int, window_size: int, sliding: bool, q_offset: int,
                   block_n: int, block_m_dq: int, block_n_dq: int) -> tuple[int, int, int, bool]:
    """The DS_STORE scratch's row layout: (columns, the column of start(t), the first summary column,
    whether the dQ kernel's masked blocks may load whole rows).

    The dK/dV kernel stores whole key tiles of block_n keys per query row: key n of a tile that row t sees
    some key of lies in [start(t) - block_n + 1, start(t) + band + block_n - 1), band being the keys a
    query sees (n - start(t) < W + C - 1 sliding, < W block; at most Nk). The dQ kernel's blocks of
    block_n_dq keys from start(t_min) of its tile of block_m_dq rows reach below start(t) by
    start(t_max) - start(t_min): under block_m_dq + C sliding, 0 in a block window when no tile straddles
    a window (W and q_offset multiples of block_m_dq; else it loads only what its rows see), and above
    start(t) + band by under block_m_dq + block_n_dq. The summaries' part holds whole tiles of either
    kernel. Parts padded to 16 elements (aligned vectors and rows)."""
    def pad(n):
        return -(-n // 16) * 16
    C, W = chunk_size, window_size
    band = max(1, min(W + C - 1 if sliding else W, Nk))
    row_loads = sliding or (W % block_m_dq == 0 and q_offset % block_m_dq == 0)
    below = max(block_n, (block_m_dq + C) if sliding else 0)
    origin = pad(below)
    exact = pad(origin + band + max(block_n, block_m_dq + block_n_dq))
    sums = pad(max(-(-Nc // block_n) * block_n, -(-Nc // block_n_dq) * block_n_dq))
    return exact + sums, origin, exact, row_loads


def prepare(q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, dq, dk, dv, dk_sum, dv_sum, dbias, *, chunk_size,
            window_size, sliding, scale, q_offset, log_count, config, fast=False):
    """The launches `launch` makes for these arguments, prepared from their metadata (shapes, strides,
    dtypes, device; which of bias, dlse and dbias are given): an enqueue taking the 16 tensors of a call
    with the same metadata, in `launch`'s order. Scratch (delta, split partial sums, DS_STORE's dS) is allocated per
    call. fast: direct launches (kernel_call.py)."""
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"backward config lacks {missing}")
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {D}; the triton backend supports D <= {MAX_HEAD_DIM}")
    if B * Hkv == 0:
        return _nothing
    kwargs = dict(chunk_size=chunk_size, window_size=window_size, sliding=sliding, scale=scale, q_offset=q_offset,
                  log_count=log_count, config=config, fast=fast)
    if B * H > MAX_GRID_Y:  # grid axis 1 holds (batch, head): slices of the batch
        step = MAX_GRID_Y // H
        if step == 0:
            raise ValueError(f"q has {H} heads; the triton backward takes at most {MAX_GRID_Y}")
        parts = []
        for b0 in range(0, B, step):
            sl = slice(b0, b0 + step)
            parts.append((sl, prepare(*(None if t is None else t[sl] for t in (
                q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, dq, dk, dv, dk_sum, dv_sum, dbias)), **kwargs)))

        def enqueue_slices(*tensors):
            for sl, part in parts:
                part(*(None if t is None else t[sl] for t in tensors))
        return enqueue_slices

    C, W = int(chunk_size), int(window_size)
    q_offset = int(q_offset)
    G = H // Hkv
    bm, bn = _block(config, "BLOCK_M"), _block(config, "BLOCK_N")
    bm_dq, bn_dq = _block(config, "BLOCK_M_DQ"), _block(config, "BLOCK_N_DQ")
    split_loops = config.get("KV_SPLIT_LOOPS", False)
    ds_store = config.get("DS_STORE", False)
    for name, val in (("KV_SPLIT_LOOPS", split_loops), ("DS_STORE", ds_store)):
        if not isinstance(val, bool):
            raise TypeError(f"config {name} must be a bool, got {val!r}")
    block_d = max(16, triton.next_power_of_2(D))
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * LOG2E
    has_bias, has_dlse = bias is not None, dlse is not None
    if has_bias:
        bias_mode, sb = BIAS_TENSOR, bias.stride()
    else:
        bias_mode, sb = (BIAS_LOG_COUNT if log_count else BIAS_NONE), (0, 0, 0)
    device = q.device
    has_rows = Nq > 0 and H > 0

    delta_call = None
    if has_rows:
        block_r = max(1, min(64, 4096 // block_d))
        dl = dlse if has_dlse else lse
        delta_call = KernelCall(
            _eva_bwd_delta, (triton.cdiv(Nq, block_r), B * H), 4,
            (H, Nq, D, *o.stride()[:3], *do.stride()[:3], *dl.stride()[:3]),
            dict(HAS_DLSE=has_dlse, BLOCK_R=block_r, BLOCK_D=block_d), dict(num_warps=4), fast=fast)

    common = (H, Hkv, G, Nq, Nk, Nc)
    q_strides = q.stride()[:3]
    tail = (*do.stride()[:3], *lse.stride()[:3])
    kv_strides = (*k.stride()[:3], *v.stride()[:3], *k_sum.stride()[:3], *v_sum.stride()[:3], *sb[:3])
    n_sum_tiles, n_key_tiles = triton.cdiv(Nc, bn), triton.cdiv(Nk, bn)
    splits = _sum_splits(config, n_sum_tiles * B * Hkv, G * triton.cdiv(Nq, bm), device) if n_sum_tiles else 1
    part_k, part_b = (splits, B, Hkv, Nc, D), (splits, B, Hkv, Nc)
    if splits > 1:  # partial sums per piece, fp32 contiguous scratch
        sk = _strides(part_k)
        sbias = _strides(part_b) if has_bias else sk
        g_strides = (*sk[1:4], *sk[1:4], sk[0], sk[0], sbias[0])
    else:
        g_strides = (*dk_sum.stride()[:3], *dv_sum.stride()[:3], 0, 0, 0)
    ds_width, ds_col_e, ds_col0, ds_row_loads = ds_store_width(Nk, Nc, C, W, bool(sliding), q_offset, bn, bm_dq,
                                                               bn_dq)
    ds_shape = (B, H, max(Nq, 0), ds_width)
    ds_store = ds_store and has_rows and B * H * Nq * ds_width * q.element_size() <= DS_STORE_MAX_BYTES
    ds_strides = (*_strides(ds_shape)[:3], ds_col_e, ds_col0) if ds_store else (0, 0, 0, 0, 0)
    kv_call = None
    if n_sum_tiles + n_key_tiles > 0:
        kv_call = KernelCall(
            _eva_bwd_kv, ((n_sum_tiles * splits + n_key_tiles) * B * Hkv,), 15,
            (*common, D, C, W, q_offset, n_sum_tiles, n_key_tiles, splits, *q_strides, *kv_strides, *tail,
             *dk.stride()[:3], *dv.stride()[:3], *g_strides, *ds_strides, qk_scale, float(scale)),
            dict(SLIDING=bool(sliding), BIAS_MODE=bias_mode, EVEN_D=D == block_d, SPLIT_LOOPS=split_loops,
                 DOT_PREC=dot_prec, DS_STORE=ds_store, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d),
            dict(num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"])), fast=fast)
    sum_call = None
    if splits > 1:
        R = B * Hkv * Nc
        block_r = max(1, min(64, 4096 // block_d))
        sum_call = KernelCall(
            _eva_bwd_sum_splits, (triton.cdiv(R, block_r),), 6,
            (R, Hkv, Nc, D, splits, *dk_sum.stride()[:3], *dv_sum.stride()[:3]),
            dict(HAS_DBIAS=has_bias, BLOCK_R=block_r, BLOCK_D=block_d), dict(num_warps=4), fast=fast)
    dq_call = None
    if has_rows:
        bm_dq = min(bm_dq, max(16, triton.next_power_of_2(Nq)))
        dq_call = KernelCall(
            _eva_bwd_dq, (triton.cdiv(Nq, bm_dq), B * H), 11,
            (*common, D, C, W, q_offset, *q_strides, *kv_strides, *tail, *dq.stride()[:3], *ds_strides, qk_scale,
             float(scale)),
            dict(SLIDING=bool(sliding), BIAS_MODE=bias_mode, EVEN_D=D == block_d, DOT_PREC=dot_prec,
                 DS_STORE=ds_store, DS_ROW_LOADS=ds_row_loads, BLOCK_M=bm_dq, BLOCK_N=bn_dq, BLOCK_D=block_d),
            dict(num_warps=int(config["num_warps_dq"]), num_stages=int(config["num_stages_dq"])), fast=fast)

    def enqueue(q, k, v, k_sum, v_sum, bias, o, lse, do, dlse, dq, dk, dv, dk_sum, dv_sum, dbias):
        bias_t = bias if has_bias else q  # stands in, never read
        dbias_t = dbias if has_bias else q
        delta = new_output((B, H, max(Nq, 0)), torch.float32, device)
        if delta_call is not None:
            delta_call(o, do, dlse if has_dlse else lse, delta)
        if splits > 1:  # every element is written
            gks = new_output(part_k, torch.float32, device)
            gvs = new_output(part_k, torch.float32, device)
            gb = new_output(part_b, torch.float32, device) if has_bias else gks
        else:
            gks, gvs, gb = dk_sum, dv_sum, dbias_t
        ds = new_output(ds_shape, q.dtype, device) if ds_store else q  # every entry the dQ kernel reads is written
        if kv_call is not None:
            kv_call(q, k, v, k_sum, v_sum, bias_t, do, lse, delta, dk, dv, gks, gvs, gb, ds)
        if sum_call is not None:
            sum_call(gks, gvs, gb, dk_sum, dv_sum, dbias_t)
        if dq_call is not None:
            dq_call(q, k, v, k_sum, v_sum, bias_t, do, lse, delta, dq, ds)

    enqueue.calls = tuple(c for c in (delta_call, kv_call, sum_call, dq_call) if c is not None)  # tests
    return enqueue
