"""Op 2 forward in Triton: causal softmax attention over exact local keys plus the summaries of the
chunks before the window (SPEC.md, op 2).

Flash-attention style. A program owns a tile of BLOCK_M query rows of one (batch, head), or, with
PACK_GQA, of one (batch, kv head): row r is then query r // G of query head hkv * G + r % G, so the
G query heads sharing a kv head read each key tile once. For the rows of a tile the visible set is
a union of two intervals, because start(t) is non-decreasing in t:

    summaries  c in [0, min(start(t_max) / C, Nc))
    exact keys j in [start(t_min), t_max]

Both are walked in BLOCK_N steps, numbered as one list of key blocks (summary blocks first, then
exact blocks counted from start(t_min)), in five loops by kind or, with config FUSE, in one loop
(better when each kind is only a few blocks long: short sliding windows). Blocks that every row of
the tile sees in full (summaries below start(t_min) / C, exact keys inside [start(t_max), t_min])
run without any mask; the few others compare positions per element. Fully invisible blocks are
never visited, so the work is proportional to the visible pairs, and nothing outside the two
intervals reaches the output (k/v past t_max and summaries past the last visible one may hold
anything, e.g. unused cache capacity): pointer loads mask those rows; with config TMA (tiles loaded
by the tensor memory accelerator through descriptors) the five loops zero them in v on masked
blocks, and the FUSE loop's descriptors end at the last key and summary any query sees, so that
rows past them arrive as zeros.

Non-finite inputs: in a masked block p = 0 on a key a row cannot see, and p·inf is NaN, so an inf /
NaN value of v would reach rows that do not see it. The walk does not look for them (finite inputs
would pay on every masked block, and the check kept v in registers in every block of the FUSE loop);
a tile whose accumulator ends non-finite walks its range again with ISOLATE, zeroing those entries
of v in masked blocks and making NaN only the rows whose p reaches one (`_isolate_nonfinite`): a
non-finite input reaches only the queries that see it (SPEC.md, op 2). The second walk's code raises
the kernel's register count, which ptxas sets for the whole kernel: without a config `maxnreg` the
launcher caps it at what the first walk's occupancy (shared memory) allows (`_register_cap`).

With NUM_SPLITS > 1 (flash-decoding) the list of key blocks of each tile is cut into NUM_SPLITS
contiguous pieces, one per program along grid axis 2. Each writes a normalised partial output and
its log-normaliser (fp32) into scratch buffers; `_eva_combine` merges them by lse. A piece in which
a row sees nothing writes o = 0, lse = -inf for that row.

Softmax: fp32, base 2, with scale * log2(e) folded into the logits (and log2(e) into the summary
bias); on blocks with neither mask nor bias (and, in the FUSE loop, on every block without a bias)
the scale goes into the row max and one FMA per logit. A negative scale negates q (exact) and scale
0 runs as 1e-30, so the kernel's scale is > 0 and keeps masked -inf logits -inf. The per-row running
max is clamped to 0 while it is still -inf so masked rows stay finite; p·v accumulates into the
output tile in place. lse is stored in natural log. fp32 inputs use IEEE dot products (no tf32).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashswitch._common import new_output, next_pow2
from flashswitch.kernels_triton.eva_tiles import _log2_count, _qk_scale, _start, _tile_blocks, _window_start
from flashswitch.kernels_triton.kernel_call import KernelCall

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535  # CUDA's limit on grid axes 1 and 2

BIAS_NONE, BIAS_TENSOR, BIAS_LOG_COUNT = 0, 1, 2


@triton.jit
def _load_kv(k_ptrs, v_ptrs, n, limit, mask_d, EVEN_D: tl.constexpr):
    """The k and v rows n < limit of a block (zeros elsewhere)."""
    if EVEN_D:
        lmask = (n < limit)[:, None]
    else:
        lmask = (n < limit)[:, None] & mask_d[None, :]
    return tl.load(k_ptrs, mask=lmask, other=0.0), tl.load(v_ptrs, mask=lmask, other=0.0)


@triton.jit
def _load_kv_block(k_base, v_base, stride_kn, stride_vn, n0, n, limit, offs_n, offs_d, mask_d,
                   MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """The k and v rows of the key block at position n0 through pointers: with MASK only the rows
    n < limit (zeros elsewhere), without it every row. Shared with the backward's dQ kernel."""
    k_ptrs = k_base + n0.to(tl.int64) * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
    v_ptrs = v_base + n0.to(tl.int64) * stride_vn + (offs_n[:, None] * stride_vn + offs_d[None, :])
    if MASK:
        k, v = _load_kv(k_ptrs, v_ptrs, n, limit, mask_d, EVEN_D)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=mask_d[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    return k, v


@triton.jit
def _add_summary_bias(s, n, limit, bias_base, stride_bc, Nk, C, MASK: tl.constexpr, BIAS_MODE: tl.constexpr):
    """Base-2 logits s of summaries n plus their bias (log2(e) times it): the caller's tensor
    (BIAS_MODE 1; with MASK read only below `limit`) or log of the chunk's token count (2). Shared with
    the backward's dQ kernel, whose logits must match the forward's."""
    if BIAS_MODE == 1:
        if MASK:
            bias = tl.load(bias_base + n.to(tl.int64) * stride_bc, mask=n < limit, other=0.0)
        else:
            bias = tl.load(bias_base + n.to(tl.int64) * stride_bc)
        s += bias.to(tl.float32)[None, :] * 1.4426950408889634
    elif BIAS_MODE == 2:
        s += _log2_count(n, Nk, C)[None, :]
    return s


@triton.jit
def _isolate_nonfinite(v, p, acc):
    """v with its non-finite entries zeroed, and acc NaN on the rows whose p reaches a key holding one.
    Masked blocks only: there p = 0 on the keys a row cannot see, and p * inf = NaN in p.v would turn
    that row into NaN; a row that sees such a value is NaN as it would be anyway. Interior blocks,
    which every row sees whole, skip it."""
    if v.dtype == tl.float16:  # all-ones exponent: inf or NaN (tested on the bits, in v's registers)
        fin = (v.to(tl.int16, bitcast=True) & 0x7C00) != 0x7C00
    elif v.dtype == tl.bfloat16:
        fin = (v.to(tl.int16, bitcast=True) & 0x7F80) != 0x7F80
    else:
        fin = tl.abs(v) < float("inf")                                  # false for inf and NaN
    bad = tl.max(tl.where(fin, 0, 1), axis=1)                           # keys with a non-finite value
    hit = tl.max(tl.where((p > 0.0) & (bad[None, :] != 0), 1, 0), axis=1)
    return tl.where(fin, v, 0.0), tl.where(hit[:, None] != 0, float("nan"), acc)


@triton.jit
def _attend(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
            e_lo, e_hi, origin, limit, lo_row, hi_row, Nk, C, qk_scale, offs_n, offs_d, mask_d, row0,
            SUMMARY: tl.constexpr, MASK: tl.constexpr, BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr,
            DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, ISOLATE: tl.constexpr):
    """Fold key blocks e in [e_lo, e_hi) (positions origin + e * BLOCK_N + [0, BLOCK_N)) into the
    running softmax. MASK: row r sees position n iff lo_row[r] <= n <= hi_row[r], and only positions
    below `limit` are read; without MASK every row sees the whole block. A caller tensor bias may be
    -inf (a summary switched off). TMA: k_base / v_base are tensor descriptors of [rows, D] views
    whose row row0 + n is position n of this (batch, kv head); a masked block's rows at or past
    `limit` may then hold anything (another head's rows, unused cache) and v is zeroed there."""
    for e in tl.range(e_lo, e_hi, num_stages=1 if ISOLATE else None):  # the rare second walk: no ring
        n0 = origin + e * BLOCK_N
        n = n0 + offs_n
        if TMA:
            k = k_base.load([row0 + n0, 0])
            v = v_base.load([row0 + n0, 0])
            if MASK:
                v = tl.where((n < limit)[:, None], v, 0.0)
        else:
            k, v = _load_kv_block(k_base, v_base, stride_kn, stride_vn, n0, n, limit, offs_n, offs_d, mask_d,
                                  MASK, EVEN_D)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)               # raw q.k
        if MASK or (SUMMARY and BIAS_MODE != 0):
            s = s * qk_scale                                                # base-2 logits
            if SUMMARY:
                s = _add_summary_bias(s, n, limit, bias_base, stride_bc, Nk, C, MASK, BIAS_MODE)
            if MASK:
                vis = (n[None, :] >= lo_row[:, None]) & (n[None, :] <= hi_row[:, None])
                s = tl.where(vis, s, float("-inf"))
            # a row may have seen only -inf so far
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
        else:
            # every logit finite: the scale folds into the max and into one FMA per logit (the
            # launcher makes qk_scale >= 0 by negating q instead)
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if MASK and ISOLATE:
            v, acc = _isolate_nonfinite(v, p, acc)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)       # accumulates in place
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_fused(acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base, stride_kn, stride_vn, stride_ksn, stride_vsn,
                  bias_base, stride_bc, blk_lo, blk_hi, nb_s, nb_s_full, e_a, e_b, st_min, c_hi, t_max,
                  st_row, t_row, sc_row, Nk, C, qk_scale, offs_n, offs_d, mask_d, b32, hkv32,
                  BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, TMA: tl.constexpr, ISOLATE: tl.constexpr):
    """The same key blocks as the five `_attend` loops, in one loop (FUSE): summary blocks [0, nb_s),
    then exact blocks; a block takes the mask only where some row of the tile does not see all of it.
    One loop keeps one software pipeline full where the five would each be a few blocks long and
    start cold (short sliding windows). TMA: the four bases are [B, Hkv, rows, D] descriptors whose
    rows stop at the last key / summary any query sees, so that a block reading past them gets zeros
    (v needs no zeroing); the rows it reads below that but past `limit` are keys and summaries of
    later queries, which the mask gives p = 0."""
    for e in tl.range(blk_lo, blk_hi, num_stages=1 if ISOLATE else None):  # the rare second walk: no ring
        is_sum = e < nb_s
        ee = e - nb_s
        n0 = tl.where(is_sum, e * BLOCK_N, st_min + ee * BLOCK_N)
        limit = tl.where(is_sum, c_hi, t_max + 1)
        n = n0 + offs_n
        if TMA:
            if is_sum:
                kd = ks_base
                vd = vs_base
            else:
                kd = k_base
                vd = v_base
            k = kd.load([b32, hkv32, n0, 0]).reshape(BLOCK_N, BLOCK_D)
            v = vd.load([b32, hkv32, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            kb = tl.where(is_sum, ks_base, k_base)
            vb = tl.where(is_sum, vs_base, v_base)
            skn = tl.where(is_sum, stride_ksn, stride_kn)
            svn = tl.where(is_sum, stride_vsn, stride_vn)
            k_ptrs = kb + n0.to(tl.int64) * skn + (offs_n[:, None] * skn + offs_d[None, :])
            v_ptrs = vb + n0.to(tl.int64) * svn + (offs_n[:, None] * svn + offs_d[None, :])
            k, v = _load_kv(k_ptrs, v_ptrs, n, limit, mask_d, EVEN_D)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)                # raw q.k
        # the scale folds into the max and into one FMA per logit (qk_scale > 0 here, so that a masked
        # -inf stays -inf); summary blocks with a bias take it before the mask (a NaN or inf bias must
        # not reach rows masked off) and are scaled here already
        sc = qk_scale
        if BIAS_MODE != 0:
            if is_sum:
                if BIAS_MODE == 1:
                    bias = tl.load(bias_base + n.to(tl.int64) * stride_bc, mask=n < limit, other=0.0)
                    s = s * qk_scale + bias.to(tl.float32)[None, :] * 1.4426950408889634
                else:
                    s = s * qk_scale + _log2_count(n, Nk, C)[None, :]
                sc = 1.0
        full = tl.where(is_sum, e < nb_s_full, (ee >= e_a) & (ee < e_b))
        if not full:
            lo_row = tl.where(is_sum, 0, st_row)
            hi_row = tl.where(is_sum, sc_row - 1, t_row)
            vis = (n[None, :] >= lo_row[:, None]) & (n[None, :] <= hi_row[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * sc)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * sc - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if ISOLATE:
            if not full:
                v, acc = _isolate_nonfinite(v, p, acc)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _walk(q, k_base, v_base, ks_base, vs_base, bias_base, blk_lo, blk_hi, nb_s, nb_s_full, nb_e, e_a, e_b, st_min,
          c_hi, t_max, st_row, t_row, sc_row, kv_row0, sum_row0, b, hkv, stride_kn, stride_vn, stride_ksn, stride_vsn,
          stride_bc, Nk, C, qk_scale, offs_n, offs_d, mask_d,
          BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, FUSE: tl.constexpr,
          TMA: tl.constexpr, ISOLATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr):
    """A tile's key blocks [blk_lo, blk_hi) of the list (one FUSE loop or five loops by kind), folded
    into a fresh online softmax: (acc, l_i, m_i)."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    zero_row = tl.zeros([BLOCK_M], dtype=tl.int32)

    if FUSE:
        acc, l_i, m_i = _attend_fused(acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base,
                                      stride_kn, stride_vn, stride_ksn, stride_vsn, bias_base, stride_bc,
                                      blk_lo, blk_hi, nb_s, nb_s_full, e_a, e_b, st_min, c_hi, t_max,
                                      st_row, t_row, sc_row, Nk, C, qk_scale, offs_n, offs_d, mask_d,
                                      b.to(tl.int32), hkv.to(tl.int32), BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N,
                                      BLOCK_D, TMA, ISOLATE)
    else:
        # summaries every row sees
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, ks_base, vs_base, stride_ksn, stride_vsn, bias_base, stride_bc,
                                tl.maximum(blk_lo, 0), tl.minimum(nb_s_full, blk_hi), 0, c_hi,
                                zero_row, sc_row - 1, Nk, C, qk_scale, offs_n, offs_d, mask_d, sum_row0,
                                True, False, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N, TMA, ISOLATE)
        # summaries only some rows see
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, ks_base, vs_base, stride_ksn, stride_vsn, bias_base, stride_bc,
                                tl.maximum(blk_lo, nb_s_full), tl.minimum(nb_s, blk_hi), 0, c_hi,
                                zero_row, sc_row - 1, Nk, C, qk_scale, offs_n, offs_d, mask_d, sum_row0,
                                True, True, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N, TMA, ISOLATE)
        # exact keys below start(t_max)
        lo_e = blk_lo - nb_s
        hi_e = blk_hi - nb_s
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
                                tl.maximum(lo_e, 0), tl.minimum(e_a, hi_e), st_min, t_max + 1,
                                st_row, t_row, Nk, C, qk_scale, offs_n, offs_d, mask_d, kv_row0,
                                False, True, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N, TMA, ISOLATE)
        # exact keys every row sees
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
                                tl.maximum(lo_e, e_a), tl.minimum(e_b, hi_e), st_min, t_max + 1,
                                st_row, t_row, Nk, C, qk_scale, offs_n, offs_d, mask_d, kv_row0,
                                False, False, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N, TMA, ISOLATE)
        # exact keys past t_min (the causal diagonal)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bc,
                                tl.maximum(lo_e, e_b), tl.minimum(nb_e, hi_e), st_min, t_max + 1,
                                st_row, t_row, Nk, C, qk_scale, offs_n, offs_d, mask_d, kv_row0,
                                False, True, BIAS_MODE, EVEN_D, DOT_PREC, BLOCK_N, TMA, ISOLATE)
    return acc, l_i, m_i


@triton.jit
def _normalize(acc, l_i, m_i):
    """(o, lse) of a walk: lse in natural log, -inf (and o = 0) where a row saw nothing."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))


@triton.jit
def _eva_fwd(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bias_ptr, o_ptr, lse_ptr,
    H, Hkv, G, Nq, Nk, Nc, D: tl.constexpr, C, W, q_offset, rows, n_row_blocks, NUM_SPLITS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_bb, stride_bh, stride_bc,
    stride_os, stride_ob, stride_oh, stride_om,
    stride_ls, stride_lb, stride_lh, stride_lm,
    qk_scale, q_sign,
    SLIDING: tl.constexpr, PACK_GQA: tl.constexpr, BIAS_MODE: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr, NEG_Q: tl.constexpr, Q_REG: tl.constexpr, FUSE: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = n_row_blocks - 1 - tl.program_id(0)     # the longest rows first
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    if PACK_GQA:
        b = pid_bh // Hkv
        hkv = pid_bh % Hkv
        GP = G
    else:
        b = pid_bh // H
        hkv = (pid_bh % H) // G
        GP = 1
    b = b.to(tl.int64)
    hkv = hkv.to(tl.int64)

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    row_ok = offs_r < rows
    if PACK_GQA:
        i_row = offs_r // G
        h_row = hkv * G + offs_r % G
    else:
        i_row = offs_r
        h_row = tl.zeros([BLOCK_M], dtype=tl.int64) + (pid_bh % H)
    t_row = q_offset + i_row
    st_row = _start(t_row, C, W, SLIDING)
    sc_row = tl.minimum(st_row // C, Nc)                    # summaries [0, sc_row) are visible

    r_first = pid_m * BLOCK_M
    r_last = tl.minimum(r_first + BLOCK_M, rows) - 1
    t_min = q_offset + r_first // GP
    t_max = q_offset + r_last // GP
    st_min, c_hi, nb_s_full, nb_s, nb_e, e_a, e_b = _tile_blocks(t_min, t_max, C, W, Nc, SLIDING, BLOCK_N)
    nb = nb_s + nb_e
    blk_lo = (pid_s * nb) // NUM_SPLITS
    blk_hi = ((pid_s + 1) * nb) // NUM_SPLITS

    row_off_q = h_row.to(tl.int64) * stride_qh + i_row.to(tl.int64) * stride_qm
    q_ptrs = q_ptr + b * stride_qb + row_off_q[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & mask_d[None, :], other=0.0)
    if Q_REG:  # q times a run-time +-1 (exact): a computed operand, which q.k then takes from registers
        q = (q * q_sign).to(q_ptr.dtype.element_ty)  # (RS wgmma) where a loaded q is read from shared memory
    elif NEG_Q:  # a negative scale: q -> -q (exact) and qk_scale = |scale| log2(e)
        q = -q

    if TMA:  # descriptors: of the [B * Hkv * N, D] views (32-bit rows: the launcher checked the size);
        # with FUSE of the [B, Hkv, N, D] tensors
        k_base = k_ptr
        v_base = v_ptr
        ks_base = ks_ptr
        vs_base = vs_ptr
        kv_row0 = (b * Hkv + hkv).to(tl.int32) * Nk
        sum_row0 = (b * Hkv + hkv).to(tl.int32) * Nc
    else:
        k_base = k_ptr + b * stride_kb + hkv * stride_kh
        v_base = v_ptr + b * stride_vb + hkv * stride_vh
        ks_base = ks_ptr + b * stride_ksb + hkv * stride_ksh
        vs_base = vs_ptr + b * stride_vsb + hkv * stride_vsh
        kv_row0 = 0
        sum_row0 = 0
    bias_base = bias_ptr + b * stride_bb + hkv * stride_bh

    acc, l_i, m_i = _walk(q, k_base, v_base, ks_base, vs_base, bias_base, blk_lo, blk_hi, nb_s, nb_s_full, nb_e,
                          e_a, e_b, st_min, c_hi, t_max, st_row, t_row, sc_row, kv_row0, sum_row0, b, hkv,
                          stride_kn, stride_vn, stride_ksn, stride_vsn, stride_bc, Nk, C, qk_scale,
                          offs_n, offs_d, mask_d, BIAS_MODE, EVEN_D, DOT_PREC, FUSE, TMA, False,
                          BLOCK_M, BLOCK_N, BLOCK_D)
    if tl.max(tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1), axis=1), axis=0) != 0:
        # a non-finite accumulator (p = 0 times an inf may be in it): this tile's range again,
        # isolating (module docstring); rows no such value reaches come out as they would clean
        acc, l_i, m_i = _walk(q, k_base, v_base, ks_base, vs_base, bias_base, blk_lo, blk_hi, nb_s, nb_s_full,
                              nb_e, e_a, e_b, st_min, c_hi, t_max, st_row, t_row, sc_row, kv_row0, sum_row0, b,
                              hkv, stride_kn, stride_vn, stride_ksn, stride_vsn, stride_bc, Nk, C, qk_scale,
                              offs_n, offs_d, mask_d, BIAS_MODE, EVEN_D, DOT_PREC, FUSE, TMA, True,
                              BLOCK_M, BLOCK_N, BLOCK_D)
    o, lse = _normalize(acc, l_i, m_i)

    split = pid_s.to(tl.int64)
    row_off_o = h_row.to(tl.int64) * stride_oh + i_row.to(tl.int64) * stride_om
    o_ptrs = o_ptr + split * stride_os + b * stride_ob + row_off_o[:, None] + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])
    row_off_l = h_row.to(tl.int64) * stride_lh + i_row.to(tl.int64) * stride_lm
    tl.store(lse_ptr + split * stride_ls + b * stride_lb + row_off_l, lse, mask=row_ok)


@triton.jit
def _eva_combine(
    op_ptr, lp_ptr, o_ptr, lse_ptr,
    R, H, Nq, D: tl.constexpr, NUM_SPLITS,
    stride_ps, stride_ls,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge NUM_SPLITS partial (o, lse) of rows r = (b * H + h) * Nq + i (scratch rows of D values)."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_r < R
    mask = row_ok[:, None] & (offs_d < D)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    lp_ptrs = lp_ptr + offs_r
    op_ptrs = op_ptr + offs_r[:, None] * D + offs_d[None, :]
    for _ in range(0, NUM_SPLITS):
        ls = tl.load(lp_ptrs, mask=row_ok, other=float("-inf"))
        os_ = tl.load(op_ptrs, mask=mask, other=0.0)
        lp_ptrs += stride_ls
        op_ptrs += stride_ps
        m_new = tl.maximum(m, ls)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        w = tl.exp(ls - m_use)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * os_
        m = m_new
    seen = den > 0.0
    den_safe = tl.where(seen, den, 1.0)
    o = acc / den_safe[:, None]
    lse = tl.where(seen, m + tl.log(den_safe), float("-inf"))
    i = offs_r % Nq
    bh = offs_r // Nq
    b = bh // H
    h = bh % H
    o_off = b * stride_ob + h * stride_oh + i * stride_om
    tl.store(o_ptr + o_off[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + i * stride_lm, lse, mask=row_ok)


# ---------------------------------------------------------------- launcher
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a small number still exercises the split path


MIN_SPLIT_BLOCKS = 4  # key blocks per split at least: a shorter walk saves less than the merge launch costs


def auto_splits(programs: int, n_blocks: int, sms: int, max_splits: int = 128) -> int:
    """Number of key-range splits that best fills `sms` multiprocessors (FlashAttention-2's rule):
    none when the grid already covers 80% of them; else the smallest count within 85% of the best
    wave efficiency, with at least MIN_SPLIT_BLOCKS key blocks per split (a split costs a merge launch
    and two scratch buffers: on short key ranges more than the parallel walk gains)."""
    limit = min(max_splits, n_blocks // MIN_SPLIT_BLOCKS, sms)
    if programs <= 0 or programs >= 0.8 * sms or limit <= 1:
        return 1
    eff = []
    for s in range(1, limit + 1):
        waves = programs * s / sms
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    for s, e in enumerate(eff, start=1):
        if e >= 0.85 * best:
            return s
    return 1


SMEM_PER_SM = 227 * 1024  # shared memory one multiprocessor gives its programs (sm_80 / sm_90)
MIN_REGISTER_CAP = 128  # what the tuned tiles' first walk needs at most without spilling


def _register_cap(cfg: dict, block_m: int, block_n: int, block_d: int, itemsize: int) -> dict:
    """Launch options from config `maxnreg` (registers per thread: a lower cap lets more programs
    share a multiprocessor). Unset: the cap that keeps as many programs per multiprocessor as the
    first walk's shared memory (the k/v ring and the q tile) allows, at least MIN_REGISTER_CAP, since
    ptxas sizes registers for the whole kernel and the isolating second walk would otherwise take them
    (module docstring); none where the ring leaves room for only one program or two."""
    cap = cfg.get("maxnreg")
    if cap is None:
        threads = int(cfg["num_warps"]) * 32
        smem = (int(cfg["num_stages"]) * 2 * block_n + block_m) * block_d * itemsize  # at most
        programs = min(max(1, SMEM_PER_SM // smem), 2048 // threads)
        cap = min(255, 65536 // (programs * threads) // 8 * 8)
        return {} if cap >= 255 else {"maxnreg": max(MIN_REGISTER_CAP, cap)}
    cap = int(cap)
    if not 24 <= cap <= 255 or cap % 8:
        raise ValueError(f"config maxnreg must be a multiple of 8 in [24, 255], got {cap}")
    return {"maxnreg": cap}


def _visible_blocks(t: int, C: int, W: int, sliding: bool, Nc: int, block_n: int) -> int:
    start = _window_start(t, C, W, sliding)
    return -(-min(start // C, Nc) // block_n) + -(-(W + C) // block_n)


def plan(q, k, k_sum, *, chunk_size, window_size, sliding, q_offset, config):
    """The launch geometry for a problem: dict with BLOCK_M, BLOCK_N, BLOCK_D, PACK_GQA, NUM_SPLITS,
    num_warps, num_stages (a complete config: call_plan.config or complete_config)."""
    B, H, Nq, D = q.shape
    Hkv, Nc = k.shape[1], k_sum.shape[2]
    G = H // Hkv
    cfg = config
    pack = bool(cfg.get("PACK_GQA", G > 1))
    rows = Nq * G if pack else Nq
    block_m = int(cfg["BLOCK_M"])
    block_n = int(cfg["BLOCK_N"])
    for name, val in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"config {name} must be a power of two >= 16, got {val}")
    block_m = min(block_m, max(16, next_pow2(rows)))
    block_d = max(16, next_pow2(D))
    n_row_blocks = triton.cdiv(rows, block_m)
    programs = n_row_blocks * B * (Hkv if pack else H)
    splits = int(cfg.get("NUM_SPLITS", 0 if Nq <= 16 else 1))
    if splits <= 0:
        t_last = q_offset + Nq - 1
        n_blocks = _visible_blocks(t_last, chunk_size, window_size, sliding, Nc, block_n)
        splits = auto_splits(programs, n_blocks, _sm_count(q.device))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PACK_GQA=pack, NUM_SPLITS=splits,
                FUSE=bool(cfg.get("FUSE", False)), Q_REG=bool(cfg.get("QREG", False)),
                TMA=bool(cfg.get("TMA", False)),
                launch=_register_cap(cfg, block_m, block_n, block_d, q.element_size()),
                rows=rows, n_row_blocks=n_row_blocks, num_warps=int(cfg["num_warps"]),
                num_stages=int(cfg["num_stages"]))


def _row_descriptor(t: torch.Tensor, block_n: int, block_d: int):
    """A TMA descriptor of t [B, H, N, D] seen as [B*H*N, D] rows, in [block_n, block_d] blocks; None
    where TMA cannot read it that way (not contiguous, D != block_d, rows not a multiple of 16 bytes,
    a box side over 256, 2^31 rows or more, empty)."""
    B, H, N, D = t.shape
    if (TensorDescriptor is None or t.numel() == 0 or not t.is_contiguous() or D != block_d or block_n > 256
            or (D * t.element_size()) % 16 or t.data_ptr() % 16 or B * H * N >= 2 ** 31):
        return None
    return TensorDescriptor.from_tensor(t.view(B * H * N, D), [block_n, block_d])


def _clipped_descriptor(t: torch.Tensor, rows: int, block_n: int, block_d: int):
    """A TMA descriptor of t [B, H, N, D] (any strides TMA takes) that ends at row `rows` of each
    (batch, head): a box past it reads zeros. None where TMA cannot read t."""
    B, H, N, D = t.shape
    esize = t.element_size()
    if (TensorDescriptor is None or t.numel() == 0 or D != block_d or block_n > 256 or t.stride(3) != 1
            or t.data_ptr() % 16 or any((s * esize) % 16 for s in t.stride()[:3])):
        return None
    return TensorDescriptor(t, [B, H, max(1, min(rows, N)), D], list(t.stride()), [1, 1, block_n, block_d])


def _tma_operands(geo: dict, q, k, v, k_sum, v_sum, n_keys: int, n_sums: int):
    """(k, v, k_sum, v_sum) as TMA descriptors for config TMA (fp16/bf16), or None when any of them
    cannot be one: the kernel then reads through pointers. The five-loop walk takes [B*Hkv*N, D] row
    views (contiguous tensors); the one-loop walk (FUSE) [B, Hkv, N, D] descriptors that end at the
    n_keys keys and n_sums summaries some query sees."""
    if not geo["TMA"] or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    bn, bd = geo["BLOCK_N"], geo["BLOCK_D"]
    if geo["FUSE"]:
        descs = [_clipped_descriptor(t, n, bn, bd) for t, n in ((k, n_keys), (v, n_keys), (k_sum, n_sums),
                                                                 (v_sum, n_sums))]
    else:
        descs = [_row_descriptor(t, bn, bd) for t in (k, v, k_sum, v_sum)]
    return None if any(d is None for d in descs) else descs


def _nothing(*tensors) -> None:
    """The enqueue of a problem with nothing to compute."""


_nothing.calls = ()


def prepare(q, k, v, k_sum, v_sum, bias, o, lse, *, chunk_size, window_size, sliding, scale, q_offset, log_count,
            config, geometry=None, fast=False):
    """The launches `launch` makes for these arguments, prepared from their metadata only (shapes,
    strides, dtypes; o and lse may be meta tensors): an enqueue taking the tensors of a call with the
    same metadata, (q, k, v, k_sum, v_sum, bias, o, lse). What depends on the tensors' addresses (TMA
    descriptors, the Gluon kernel's alignment check) is decided per call. fast: direct launches."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    if B * H * Nq == 0:
        return _nothing
    if D > MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {D}; the triton backend supports D <= {MAX_HEAD_DIM}")
    kwargs = dict(chunk_size=chunk_size, window_size=window_size, sliding=sliding, scale=scale, q_offset=q_offset,
                  log_count=log_count, config=config)
    limit = MAX_GRID_Y

    def relaunch(q, k, v, k_sum, v_sum, bias, o, lse) -> bool:
        """A test moved the grid limit since: launch in full."""
        if MAX_GRID_Y == limit:
            return False
        launch(q, k, v, k_sum, v_sum, bias, o, lse, **kwargs)
        return True

    if B * H > limit:  # grid axis 1 holds (batch, head): launch slices of the batch (large decode batches)
        if H > limit:
            raise ValueError(f"q has {H} heads; the triton backend takes at most {limit}")
        step = limit // H
        slices = [slice(b0, b0 + step) for b0 in range(0, B, step)]
        parts = [(sl, prepare(q[sl], k[sl], v[sl], k_sum[sl], v_sum[sl], None if bias is None else bias[sl], o[sl],
                              lse[sl], **kwargs, fast=fast)) for sl in slices]

        def enqueue_slices(q, k, v, k_sum, v_sum, bias, o, lse):
            if relaunch(q, k, v, k_sum, v_sum, bias, o, lse):
                return
            for sl, part in parts:
                part(q[sl], k[sl], v[sl], k_sum[sl], v_sum[sl], None if bias is None else bias[sl], o[sl], lse[sl])
        enqueue_slices.calls = tuple(c for _, part in parts for c in part.calls)  # what it launches (tests)
        return enqueue_slices

    C, W = int(chunk_size), int(window_size)
    q_offset = int(q_offset)
    G = H // Hkv
    geo = geometry or plan(q, k, k_sum, chunk_size=C, window_size=W, sliding=sliding, q_offset=q_offset,
                           config=config)
    splits = geo["NUM_SPLITS"]
    if bias is not None:
        bias_mode, sb = BIAS_TENSOR, bias.stride()
    else:
        bias_mode, sb = (BIAS_LOG_COUNT if log_count else BIAS_NONE), (0, 0, 0)
    part_o_shape, part_l_shape = (splits, B, H, Nq, D), (splits, B, H, Nq)
    if splits > 1:  # partial outputs in fp32 scratch, merged by _eva_combine
        so = torch.empty(part_o_shape, dtype=torch.float32, device="meta").stride()
        sl = torch.empty(part_l_shape, dtype=torch.float32, device="meta").stride()
    else:
        so = (0,) + o.stride()[:3]
        sl = (0,) + lse.stride()

    t_last = q_offset + Nq - 1  # the last query: it sees the most keys and summaries
    n_keys, n_sums = t_last + 1, min(_window_start(t_last, C, W, sliding) // C, Nc)
    grid = (geo["n_row_blocks"], B * (Hkv if geo["PACK_GQA"] else H), splits)
    scalars = (H, Hkv, G, Nq, Nk, Nc, D, C, W, q_offset, geo["rows"], geo["n_row_blocks"], splits,
               q.stride(0), q.stride(1), q.stride(2),
               k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2),
               k_sum.stride(0), k_sum.stride(1), k_sum.stride(2),
               v_sum.stride(0), v_sum.stride(1), v_sum.stride(2),
               sb[0], sb[1], sb[2],
               so[0], so[1], so[2], so[3],
               sl[0], sl[1], sl[2], sl[3],
               _qk_scale(scale), -1.0 if float(scale) < 0 else 1.0)
    options = dict(num_warps=geo["num_warps"], num_stages=geo["num_stages"], **geo["launch"])

    def fwd_call(tma: bool) -> KernelCall:
        return KernelCall(_eva_fwd, grid, 8, scalars, dict(
            SLIDING=bool(sliding), PACK_GQA=geo["PACK_GQA"], BIAS_MODE=bias_mode, EVEN_D=D == geo["BLOCK_D"],
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", NEG_Q=float(scale) < 0, Q_REG=geo["Q_REG"],
            FUSE=geo["FUSE"], TMA=tma, BLOCK_M=geo["BLOCK_M"], BLOCK_N=geo["BLOCK_N"], BLOCK_D=geo["BLOCK_D"]),
            options, fast=fast)

    fwd = fwd_call(False)
    tma = geo["TMA"]  # descriptors where this call's tensors take them (_tma_operands), else pointers
    fwd_tma = fwd_call(True) if tma else None
    combine = None
    if splits > 1:
        R = B * H * Nq
        block_d = geo["BLOCK_D"]
        block_r = max(1, min(64, 4096 // block_d))
        combine = KernelCall(_eva_combine, (triton.cdiv(R, block_r),), 4,
                             (R, H, Nq, D, splits, so[0], sl[0],
                              o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2)),
                             dict(BLOCK_R=block_r, BLOCK_D=block_d), dict(num_warps=4), fast=fast)
    device = q.device

    def enqueue(q, k, v, k_sum, v_sum, bias, o, lse):
        if relaunch(q, k, v, k_sum, v_sum, bias, o, lse):
            return
        if bias is None:
            bias = q  # stands in, never read
        if combine is not None:
            o_dst = new_output(part_o_shape, torch.float32, device)  # every element is written
            l_dst = new_output(part_l_shape, torch.float32, device)
        else:
            o_dst, l_dst = o, lse
        descs = _tma_operands(geo, q, k, v, k_sum, v_sum, n_keys, n_sums) if tma else None
        if descs is None:
            fwd(q, k, v, k_sum, v_sum, bias, o_dst, l_dst)
        else:
            fwd_tma(q, *descs, bias, o_dst, l_dst)
        if combine is not None:
            combine(o_dst, l_dst, o, lse)

    enqueue.calls = tuple(c for c in (fwd, fwd_tma, combine) if c is not None)  # what it launches (tests)
    if not (config and config.get("GLUON")):
        return enqueue
    from flashswitch.kernels_triton import eva_attention_gluon as glu
    if not glu.worth_launching(B, H, Nq, Nk, Nc, D):
        return enqueue

    def enqueue_gluon(q, k, v, k_sum, v_sum, bias, o, lse):
        """The warp-specialized Hopper kernel where it takes this call (its checks read addresses)."""
        if glu.supports(q, k, v, k_sum, v_sum, bias, scale, config):
            glu.launch(q, k, v, k_sum, v_sum, o, lse, chunk_size=C, window_size=W, sliding=sliding, scale=scale,
                       q_offset=q_offset, log_count=log_count, config=config)
        else:
            enqueue(q, k, v, k_sum, v_sum, bias, o, lse)
    enqueue_gluon.calls = enqueue.calls
    return enqueue_gluon


def launch(q, k, v, k_sum, v_sum, bias, o, lse, *, chunk_size, window_size, sliding, scale, q_offset,
           log_count, config, geometry=None):
    """Fill o ([B, H, Nq, D], q's dtype) and lse (fp32 [B, H, Nq], natural log).

    q: [B, H, Nq, D]; k, v: [B, Hkv, Nk, D]; k_sum, v_sum: [B, Hkv, Nc, D]; any strides with a unit
    last stride. bias: None or a [B, Hkv, Nc] tensor (any strides, read as fp32). log_count: use
    log n_c as the summary bias. Query i sits at position q_offset + i, with q_offset + Nq <= Nk.
    config: BLOCK_M, BLOCK_N, num_warps, num_stages, optional NUM_SPLITS (0: automatic; default 0
    for Nq <= 16, else 1), PACK_GQA (default: when H > Hkv), FUSE (one loop over all key blocks;
    default off), TMA (k, v and the summaries read by the tensor memory accelerator through
    descriptors; fp16/bf16, D a power of two; contiguous tensors unless with FUSE; otherwise
    ignored), QREG (q held in registers for q.k: RS instead of SS wgmma on Hopper; default off),
    maxnreg (a register cap per thread; default none) and GLUON (the warp-specialized Hopper kernel
    of eva_attention_gluon.py, for the problems its `supports` takes; the others run this one).
    geometry: what `plan` returns for these arguments, where the caller keeps it.
    """
    prepare(q, k, v, k_sum, v_sum, bias, o, lse, chunk_size=chunk_size, window_size=window_size, sliding=sliding,
            scale=scale, q_offset=q_offset, log_count=log_count, config=config,
            geometry=geometry)(q, k, v, k_sum, v_sum, bias, o, lse)
