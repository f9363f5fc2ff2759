// Definitions shared by the flashswitch CUDA kernels and their host code.
//
// Compiles under nvcc (AOT extension), under NVRTC (CuPy JIT) and, for the constants only, under a
// plain C++ compiler (the torch bindings): device code uses no host-only headers, and host-only
// includes sit behind `#ifndef __CUDACC_RTC__`.
#pragma once

// Element types of tensors passed to the launchers (mirrored in flashswitch/bindings/cupy.py).
#define FS_DTYPE_F32 0
#define FS_DTYPE_F16 1
#define FS_DTYPE_BF16 2

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashswitch {

typedef long long i64;  // no <cstdint> under NVRTC

#define FS_LOG2E 1.4426950408889634f
#define FS_LN2 0.6931471805599453f

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ------------------------------------------------------------------ element types
// Raw storage bits <-> float. 16-bit types live in the low half of an unsigned int.
template <int DT>
struct Elem;

template <>
struct Elem<FS_DTYPE_F32> {
  static constexpr int kSize = 4;
  static __device__ __forceinline__ float to_float(unsigned int b) { return __uint_as_float(b); }
  static __device__ __forceinline__ unsigned int from_float(float f) { return __float_as_uint(f); }
};

template <>
struct Elem<FS_DTYPE_F16> {
  static constexpr int kSize = 2;
  static __device__ __forceinline__ float to_float(unsigned int b) {
    return __half2float(__ushort_as_half((unsigned short)(b & 0xffffu)));
  }
  static __device__ __forceinline__ unsigned int from_float(float f) {
    return (unsigned int)__half_as_ushort(__float2half_rn(f));
  }
};

template <>
struct Elem<FS_DTYPE_BF16> {
  static constexpr int kSize = 2;
  static __device__ __forceinline__ float to_float(unsigned int b) { return __uint_as_float(b << 16); }
  static __device__ __forceinline__ unsigned int from_float(float f) {
    return (unsigned int)__bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

// A lane's slice of one row of a tensor whose dtype is known only at run time (small operands such
// as omega): x[i * VEC + e] = p[off + d0 + i * step + e] where d0 + i * step < D, else 0.
template <int VEC, int VPL>
__device__ __forceinline__ void load_slice(float (&x)[VEC * VPL], const void* p, int dtype, i64 off, i64 d0,
                                           int step, i64 D) {
  if (dtype == FS_DTYPE_F32) {
    const float* q = reinterpret_cast<const float*>(p) + off + d0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[i * VEC + e] = d0 + i * step < D ? __ldg(q + i * step + e) : 0.f;
    }
  } else {
    const unsigned short* q = reinterpret_cast<const unsigned short*>(p) + off + d0;
    const bool half = dtype == FS_DTYPE_F16;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const unsigned int b = d0 + i * step < D ? (unsigned int)__ldg(q + i * step + e) : 0u;
        x[i * VEC + e] = half ? Elem<FS_DTYPE_F16>::to_float(b) : Elem<FS_DTYPE_BF16>::to_float(b);
      }
    }
  }
}

// ------------------------------------------------------------------ vectors
// VEC elements of type DT moved as one 16, 8, 4 or 2-byte access, held as 32-bit words.
template <int DT, int VEC>
struct Vec {
  static constexpr int kBytes = VEC * Elem<DT>::kSize;
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  unsigned int w[kWords];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }

  // p must be aligned to kBytes.
  __device__ __forceinline__ void load(const void* p) {
    if constexpr (kBytes == 16) {
      const uint4 t = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
    } else if constexpr (kBytes == 8) {
      const uint2 t = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = t.x; w[1] = t.y;
    } else if constexpr (kBytes == 4) {
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else {
      static_assert(kBytes == 2, "vector of 2, 4, 8 or 16 bytes");
      w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    }
  }

  __device__ __forceinline__ void store(void* p) const {
    if constexpr (kBytes == 16) {
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (kBytes == 8) {
      *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else if constexpr (kBytes == 4) {
      *reinterpret_cast<unsigned int*>(p) = w[0];
    } else {
      *reinterpret_cast<unsigned short*>(p) = (unsigned short)w[0];
    }
  }

  __device__ __forceinline__ float get(int e) const {
    if constexpr (Elem<DT>::kSize == 4) {
      return Elem<DT>::to_float(w[e]);
    } else {
      return Elem<DT>::to_float(w[e >> 1] >> ((e & 1) * 16));
    }
  }

  __device__ __forceinline__ void set(int e, float f) {
    const unsigned int b = Elem<DT>::from_float(f);
    if constexpr (Elem<DT>::kSize == 4) {
      w[e] = b;
    } else if (e & 1) {
      w[e >> 1] = (w[e >> 1] & 0x0000ffffu) | (b << 16);
    } else {
      w[e >> 1] = (w[e >> 1] & 0xffff0000u) | b;
    }
  }
};

// ------------------------------------------------------------------ tensor-core helpers (sm_80+)
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  return (unsigned int)__cvta_generic_to_shared(p);
}

// BYTES (4, 8 or 16) from global to shared, asynchronously (both addresses aligned to BYTES).
template <int BYTES>
__device__ __forceinline__ void cp_async(unsigned int dst, const void* src) {
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and lane l receives
// register i = (row l / 4, cols 2 (l % 4), +1) of matrix i (.trans: the transposed matrix).
__device__ __forceinline__ void ldsm_x4(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d += a . b on a 16x8x16 tile. Layouts (g = lane / 4, c = lane % 4; each register holds two
// consecutive-column elements, the lower column in the low half):
//   a (16x16 row-major): a0 (row g, cols 2c..), a1 (row g+8, cols 2c..), a2 (row g, cols 2c+8..),
//                        a3 (row g+8, cols 2c+8..)
//   b (16x8 "col"):      b0 (k rows 2c, 2c+1, col g), b1 (k rows 2c+8, 2c+9, col g)
//   d (16x8 fp32):       d0, d1 (row g, cols 2c, 2c+1), d2, d3 (row g+8, cols 2c, 2c+1)
template <int DT>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                         unsigned int b1) {
  if constexpr (DT == FS_DTYPE_BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <int DT>
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
  return Elem<DT>::from_float(lo) | (Elem<DT>::from_float(hi) << 16);
}

// 16 bytes from global to shared, asynchronously; src_bytes = 0 writes zeros and reads nothing
// (src must still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(unsigned int dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Wait until at most N committed cp.async groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ------------------------------------------------------------------ online softmax states
// Merge weights of two (max, ...) states in base 2: a state with max -inf weighs 0, and two empty
// states keep weight 1 (their sums are 0), so no NaN appears.
__device__ __forceinline__ void merge_weights(float ma, float mb, float& mm, float& fa, float& fb) {
  mm = fmaxf(ma, mb);
  fa = ma == mm ? 1.f : exp2f(ma - mm);
  fb = mb == mm ? 1.f : exp2f(mb - mm);
}

}  // namespace flashswitch

#endif  // __CUDACC__ || __CUDACC_RTC__
