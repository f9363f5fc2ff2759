// Op 1 (SPEC.md): chunked control-variate key/value summaries.
//
// For chunk c of head (b, h), over the valid tokens j of the chunk, in fp32:
//   l_j = scale * (omega_c . k_j - |k_j|^2 / 2),   v_sum = softmax(l) . v,   lse = logsumexp(l),
//   k_sum = mean of k_j, or softmax_j(key_weight_h . k_j) . k_j when key_weight is given;
//   an empty chunk gives k_sum = v_sum = 0 and lse = -inf.
//
// Work layout. A *group* of `lanes` consecutive lanes (a power of two) holds one token row: lane g of
// the group owns vectors g, g + lanes, ... (VPL of them) of VEC elements, each one 16, 8, 4-byte or
// scalar access. A warp holds 32 / lanes groups. `split` groups share one chunk: group r of a chunk
// takes rows r, r + split, ... and runs an online softmax (base 2) over them, loading U rows of k
// and v before using any (U = config "unroll"; WEIGHTED: key_weight given). The groups of a chunk
// then merge their states: with xor shuffles inside a warp, and through shared memory when a chunk
// spans several warps (split > 32 / lanes). Group 0 of the chunk writes the outputs. Every loop trip
// count is uniform across a block, so all shuffles run with the full mask and __syncthreads is
// reached by every thread.
#include "common.cuh"
#include "chunk_summaries.h"

namespace flashswitch {

// a / n and a % n for a, n >= 0, in 32 bits when both fit (64-bit division is slow).
__device__ __forceinline__ void divmod(i64 a, i64 n, i64& quot, i64& rem) {
  if (((a | n) >> 31) == 0) {
    const unsigned int qq = (unsigned int)a / (unsigned int)n;
    quot = qq;
    rem = a - (i64)qq * n;
  } else {
    quot = a / n;
    rem = a - quot * n;
  }
}

template <int DT, int VEC, int VPL, int U, bool WEIGHTED>
__global__ void __launch_bounds__(FS_CS_MAX_THREADS) chunk_summaries_fwd_kernel(
    const void* __restrict__ k, const void* __restrict__ v, const void* __restrict__ omega,
    const void* __restrict__ key_weight, const unsigned char* __restrict__ valid, void* __restrict__ k_sum,
    void* __restrict__ v_sum, float* __restrict__ lse, i64 B, i64 H, i64 N, i64 D, i64 C,
    i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 om_sb, i64 om_sh, i64 om_sc,
    i64 kw_sh, i64 va_sb, i64 va_sn, i64 ks_sb, i64 ks_sh, i64 ks_sc, i64 vs_sb, i64 vs_sh, i64 vs_sc,
    i64 ls_sb, i64 ls_sh, i64 ls_sc, float scale_log2, int omega_dtype, int key_weight_dtype, int lanes,
    int split) {
  typedef Vec<DT, VEC> V;
  constexpr int E = VEC * VPL;  // elements of a row held by one lane
  constexpr int SZ = Elem<DT>::kSize;
  extern __shared__ float smem[];

  const int G = lanes;
  const int R = 32 / G;                         // groups per warp
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gl = lane & (G - 1);                // lane within its group
  const int group = warp * R + lane / G;        // group within the block
  const int P = split;                          // groups per chunk
  const int Pi = P < R ? P : R;                 // ... of them inside one warp
  const int W = P / Pi;                         // warps per chunk
  const int cpb = (int)(blockDim.x >> 5) * R / P;  // chunks per block
  const int slot = group / P;
  const int r = group - slot * P;               // rank of this group within its chunk
  const i64 Nc = (N + C - 1) / C;
  const i64 nchunks = B * H * Nc;
  const i64 rows = C < N ? C : N;               // most rows in any chunk

  for (i64 first = (i64)blockIdx.x * cpb; first < nchunks; first += (i64)gridDim.x * cpb) {
    const i64 q = first + slot;
    const bool live = q < nchunks;
    i64 b = 0, h = 0, c = 0;
    if (live) {
      i64 bh;
      divmod(q, Nc, bh, c);
      divmod(bh, H, b, h);
    }
    const i64 j0 = c * C;
    const i64 len = live ? (N - j0 < C ? N - j0 : C) : 0;  // rows of this chunk

    // This lane's slices of omega_c and key_weight_h.
    const i64 d_lane = (i64)gl * VEC;
    float om[E], kw[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      om[i] = 0.f;
      kw[i] = 0.f;
    }
    if (omega != nullptr && live)
      load_slice<VEC, VPL>(om, omega, omega_dtype, b * om_sb + h * om_sh + c * om_sc, d_lane, G * VEC, D);
    if (WEIGHTED && live) load_slice<VEC, VPL>(kw, key_weight, key_weight_dtype, h * kw_sh, d_lane, G * VEC, D);

    // Online softmax states (base 2): values (m, s, av) and keys (m2, s2, ak). In mean mode the key
    // state is (0 or -inf, count, sum), which merges with the same rule.
    float m = neg_inf(), s = 0.f, m2 = neg_inf(), s2 = 0.f;
    float av[E], ak[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      av[i] = 0.f;
      ak[i] = 0.f;
    }
    // Row t of the chunk starts at kp + t * kstep (bytes) for this lane; this group starts at row r.
    const char* kp = reinterpret_cast<const char*>(k) + (b * k_sb + h * k_sh + (j0 + r) * k_sn + d_lane) * SZ;
    const char* vp = reinterpret_cast<const char*>(v) + (b * v_sb + h * v_sh + (j0 + r) * v_sn + d_lane) * SZ;
    const unsigned char* mp = valid != nullptr ? valid + b * va_sb + (j0 + r) * va_sn : nullptr;
    const i64 kstep = k_sn * SZ * P, vstep = v_sn * SZ * P, mstep = va_sn * P;

    for (i64 it = 0; it < rows; it += (i64)P * U) {
      V kx[U][VPL], vx[U][VPL];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        ok[u] = it + (i64)u * P + r < len;
        // Padded rows are never loaded: their contents may be inf/NaN, and 0 * inf would leak in.
        if (mp != nullptr && ok[u]) ok[u] = mp[u * mstep] != 0;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          if (ok[u] && d_lane + i * G * VEC < D) {
            kx[u][i].load(kp + u * kstep + i * G * VEC * SZ);
            vx[u][i].load(vp + u * vstep + i * G * VEC * SZ);
          } else {
            kx[u][i].zero();
            vx[u][i].zero();
          }
        }
      }
      kp += U * kstep;
      vp += U * vstep;
      if (mp != nullptr) mp += U * mstep;

      // Row dot products, summed over the lanes of the group (mean mode: key sums on the way).
      float l[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const float x = kx[u][i].get(e);
            acc = fmaf(x, fmaf(-0.5f, x, om[i * VEC + e]), acc);
            if constexpr (!WEIGHTED) ak[i * VEC + e] = fmaf(ok[u] ? 1.f : 0.f, x, ak[i * VEC + e]);
          }
        }
        l[u] = acc;
      }
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        if (o < G) {
#pragma unroll
          for (int u = 0; u < U; ++u) l[u] += __shfl_xor_sync(0xffffffffu, l[u], o);
        }
      }

      // Values: one rescale per batch of U rows.
      float mn = m;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        l[u] *= scale_log2;
        if (ok[u]) mn = fmaxf(mn, l[u]);
      }
      const float alpha = mn == m ? 1.f : exp2f(m - mn);
      s *= alpha;
#pragma unroll
      for (int i = 0; i < E; ++i) av[i] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = ok[u] ? exp2f(l[u] - mn) : 0.f;
        s += p;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) av[i * VEC + e] = fmaf(p, vx[u][i].get(e), av[i * VEC + e]);
        }
      }
      m = mn;

      // Keys.
      if constexpr (WEIGHTED) {
        float a[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float acc = 0.f;
#pragma unroll
          for (int i = 0; i < VPL; ++i) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc = fmaf(kx[u][i].get(e), kw[i * VEC + e], acc);
          }
          a[u] = acc;
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          if (o < G) {
#pragma unroll
            for (int u = 0; u < U; ++u) a[u] += __shfl_xor_sync(0xffffffffu, a[u], o);
          }
        }
        float mn2 = m2;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          a[u] *= FS_LOG2E;
          if (ok[u]) mn2 = fmaxf(mn2, a[u]);
        }
        const float beta = mn2 == m2 ? 1.f : exp2f(m2 - mn2);
        s2 *= beta;
#pragma unroll
        for (int i = 0; i < E; ++i) ak[i] *= beta;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const float p = ok[u] ? exp2f(a[u] - mn2) : 0.f;
          s2 += p;
#pragma unroll
          for (int i = 0; i < VPL; ++i) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) ak[i * VEC + e] = fmaf(p, kx[u][i].get(e), ak[i * VEC + e]);
          }
        }
        m2 = mn2;
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) s2 += ok[u] ? 1.f : 0.f;
      }
    }
    if constexpr (!WEIGHTED) m2 = s2 > 0.f ? 0.f : neg_inf();

    // Merge the groups of a chunk that share this warp (partners hold the same vector slots); after
    // this every group of the chunk in this warp holds the same state.
    for (int o = G; o < G * Pi; o <<= 1) {
      float mm, fa, fb;
      const float mo = __shfl_xor_sync(0xffffffffu, m, o);
      const float so = __shfl_xor_sync(0xffffffffu, s, o);
      merge_weights(m, mo, mm, fa, fb);
      m = mm;
      s = s * fa + so * fb;
#pragma unroll
      for (int i = 0; i < E; ++i) av[i] = av[i] * fa + __shfl_xor_sync(0xffffffffu, av[i], o) * fb;
      const float mo2 = __shfl_xor_sync(0xffffffffu, m2, o);
      const float so2 = __shfl_xor_sync(0xffffffffu, s2, o);
      merge_weights(m2, mo2, mm, fa, fb);
      m2 = mm;
      s2 = s2 * fa + so2 * fb;
#pragma unroll
      for (int i = 0; i < E; ++i) ak[i] = ak[i] * fa + __shfl_xor_sync(0xffffffffu, ak[i], o) * fb;
    }

    // Merge across the warps of a chunk: each warp's group 0 posts its state, the chunk's first warp
    // folds the others into its own.
    if (W > 1) {
      const int stride = 4 + 2 * G * E;
      float* st = smem + warp * stride;
      if (lane < G) {
        if (lane == 0) {
          st[0] = m;
          st[1] = s;
          st[2] = m2;
          st[3] = s2;
        }
#pragma unroll
        for (int i = 0; i < E; ++i) {
          st[4 + i * G + gl] = av[i];
          st[4 + (E + i) * G + gl] = ak[i];
        }
      }
      __syncthreads();
      if (r == 0) {  // group 0 of the first warp of the chunk
        for (int w = 1; w < W; ++w) {
          const float* ot = smem + (warp + w) * stride;
          float mm, fa, fb;
          merge_weights(m, ot[0], mm, fa, fb);
          m = mm;
          s = s * fa + ot[1] * fb;
#pragma unroll
          for (int i = 0; i < E; ++i) av[i] = av[i] * fa + ot[4 + i * G + gl] * fb;
          merge_weights(m2, ot[2], mm, fa, fb);
          m2 = mm;
          s2 = s2 * fa + ot[3] * fb;
#pragma unroll
          for (int i = 0; i < E; ++i) ak[i] = ak[i] * fa + ot[4 + (E + i) * G + gl] * fb;
        }
      }
      __syncthreads();  // the next round reuses the shared memory
    }

    if (live && r == 0) {
      const float inv = s > 0.f ? 1.f / s : 0.f;
      const float inv2 = s2 > 0.f ? 1.f / s2 : 0.f;
      char* kso = reinterpret_cast<char*>(k_sum) + (b * ks_sb + h * ks_sh + c * ks_sc) * SZ;
      char* vso = reinterpret_cast<char*>(v_sum) + (b * vs_sb + h * vs_sh + c * vs_sc) * SZ;
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        const i64 d0 = (i64)(gl + i * G) * VEC;
        if (d0 < D) {
          V ko, vo;
          ko.zero();
          vo.zero();
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            ko.set(e, ak[i * VEC + e] * inv2);
            vo.set(e, av[i * VEC + e] * inv);
          }
          ko.store(kso + d0 * SZ);
          vo.store(vso + d0 * SZ);
        }
      }
      if (gl == 0) lse[b * ls_sb + h * ls_sh + c * ls_sc] = s > 0.f ? (m + log2f(s)) * FS_LN2 : neg_inf();
    }
  }
}

}  // namespace flashswitch

#ifndef __CUDACC_RTC__
// ------------------------------------------------------------------ host launcher
namespace {

using flashswitch::chunk_summaries_fwd_kernel;

long long floor_pow2(long long x) {
  long long p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

long long ceil_pow2(long long x) {
  long long p = 1;
  while (p < x) p *= 2;
  return p;
}

template <int DT, int VEC, int VPL, int U, bool WEIGHTED>
cudaError_t launch(const fs_chunk_summaries_args& a, const fs_chunk_summaries_plan& p, cudaStream_t stream) {
  const float scale_log2 = (float)((double)a.scale * 1.4426950408889634);
  chunk_summaries_fwd_kernel<DT, VEC, VPL, U, WEIGHTED><<<(unsigned int)p.grid, p.threads, p.smem_bytes, stream>>>(
      a.k, a.v, a.omega, a.key_weight, a.valid, a.k_sum, a.v_sum, a.lse, a.B, a.H, a.N, a.D, a.C,
      a.k_stride[0], a.k_stride[1], a.k_stride[2], a.v_stride[0], a.v_stride[1], a.v_stride[2],
      a.omega_stride[0], a.omega_stride[1], a.omega_stride[2], a.key_weight_stride, a.valid_stride[0],
      a.valid_stride[1], a.k_sum_stride[0], a.k_sum_stride[1], a.k_sum_stride[2], a.v_sum_stride[0],
      a.v_sum_stride[1], a.v_sum_stride[2], a.lse_stride[0], a.lse_stride[1], a.lse_stride[2], scale_log2,
      a.omega_dtype, a.key_weight_dtype, p.lanes, p.split);
  return cudaGetLastError();
}

template <int DT, int VEC, int VPL, int U>
cudaError_t by_mode(const fs_chunk_summaries_args& a, const fs_chunk_summaries_plan& p, cudaStream_t s) {
  return a.key_weight != nullptr ? launch<DT, VEC, VPL, U, true>(a, p, s) : launch<DT, VEC, VPL, U, false>(a, p, s);
}

template <int DT, int VEC, int VPL>
cudaError_t by_unroll(const fs_chunk_summaries_args& a, const fs_chunk_summaries_plan& p, cudaStream_t s) {
  switch (p.unroll) {
    case 1: return by_mode<DT, VEC, VPL, 1>(a, p, s);
    case 2: return by_mode<DT, VEC, VPL, 2>(a, p, s);
    case 4: return by_mode<DT, VEC, VPL, 4>(a, p, s);
    default: return cudaErrorInvalidValue;
  }
}

template <int DT, int VEC>
cudaError_t by_vpl(const fs_chunk_summaries_args& a, const fs_chunk_summaries_plan& p, cudaStream_t s) {
  switch (p.vpl) {
    case 1: return by_unroll<DT, VEC, 1>(a, p, s);
    case 2: if constexpr (VEC * 2 <= FS_CS_MAX_ELEMS) return by_unroll<DT, VEC, 2>(a, p, s); break;
    case 4: if constexpr (VEC * 4 <= FS_CS_MAX_ELEMS) return by_unroll<DT, VEC, 4>(a, p, s); break;
    case 8: if constexpr (VEC * 8 <= FS_CS_MAX_ELEMS) return by_unroll<DT, VEC, 8>(a, p, s); break;
    default: break;
  }
  return cudaErrorInvalidValue;
}

template <int DT>
cudaError_t by_vec(const fs_chunk_summaries_args& a, const fs_chunk_summaries_plan& p, cudaStream_t s) {
  switch (p.vec) {
    case 1: return by_vpl<DT, 1>(a, p, s);
    case 2: return by_vpl<DT, 2>(a, p, s);
    case 4: return by_vpl<DT, 4>(a, p, s);
    case 8: if constexpr (flashswitch::Elem<DT>::kSize == 2) return by_vpl<DT, 8>(a, p, s); break;
    default: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" cudaError_t fs_chunk_summaries_plan_for(long long D, int elem_size, long long align, long long C,
                                                   long long nchunks, int threads, int unroll, int split,
                                                   fs_chunk_summaries_plan* plan) {
  if (plan == nullptr || D < 0 || D > FS_CS_MAX_D || (elem_size != 2 && elem_size != 4) || C < 1 ||
      nchunks < 0 || align < 1)
    return cudaErrorInvalidValue;
  // Widest access (16, 8, 4 bytes, else one element) that divides a row and every address/stride.
  long long vb = 16;
  while (vb > elem_size && ((D * elem_size) % vb != 0 || align % vb != 0)) vb /= 2;
  const long long vec = vb / elem_size;
  const long long nvec = D / vec;
  const long long lanes = nvec < 32 ? ceil_pow2(nvec) : 32;
  const long long vpl = ceil_pow2((nvec + lanes - 1) / lanes);
  const long long t_in = threads < 32 ? 32 : threads > FS_CS_MAX_THREADS ? FS_CS_MAX_THREADS : threads;
  const long long t = threads <= 0 ? 128 : floor_pow2(t_in);
  const long long u = unroll >= 4 ? 4 : unroll >= 2 ? 2 : 1;
  const long long R = 32 / lanes;
  const long long groups = t / 32 * R;  // per block
  long long p;
  if (split > 0) {
    p = floor_pow2(split < groups ? split : groups);
  } else {  // more groups per chunk while the grid is small and each group keeps >= U rows
    p = 1;
    while (2 * p <= groups && 2 * p * u <= C && nchunks * p * lanes < 32LL * 8192) p *= 2;
  }
  const long long cpb = groups / p;
  long long grid = (nchunks + cpb - 1) / cpb;
  if (grid > 0x7fffffffLL) grid = 0x7fffffffLL;  // the kernel loops over the rest
  plan->vec = (int)vec;
  plan->vpl = (int)vpl;
  plan->lanes = (int)lanes;
  plan->split = (int)p;
  plan->threads = (int)t;
  plan->unroll = (int)u;
  plan->grid = grid;
  plan->smem_bytes = p > R ? (int)(t / 32 * (4 + 2 * lanes * vec * vpl) * (long long)sizeof(float)) : 0;
  return cudaSuccess;
}

extern "C" cudaError_t fs_chunk_summaries_fwd(const fs_chunk_summaries_args* a, int threads, int unroll,
                                              int split, cudaStream_t stream) {
  if (a == nullptr || a->B < 0 || a->H < 0 || a->N < 0 || a->C < 1) return cudaErrorInvalidValue;
  const int es = a->dtype == FS_DTYPE_F32 ? 4 : (a->dtype == FS_DTYPE_F16 || a->dtype == FS_DTYPE_BF16) ? 2 : 0;
  if (es == 0) return cudaErrorInvalidValue;
  const long long Nc = (a->N + a->C - 1) / a->C;
  const long long nchunks = a->B * a->H * Nc;

  // Alignment of every vector access: base addresses and the byte strides of dims that move.
  long long align = 16;
  auto fold = [&align](long long x) {
    while (align > 1 && x % align != 0) align /= 2;
  };
  fold((long long)(size_t)a->k);
  fold((long long)(size_t)a->v);
  fold((long long)(size_t)a->k_sum);
  fold((long long)(size_t)a->v_sum);
  const long long in_sizes[3] = {a->B, a->H, a->N};
  const long long out_sizes[3] = {a->B, a->H, Nc};
  for (int i = 0; i < 3; ++i) {
    if (in_sizes[i] > 1) {
      fold(a->k_stride[i] * es);
      fold(a->v_stride[i] * es);
    }
    if (out_sizes[i] > 1) {
      fold(a->k_sum_stride[i] * es);
      fold(a->v_sum_stride[i] * es);
    }
  }

  fs_chunk_summaries_plan p;
  cudaError_t err = fs_chunk_summaries_plan_for(a->D, es, align, a->C, nchunks, threads, unroll, split, &p);
  if (err != cudaSuccess) return err;
  if (p.grid == 0) return cudaSuccess;
  switch (a->dtype) {
    case FS_DTYPE_F32: return by_vec<FS_DTYPE_F32>(*a, p, stream);
    case FS_DTYPE_F16: return by_vec<FS_DTYPE_F16>(*a, p, stream);
    case FS_DTYPE_BF16: return by_vec<FS_DTYPE_BF16>(*a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}
#endif  // __CUDACC_RTC__
