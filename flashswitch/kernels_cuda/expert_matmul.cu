// Op 3 (SPEC.md): grouped expert matmul, gather -> per-expert GEMM -> scatter over expert-sorted pairs.
//
//   y[t, g] = sum over slots s of group g (s / (S / G_out) == g) of gate[t, s] * x[t, s / (S / G_in)] @ W[e(t, s)]
//
// Same tiling as the Triton kernel (kernels_triton/expert_matmul.py): a block computes a
// [BLOCK_M, BLOCK_N] tile of per-pair products for BLOCK_M consecutive pairs of the expert-sorted list
// (a row tile) and BLOCK_N output features. Row tiles never straddle experts: expert e owns
// ceil(n_e / BLOCK_M) of them, numbered in expert order, and each block finds its expert and first row
// from the route's offsets [E+1] with a block-wide scan (no host sync, no extra launch). The grid is
// sized on the host from sizes only: ceil(P / BLOCK_M) + min(E, P) row tiles (an upper bound), times
// the column tiles; blocks whose row tile does not exist exit. Tile ids are ordered (group of GROUP_N
// column tiles, row tile, column tile within the group), as in the Triton kernel; its interleaved
// row-tile order (INTERLEAVE) is not implemented here: row tiles are always expert-major.
//
// Main loop (BLOCK_K = 32): the A rows x[t, s / (S / G_in)] of the tile's pairs are gathered into shared
// memory ([BLOCK_M][BLOCK_K], k contiguous), the B tile W[e][k0:k0+32, n0:n0+BLOCK_N] is stored
// transposed ([BLOCK_N][BLOCK_K], k contiguous) after a cast to x's dtype (fp32 master weights). The
// next step's global loads are issued into registers before the current step's math. Loads are
// 16-byte vectors where the base address, the strides and the remaining row length allow it, scalar
// (masked) elsewhere, so no alignment is assumed.
//
// Math: fp16/bf16 on tensor cores, mma.sync.m16n8k16 with fp32 accumulation. 4 warps as 2 x 2, each
// owning a (BLOCK_M/2) x (BLOCK_N/2) piece = MT x NT fragments of 16 x 8. Fragment layouts (PTX ISA,
// "Matrix Fragments for mma.m16n8k16", g = lane / 4, q = lane % 4; a 32-bit register holds two
// 16-bit elements, the lower column / k index in the low half):
//   A (16 x 16, row-major): a0 = A[g][2q..2q+1], a1 = A[g+8][2q..], a2 = A[g][2q+8..], a3 = A[g+8][2q+8..]
//   B (16 x 8, "col"):      b0 = B[2q..2q+1][g],  b1 = B[2q+8..2q+9][g]   (k pairs contiguous in Bs[n][k])
//   C (16 x 8, fp32):       c0, c1 = C[g][2q], C[g][2q+1];  c2, c3 = C[g+8][2q], C[g+8][2q+1]
// fp32 x runs the same tiles with plain FMAs (no tensor cores) into the same accumulator layout.
//
// Epilogue: each row times its gate, then by mode (expert_matmul.h): direct store into y (G_out == S),
// fp32 atomicAdd into a zeroed accumulator, or the pair's fp32 row into a scratch (deterministic); the
// last two are finished by expert_matmul_finish_kernel (cast, or slot-ordered group sum, into y).
#include "common.cuh"
#include "expert_matmul.h"

namespace flashswitch {

template <bool C, class A, class B>
struct EmSelect {
  typedef A type;
};
template <class A, class B>
struct EmSelect<false, A, B> {
  typedef B type;
};

// Element i of a tensor of type DT, as float.
template <int DT>
__device__ __forceinline__ float em_load(const void* p, i64 i) {
  if constexpr (Elem<DT>::kSize == 4) {
    return __ldg(reinterpret_cast<const float*>(p) + i);
  } else {
    return Elem<DT>::to_float(__ldg(reinterpret_cast<const unsigned short*>(p) + i));
  }
}

__device__ __forceinline__ float em_load_any(const void* p, int dtype, i64 i) {
  switch (dtype) {
    case FS_DTYPE_F16: return em_load<FS_DTYPE_F16>(p, i);
    case FS_DTYPE_BF16: return em_load<FS_DTYPE_BF16>(p, i);
    default: return em_load<FS_DTYPE_F32>(p, i);
  }
}

template <int DT>
__device__ __forceinline__ void em_store(void* p, i64 i, float v) {
  if constexpr (Elem<DT>::kSize == 4) {
    reinterpret_cast<float*>(p)[i] = v;
  } else {
    reinterpret_cast<unsigned short*>(p)[i] = (unsigned short)Elem<DT>::from_float(v);
  }
}

// D += A * B on tensor cores, one m16n8k16 fragment (layouts in the header comment).
template <int DT>
__device__ __forceinline__ void em_mma(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (DT == FS_DTYPE_BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  __trap();  // tensor-core path needs sm_80+
#endif
}

// The row tile `pid_m` (expert-major numbering): its expert (E when there is no such tile), first
// sorted row and the end of its expert's rows. Block-wide: every thread of the THREADS calls it and
// gets the same answer. Scans the experts THREADS at a time, stopping once the tile is passed.
template <int BM, int THREADS = FS_EM_THREADS>
__device__ __forceinline__ void em_find_tile(const i64* __restrict__ offsets, i64 E, i64 pid_m, i64* s_scan,
                                             i64* s_tile, i64& e, i64& row0, i64& row_end) {
  constexpr int NW = THREADS / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    s_tile[0] = E;
    s_tile[1] = 0;
    s_tile[2] = 0;
  }
  i64 carry = 0;  // tiles of the experts already scanned
  for (i64 c = 0; c < E; c += THREADS) {
    const i64 j = c + tid;
    i64 lo = 0, hi = 0;
    if (j < E) {
      lo = __ldg(offsets + j);
      hi = __ldg(offsets + j + 1);
    }
    const i64 nt = hi > lo ? (hi - lo + BM - 1) / BM : 0;
    i64 incl = nt;  // inclusive scan of nt over the block
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const i64 v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) s_scan[warp] = incl;
    __syncthreads();
    i64 before = 0, total = 0;
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      const i64 v = s_scan[i];
      if (i < warp) before += v;
      total += v;
    }
    const i64 first = carry + before + incl - nt;  // first tile of expert j
    if (nt > 0 && first <= pid_m && pid_m < first + nt) {
      s_tile[0] = j;
      s_tile[1] = lo + (pid_m - first) * BM;
      s_tile[2] = hi;
    }
    carry += total;
    __syncthreads();  // s_tile is final if found; s_scan may be rewritten
    if (carry > pid_m) break;  // uniform: carry is the same in every thread
  }
  __syncthreads();
  e = s_tile[0];
  row0 = s_tile[1];
  row_end = s_tile[2];
}

template <int MT, int NT>
__device__ __forceinline__ void em_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;
    }
  }
}

// The work of schedule slot `tile`: its column tile pid_n and row tile (expert e, sorted rows from
// row0, ordered (group of GROUP_N column tiles, row tile, column tile in group)), and the per-pair facts
// of the row tile in shared memory: x row offset, output row offset (-1 past the expert's rows) and
// gate. Block-wide; false (the same in every thread) when the row tile does not exist.
template <int BM, int THREADS>
__device__ __forceinline__ bool em_row_tile(i64 tile, i64 grid_m, i64 n_tiles_n, i64 group_n,
                                            const i64* __restrict__ offsets, i64 E, const int* __restrict__ token,
                                            const int* __restrict__ slot, const void* __restrict__ gates,
                                            int gates_dtype, i64 x_st, i64 x_sg, i64 spg_in, i64 o_st, i64 o_sg,
                                            i64 spg_out, i64 g_st, i64 g_ss, i64* s_scan, i64* s_tile, i64* s_x,
                                            i64* s_o, float* s_g, i64& e, i64& pid_n) {
  const i64 per_group = group_n * grid_m;
  const i64 grp = tile / per_group;
  const i64 first_n = grp * group_n;
  const i64 gn = n_tiles_n - first_n < group_n ? n_tiles_n - first_n : group_n;
  const i64 local = tile - grp * per_group;
  const i64 pid_m = local / gn;
  pid_n = first_n + (local - pid_m * gn);

  i64 row0, row_end;
  em_find_tile<BM, THREADS>(offsets, E, pid_m, s_scan, s_tile, e, row0, row_end);
  if (e >= E) return false;
  for (int r = threadIdx.x; r < BM; r += THREADS) {
    const i64 row = row0 + r;
    i64 xo = 0, oo = -1;
    float gv = 0.f;
    if (row < row_end) {
      const i64 t = __ldg(token + row);
      const i64 s = __ldg(slot + row);
      xo = t * x_st + (s / spg_in) * x_sg;
      oo = t * o_st + (s / spg_out) * o_sg;
      gv = gates != nullptr ? em_load_any(gates, gates_dtype, t * g_st + s * g_ss) : 1.f;
    }
    s_x[r] = xo;
    s_o[r] = oo;
    s_g[r] = gv;
  }
  __syncthreads();
  return true;
}

// DT: dtype of x (and of the shared tiles); WDT: dtype of weight (DT, or fp32 with fp16/bf16 x).
template <int DT, int WDT, int BM, int BN>
__global__ void __launch_bounds__(FS_EM_THREADS) expert_matmul_fwd_kernel(
    const void* __restrict__ x, const void* __restrict__ w, const void* __restrict__ gates,
    const int* __restrict__ token, const int* __restrict__ slot, const i64* __restrict__ offsets,
    void* __restrict__ out, i64 E, i64 d_in, i64 d_out, i64 spg_in, i64 spg_out, i64 x_st, i64 x_sg, i64 w_se,
    i64 w_sk, i64 w_sn, i64 g_st, i64 g_ss, i64 o_st, i64 o_sg, i64 grid_m, i64 n_tiles_n, i64 group_n, i64 tiles,
    int gates_dtype, int mode) {
  constexpr bool F32 = DT == FS_DTYPE_F32;
  typedef typename EmSelect<F32, float, unsigned short>::type ST;  // shared tile element (x's dtype bits)
  constexpr int T = FS_EM_THREADS;
  constexpr int BK = FS_EM_BLOCK_K;
  constexpr int LDS = BK + (F32 ? 4 : 8);  // row pitch of the shared tiles: 144 / 80 bytes (16-byte multiple,
                                           // fragment reads of 8 rows hit distinct banks)
  constexpr int XS = Elem<DT>::kSize, WS = Elem<WDT>::kSize;
  constexpr int VA = 16 / XS;  // elements of one 16-byte A vector
  constexpr int VB = 16 / WS;  // elements of one 16-byte B vector
  constexpr int A_CHUNKS = BM * BK / VA / T;
  constexpr int B_CHUNKS = BN * BK / VB / T;
  constexpr int WM = BM / 2, WN = BN / 2;  // warp tile
  constexpr int MT = WM / 16, NT = WN / 8;  // fragments per warp
  static_assert(A_CHUNKS >= 1 && B_CHUNKS >= 1 && MT >= 1 && NT >= 1, "tile too small");
  static_assert(BM * BK % (VA * T) == 0 && BN * BK % (VB * T) == 0, "tile not a multiple of the loads");
  static_assert(F32 || WDT == DT || WDT == FS_DTYPE_F32, "weight is x's dtype or fp32");
  static_assert(!F32 || WDT == FS_DTYPE_F32, "fp32 x needs fp32 weight");

  __shared__ __align__(16) ST As[BM * LDS];  // As[r][k]: x row of pair r
  __shared__ __align__(16) ST Bs[BN * LDS];  // Bs[n][k] = W[e][k0 + k][n0 + n]
  __shared__ i64 s_x[BM];                    // element offset of pair r's x row
  __shared__ i64 s_o[BM];                    // element offset of pair r's output row; -1: no pair
  __shared__ float s_g[BM];                  // gate of pair r
  __shared__ i64 s_scan[T / 32];
  __shared__ i64 s_tile[3];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp >> 1, warp_n = warp & 1;
  const int g = lane >> 2, q = lane & 3;

  // Vector paths (uniform): 16-byte aligned base and strides. x rows are contiguous; W is read along
  // whichever of its k / n dims has unit stride (n when both or neither), in chunks of VB elements.
  const bool a_vec = ((unsigned long long)x & 15ull) == 0 && ((x_st * XS) & 15) == 0 && ((x_sg * XS) & 15) == 0;
  const bool b_kfast = w_sk == 1 && w_sn != 1;
  const i64 w_slow = b_kfast ? w_sn : w_sk;  // stride of the other dim
  const i64 w_fast = b_kfast ? w_sk : w_sn;
  const bool b_vec = w_fast == 1 && ((unsigned long long)w & 15ull) == 0 && ((w_se * WS) & 15) == 0 &&
                     ((w_slow * WS) & 15) == 0;

  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    __syncthreads();  // the previous tile is done with the shared memory
    i64 e, pid_n;
    if (!em_row_tile<BM, T>(tile, grid_m, n_tiles_n, group_n, offsets, E, token, slot, gates, gates_dtype, x_st,
                            x_sg, spg_in, o_st, o_sg, spg_out, g_st, g_ss, s_scan, s_tile, s_x, s_o, s_g, e, pid_n))
      continue;  // uniform: no such row tile

    const i64 n0 = pid_n * BN;
    const char* wb = reinterpret_cast<const char*>(w) + e * w_se * WS;

    // Register staging of one k step: A as raw 16-byte chunks, B as floats.
    uint4 areg[A_CHUNKS];
    float breg[B_CHUNKS][VB];

    auto load_a = [&](i64 k0) {
#pragma unroll
      for (int i = 0; i < A_CHUNKS; ++i) {
        const int c = tid + i * T;
        const int r = c / (BK / VA);
        const int kc = (c % (BK / VA)) * VA;
        const i64 k = k0 + kc;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (s_o[r] >= 0 && k < d_in) {
          const char* p = reinterpret_cast<const char*>(x) + (s_x[r] + k) * XS;
          if (a_vec && k + VA <= d_in) {
            v = __ldg(reinterpret_cast<const uint4*>(p));
          } else {
            unsigned int wd[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int u = 0; u < VA; ++u) {
              if (k + u < d_in) {
                const unsigned int bits = XS == 4 ? __ldg(reinterpret_cast<const unsigned int*>(p) + u)
                                                  : (unsigned int)__ldg(reinterpret_cast<const unsigned short*>(p) + u);
                wd[u * XS / 4] |= bits << ((u * XS % 4) * 8);
              }
            }
            v = make_uint4(wd[0], wd[1], wd[2], wd[3]);
          }
        }
        areg[i] = v;
      }
    };

    // Position in the tile (k, n) of B chunk c: VB consecutive elements along the fast dim.
    auto b_pos = [&](int c, int& kk, int& nn) {
      if (b_kfast) {
        nn = c / (BK / VB);
        kk = (c % (BK / VB)) * VB;
      } else {
        kk = c / (BN / VB);
        nn = (c % (BN / VB)) * VB;
      }
    };

    auto load_b = [&](i64 k0) {
#pragma unroll
      for (int i = 0; i < B_CHUNKS; ++i) {
        int kk, nn;
        b_pos(tid + i * T, kk, nn);
        const i64 k = k0 + kk, n = n0 + nn;
        const bool in = b_kfast ? n < d_out : k < d_in;     // the slow coordinate
        const i64 left = b_kfast ? d_in - k : d_out - n;    // elements left along the fast dim
        const char* p = wb + (k * w_sk + n * w_sn) * WS;
        if (in && b_vec && left >= VB) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
          const unsigned int wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int u = 0; u < VB; ++u) {
            if constexpr (WS == 4) {
              breg[i][u] = __uint_as_float(wd[u]);
            } else {
              breg[i][u] = Elem<WDT>::to_float(wd[u >> 1] >> ((u & 1) * 16));
            }
          }
        } else {
#pragma unroll
          for (int u = 0; u < VB; ++u) {
            breg[i][u] = in && u < left ? em_load<WDT>(p, (i64)u * w_fast) : 0.f;
          }
        }
      }
    };

    auto store_tiles = [&]() {
#pragma unroll
      for (int i = 0; i < A_CHUNKS; ++i) {
        const int c = tid + i * T;
        const int r = c / (BK / VA);
        const int kc = (c % (BK / VA)) * VA;
        *reinterpret_cast<uint4*>(&As[r * LDS + kc]) = areg[i];
      }
#pragma unroll
      for (int i = 0; i < B_CHUNKS; ++i) {
        int kk, nn;
        b_pos(tid + i * T, kk, nn);
#pragma unroll
        for (int u = 0; u < VB; ++u) {
          const int k = b_kfast ? kk + u : kk;
          const int n = b_kfast ? nn : nn + u;
          if constexpr (F32) {
            Bs[n * LDS + k] = breg[i][u];
          } else {
            Bs[n * LDS + k] = (unsigned short)Elem<DT>::from_float(breg[i][u]);  // exact for 16-bit W
          }
        }
      }
    };

    float acc[MT][NT][4];
    em_zero(acc);

    const i64 nk = (d_in + BK - 1) / BK;
    if (nk > 0) {
      load_a(0);
      load_b(0);
    }
    for (i64 kt = 0; kt < nk; ++kt) {
      __syncthreads();  // the previous step's reads of As / Bs are done
      store_tiles();
      __syncthreads();
      if (kt + 1 < nk) {  // next step's loads fly during this step's math
        load_a((kt + 1) * BK);
        load_b((kt + 1) * BK);
      }
      if constexpr (F32) {
#pragma unroll 4
        for (int k = 0; k < BK; ++k) {
          float a_lo[MT], a_hi[MT], b_0[NT], b_1[NT];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const int r = warp_m * WM + mt * 16 + g;
            a_lo[mt] = As[r * LDS + k];
            a_hi[mt] = As[(r + 8) * LDS + k];
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const int n = warp_n * WN + nt * 8 + 2 * q;
            b_0[nt] = Bs[n * LDS + k];
            b_1[nt] = Bs[(n + 1) * LDS + k];
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              acc[mt][nt][0] = fmaf(a_lo[mt], b_0[nt], acc[mt][nt][0]);
              acc[mt][nt][1] = fmaf(a_lo[mt], b_1[nt], acc[mt][nt][1]);
              acc[mt][nt][2] = fmaf(a_hi[mt], b_0[nt], acc[mt][nt][2]);
              acc[mt][nt][3] = fmaf(a_hi[mt], b_1[nt], acc[mt][nt][3]);
            }
          }
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < BK; ks += 16) {
          unsigned int a[MT][4], b[NT][2];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const ST* ap = As + (warp_m * WM + mt * 16 + g) * LDS + ks + 2 * q;
            a[mt][0] = *reinterpret_cast<const unsigned int*>(ap);                // row g,   k 2q, 2q+1
            a[mt][1] = *reinterpret_cast<const unsigned int*>(ap + 8 * LDS);      // row g+8, k 2q, 2q+1
            a[mt][2] = *reinterpret_cast<const unsigned int*>(ap + 8);            // row g,   k 2q+8, 2q+9
            a[mt][3] = *reinterpret_cast<const unsigned int*>(ap + 8 * LDS + 8);  // row g+8, k 2q+8, 2q+9
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const ST* bp = Bs + (warp_n * WN + nt * 8 + g) * LDS + ks + 2 * q;
            b[nt][0] = *reinterpret_cast<const unsigned int*>(bp);      // col g, k 2q, 2q+1
            b[nt][1] = *reinterpret_cast<const unsigned int*>(bp + 8);  // col g, k 2q+8, 2q+9
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) em_mma<DT>(acc[mt][nt], a[mt], b[nt]);
          }
        }
      }
    }

    // Epilogue: accumulator (mt, nt, j) is row warp_m*WM + mt*16 + g + 8*(j/2), column
    // n0 + warp_n*WN + nt*8 + 2q + (j%2).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_m * WM + mt * 16 + g + 8 * h;
        const i64 oo = s_o[r];
        if (oo < 0) continue;
        const float gv = s_g[r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const i64 n = n0 + warp_n * WN + nt * 8 + 2 * q;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            if (n + j >= d_out) continue;
            const float v = acc[mt][nt][2 * h + j] * gv;
            const i64 idx = oo + n + j;
            if (mode == FS_EM_ATOMIC) {
              atomicAdd(reinterpret_cast<float*>(out) + idx, v);
            } else if (mode == FS_EM_STORE_F32) {
              reinterpret_cast<float*>(out)[idx] = v;
            } else {
              em_store<DT>(out, idx, v);
            }
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ v2: cp.async pipeline + ldmatrix
// For fp16/bf16 x with a weight of the same dtype read along n (w_sn == 1) and every row start and
// stride a multiple of 8 elements (16 bytes), d_in and d_out multiples of 8: the gathered x rows
// (As[r][k]) and the W[e] tile (Bs[k][n], not transposed) stream through FS_EM2_STAGES cp.async
// stages (zero-filled past the valid rows / k / n), and the mma.sync fragments come from ldmatrix
// (B with .trans), as in the op-2 kernel. 8 warps as (BM / 32) x (8 / (BM / 32)), each owning a
// 32 x WN piece. Same tile numbering, row-tile search and epilogue modes as the kernel above; the
// epilogue writes column pairs (packed 16-bit stores, float2 stores or float2 atomics).
template <int DT, int BM, int BN>
__global__ void __launch_bounds__(FS_EM2_THREADS) expert_matmul_fwd_v2_kernel(
    const void* __restrict__ x, const void* __restrict__ w, const void* __restrict__ gates,
    const int* __restrict__ token, const int* __restrict__ slot, const i64* __restrict__ offsets,
    void* __restrict__ out, i64 E, i64 d_in, i64 d_out, i64 spg_in, i64 spg_out, i64 x_st, i64 x_sg, i64 w_se,
    i64 w_sk, i64 w_sn, i64 g_st, i64 g_ss, i64 o_st, i64 o_sg, i64 grid_m, i64 n_tiles_n, i64 group_n, i64 tiles,
    int gates_dtype, int mode) {
  constexpr int T = FS_EM2_THREADS;
  constexpr int BK = FS_EM2_BLOCK_K;
  constexpr int NS = FS_EM2_STAGES;
  constexpr int LDA = BK + 8;  // 80-byte rows: the 8 rows of an ldmatrix hit distinct banks
  constexpr int LDB = BN + 8;  // (BN + 8) * 2 bytes = 4 banks past a multiple of 128 bytes: same
  constexpr int WARPS_M = BM / 32, WARPS_N = (T / 32) / WARPS_M;
  constexpr int WN = BN / WARPS_N;
  constexpr int MT = 2, NT = WN / 8;
  constexpr int A_CHUNKS = BM * BK / 8 / T;  // 16-byte copies per thread per stage
  constexpr int B_CHUNKS = BK * BN / 8 / T;
  static_assert(DT != FS_DTYPE_F32, "v2 is the fp16/bf16 kernel");
  static_assert(WARPS_M * WARPS_N * 32 == T && WN % 16 == 0, "warp layout");
  static_assert(A_CHUNKS >= 1 && B_CHUNKS >= 1 && A_CHUNKS * T * 8 == BM * BK && B_CHUNKS * T * 8 == BK * BN,
                "tile not a multiple of the copies");

  __shared__ __align__(128) unsigned short As[NS][BM * LDA];
  __shared__ __align__(128) unsigned short Bs[NS][BK * LDB];
  __shared__ i64 s_x[BM];   // element offset of pair r's x row
  __shared__ i64 s_o[BM];   // element offset of pair r's output row; -1: no pair
  __shared__ float s_g[BM]; // gate of pair r
  __shared__ i64 s_scan[T / 32];
  __shared__ i64 s_tile[3];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  const int g = lane >> 2, q = lane & 3;
  const int lr = lane & 7, b3 = (lane >> 3) & 1, b4 = (lane >> 4) & 1;  // ldmatrix row / matrix of a lane
  const unsigned short* xb = reinterpret_cast<const unsigned short*>(x);

  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    __syncthreads();  // the previous tile is done with the shared memory
    i64 e, pid_n;
    if (!em_row_tile<BM, T>(tile, grid_m, n_tiles_n, group_n, offsets, E, token, slot, gates, gates_dtype, x_st,
                            x_sg, spg_in, o_st, o_sg, spg_out, g_st, g_ss, s_scan, s_tile, s_x, s_o, s_g, e, pid_n))
      continue;  // uniform: no such row tile

    const i64 n0 = pid_n * BN;
    const unsigned short* wb = reinterpret_cast<const unsigned short*>(w) + e * w_se;

    // Stage `st` <- k step [k0, k0 + BK): every thread issues its 16-byte copies (zeros where invalid).
    auto load_stage = [&](int st, i64 k0) {
#pragma unroll
      for (int i = 0; i < A_CHUNKS; ++i) {
        const int c = tid + i * T;
        const int r = c / (BK / 8);
        const int kc = (c % (BK / 8)) * 8;
        const i64 k = k0 + kc;
        const bool ok = s_o[r] >= 0 && k < d_in;
        cp_async16_zfill(smem_addr(&As[st][r * LDA + kc]), ok ? xb + s_x[r] + k : xb, ok ? 16 : 0);
      }
#pragma unroll
      for (int i = 0; i < B_CHUNKS; ++i) {
        const int c = tid + i * T;
        const int kk = c / (BN / 8);
        const int nc = (c % (BN / 8)) * 8;
        const i64 k = k0 + kk, n = n0 + nc;
        const bool ok = k < d_in && n < d_out;
        cp_async16_zfill(smem_addr(&Bs[st][kk * LDB + nc]), ok ? wb + k * w_sk + n * w_sn : wb, ok ? 16 : 0);
      }
    };

    float acc[MT][NT][4];
    em_zero(acc);

    const i64 nk = (d_in + BK - 1) / BK;
#pragma unroll
    for (int st = 0; st < NS - 1; ++st) {
      if (st < nk) load_stage(st, (i64)st * BK);
      cp_async_commit();  // (empty groups keep the count uniform)
    }
    for (i64 kt = 0; kt < nk; ++kt) {
      cp_async_wait<NS - 2>();  // this thread's copies of step kt have landed ...
      __syncthreads();          // ... everyone's; and every warp is done with step kt - 1's buffer
      const i64 kn = kt + NS - 1;
      if (kn < nk) load_stage((int)(kn % NS), kn * BK);  // into the buffer step kt - 1 used
      cp_async_commit();
      const unsigned short* as = As[kt % NS];
      const unsigned short* bs = Bs[kt % NS];
#pragma unroll
      for (int ks = 0; ks < BK; ks += 16) {
        // A (row-major [r][k]): matrices (rows +0, k +0), (+8, +0), (+0, +8), (+8, +8) = a0..a3.
        unsigned int a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ldsm_x4(a[mt], smem_addr(as + (warp_m * 32 + mt * 16 + lr + 8 * b3) * LDA + ks + 8 * b4));
        }
        // B ([k][n]) with .trans: matrices (k +0, n +0), (+8, +0), (+0, +8), (+8, +8) = b0, b1 of two
        // 8-column tiles.
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          unsigned int bv[4];
          ldsm_x4_trans(bv, smem_addr(bs + (ks + lr + 8 * b3) * LDB + warp_n * WN + np * 16 + 8 * b4));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma16816<DT>(acc[mt][2 * np], a[mt], bv[0], bv[1]);
            mma16816<DT>(acc[mt][2 * np + 1], a[mt], bv[2], bv[3]);
          }
        }
      }
    }
    cp_async_wait<0>();  // only empty groups are left; nothing may land after the next tile starts

    // Epilogue: accumulator (mt, nt, 2h + j) is row warp_m*32 + mt*16 + g + 8h, column
    // n0 + warp_n*WN + nt*8 + 2q + j. Columns come in even-aligned pairs, and d_out is a multiple of 8.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_m * 32 + mt * 16 + g + 8 * h;
        const i64 oo = s_o[r];
        if (oo < 0) continue;
        const float gv = s_g[r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const i64 n = n0 + warp_n * WN + nt * 8 + 2 * q;
          if (n >= d_out) continue;
          const float v0 = acc[mt][nt][2 * h] * gv, v1 = acc[mt][nt][2 * h + 1] * gv;
          const i64 idx = oo + n;
          if (mode == FS_EM_ATOMIC) {
            float* p = reinterpret_cast<float*>(out) + idx;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float2*>(p), make_float2(v0, v1));
#else
            atomicAdd(p, v0);
            atomicAdd(p + 1, v1);
#endif
          } else if (mode == FS_EM_STORE_F32) {
            *reinterpret_cast<float2*>(reinterpret_cast<float*>(out) + idx) = make_float2(v0, v1);
          } else {
            *reinterpret_cast<unsigned int*>(reinterpret_cast<unsigned short*>(out) + idx) = pack2<DT>(v0, v1);
          }
        }
      }
    }
  }
}

// y[t, g, n] = sum_{j < spg} src[(t * G_out + g) * spg + j][n], j in increasing order (src: fp32 rows of
// d_out, contiguous). spg = 1 casts an fp32 accumulator into y.
template <int DT>
__global__ void __launch_bounds__(FS_EM_FINISH_THREADS) expert_matmul_finish_kernel(
    const float* __restrict__ src, void* __restrict__ y, i64 R, i64 G_out, i64 d_out, i64 spg, i64 y_st, i64 y_sg) {
  const i64 total = R * d_out;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const i64 r = i / d_out;
    const i64 n = i - r * d_out;
    const float* p = src + r * spg * d_out + n;
    float s = 0.f;
    for (i64 j = 0; j < spg; ++j) s += p[j * d_out];
    const i64 t = r / G_out;
    const i64 gg = r - t * G_out;
    em_store<DT>(y, t * y_st + gg * y_sg + n, s);
  }
}

}  // namespace flashswitch

#ifndef __CUDACC_RTC__
// ------------------------------------------------------------------ host launcher
namespace {

using flashswitch::expert_matmul_finish_kernel;
using flashswitch::expert_matmul_fwd_kernel;

long long em_floor_pow2(long long x) {
  long long p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

long long em_ceil_pow2(long long x) {
  long long p = 1;
  while (p < x) p *= 2;
  return p;
}

long long em_clamp(long long v, long long lo, long long hi) { return v < lo ? lo : v > hi ? hi : v; }

// Output of the main kernel: target, its row strides (t, g) and slots per output group.
struct EmTarget {
  void* out;
  long long st, sg, spg_out;
};

template <int DT, int WDT, int BM, int BN>
cudaError_t em_launch(const fs_expert_matmul_args& a, const fs_expert_matmul_plan& p, const EmTarget& o,
                      cudaStream_t stream) {
  const long long x_st = a.T > 1 ? a.x_stride[0] : 0;
  const long long x_sg = a.G_in > 1 ? a.x_stride[1] : 0;  // with one input group every slot reads group 0
  const long long w_se = a.E > 1 ? a.w_stride[0] : 0;
  const long long w_sk = a.d_in > 1 ? a.w_stride[1] : 0;  // size-1 dims: stride 0, so the other dim can
  const long long w_sn = a.d_out > 1 ? a.w_stride[2] : 0;  // take the vector path
  expert_matmul_fwd_kernel<DT, WDT, BM, BN><<<(unsigned int)p.grid, FS_EM_THREADS, 0, stream>>>(
      a.x, a.weight, a.gates, a.token, a.slot, a.offsets, o.out, a.E, a.d_in, a.d_out, a.S / a.G_in, o.spg_out,
      x_st, x_sg, w_se, w_sk, w_sn, a.gates_stride[0], a.gates_stride[1], o.st, o.sg, p.grid_m,
      p.n_tiles_n, p.group_n, p.tiles, a.gates_dtype, p.mode);
  return cudaGetLastError();
}

template <int DT, int WDT>
cudaError_t em_by_tile(const fs_expert_matmul_args& a, const fs_expert_matmul_plan& p, const EmTarget& o,
                       cudaStream_t s) {
  switch (p.block_m * 1000 + p.block_n) {
    case 32032: return em_launch<DT, WDT, 32, 32>(a, p, o, s);
    case 32064: return em_launch<DT, WDT, 32, 64>(a, p, o, s);
    case 32128: return em_launch<DT, WDT, 32, 128>(a, p, o, s);
    case 64032: return em_launch<DT, WDT, 64, 32>(a, p, o, s);
    case 64064: return em_launch<DT, WDT, 64, 64>(a, p, o, s);
    case 64128: return em_launch<DT, WDT, 64, 128>(a, p, o, s);
    case 128032: return em_launch<DT, WDT, 128, 32>(a, p, o, s);
    case 128064: return em_launch<DT, WDT, 128, 64>(a, p, o, s);
    default: return cudaErrorInvalidValue;
  }
}

template <int DT, int BM, int BN>
cudaError_t em_launch_v2(const fs_expert_matmul_args& a, const fs_expert_matmul_plan& p, const EmTarget& o,
                         cudaStream_t stream) {
  const long long x_st = a.T > 1 ? a.x_stride[0] : 0;
  const long long x_sg = a.G_in > 1 ? a.x_stride[1] : 0;
  const long long w_se = a.E > 1 ? a.w_stride[0] : 0;
  flashswitch::expert_matmul_fwd_v2_kernel<DT, BM, BN><<<(unsigned int)p.grid, FS_EM2_THREADS, 0, stream>>>(
      a.x, a.weight, a.gates, a.token, a.slot, a.offsets, o.out, a.E, a.d_in, a.d_out, a.S / a.G_in, o.spg_out,
      x_st, x_sg, w_se, a.w_stride[1], 1, a.gates_stride[0], a.gates_stride[1], o.st, o.sg, p.grid_m,
      p.n_tiles_n, p.group_n, p.tiles, a.gates_dtype, p.mode);
  return cudaGetLastError();
}

// The v2 kernel's preconditions (see its comment), else the plain kernel runs.
bool em_v2_fits(const fs_expert_matmul_args& a, const fs_expert_matmul_plan& p, const EmTarget& o) {
  auto al = [](long long v) { return v % 8 == 0; };  // 16 bytes of 16-bit elements
  const bool half = a.x_dtype == FS_DTYPE_F16 || a.x_dtype == FS_DTYPE_BF16;
  const bool tile = (p.block_m == 64 || p.block_m == 128) && (p.block_n == 64 || p.block_n == 128);
  return half && a.w_dtype == a.x_dtype && tile && al(a.d_in) && al(a.d_out) &&
         (a.d_out <= 1 || a.w_stride[2] == 1) && ((size_t)a.x & 15) == 0 && ((size_t)a.weight & 15) == 0 &&
         (a.T <= 1 || al(a.x_stride[0])) && (a.G_in <= 1 || al(a.x_stride[1])) &&
         (a.E <= 1 || al(a.w_stride[0])) && (a.d_in <= 1 || al(a.w_stride[1])) &&
         ((size_t)o.out & 7) == 0 && o.st % 2 == 0 && o.sg % 2 == 0;  // column pairs in the epilogue
}

template <int DT>
cudaError_t em_by_tile_v2(const fs_expert_matmul_args& a, const fs_expert_matmul_plan& p, const EmTarget& o,
                          cudaStream_t s) {
  switch (p.block_m * 1000 + p.block_n) {
    case 64064: return em_launch_v2<DT, 64, 64>(a, p, o, s);
    case 64128: return em_launch_v2<DT, 64, 128>(a, p, o, s);
    case 128064: return em_launch_v2<DT, 128, 64>(a, p, o, s);
    default: return cudaErrorInvalidValue;
  }
}

template <int DT>
cudaError_t em_finish(const fs_expert_matmul_args& a, const fs_expert_matmul_plan& p, cudaStream_t stream) {
  const long long spg = p.mode == FS_EM_ATOMIC ? 1 : a.S / a.G_out;
  expert_matmul_finish_kernel<DT><<<(unsigned int)p.finish_grid, FS_EM_FINISH_THREADS, 0, stream>>>(
      a.workspace, a.y, a.T * a.G_out, a.G_out, a.d_out, spg, a.y_stride[0], a.y_stride[1]);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t fs_expert_matmul_plan_for(long long T, long long S, long long E, long long G_out,
                                                 long long d_out, int deterministic, int block_m, int block_n,
                                                 long long group_n, fs_expert_matmul_plan* plan) {
  if (plan == nullptr || T < 0 || S < 1 || E < 1 || G_out < 1 || S % G_out != 0 || d_out < 0)
    return cudaErrorInvalidValue;
  long long bm = block_m <= 0 ? 64 : em_clamp(em_floor_pow2(block_m), FS_EM_MIN_TILE, FS_EM_MAX_TILE);
  // BLOCK_N: the config's (a power of two) or d_out's, never wider than d_out needs
  const long long bn_fit = em_ceil_pow2(d_out);
  long long bn = block_n <= 0 ? bn_fit : em_floor_pow2(block_n);
  bn = em_clamp(bn < bn_fit ? bn : bn_fit, FS_EM_MIN_TILE, FS_EM_MAX_TILE);
  while (bm * bn > FS_EM_MAX_TILE_ELEMS) {
    if (bn >= bm) bn /= 2;
    else bm /= 2;
  }
  const long long P = T * S;
  const long long grid_m = (P + bm - 1) / bm + (E < P ? E : P);
  const long long n_tiles_n = (d_out + bn - 1) / bn;
  long long gn = group_n <= 0 ? n_tiles_n : (group_n < n_tiles_n ? group_n : n_tiles_n);
  if (gn < 1) gn = 1;
  const long long tiles = grid_m * n_tiles_n;
  const int mode = G_out == S ? FS_EM_STORE : deterministic ? FS_EM_STORE_F32 : FS_EM_ATOMIC;
  const long long out_elems = T * G_out * d_out;
  plan->block_m = (int)bm;
  plan->block_n = (int)bn;
  plan->mode = mode;
  plan->grid_m = grid_m;
  plan->n_tiles_n = n_tiles_n;
  plan->group_n = gn;
  plan->tiles = tiles;
  plan->grid = tiles < 0x7fffffffLL ? tiles : 0x7fffffffLL;
  plan->workspace_elems = mode == FS_EM_ATOMIC ? out_elems : mode == FS_EM_STORE_F32 ? P * d_out : 0;
  long long fg = mode == FS_EM_STORE ? 0 : (out_elems + FS_EM_FINISH_THREADS - 1) / FS_EM_FINISH_THREADS;
  plan->finish_grid = fg < FS_EM_FINISH_MAX_GRID ? fg : FS_EM_FINISH_MAX_GRID;
  return cudaSuccess;
}

extern "C" cudaError_t fs_expert_matmul_fwd(const fs_expert_matmul_args* a, int block_m, int block_n,
                                            long long group_n, cudaStream_t stream) {
  if (a == nullptr || a->T < 0 || a->S < 1 || a->E < 1 || a->G_in < 1 || a->S % a->G_in != 0 || a->G_out < 1 ||
      a->S % a->G_out != 0 || a->d_in < 0 || a->d_out < 0)
    return cudaErrorInvalidValue;
  const bool half_x = a->x_dtype == FS_DTYPE_F16 || a->x_dtype == FS_DTYPE_BF16;
  if (!(a->x_dtype == FS_DTYPE_F32 || half_x)) return cudaErrorInvalidValue;
  if (!(a->w_dtype == a->x_dtype || (half_x && a->w_dtype == FS_DTYPE_F32))) return cudaErrorInvalidValue;
  if (a->gates != nullptr && !(a->gates_dtype == FS_DTYPE_F32 || a->gates_dtype == FS_DTYPE_F16 ||
                               a->gates_dtype == FS_DTYPE_BF16))
    return cudaErrorInvalidValue;

  fs_expert_matmul_plan p;
  cudaError_t err = fs_expert_matmul_plan_for(a->T, a->S, a->E, a->G_out, a->d_out, a->deterministic, block_m,
                                              block_n, group_n, &p);
  if (err != cudaSuccess) return err;
  if (a->T * a->G_out * a->d_out == 0) return cudaSuccess;  // empty y
  if (p.workspace_elems > 0 && a->workspace == nullptr) return cudaErrorInvalidValue;

  EmTarget o;
  if (p.mode == FS_EM_STORE) {
    o = {a->y, a->T > 1 ? a->y_stride[0] : 0, a->G_out > 1 ? a->y_stride[1] : 0, 1};
  } else if (p.mode == FS_EM_STORE_F32) {
    o = {a->workspace, a->S * a->d_out, a->d_out, 1};
  } else {
    o = {a->workspace, a->G_out * a->d_out, a->d_out, a->S / a->G_out};
    err = cudaMemsetAsync(a->workspace, 0, (size_t)p.workspace_elems * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }

  if (p.grid > 0 && a->variant == 2 && em_v2_fits(*a, p, o)) {
    err = a->x_dtype == FS_DTYPE_F16 ? em_by_tile_v2<FS_DTYPE_F16>(*a, p, o, stream)
                                     : em_by_tile_v2<FS_DTYPE_BF16>(*a, p, o, stream);
    if (err != cudaSuccess) return err;
  } else if (p.grid > 0) {
    switch (a->x_dtype * 3 + a->w_dtype) {
      case FS_DTYPE_F32 * 3 + FS_DTYPE_F32: err = em_by_tile<FS_DTYPE_F32, FS_DTYPE_F32>(*a, p, o, stream); break;
      case FS_DTYPE_F16 * 3 + FS_DTYPE_F16: err = em_by_tile<FS_DTYPE_F16, FS_DTYPE_F16>(*a, p, o, stream); break;
      case FS_DTYPE_F16 * 3 + FS_DTYPE_F32: err = em_by_tile<FS_DTYPE_F16, FS_DTYPE_F32>(*a, p, o, stream); break;
      case FS_DTYPE_BF16 * 3 + FS_DTYPE_BF16: err = em_by_tile<FS_DTYPE_BF16, FS_DTYPE_BF16>(*a, p, o, stream); break;
      case FS_DTYPE_BF16 * 3 + FS_DTYPE_F32: err = em_by_tile<FS_DTYPE_BF16, FS_DTYPE_F32>(*a, p, o, stream); break;
      default: return cudaErrorInvalidValue;
    }
    if (err != cudaSuccess) return err;
  }
  if (p.finish_grid > 0) {
    switch (a->x_dtype) {
      case FS_DTYPE_F32: return em_finish<FS_DTYPE_F32>(*a, p, stream);
      case FS_DTYPE_F16: return em_finish<FS_DTYPE_F16>(*a, p, stream);
      case FS_DTYPE_BF16: return em_finish<FS_DTYPE_BF16>(*a, p, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  return cudaSuccess;
}
#endif  // __CUDACC_RTC__
