"""Op 2 forward in Gluon for Hopper (sm_90): the same walk over summary and exact key blocks as
`eva_attention._attend_fused`, in FlashAttention-3's structure, which Triton's compiler does not
emit on sm_90:

- a producer warp (its own partition, 24 registers) issues the TMA of each key block's k and v into
  a ring of NUM_STAGES shared-memory stages, waiting on an "empty" mbarrier per stage, and signals a
  "ready" mbarrier with the bytes; no CTA barrier is involved;
- two consumer warpgroups (64 query rows each, each its own partition, so that they drift apart and
  one's softmax runs under the other's wgmma) issue the wgmma by hand so that each also overlaps its
  own softmax with its tensor-core work: in iteration e, q·k of block e + 1 is in flight while it
  rescales and issues p·v of block e, and p·v of block e while it computes the softmax of block
  e + 1; once p·v of block e retires, it arrives on block e's "empty" barrier (count 2: the stage
  is refilled once both warpgroups are done with it). (Making them take turns issuing their wgmma,
  as FlashAttention-3 does, cost 1-4% on the H200; rescaling o only when a row's max moved by
  more than 8, 4-11%: docs/PERFORMANCE.md.)

k, v and the summaries are read through [B * Hkv, rows, D] descriptors whose rows stop at the last
key and the last summary any query sees: a block reading past them gets zeros, and the rows it reads
below that but past its limit (keys and summaries of later queries) are masked out of the logits,
so p = 0 there. p = 0 times an inf / NaN of v is NaN, so the walk would spread a non-finite value
to rows that do not see it. The walk does not check for that: a warpgroup whose accumulator ends
non-finite (any non-finite v of a walked block makes every one of its rows so) walks its tile again,
alone, once both warpgroups are through the ring: the producer reloads each block into a ring stage
of that warpgroup's own, which zeroes v's inf / NaN in place in the masked blocks
(`_isolate_nonfinite`). Each block's arithmetic is that of the first walk, so the rows that do not
see such a value are bitwise those of the call with that value finite. (The producer, not the
consumer, issues these loads: TMA descriptors in a consumer partition stay live through its main loop
and made ptxas spill there.) Fast path only: fp16/bf16, contiguous q/k/v/summaries, D a power of
two in [16, 128], no PACK_GQA, no key splits, no tensor bias, scale >= 0 (`supports`); other problems
take the Triton kernel.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashswitch._common import triton_interpret
from flashswitch.kernels_triton.eva_tiles import _qk_scale, _start, _tile_blocks, _window_start

BLOCK_M = gl.constexpr(128)
# a barrier of the calling warps (in a warp_specialize partition, of that partition's warps only):
# gl.barrier from Triton 3.7, gl.thread_barrier before
_warps_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # rows per program: two consumer warpgroups of 64 rows


@gluon.jit
def _block_span(e, nb_s, st_min, c_hi, t_max, BLOCK_N: gl.constexpr):
    """(is_sum, ee, n0, limit) of key block e: summary blocks [0, nb_s), then exact blocks from st_min;
    rows at or past `limit` are not visible to any row of the tile."""
    is_sum = e < nb_s
    ee = e - nb_s
    n0 = gl.where(is_sum, e * BLOCK_N, st_min + ee * BLOCK_N)
    limit = gl.where(is_sum, c_hi, t_max + 1)
    return is_sum, ee, n0, limit


@gluon.jit
def _softmax_block(s, m_i, l_i, e, valid, nb_s, nb_s_full, e_a, e_b, st_min, c_hi, t_max, st_row, t_row, sc_row,
                   offs_n, Nk, C, qk_scale, LOG_COUNT: gl.constexpr, BLOCK_N: gl.constexpr):
    """Fold the raw q.k tile s of key block e into the running softmax: (p, alpha, m_i, l_i), with
    alpha the factor of the output so far. A block past the last (valid false) adds nothing."""
    is_sum, ee, n0, limit = _block_span(e, nb_s, st_min, c_hi, t_max, BLOCK_N)
    n = n0 + offs_n
    full = valid & gl.where(is_sum, e < nb_s_full, (ee >= e_a) & (ee < e_b))
    if LOG_COUNT:
        s = s * qk_scale                                                    # base-2 logits
        count = gl.minimum(C, Nk - n * C).to(gl.float32)                    # tokens of chunk n
        s += gl.where(is_sum, gl.log2(gl.maximum(count, 1.0)), 0.0)[None, :]
    if not full:
        lo_row = gl.where(is_sum, 0, st_row)
        hi_row = gl.where(is_sum, sc_row - 1, t_row)
        vis = (n[None, :] >= lo_row[:, None]) & (n[None, :] <= hi_row[:, None]) & valid
        s = gl.where(vis, s, float("-inf"))
    if LOG_COUNT:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
    else:
        # the scale folds into the max and one FMA per logit (qk_scale > 0 keeps -inf at -inf)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i, full


@gluon.jit
def _isolate_nonfinite(v_tile, p, o, v_layout: gl.constexpr, col_s: gl.constexpr, row_o: gl.constexpr,
                       BLOCK_N: gl.constexpr, D: gl.constexpr):
    """A masked block's p.v without 0 * inf: zeroes the inf / NaN entries of the block's v in place
    (`v_tile`, a stage this warpgroup alone reads) and makes NaN the rows of o whose p reaches such a
    key. Returns o."""
    vt = v_tile.load(v_layout)
    bits = vt.to(gl.int16, bitcast=True)
    exp_mask: gl.constexpr = 0x7C00 if v_tile.dtype == gl.float16 else 0x7F80   # all-ones exponent: inf / NaN
    fin = (bits & exp_mask) != exp_mask
    bad = gl.convert_layout(gl.max(gl.where(fin, 0, 1), axis=1), col_s)
    hit = gl.max(gl.where((p > 0.0) & (bad[None, :] != 0), 1, 0), axis=1)
    v_tile.store(gl.where(fin, vt, 0.0))
    fence_async_shared()
    return gl.where(gl.convert_layout(hit, row_o)[:, None] != 0, float("nan"), o)


@gluon.jit
def _load_block(k_desc, v_desc, ks_desc, vs_desc, k_dst, v_dst, bar, bh, e, nb_s, st_min,
                BLOCK_N: gl.constexpr, BLOCK_BYTES: gl.constexpr):
    """TMA of key block e (summary blocks [0, nb_s), then exact blocks from st_min) into k_dst, v_dst,
    completing on `bar`."""
    mbarrier.expect(bar, 2 * BLOCK_BYTES)
    if e < nb_s:
        row = e * BLOCK_N
        tma.async_copy_global_to_shared(ks_desc, [bh, row, 0], bar, k_dst)
        tma.async_copy_global_to_shared(vs_desc, [bh, row, 0], bar, v_dst)
    else:
        row = st_min + (e - nb_s) * BLOCK_N
        tma.async_copy_global_to_shared(k_desc, [bh, row, 0], bar, k_dst)
        tma.async_copy_global_to_shared(v_desc, [bh, row, 0], bar, v_dst)


@gluon.jit
def _producer(k_desc, v_desc, ks_desc, vs_desc, k_smem, v_smem, ready, empty, done, flags, rready, rempty, bh, nb,
              nb_s, st_min, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_BYTES: gl.constexpr):
    """TMA of key blocks 0..nb-1 into the ring, each once its stage is empty (a fresh barrier passes
    the first round's wait on phase 1). Then, once both consumers are through the ring, the blocks
    again for each consumer whose accumulator ended non-finite (its flags), into ring stage WG."""
    for e in range(nb):
        stage = e % NUM_STAGES
        mbarrier.wait(empty.index(stage), ((e // NUM_STAGES) & 1) ^ 1)
        _load_block(k_desc, v_desc, ks_desc, vs_desc, k_smem.index(stage), v_smem.index(stage), ready.index(stage),
                    bh, e, nb_s, st_min, BLOCK_N, BLOCK_BYTES)
    mbarrier.wait(done, 0)
    flag_layout: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    bad0 = gl.max(flags.index(0).load(flag_layout), axis=0)             # per consumer warpgroup
    bad1 = gl.max(flags.index(1).load(flag_layout), axis=0)
    if bad0 + bad1 != 0:
        for e in range(nb):
            for w in gl.static_range(2):
                if gl.where(w == 0, bad0, bad1) != 0:
                    mbarrier.wait(rempty.index(w), (e & 1) ^ 1)
                    _load_block(k_desc, v_desc, ks_desc, vs_desc, k_smem.index(w), v_smem.index(w), rready.index(w),
                                bh, e, nb_s, st_min, BLOCK_N, BLOCK_BYTES)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, ready, empty, done, flags, rready, rempty, o_ptr, lse_ptr, b, h, r_first, Nq, Nk, Nc, C, W, q_offset,
              qk_scale, nb, nb_s, nb_s_full, e_a, e_b, st_min, c_hi, t_max,
              stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
              SLIDING: gl.constexpr, LOG_COUNT: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG (rows WG * 64 .. + 64 of the tile, its own partition, so that the two
    drift apart and one's softmax runs under the other's wgmma): block 0's logits and softmax, then
    per block e (FlashAttention-3's order) issue q.k of e + 1; rescale o; issue o += p[e] v[e]; wait
    for q.k; softmax of e + 1 while p.v runs; wait for p.v and release block e's stage; the last block
    takes p.v only. No wgmma is in flight across the loop's back edge, so no accumulator register is
    rewritten while one runs (ptxas would serialize every wgmma). An accumulator that ends non-finite
    walks its tile again with the isolation (see the module docstring)."""
    BM: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    r_first = r_first + WG * BM                              # this warpgroup's rows of the tile
    q_smem = q_smem.slice(WG * BM, BM)
    offs_r = r_first + gl.arange(0, BM, layout=row_s)
    t_row = q_offset + offs_r
    st_row = _start(t_row, C, W, SLIDING)
    sc_row = gl.minimum(st_row // C, Nc)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    tpr: gl.constexpr = D // 8 if D // 8 < 32 else 32       # 16-byte pieces, row-major (also o's store)
    v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpr, tpr], [4, 1], [1, 0])
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    s_zero = gl.zeros([BM, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(ready.index(0), 0, pred=nb > 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    p, alpha, m_i, l_i, full = _softmax_block(s, m_i, l_i, 0, nb > 0, nb_s, nb_s_full, e_a, e_b, st_min, c_hi,
                                              t_max, st_row, t_row, sc_row, offs_n, Nk, C, qk_scale, LOG_COUNT,
                                              BLOCK_N)
    p16 = gl.convert_layout(p.to(dtype), p_layout)
    o = gl.zeros([BM, D], gl.float32, layout=o_layout)
    for e in range(0, nb - 1):
        stage = e % NUM_STAGES
        nxt = (e + 1) % NUM_STAGES
        mbarrier.wait(ready.index(nxt), ((e + 1) // NUM_STAGES) & 1)
        s_acc = warpgroup_mma(q_smem, k_smem.index(nxt).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        o_acc = warpgroup_mma(p16, v_smem.index(stage).reshape([BLOCK_N, D]), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_acc])
        p, alpha, m_i, l_i, full = _softmax_block(s, m_i, l_i, e + 1, True, nb_s, nb_s_full, e_a, e_b, st_min,
                                                  c_hi, t_max, st_row, t_row, sc_row, offs_n, Nk, C, qk_scale,
                                                  LOG_COUNT, BLOCK_N)
        o = warpgroup_mma_wait(0, deps=[o_acc])
        mbarrier.arrive(empty.index(stage))  # this warpgroup is done with block e's stage (count 2)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
    # the last block: p.v only
    last = gl.maximum(nb - 1, 0)
    o = o * gl.convert_layout(alpha, row_o)[:, None]
    o_acc = warpgroup_mma(p16, v_smem.index(last % NUM_STAGES).reshape([BLOCK_N, D]), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o_acc])
    # o - o is 0 for a finite o, NaN for inf / NaN: each row's flag, for the producer to read once
    # both warpgroups are through the ring (count 2)
    row_bad = gl.max(gl.where(o - o == 0.0, 0, 1), axis=1)
    flags.index(WG).store(row_bad)
    _warps_barrier()  # every row's flag is in shared memory before the arrive
    mbarrier.arrive(done)
    if gl.max(row_bad, axis=0) != 0:
        k_own = k_smem.index(WG).reshape([BLOCK_N, D])
        v_own = v_smem.index(WG).reshape([BLOCK_N, D])
        m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BM], gl.float32, layout=row_s)
        o = gl.zeros([BM, D], gl.float32, layout=o_layout)
        for e in range(0, nb):
            mbarrier.wait(rready, e & 1)
            s = warpgroup_mma(q_smem, k_own.permute((1, 0)), s_zero, use_acc=False)
            p, alpha, m_i, l_i, full = _softmax_block(s, m_i, l_i, e, True, nb_s, nb_s_full, e_a, e_b, st_min,
                                                      c_hi, t_max, st_row, t_row, sc_row, offs_n, Nk, C, qk_scale,
                                                      LOG_COUNT, BLOCK_N)
            o = o * gl.convert_layout(alpha, row_o)[:, None]
            if not full:
                o = _isolate_nonfinite(v_own, p, o, v_layout, col_s, row_o, BLOCK_N, D)
            o = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_own, o)
            mbarrier.arrive(rempty)

    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    out = o / gl.convert_layout(l_safe, row_o)[:, None]
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    # through shared memory into a row-major layout, so that each thread stores 16 contiguous bytes
    st_layout: gl.constexpr = v_layout
    out = gl.convert_layout(out.to(dtype), st_layout)
    b64 = b.to(gl.int64)
    rows_o = r_first + gl.arange(0, BM, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
    o_ptrs = (o_ptr + b64 * stride_ob + h.to(gl.int64) * stride_oh
              + (rows_o.to(gl.int64) * stride_om)[:, None] + cols[None, :])
    gl.store(o_ptrs, out, mask=(rows_o < Nq)[:, None])
    l_ptrs = lse_ptr + b64 * stride_lb + h.to(gl.int64) * stride_lh + offs_r.to(gl.int64) * stride_lm
    gl.store(l_ptrs, lse, mask=offs_r < Nq)


@gluon.jit
def _eva_fwd_gluon(
    q_desc, k_desc, v_desc, ks_desc, vs_desc, o_ptr, lse_ptr,
    H, Hkv, G, Nq, Nk, Nc, C, W, q_offset, n_row_blocks,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
    qk_scale,
    SLIDING: gl.constexpr, LOG_COUNT: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    BM: gl.constexpr = BLOCK_M
    BLOCK_BYTES: gl.constexpr = BLOCK_N * D * 2
    dtype: gl.constexpr = q_desc.dtype

    pid_m = n_row_blocks - 1 - gl.program_id(0)     # the longest rows first
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hkv = h // G

    # the tile's key blocks, as in eva_attention._eva_fwd
    r_first = pid_m * BM
    r_last = gl.minimum(r_first + BM, Nq) - 1
    t_min = q_offset + r_first
    t_max = q_offset + r_last
    st_min, c_hi, nb_s_full, nb_s, nb_e, e_a, e_b = _tile_blocks(t_min, t_max, C, W, Nc, SLIDING, BLOCK_N)
    nb = nb_s + nb_e


    q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # done: both consumer warpgroups are through the ring, their rows' non-finite flags written;
    # rready / rempty: the one-stage ring of a warpgroup's second walk
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    rready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    rempty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    flags = gl.allocate_shared_memory(gl.int32, [2, BM // 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    mbarrier.init(done, count=2)
    for i in gl.static_range(2):
        mbarrier.init(rready.index(i), count=1)
        mbarrier.init(rempty.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, BM * D * 2)
    tma.async_copy_global_to_shared(q_desc, [pid_bh * Nq + r_first, 0], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)

    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, ready, empty, done, flags, rready.index(0), rempty.index(0),
                     o_ptr, lse_ptr, b, h, r_first, Nq, Nk, Nc, C, W, q_offset,
                     qk_scale, nb, nb_s, nb_s_full, e_a, e_b, st_min, c_hi, t_max,
                     stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
                     SLIDING, LOG_COUNT, D, BLOCK_N, NUM_STAGES, 0)),
        (_consumer, (q_smem, k_smem, v_smem, ready, empty, done, flags, rready.index(1), rempty.index(1),
                     o_ptr, lse_ptr, b, h, r_first, Nq, Nk, Nc, C, W, q_offset,
                     qk_scale, nb, nb_s, nb_s_full, e_a, e_b, st_min, c_hi, t_max,
                     stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
                     SLIDING, LOG_COUNT, D, BLOCK_N, NUM_STAGES, 1)),
        (_producer, (k_desc, v_desc, ks_desc, vs_desc, k_smem, v_smem, ready, empty, done, flags, rready, rempty,
                     b * Hkv + hkv, nb, nb_s, st_min, BLOCK_N, NUM_STAGES, BLOCK_BYTES)),
    ], [4, 1], [240, 24])

    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(done)
    for i in gl.static_range(2):
        mbarrier.invalidate(rready.index(i))
        mbarrier.invalidate(rempty.index(i))


# ---------------------------------------------------------------- launcher
# Problems below this many q.k multiply-adds (every query against every key and summary row) run the
# Triton kernel: their kernel takes microseconds, and the Gluon launch's host work (argument binding,
# five TMA descriptors) would be most of the call
MIN_MACS = 2 ** 24


def worth_launching(B: int, H: int, Nq: int, Nk: int, Nc: int, D: int) -> bool:
    return B * H * Nq * (Nk + Nc) * D >= MIN_MACS


def supports(q, k, v, k_sum, v_sum, bias, scale, config) -> bool:
    """Whether this kernel takes the problem (else the Triton kernel does): Hopper only (wgmma), never
    under the Triton interpreter, which does not run Gluon. (CPU tensors pass: bench/tools/compile_check.py
    compiles for sm_90 without a GPU.)"""
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    block_n = int(config.get("BLOCK_N", 64))
    hopper = not q.is_cuda or _major(q.device.index) == 9
    return (hopper and not triton_interpret() and q.dtype in (torch.float16, torch.bfloat16) and bias is None and float(scale) >= 0
            and 16 <= D <= 128 and D & (D - 1) == 0 and block_n in (32, 64, 128)
            and int(config.get("BLOCK_M", BLOCK_M.value)) == BLOCK_M.value
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v, k_sum, v_sum))
            and max(B * H * Nq, B * Hkv * Nk, B * Hkv * Nc) + 256 < 2 ** 31
            and int(config.get("NUM_SPLITS", 1)) in (0, 1) and not config.get("PACK_GQA", False) and Nq > 16)


@functools.lru_cache(maxsize=None)
def _major(device_index):
    """Compute capability major of a CUDA device (asked once: the call sits on every launch's path)."""
    return torch.cuda.get_device_capability(device_index)[0]


@functools.lru_cache(maxsize=None)
def _box_layout(box: tuple, dtype: torch.dtype):
    """The shared-memory layout of a TMA box: computed once per box and dtype (building it costs
    ~25 us of host time per call, which short calls wait for)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), gl.float16 if dtype == torch.float16 else gl.bfloat16)


def _row_desc(t: torch.Tensor, rows: int):
    """[B * H * N, D] view of q, in boxes of `rows` rows."""
    D = t.shape[-1]
    return TensorDescriptor(t, [t.numel() // D, D], [D, 1], [rows, D], _box_layout((rows, D), t.dtype))


def _clipped_desc(t: torch.Tensor, n: int, block_n: int):
    """[B * Hkv, n, D] view of a contiguous [B, Hkv, N, D] tensor cut at row n (rows past it read as
    zeros), in boxes of [1, block_n, D]."""
    B, Hk, N, D = t.shape
    return TensorDescriptor(t, [B * Hk, max(n, 1), D], [N * D, D, 1], [1, block_n, D],
                            _box_layout((1, block_n, D), t.dtype))


def launch(q, k, v, k_sum, v_sum, o, lse, *, chunk_size, window_size, sliding, scale, q_offset, log_count, config):
    """Fill o and lse like `eva_attention.launch` (a problem `supports` accepts). config: BLOCK_N,
    num_stages (the ring of k/v stages, >= 2), optional maxnreg (registers per thread)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Nc = k.shape[1], k.shape[2], k_sum.shape[2]
    block_n = int(config.get("BLOCK_N", 64))
    stages = max(2, int(config.get("num_stages", 3)))
    C, W = int(chunk_size), int(window_size)
    n_row_blocks = -(-Nq // BLOCK_M.value)
    t_last = int(q_offset) + Nq - 1  # the last query sees the most keys and summaries
    n_keys = t_last + 1
    n_sums = min(_window_start(t_last, C, W, sliding) // C, Nc)
    grid = (n_row_blocks, B * H)
    _eva_fwd_gluon[grid](
        _row_desc(q, BLOCK_M.value), _clipped_desc(k, n_keys, block_n), _clipped_desc(v, n_keys, block_n),
        _clipped_desc(k_sum, n_sums, block_n), _clipped_desc(v_sum, n_sums, block_n),
        o, lse,
        H, Hkv, H // Hkv, Nq, Nk, Nc, C, W, int(q_offset), n_row_blocks,
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        _qk_scale(scale),
        SLIDING=bool(sliding), LOG_COUNT=bool(log_count), D=D, BLOCK_N=block_n, NUM_STAGES=stages,
        num_warps=4, **({"maxnreg": int(config["maxnreg"])} if config.get("maxnreg") else {}),
    )
