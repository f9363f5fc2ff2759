// Op 2 (SPEC.md): causal EVA attention forward, flash-attention style.
//
// The query at position t = q_offset + i sees the exact keys j in [start(t), t] and the summaries
// c in [0, min(start(t) / C, Nc)), with
//   start(t) = W floor(t / W)                                  (block window)
//   start(t) = t < W ? 0 : C floor((t - W + 1) / C)            (sliding window).
// Logits are scale q.k (exact) and scale q.k_sum + bias_c (summary); o = softmax . [v; v_sum] and
// lse = logsumexp (natural log). Softmax runs in base 2 with scale * log2(e) folded into the logits.
//
// fp16 / bf16: eva_attention_fwd_kernel<DT, HD>. A block owns BLOCK_M = 64 query rows of one
// (batch, head), 4 warps of 16 rows; HD is the head dim padded to a multiple of 16 (zero columns).
// start(t) is non-decreasing in t, so the keys visible to the rows of a tile are two intervals:
//   summaries  [0, min(start(t_max) / C, Nc))      exact keys  [start(t_min), t_max]
// walked as one list of key blocks of BLOCK_N rows (summary blocks first). A block every row sees
// whole (summaries below start(t_min) / C; exact keys inside [start(t_max), t_min]) takes no mask;
// the others compare positions per element. Nothing outside the intervals is read.
// Per key block: K and V tiles are copied to shared memory with cp.async (rows past the interval
// and columns past D are zero-filled), S = Q K^T and O += P V run on mma.sync.m16n8k16 with fp32
// accumulators; the V copy overlaps S, the next K copy overlaps P V. In a masked block the staged V
// loses its inf / NaN entries before P V, and only the rows whose p reaches one become NaN, so that a
// non-finite input reaches only the queries that see it (eva_sanitize_v, eva_poison_rows).
//
// fp32: eva_attention_fwd_f32_kernel<EPL>, one warp per query row (lane l holds dims l + 32 e),
// IEEE fp32 FMA dot products reduced with shuffles, same visibility and online softmax.
#include "common.cuh"
#include "eva_attention.h"

namespace flashswitch {

// Kernel parameters, shared by both kernels (the launchers of bindings/cupy.py pass them in this order).
#define FS_EVA_PARAMS                                                                                     \
  const void *__restrict__ q, const void *__restrict__ k, const void *__restrict__ v,                    \
      const void *__restrict__ k_sum, const void *__restrict__ v_sum, const float *__restrict__ bias,    \
      void *__restrict__ o, float *__restrict__ lse, i64 B, i64 H, i64 G, i64 Nq, i64 Nk, i64 Nc, i64 D,  \
      i64 C, i64 W, i64 q_offset, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb,   \
      i64 v_sh, i64 v_sn, i64 ks_sb, i64 ks_sh, i64 ks_sn, i64 vs_sb, i64 vs_sh, i64 vs_sn, i64 b_sb,     \
      i64 b_sh, i64 b_sn, i64 o_sb, i64 o_sh, i64 o_sn, i64 l_sb, i64 l_sh, i64 l_sn, float scale_log2, \
      int sliding, int bias_mode, int vec_bytes

// First exact key of position t >= 0.
__device__ __forceinline__ i64 eva_start(i64 t, i64 C, i64 W, bool sliding) {
  if (sliding) return t < W ? 0 : C * ((t - W + 1) / C);
  return W * (t / W);
}

__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }

// Base-2 summary bias of chunk c (c < the summary limit, so that a tensor entry exists).
__device__ __forceinline__ float eva_bias(int mode, const float* bb, i64 b_sn, i64 c, i64 C, i64 Nk) {
  if (mode == FS_EVA_BIAS_TENSOR) return __ldg(bb + c * b_sn) * FS_LOG2E;
  if (mode == FS_EVA_BIAS_LOG_COUNT) return log2f((float)imax(imin(C, Nk - c * C), 1));
  return 0.f;
}

// Query row `row` = (b H + h) Nq + i of the one-row-at-a-time kernels: its batch, head, kv head,
// index, position t = q_offset + i and first exact key st = start(t).
struct EvaRow {
  i64 b, h, hk, i, t, st;
};

__device__ __forceinline__ EvaRow eva_row(i64 row, i64 H, i64 G, i64 Nq, i64 q_offset, i64 C, i64 W, bool slid) {
  EvaRow r;
  const i64 bh = row / Nq;
  r.i = row - bh * Nq;
  r.b = bh / H;
  r.h = bh - r.b * H;
  r.hk = r.h / G;
  r.t = q_offset + r.i;
  r.st = eva_start(r.t, C, W, slid);
  return r;
}

// ------------------------------------------------------------------ fp32 kernel
// Keys j0 + u (u < U) with this lane's partial dot products x: the warp's sums (an xor butterfly,
// which leaves bit-identical sums in every lane, so what follows is warp-uniform), base-2 logits
// (scaled, plus the summary bias; -inf at or past hi), folded into the online-softmax state
// (m, l, acc) of a row, value element e of key u being v(u, e).
template <int U, int EPL, class V>
__device__ __forceinline__ void eva_fold(float (&x)[U], i64 j0, i64 hi, float scale_log2, bool summary, int bias_mode,
                                         const float* bb, i64 b_sn, i64 C, i64 Nk, float& m, float& l,
                                         float (&acc)[EPL], V v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] += __shfl_xor_sync(0xffffffffu, x[u], off);
  }
  float mx = m;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 j = j0 + u;
    x[u] = j < hi ? x[u] * scale_log2 + (summary ? eva_bias(bias_mode, bb, b_sn, j, C, Nk) : 0.f) : neg_inf();
    mx = fmaxf(mx, x[u]);
  }
  if (mx == neg_inf()) return;  // nothing finite yet (a -inf tensor bias)
  const float alpha = exp2f(m - mx);
  l *= alpha;
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] *= alpha;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float p = exp2f(x[u] - mx);  // 0 for the keys past hi
    l += p;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[e] = fmaf(p, v(u, e), acc[e]);
  }
  m = mx;
}

// Folds keys j in [lo, hi) of one kv head into the online softmax state (m, l, acc) of a row;
// U keys per step, their dot products reduced together. The xor butterfly leaves bit-identical
// sums in every lane, so all branches below are warp-uniform.
template <int EPL, int U>
__device__ __forceinline__ void f32_attend(const float (&qr)[EPL], float& m, float& l, float (&acc)[EPL],
                                           const float* kp, const float* vp, i64 sk, i64 sv, i64 lo, i64 hi,
                                           int lane, i64 D, float scale_log2, bool summary, int bias_mode,
                                           const float* bb, i64 b_sn, i64 C, i64 Nk) {
  for (i64 j0 = lo; j0 < hi; j0 += U) {
    float x[U], vv[U][EPL];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 j = j0 + u;
      const bool ok = j < hi;
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const i64 d = lane + 32 * e;
        const bool in = ok && d < D;
        const float kx = in ? __ldg(kp + j * sk + d) : 0.f;
        vv[u][e] = in ? __ldg(vp + j * sv + d) : 0.f;
        dot = fmaf(qr[e], kx, dot);
      }
      x[u] = dot;
    }
    eva_fold<U, EPL>(x, j0, hi, scale_log2, summary, bias_mode, bb, b_sn, C, Nk, m, l, acc,
                     [&](int u, int e) { return vv[u][e]; });
  }
}

template <int EPL>
__global__ void __launch_bounds__(FS_EVA_THREADS) eva_attention_fwd_f32_kernel(FS_EVA_PARAMS) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const bool slid = sliding != 0;
  const i64 rows = B * H * Nq;
  for (i64 row = (i64)blockIdx.x * FS_EVA_F32_ROWS + warp; row < rows; row += (i64)gridDim.x * FS_EVA_F32_ROWS) {
    const EvaRow rw = eva_row(row, H, G, Nq, q_offset, C, W, slid);
    const i64 b = rw.b, h = rw.h, hk = rw.hk, i = rw.i, t = rw.t, st = rw.st;
    const i64 sc = imin(st / C, Nc);
    const i64 j_hi = imin(t + 1, Nk);

    const float* qp = reinterpret_cast<const float*>(q) + b * q_sb + h * q_sh + i * q_sn;
    float qr[EPL], acc[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const i64 d = lane + 32 * e;
      qr[e] = d < D ? __ldg(qp + d) : 0.f;
      acc[e] = 0.f;
    }
    float m = neg_inf(), l = 0.f;
    const float* bb = bias != nullptr ? bias + b * b_sb + hk * b_sh : nullptr;
    f32_attend<EPL, 4>(qr, m, l, acc, reinterpret_cast<const float*>(k_sum) + b * ks_sb + hk * ks_sh,
                       reinterpret_cast<const float*>(v_sum) + b * vs_sb + hk * vs_sh, ks_sn, vs_sn, 0, sc, lane,
                       D, scale_log2, true, bias_mode, bb, b_sn, C, Nk);
    f32_attend<EPL, 4>(qr, m, l, acc, reinterpret_cast<const float*>(k) + b * k_sb + hk * k_sh,
                       reinterpret_cast<const float*>(v) + b * v_sb + hk * v_sh, k_sn, v_sn, imax(st, 0), j_hi,
                       lane, D, scale_log2, false, bias_mode, bb, b_sn, C, Nk);

    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* op = reinterpret_cast<float*>(o) + b * o_sb + h * o_sh + i * o_sn;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const i64 d = lane + 32 * e;
      if (d < D) op[d] = acc[e] * inv;
    }
    if (lane == 0) lse[b * l_sb + h * l_sh + i * l_sn] = l > 0.f ? (m + log2f(l)) * FS_LN2 : neg_inf();
  }
}

// ------------------------------------------------------------------ decode kernel (fp16 / bf16)
// For few queries (Nq <= FS_EVA_DEC_MAX_Q), where a 64-row tensor-core tile would hold one or a few
// valid rows and 512 (batch, head) tiles leave most of the GPU idle: one block per query row, its
// FS_EVA_DEC_WARPS warps splitting the row's visible keys (summaries, then exact keys, as one list)
// into contiguous slices (flash-decoding inside a block). Lane l holds dims EPL l .. EPL l + EPL - 1
// (one 2 EPL-byte access per key row when `vec_bytes` allows it), each warp folds its slice into an
// online-softmax state, U keys per step with their dot products reduced together, and the warps'
// states merge through shared memory by their maxima.

// w = elements [d0, d0 + EPL) of a 16-bit row, two per word (0 past D): kept packed, converted per use.
template <int EPL>
__device__ __forceinline__ void dec_load(unsigned int (&w)[EPL / 2], const unsigned short* row, i64 d0, i64 D,
                                         bool vec) {
  if (vec && d0 + EPL <= D) {
    if constexpr (EPL == 8) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + d0));
      w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
    } else if constexpr (EPL == 4) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(row + d0));
      w[0] = u.x; w[1] = u.y;
    } else {
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(row + d0));
    }
  } else {
#pragma unroll
    for (int e = 0; e < EPL; e += 2) {
      const unsigned int lo = d0 + e < D ? (unsigned int)__ldg(row + d0 + e) : 0u;
      const unsigned int hi = d0 + e + 1 < D ? (unsigned int)__ldg(row + d0 + e + 1) : 0u;
      w[e / 2] = lo | (hi << 16);
    }
  }
}

template <int DT, int EPL>
__device__ __forceinline__ float dec_elem(const unsigned int (&w)[EPL / 2], int e) {
  return Elem<DT>::to_float((w[e >> 1] >> ((e & 1) * 16)) & 0xffffu);
}

// f32_attend for 16-bit rows: folds keys j in [lo, hi) into (m, l, acc); warp-uniform branches.
template <int DT, int EPL, int U>
__device__ __forceinline__ void dec_attend(const float (&qr)[EPL], float& m, float& l, float (&acc)[EPL],
                                           const unsigned short* kp, const unsigned short* vp, i64 sk, i64 sv,
                                           i64 lo, i64 hi, i64 d0, i64 D, bool vec, float scale_log2,
                                           bool summary, int bias_mode, const float* bb, i64 b_sn, i64 C, i64 Nk) {
  for (i64 j0 = lo; j0 < hi; j0 += U) {
    float x[U];
    unsigned int vw[U][EPL / 2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 j = j0 + u < hi ? j0 + u : lo;  // past hi: a valid row, its logit masked below
      unsigned int kw[EPL / 2];
      dec_load<EPL>(kw, kp + j * sk, d0, D, vec);
      dec_load<EPL>(vw[u], vp + j * sv, d0, D, vec);
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) dot = fmaf(qr[e], dec_elem<DT, EPL>(kw, e), dot);
      x[u] = dot;
    }
    eva_fold<U, EPL>(x, j0, hi, scale_log2, summary, bias_mode, bb, b_sn, C, Nk, m, l, acc,
                     [&](int u, int e) { return dec_elem<DT, EPL>(vw[u], e); });
  }
}

template <int DT, int EPL>
__global__ void __launch_bounds__(FS_EVA_DEC_WARPS * 32, EPL == 8 ? 2 : 3) eva_attention_decode_kernel(FS_EVA_PARAMS) {
  constexpr int NW = FS_EVA_DEC_WARPS;
  __shared__ float s_m[NW], s_l[NW];
  __shared__ float s_acc[NW][32 * EPL];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const bool slid = sliding != 0;
  const bool vec = vec_bytes >= 2 * EPL;  // the host checked every row start and D
  const i64 d0 = (i64)lane * EPL;
  const i64 rows = B * H * Nq;
  const unsigned short* q16 = reinterpret_cast<const unsigned short*>(q);
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const EvaRow rw = eva_row(row, H, G, Nq, q_offset, C, W, slid);
    const i64 b = rw.b, h = rw.h, hk = rw.hk, i = rw.i, t = rw.t, st = rw.st;
    const i64 n_sum = imin(st / C, Nc);             // summaries [0, n_sum)
    const i64 n_ex = imax(imin(t + 1, Nk) - st, 0);  // exact keys [st, st + n_ex)
    const i64 n_vis = n_sum + n_ex;
    const i64 lo = n_vis * warp / NW, hi = n_vis * (warp + 1) / NW;  // this warp's slice of the list

    float qr[EPL], acc[EPL];
    {
      unsigned int qw[EPL / 2];
      dec_load<EPL>(qw, q16 + b * q_sb + h * q_sh + i * q_sn, d0, D, vec);
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        qr[e] = dec_elem<DT, EPL>(qw, e);
        acc[e] = 0.f;
      }
    }
    float m = neg_inf(), l = 0.f;
    const float* bb = bias != nullptr ? bias + b * b_sb + hk * b_sh : nullptr;
    if (lo < n_sum) {
      dec_attend<DT, EPL, 4>(qr, m, l, acc, reinterpret_cast<const unsigned short*>(k_sum) + b * ks_sb + hk * ks_sh,
                             reinterpret_cast<const unsigned short*>(v_sum) + b * vs_sb + hk * vs_sh, ks_sn, vs_sn,
                             lo, imin(hi, n_sum), d0, D, vec, scale_log2, true, bias_mode, bb, b_sn, C, Nk);
    }
    if (hi > n_sum) {
      dec_attend<DT, EPL, 4>(qr, m, l, acc, reinterpret_cast<const unsigned short*>(k) + b * k_sb + hk * k_sh,
                             reinterpret_cast<const unsigned short*>(v) + b * v_sb + hk * v_sh, k_sn, v_sn,
                             st + imax(lo - n_sum, 0), st + (hi - n_sum), d0, D, vec, scale_log2, false, bias_mode,
                             bb, b_sn, C, Nk);
    }

    // Merge the warps' states: weight exp2(m_w - M) (0 for a warp that saw nothing).
    if (lane == 0) {
      s_m[warp] = m;
      s_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) s_acc[warp][d0 + e] = acc[e];
    __syncthreads();
    float M = neg_inf();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w]);
    float f[NW], L = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      f[w] = s_m[w] == neg_inf() ? 0.f : exp2f(s_m[w] - M);
      L = fmaf(f[w], s_l[w], L);
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    unsigned short* op = reinterpret_cast<unsigned short*>(o) + b * o_sb + h * o_sh + i * o_sn;
    for (i64 d = threadIdx.x; d < D; d += NW * 32) {
      float od = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) od = fmaf(f[w], s_acc[w][d], od);
      op[d] = (unsigned short)Elem<DT>::from_float(od * inv);
    }
    if (threadIdx.x == 0) lse[b * l_sb + h * l_sh + i * l_sn] = L > 0.f ? (M + log2f(L)) * FS_LN2 : neg_inf();
    __syncthreads();  // the next row rewrites the shared state
  }
}

// ------------------------------------------------------------------ tensor-core tiles
template <int HD>
struct EvaTile {
  static constexpr int BM = FS_EVA_BLOCK_M;
  static constexpr int BN = HD > 128 ? 32 : 64;  // keys per tile (register budget of the O accumulator)
  static constexpr int LD = HD + 8;              // smem row pitch in elements: +16 bytes, conflict-free ldmatrix
  static constexpr int SMEM_BYTES = (BM + 2 * BN) * LD * 2;
};

// Copies rows [0, ROWS) x bytes [0, 2 HD) of a tile to shared memory (pitch LD elements), V bytes
// per access: row r < nvalid, byte x < row_bytes come from g + r * stride + x, the rest is zero
// (stored directly: nothing outside the valid rows and columns is ever addressed). V divides
// row_bytes, so no access straddles the end of a row. V = 2 has no cp.async form: plain loads.
// Everything is visible after cp_async_wait_all + __syncthreads.
template <int HD, int ROWS, int V>
__device__ __forceinline__ void load_tile_v(unsigned short* s, const char* g, i64 stride, i64 nvalid,
                                            i64 row_bytes) {
  constexpr int LD = EvaTile<HD>::LD;
  constexpr int CPR = HD * 2 / V;  // accesses per row
#pragma unroll 1
  for (int idx = threadIdx.x; idx < ROWS * CPR; idx += FS_EVA_THREADS) {
    const int r = idx / CPR;
    const int x = (idx - r * CPR) * V;
    const bool ok = r < nvalid && x < row_bytes;
    unsigned char* dst = reinterpret_cast<unsigned char*>(s) + r * LD * 2 + x;
    if (ok) {
      const char* src = g + (i64)r * stride + x;
      if constexpr (V == 2) {
        *reinterpret_cast<unsigned short*>(dst) = __ldg(reinterpret_cast<const unsigned short*>(src));
      } else {
        cp_async<V>(smem_addr(dst), src);
      }
    } else if constexpr (V == 16) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    } else if constexpr (V == 8) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(0u, 0u);
    } else if constexpr (V == 4) {
      *reinterpret_cast<unsigned int*>(dst) = 0u;
    } else {
      *reinterpret_cast<unsigned short*>(dst) = 0;
    }
  }
}

template <int HD, int ROWS>
__device__ __forceinline__ void load_tile(unsigned short* s, const char* g, i64 stride, i64 nvalid, i64 row_bytes,
                                          int vec_bytes) {
  switch (vec_bytes) {
    case 16: load_tile_v<HD, ROWS, 16>(s, g, stride, nvalid, row_bytes); break;
    case 8: load_tile_v<HD, ROWS, 8>(s, g, stride, nvalid, row_bytes); break;
    case 4: load_tile_v<HD, ROWS, 4>(s, g, stride, nvalid, row_bytes); break;
    default: load_tile_v<HD, ROWS, 2>(s, g, stride, nvalid, row_bytes); break;
  }
}

// One warp copies its 16 staged rows (pitch LD) to global: row r < nvalid, bytes < row_bytes.
template <int HD, int V>
__device__ __forceinline__ void store_rows_v(char* g, i64 stride, i64 nvalid, const unsigned short* s,
                                             i64 row_bytes, int lane) {
  constexpr int LD = EvaTile<HD>::LD;
  constexpr int CPR = HD * 2 / V;
  for (int idx = lane; idx < 16 * CPR; idx += 32) {
    const int r = idx / CPR;
    const int x = (idx - r * CPR) * V;
    if (r < nvalid && x < row_bytes) {
      const unsigned char* src = reinterpret_cast<const unsigned char*>(s) + r * LD * 2 + x;
      char* dst = g + (i64)r * stride + x;
      if constexpr (V == 16) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else if constexpr (V == 8) {
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
      } else if constexpr (V == 4) {
        *reinterpret_cast<unsigned int*>(dst) = *reinterpret_cast<const unsigned int*>(src);
      } else {
        *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(src);
      }
    }
  }
}

template <int HD>
__device__ __forceinline__ void store_rows(char* g, i64 stride, i64 nvalid, const unsigned short* s, i64 row_bytes,
                                           int lane, int vec_bytes) {
  switch (vec_bytes) {
    case 16: store_rows_v<HD, 16>(g, stride, nvalid, s, row_bytes, lane); break;
    case 8: store_rows_v<HD, 8>(g, stride, nvalid, s, row_bytes, lane); break;
    case 4: store_rows_v<HD, 4>(g, stride, nvalid, s, row_bytes, lane); break;
    default: store_rows_v<HD, 2>(g, stride, nvalid, s, row_bytes, lane); break;
  }
}

// Non-finite isolation in a masked block. There p = 0 on the keys a row cannot see, and P V would
// multiply that 0 by an inf or NaN of V into NaN; so the staged V tile (BN rows, pitch LD) gets its
// non-finite entries zeroed, and bad[tid] records whether this thread's share of its row held one
// (P threads per key row, HD / P columns each). The rows whose p reaches such a key are then made
// NaN (`eva_poison_rows`), as p . inf would have. Interior blocks, which every row sees whole, skip both.
template <int DT, int HD>
__device__ __forceinline__ void eva_sanitize_v(unsigned short* sV, int* bad) {
  constexpr int BN = EvaTile<HD>::BN;
  constexpr int P = FS_EVA_THREADS / BN;
  static_assert(FS_EVA_THREADS % BN == 0 && (HD / P) % 8 == 0, "16-byte pieces of whole rows");
  constexpr unsigned int EXP = DT == FS_DTYPE_F16 ? 0x7C00u : 0x7F80u;  // all-ones exponent: inf or NaN
  uint4* piece = reinterpret_cast<uint4*>(sV + (threadIdx.x / P) * EvaTile<HD>::LD + (threadIdx.x % P) * (HD / P));
  int any = 0;
#pragma unroll
  for (int c = 0; c < HD / P / 8; ++c) {
    uint4 u = piece[c];
    unsigned int w[4] = {u.x, u.y, u.z, u.w};
    unsigned int hit = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned int keep = ((w[i] & EXP) == EXP ? 0u : 0xffffu) | ((w[i] & (EXP << 16)) == (EXP << 16) ? 0u : 0xffff0000u);
      hit |= ~keep;
      w[i] &= keep;
    }
    if (hit) {
      piece[c] = make_uint4(w[0], w[1], w[2], w[3]);
      any = 1;
    }
  }
  bad[threadIdx.x] = any;
}

// After eva_sanitize_v (and a barrier): rows hf = 0, 1 of this thread whose weight p (s, fp32) is > 0
// on a key flagged in `bad` get a NaN accumulator; the row's 4 owners agree through two shuffles.
template <int HD, int NT, int DTL>
__device__ __forceinline__ void eva_poison_rows(const float (&s)[NT][4], float (&acc)[DTL][4], const int* bad,
                                                int cq) {
  constexpr int P = FS_EVA_THREADS / EvaTile<HD>::BN;
  int hit[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const int key = 8 * j + 2 * cq + e2;
      int b = 0;
#pragma unroll
      for (int x = 0; x < P; ++x) b |= bad[key * P + x];
      if (b) {
        hit[0] |= s[j][e2] > 0.f;
        hit[1] |= s[j][2 + e2] > 0.f;
      }
    }
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    hit[hf] |= __shfl_xor_sync(0xffffffffu, hit[hf], 1);
    hit[hf] |= __shfl_xor_sync(0xffffffffu, hit[hf], 2);
    if (hit[hf]) {
#pragma unroll
      for (int dt = 0; dt < DTL; ++dt) acc[dt][2 * hf] = acc[dt][2 * hf + 1] = __int_as_float(0x7fc00000);
    }
  }
}

// A key block of a tile's list: rows n0 .. n0 + BN - 1 of (k, v) or of (k_sum, v_sum); rows at or
// past `limit` are not read.
struct EvaBlock {
  const char* k;  // row 0 of the source (bytes)
  const char* v;
  i64 sk, sv;     // row strides in bytes
  i64 n0, limit;
  bool summary, masked;
};

// ------------------------------------------------------------------ tensor-core kernel
template <int DT, int HD>
__global__ void __launch_bounds__(FS_EVA_THREADS) eva_attention_fwd_kernel(FS_EVA_PARAMS) {
  typedef EvaTile<HD> T;
  constexpr int BM = T::BM;
  constexpr int BN = T::BN;
  constexpr int LD = T::LD;
  constexpr int NT = BN / 8;          // 8-column tiles of S per warp
  constexpr int DTL = HD / 8;         // 8-column tiles of O per warp
  constexpr int KQ = HD / 16;         // k-steps of Q K^T
  constexpr bool Q_REGS = HD <= 128;  // Q fragments stay in registers (else re-read from smem)
  extern __shared__ uint4 eva_smem[];
  unsigned short* sQ = reinterpret_cast<unsigned short*>(eva_smem);  // [BM][LD]
  unsigned short* sK = sQ + BM * LD;                                 // [BN][LD]
  unsigned short* sV = sK + BN * LD;                                 // [BN][LD]
  __shared__ int s_bad[FS_EVA_THREADS];                              // eva_sanitize_v's flags

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // accumulator row (and row + 8)
  const int cq = lane & 3;  // accumulator column pair
  // ldmatrix addresses: lane l points at row (l & 7) + 8 * (bit 3 or bit 4 of l) of a 16-row block and
  // column 8 * (the other bit) of a 16-column block, which orders the four 8x8 matrices (see each use)
  const int lr = lane & 7;
  const int b3 = (lane >> 3) & 1;
  const int b4 = (lane >> 4) & 1;
  const bool slid = sliding != 0;
  const i64 nrb = (Nq + BM - 1) / BM;
  const i64 tiles = B * H * nrb;
  const i64 row_bytes = D * 2;

  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const i64 bh = tile / nrb;
    const i64 rb = nrb - 1 - (tile - bh * nrb);  // the longest rows first
    const i64 b = bh / H;
    const i64 h = bh - b * H;
    const i64 hk = h / G;
    const i64 i0 = rb * BM;
    const i64 nrows = imin(BM, Nq - i0);
    const i64 t_min = q_offset + i0;
    const i64 t_max = t_min + nrows - 1;
    const i64 st_min = eva_start(t_min, C, W, slid);
    const i64 st_max = eva_start(t_max, C, W, slid);
    const i64 c_full = imin(st_min / C, Nc);  // summaries [0, c_full): every row
    const i64 c_hi = imin(st_max / C, Nc);    // summaries [0, c_hi): some rows
    const i64 e_lim = imin(t_max + 1, Nk);    // exact keys [st_min, e_lim)
    const i64 nb_s = (c_hi + BN - 1) / BN;
    const i64 nb_e = e_lim > st_min ? (e_lim - st_min + BN - 1) / BN : 0;
    const i64 nb = nb_s + nb_e;

    const char* kb = reinterpret_cast<const char*>(k) + (b * k_sb + hk * k_sh) * 2;
    const char* vb = reinterpret_cast<const char*>(v) + (b * v_sb + hk * v_sh) * 2;
    const char* ksb = reinterpret_cast<const char*>(k_sum) + (b * ks_sb + hk * ks_sh) * 2;
    const char* vsb = reinterpret_cast<const char*>(v_sum) + (b * vs_sb + hk * vs_sh) * 2;
    const float* bb = bias != nullptr ? bias + b * b_sb + hk * b_sh : nullptr;

    auto block_at = [&](i64 e) {
      EvaBlock blk;
      if (e < nb_s) {
        blk.k = ksb;
        blk.v = vsb;
        blk.sk = ks_sn * 2;
        blk.sv = vs_sn * 2;
        blk.n0 = e * BN;
        blk.limit = c_hi;
        blk.summary = true;
        blk.masked = blk.n0 + BN > c_full;
      } else {
        blk.k = kb;
        blk.v = vb;
        blk.sk = k_sn * 2;
        blk.sv = v_sn * 2;
        blk.n0 = st_min + (e - nb_s) * BN;
        blk.limit = e_lim;
        blk.summary = false;
        blk.masked = !(blk.n0 >= st_max && blk.n0 + BN - 1 <= t_min && blk.n0 + BN <= e_lim);
      }
      return blk;
    };

    // This thread's accumulator rows: warp * 16 + g (hf = 0) and + 8 (hf = 1).
    i64 t_r[2], st_r[2], sc_r[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      t_r[hf] = q_offset + i0 + warp * 16 + g + 8 * hf;
      st_r[hf] = eva_start(t_r[hf], C, W, slid);
      sc_r[hf] = imin(st_r[hf] / C, Nc);
    }

    load_tile<HD, BM>(sQ, reinterpret_cast<const char*>(q) + (b * q_sb + h * q_sh + i0 * q_sn) * 2, q_sn * 2,
                      nrows, row_bytes, vec_bytes);
    EvaBlock blk = block_at(0);
    if (nb > 0) {
      load_tile<HD, BN>(sK, blk.k + blk.n0 * blk.sk, blk.sk, blk.limit - blk.n0, row_bytes, vec_bytes);
    }
    cp_async_commit();

    float acc[DTL][4];
#pragma unroll
    for (int dt = 0; dt < DTL; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
    float m_r[2] = {neg_inf(), neg_inf()};
    float l_r[2] = {0.f, 0.f};  // this thread's partial row sums (its columns only)
    unsigned int qf[Q_REGS ? KQ : 1][4];

    for (i64 e = 0; e < nb; ++e) {
      const bool masked = blk.masked;  // blk moves on to block e + 1 before P V
      cp_async_wait_all();
      __syncthreads();  // K (and Q) landed; every warp is done with the previous V
      load_tile<HD, BN>(sV, blk.v + blk.n0 * blk.sv, blk.sv, blk.limit - blk.n0, row_bytes, vec_bytes);
      cp_async_commit();

      if constexpr (Q_REGS) {
        if (e == 0) {
#pragma unroll
          for (int kk = 0; kk < KQ; ++kk) ldsm_x4(qf[kk], smem_addr(sQ + (warp * 16 + lr + 8 * b3) * LD + kk * 16 + 8 * b4));
        }
      }

      // S = Q K^T. A = Q rows of this warp; B = K^T: K stored [key][dim] is B "col-major", so plain
      // ldmatrix gives b0/b1 of two key tiles: matrices (keys +0, dims +0), (+0, +8), (+8, +0), (+8, +8).
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KQ; ++kk) {
        unsigned int a[4];
        if constexpr (Q_REGS) {
          a[0] = qf[kk][0];
          a[1] = qf[kk][1];
          a[2] = qf[kk][2];
          a[3] = qf[kk][3];
        } else {
          ldsm_x4(a, smem_addr(sQ + (warp * 16 + lr + 8 * b3) * LD + kk * 16 + 8 * b4));
        }
#pragma unroll
        for (int jp = 0; jp < NT / 2; ++jp) {
          unsigned int bk[4];
          ldsm_x4(bk, smem_addr(sK + (jp * 16 + lr + 8 * b4) * LD + kk * 16 + 8 * b3));
          mma16816<DT>(s[2 * jp], a, bk[0], bk[1]);
          mma16816<DT>(s[2 * jp + 1], a, bk[2], bk[3]);
        }
      }

      // Base-2 logits, summary bias, visibility. s[j][2 hf + e2] is row warp*16 + g + 8 hf,
      // key n0 + 8 j + 2 cq + e2.
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const i64 n = blk.n0 + 8 * j + 2 * cq + e2;
          float bc = 0.f;
          if (blk.summary && bias_mode != FS_EVA_BIAS_NONE && n < blk.limit) bc = eva_bias(bias_mode, bb, b_sn, n, C, Nk);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            float x = fmaf(s[j][2 * hf + e2], scale_log2, bc);
            if (blk.masked) {
              const bool vis = blk.summary ? n < sc_r[hf] : (n >= st_r[hf] && n <= t_r[hf]);
              if (!vis) x = neg_inf();
            }
            s[j][2 * hf + e2] = x;
          }
        }
      }

      // Online softmax; a row's 4 owners (lanes 4g .. 4g+3) agree on its max through two shuffles.
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = neg_inf();
#pragma unroll
        for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * hf], s[j][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_r[hf], mx);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;  // a row that has seen nothing stays finite
        const float alpha = exp2f(m_r[hf] - m_use);
        m_r[hf] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          s[j][2 * hf] = exp2f(s[j][2 * hf] - m_use);
          s[j][2 * hf + 1] = exp2f(s[j][2 * hf + 1] - m_use);
          sum += s[j][2 * hf] + s[j][2 * hf + 1];
        }
        l_r[hf] = l_r[hf] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < DTL; ++dt) {
          acc[dt][2 * hf] *= alpha;
          acc[dt][2 * hf + 1] *= alpha;
        }
      }

      cp_async_wait_all();
      __syncthreads();  // V landed; every warp is done with K
      if (e + 1 < nb) {
        blk = block_at(e + 1);
        load_tile<HD, BN>(sK, blk.k + blk.n0 * blk.sk, blk.sk, blk.limit - blk.n0, row_bytes, vec_bytes);
        cp_async_commit();
      }
      if (masked) {  // block-uniform
        eva_sanitize_v<DT, HD>(sV, s_bad);
        __syncthreads();
        eva_poison_rows<HD, NT, DTL>(s, acc, s_bad, cq);
      }

      // O += P V. A = P: the S accumulators of key tiles 2kk, 2kk+1 are exactly the a0..a3 layout.
      // B = V (keys x dims) stored [key][dim] is "row-major", so ldmatrix.trans gives b0/b1 of two
      // dim tiles: matrices (keys +0, dims +0), (+8, +0), (+0, +8), (+8, +8).
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned int a[4];
        a[0] = pack2<DT>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<DT>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<DT>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<DT>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          unsigned int bv[4];
          ldsm_x4_trans(bv, smem_addr(sV + (kk * 16 + lr + 8 * b3) * LD + dp * 16 + 8 * b4));
          mma16816<DT>(acc[2 * dp], a, bv[0], bv[1]);
          mma16816<DT>(acc[2 * dp + 1], a, bv[2], bv[3]);
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();  // Q copies of an empty list have landed; every warp is done with K, V and Q

    // Epilogue: normalise, write lse, stage O in this warp's Q rows, copy them out.
    float inv[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = l_r[hf];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[hf] = l > 0.f ? 1.f / l : 0.f;
      const i64 i = i0 + warp * 16 + g + 8 * hf;
      if (cq == 0 && i < Nq) lse[b * l_sb + h * l_sh + i * l_sn] = l > 0.f ? (m_r[hf] + log2f(l)) * FS_LN2 : neg_inf();
    }
#pragma unroll
    for (int dt = 0; dt < DTL; ++dt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        *reinterpret_cast<unsigned int*>(sQ + (warp * 16 + g + 8 * hf) * LD + dt * 8 + 2 * cq) =
            pack2<DT>(acc[dt][2 * hf] * inv[hf], acc[dt][2 * hf + 1] * inv[hf]);
      }
    }
    __syncwarp();
    const i64 wrows = nrows - warp * 16;
    if (wrows > 0) {
      store_rows<HD>(reinterpret_cast<char*>(o) + (b * o_sb + h * o_sh + (i0 + warp * 16) * o_sn) * 2, o_sn * 2,
                     wrows, sQ + warp * 16 * LD, row_bytes, lane, vec_bytes);
    }
    __syncthreads();  // the next tile reloads sQ
  }
}

}  // namespace flashswitch

#ifndef __CUDACC_RTC__
// ------------------------------------------------------------------ host launcher
namespace {

using flashswitch::eva_attention_fwd_f32_kernel;
using flashswitch::eva_attention_fwd_kernel;
using flashswitch::EvaTile;

int padded_head_dim(long long D) {
  return D <= 32 ? 32 : D <= 64 ? 64 : D <= 96 ? 96 : D <= 128 ? 128 : D <= 192 ? 192 : 256;
}

#define FS_EVA_ARGS(a, scale_log2, vec)                                                                         \
  a.q, a.k, a.v, a.k_sum, a.v_sum, a.bias, a.o, a.lse, a.B, a.H, a.H / a.Hkv, a.Nq, a.Nk, a.Nc, a.D, a.C, a.W,  \
      a.q_offset, a.q_stride[0], a.q_stride[1], a.q_stride[2], a.k_stride[0], a.k_stride[1], a.k_stride[2],    \
      a.v_stride[0], a.v_stride[1], a.v_stride[2], a.k_sum_stride[0], a.k_sum_stride[1], a.k_sum_stride[2],    \
      a.v_sum_stride[0], a.v_sum_stride[1], a.v_sum_stride[2], a.bias_stride[0], a.bias_stride[1],             \
      a.bias_stride[2], a.o_stride[0], a.o_stride[1], a.o_stride[2], a.lse_stride[0], a.lse_stride[1],         \
      a.lse_stride[2], scale_log2, a.sliding, a.bias_mode, vec

template <int DT, int HD>
cudaError_t launch_tc(const fs_eva_attention_args& a, const fs_eva_attention_plan& p, float scale_log2,
                      cudaStream_t stream) {
  if (p.smem_bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(eva_attention_fwd_kernel<DT, HD>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem_bytes);
    if (err != cudaSuccess) return err;
  }
  eva_attention_fwd_kernel<DT, HD><<<(unsigned int)p.grid, p.threads, p.smem_bytes, stream>>>(
      FS_EVA_ARGS(a, scale_log2, p.vec_bytes));
  return cudaGetLastError();
}

template <int DT>
cudaError_t by_head_dim(const fs_eva_attention_args& a, const fs_eva_attention_plan& p, float scale_log2,
                        cudaStream_t s) {
  switch (p.head_dim) {
    case 32: return launch_tc<DT, 32>(a, p, scale_log2, s);
    case 64: return launch_tc<DT, 64>(a, p, scale_log2, s);
    case 96: return launch_tc<DT, 96>(a, p, scale_log2, s);
    case 128: return launch_tc<DT, 128>(a, p, scale_log2, s);
    case 192: return launch_tc<DT, 192>(a, p, scale_log2, s);
    case 256: return launch_tc<DT, 256>(a, p, scale_log2, s);
    default: return cudaErrorInvalidValue;
  }
}

template <int DT, int EPL>
cudaError_t launch_decode(const fs_eva_attention_args& a, const fs_eva_attention_plan& p, float scale_log2,
                          cudaStream_t stream) {
  flashswitch::eva_attention_decode_kernel<DT, EPL><<<(unsigned int)p.grid, p.threads, 0, stream>>>(
      FS_EVA_ARGS(a, scale_log2, p.vec_bytes));
  return cudaGetLastError();
}

template <int DT>
cudaError_t decode_by_head_dim(const fs_eva_attention_args& a, const fs_eva_attention_plan& p, float scale_log2,
                               cudaStream_t s) {
  switch (p.head_dim) {
    case 64: return launch_decode<DT, 2>(a, p, scale_log2, s);
    case 128: return launch_decode<DT, 4>(a, p, scale_log2, s);
    case 256: return launch_decode<DT, 8>(a, p, scale_log2, s);
    default: return cudaErrorInvalidValue;
  }
}

template <int EPL>
cudaError_t launch_f32(const fs_eva_attention_args& a, const fs_eva_attention_plan& p, float scale_log2,
                       cudaStream_t stream) {
  eva_attention_fwd_f32_kernel<EPL><<<(unsigned int)p.grid, p.threads, 0, stream>>>(FS_EVA_ARGS(a, scale_log2, 0));
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t fs_eva_attention_plan_for(long long D, int dtype, long long align, long long B, long long H,
                                                 long long Nq, int decode, fs_eva_attention_plan* plan) {
  if (plan == nullptr || D < 0 || D > FS_EVA_MAX_D || align < 1 || B < 0 || H < 0 || Nq < 0) return cudaErrorInvalidValue;
  const bool half = dtype == FS_DTYPE_F16 || dtype == FS_DTYPE_BF16;
  if (decode && half && Nq <= FS_EVA_DEC_MAX_Q && D > 0) {  // one block per query row
    const int epl = D <= 64 ? 2 : D <= 128 ? 4 : 8;
    const long long rows = B * H * Nq;
    plan->kernel = FS_EVA_KERNEL_DECODE;
    plan->head_dim = 32 * epl;
    plan->block_m = 1;
    plan->block_n = 0;
    plan->vec_bytes = align >= 2 * epl && D % epl == 0 ? 2 * epl : 0;  // one access per lane and row
    plan->threads = FS_EVA_DEC_WARPS * 32;
    plan->grid = rows < 0x7fffffffLL ? rows : 0x7fffffffLL;
    plan->smem_bytes = 0;
    return cudaSuccess;
  }
  long long work;
  if (dtype == FS_DTYPE_F32) {
    plan->kernel = FS_EVA_KERNEL_F32;
    const int epl = D <= 64 ? 2 : D <= 128 ? 4 : 8;
    plan->head_dim = 32 * epl;
    plan->block_m = FS_EVA_F32_ROWS;
    plan->block_n = 0;
    plan->vec_bytes = 0;
    plan->smem_bytes = 0;
    work = B * H * Nq;
  } else if (dtype == FS_DTYPE_F16 || dtype == FS_DTYPE_BF16) {
    const int hd = padded_head_dim(D);
    const int bn = hd > 128 ? 32 : 64;
    // widest access (16, 8, 4 or 2 bytes) dividing a row and every address / stride
    long long vb = 16;
    while (vb > 2 && ((D * 2) % vb != 0 || align % vb != 0)) vb /= 2;
    plan->kernel = FS_EVA_KERNEL_TC;
    plan->head_dim = hd;
    plan->block_m = FS_EVA_BLOCK_M;
    plan->block_n = bn;
    plan->vec_bytes = (int)vb;
    plan->smem_bytes = (FS_EVA_BLOCK_M + 2 * bn) * (hd + 8) * 2;
    work = B * H * ((Nq + FS_EVA_BLOCK_M - 1) / FS_EVA_BLOCK_M);
  } else {
    return cudaErrorInvalidValue;
  }
  plan->threads = FS_EVA_THREADS;
  long long grid = dtype == FS_DTYPE_F32 ? (work + FS_EVA_F32_ROWS - 1) / FS_EVA_F32_ROWS : work;
  if (grid > 0x7fffffffLL) grid = 0x7fffffffLL;  // the kernels loop over the rest
  plan->grid = grid;
  return cudaSuccess;
}

extern "C" cudaError_t fs_eva_attention_fwd(const fs_eva_attention_args* a, cudaStream_t stream) {
  if (a == nullptr || a->B < 0 || a->H < 0 || a->Hkv < 1 || a->H % a->Hkv != 0 || a->Nq < 0 || a->Nk < 0 ||
      a->Nc < 0 || a->D < 0 || a->C < 1 || a->W < 1 || a->q_offset < 0)
    return cudaErrorInvalidValue;
  if (a->bias_mode < FS_EVA_BIAS_NONE || a->bias_mode > FS_EVA_BIAS_LOG_COUNT ||
      (a->bias_mode == FS_EVA_BIAS_TENSOR && a->bias == nullptr))
    return cudaErrorInvalidValue;
  const int es = a->dtype == FS_DTYPE_F32 ? 4 : (a->dtype == FS_DTYPE_F16 || a->dtype == FS_DTYPE_BF16) ? 2 : 0;
  if (es == 0) return cudaErrorInvalidValue;

  // Alignment of the tile accesses: base addresses and the byte strides of dims that move.
  long long align = 16;
  auto fold = [&align](long long x) {
    while (align > 1 && x % align != 0) align /= 2;
  };
  const void* ptrs[6] = {a->q, a->k, a->v, a->k_sum, a->v_sum, a->o};
  const long long* strides[6] = {a->q_stride, a->k_stride, a->v_stride, a->k_sum_stride, a->v_sum_stride,
                                 a->o_stride};
  const long long sizes[6][3] = {{a->B, a->H, a->Nq},  {a->B, a->Hkv, a->Nk}, {a->B, a->Hkv, a->Nk},
                                 {a->B, a->Hkv, a->Nc}, {a->B, a->Hkv, a->Nc}, {a->B, a->H, a->Nq}};
  for (int t = 0; t < 6; ++t) {
    fold((long long)(size_t)ptrs[t]);
    for (int i = 0; i < 3; ++i)
      if (sizes[t][i] > 1) fold(strides[t][i] * es);
  }

  fs_eva_attention_plan p;
  const cudaError_t err = fs_eva_attention_plan_for(a->D, a->dtype, align, a->B, a->H, a->Nq, a->decode_kernel, &p);
  if (err != cudaSuccess) return err;
  if (p.grid == 0) return cudaSuccess;
  const float scale_log2 = (float)((double)a->scale * 1.4426950408889634);
  if (p.kernel == FS_EVA_KERNEL_DECODE) {
    if (a->dtype == FS_DTYPE_F16) return decode_by_head_dim<FS_DTYPE_F16>(*a, p, scale_log2, stream);
    return decode_by_head_dim<FS_DTYPE_BF16>(*a, p, scale_log2, stream);
  }
  switch (a->dtype) {
    case FS_DTYPE_F16: return by_head_dim<FS_DTYPE_F16>(*a, p, scale_log2, stream);
    case FS_DTYPE_BF16: return by_head_dim<FS_DTYPE_BF16>(*a, p, scale_log2, stream);
    default:
      switch (p.head_dim) {
        case 64: return launch_f32<2>(*a, p, scale_log2, stream);
        case 128: return launch_f32<4>(*a, p, scale_log2, stream);
        case 256: return launch_f32<8>(*a, p, scale_log2, stream);
        default: return cudaErrorInvalidValue;
      }
  }
}
#endif  // __CUDACC_RTC__
