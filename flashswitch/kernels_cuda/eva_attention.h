// Host-side interface of the op-2 kernels (causal EVA attention, SPEC.md "Op 2").
// Plain C types only: the torch bindings and any other host code can call it.
#pragma once

#include "common.cuh"

// Limits and tile sizes, shared with the kernel source (this part also compiles under NVRTC).
#define FS_EVA_MAX_D 256      // largest head dim
#define FS_EVA_BLOCK_M 64     // query rows per block of the tensor-core kernel (4 warps x 16 rows)
#define FS_EVA_THREADS 128    // threads per block (both kernels)
#define FS_EVA_F32_ROWS 4     // query rows per block of the fp32 kernel (one warp each)
#define FS_EVA_DEC_WARPS 8    // decode kernel: warps per query row (each takes a slice of its keys)
#define FS_EVA_DEC_MAX_Q 16   // decode kernel: used for Nq up to this, when asked for (decode_kernel)

// Kernel a plan launches.
#define FS_EVA_KERNEL_TC 0      // eva_attention_fwd_kernel (fp16/bf16 tensor-core tiles)
#define FS_EVA_KERNEL_F32 1     // eva_attention_fwd_f32_kernel
#define FS_EVA_KERNEL_DECODE 2  // eva_attention_decode_kernel

// Summary logit bias.
#define FS_EVA_BIAS_NONE 0
#define FS_EVA_BIAS_TENSOR 1     // fp32 [B, Hkv, Nc] tensor (any strides)
#define FS_EVA_BIAS_LOG_COUNT 2  // log min(C, Nk - c * C)

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// Arguments of one launch. Strides are in elements; sizes and strides are 64-bit.
// q: [B, H, Nq, D]; k, v: [B, Hkv, Nk, D]; k_sum, v_sum: [B, Hkv, Nc, D] (all in `dtype`, last dim
// contiguous); bias: NULL or fp32 [B, Hkv, Nc]; o: [B, H, Nq, D] in `dtype` (last dim contiguous);
// lse: fp32 [B, H, Nq]. Query i sits at position q_offset + i; H % Hkv == 0.
typedef struct fs_eva_attention_args {
  const void* q;
  const void* k;
  const void* v;
  const void* k_sum;
  const void* v_sum;
  const float* bias;
  void* o;
  float* lse;
  int dtype;      // FS_DTYPE_*
  int sliding;    // 0: block window, 1: sliding window
  int bias_mode;  // FS_EVA_BIAS_* (TENSOR needs bias != NULL)
  int decode_kernel;  // 1: fp16/bf16 with Nq <= FS_EVA_DEC_MAX_Q runs the decode kernel (one block per row)
  long long B, H, Hkv, Nq, Nk, Nc, D, C, W, q_offset;
  long long q_stride[3];      // b, h, n
  long long k_stride[3];      // b, h, n
  long long v_stride[3];      // b, h, n
  long long k_sum_stride[3];  // b, h, chunk
  long long v_sum_stride[3];  // b, h, chunk
  long long bias_stride[3];   // b, h, chunk
  long long o_stride[3];      // b, h, n
  long long lse_stride[3];    // b, h, n
  float scale;
} fs_eva_attention_args;

// The launch shape chosen for a problem (mirrored by flashswitch/bindings/cupy.py: `eva_plan`).
typedef struct fs_eva_attention_plan {
  int head_dim;    // fp16/bf16: padded head dim (template HD); fp32 and decode: 32 x elements per lane
  int block_m;     // query rows per block
  int block_n;     // keys per tile (fp16/bf16), 0 for fp32
  int vec_bytes;   // bytes per global access of q/k/v/o tiles (16, 8, 4 or 2), 0 for fp32
  int threads;     // threads per block
  long long grid;  // blocks (the kernels loop over the rest)
  int smem_bytes;  // dynamic shared memory
  int kernel;      // FS_EVA_KERNEL_*
} fs_eva_attention_plan;

// Fills `plan`. dtype: FS_DTYPE_*; align: a power of two dividing every base address and every byte
// stride of a moving dim of q, k, v, k_sum, v_sum and o; decode: the decode kernel where it applies
// (fp16/bf16, 0 < D, Nq <= FS_EVA_DEC_MAX_Q). Returns cudaErrorInvalidValue for D > FS_EVA_MAX_D
// or an unknown dtype.
cudaError_t fs_eva_attention_plan_for(long long D, int dtype, long long align, long long B, long long H,
                                      long long Nq, int decode, fs_eva_attention_plan* plan);

// Plans (fs_eva_attention_plan_for, alignment taken from the arguments) and launches on `stream`.
// Returns the launch error, or cudaErrorInvalidValue for unsupported arguments.
cudaError_t fs_eva_attention_fwd(const fs_eva_attention_args* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // __CUDACC_RTC__
