// Host-side interface of the op-1 kernel (chunked control-variate summaries, SPEC.md "Op 1").
// Plain C types only: the torch bindings and any other host code can call it.
#pragma once

#include "common.cuh"

// Limits, shared with the kernel source (this part also compiles under NVRTC).
#define FS_CS_MAX_ELEMS 8                    // elements of a row held by one lane
#define FS_CS_MAX_D (32 * FS_CS_MAX_ELEMS)   // largest head dim
#define FS_CS_MAX_THREADS 256                // largest block

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// Arguments of one launch. Strides are in elements; sizes and strides are 64-bit.
// k, v: [B, H, N, D] (last dim contiguous); omega: NULL or a [B, H, Nc, D] view (stride 0 where it is
// shared); key_weight: NULL or [H, D]; valid: NULL or bool [B, N]; k_sum, v_sum: [B, H, Nc, D] in k's
// dtype (last dim contiguous); lse: fp32 [B, H, Nc].
typedef struct fs_chunk_summaries_args {
  const void* k;
  const void* v;
  const void* omega;
  const void* key_weight;
  const unsigned char* valid;
  void* k_sum;
  void* v_sum;
  float* lse;
  int dtype;             // FS_DTYPE_* of k, v, k_sum, v_sum
  int omega_dtype;       // FS_DTYPE_* of omega (ignored when omega is NULL)
  int key_weight_dtype;  // FS_DTYPE_* of key_weight (ignored when key_weight is NULL)
  long long B, H, N, D, C;
  long long k_stride[3];      // b, h, n
  long long v_stride[3];      // b, h, n
  long long omega_stride[3];  // b, h, chunk
  long long key_weight_stride;  // h
  long long valid_stride[2];  // b, n
  long long k_sum_stride[3];  // b, h, chunk
  long long v_sum_stride[3];  // b, h, chunk
  long long lse_stride[3];    // b, h, chunk
  float scale;
} fs_chunk_summaries_args;

// The launch shape chosen for a problem (mirrored by flashswitch/bindings/cupy.py: `plan`).
typedef struct fs_chunk_summaries_plan {
  int vec;        // elements per vector access (16, 8, 4 bytes or one element)
  int vpl;        // vectors per lane per row
  int lanes;      // lanes that share one token row (a power of two <= 32)
  int split;      // lane groups that share one chunk (a power of two)
  int threads;    // threads per block
  int unroll;     // token rows per group loaded before use
  long long grid; // blocks
  int smem_bytes; // dynamic shared memory (cross-warp merge), 0 when unused
} fs_chunk_summaries_plan;

// Fills `plan`. elem_size: bytes per element of k; align: a power of two dividing every address and
// byte stride accessed with vectors (k, v, k_sum, v_sum); nchunks = B * H * Nc; threads, unroll,
// split: the tuning config (split 0 = automatic). Returns cudaErrorInvalidValue for D > FS_CS_MAX_D.
cudaError_t fs_chunk_summaries_plan_for(long long D, int elem_size, long long align, long long C,
                                        long long nchunks, int threads, int unroll, int split,
                                        fs_chunk_summaries_plan* plan);

// Plans (fs_chunk_summaries_plan_for, alignment taken from the arguments) and launches on `stream`.
// Returns the launch error, or cudaErrorInvalidValue for unsupported arguments.
cudaError_t fs_chunk_summaries_fwd(const fs_chunk_summaries_args* args, int threads, int unroll, int split,
                                   cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // __CUDACC_RTC__
