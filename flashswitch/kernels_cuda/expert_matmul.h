// Host-side interface of the op-3 kernels (grouped expert matmul, SPEC.md "Op 3").
// Plain C types only: the torch bindings and any other host code can call it.
#pragma once

#include "common.cuh"

// Limits and modes, shared with the kernel source (this part also compiles under NVRTC).
#define FS_EM_THREADS 128          // threads of the main kernel: 4 warps as 2 (rows) x 2 (columns)
#define FS_EM_BLOCK_K 32           // inner-dimension step
#define FS_EM_MIN_TILE 32          // BLOCK_M and BLOCK_N are 32, 64 or 128 ...
#define FS_EM_MAX_TILE 128
#define FS_EM_MAX_TILE_ELEMS 8192  // ... with BLOCK_M * BLOCK_N <= this (at most 64 accumulators a thread)
#define FS_EM_FINISH_THREADS 256   // threads of the finishing (cast / group-sum) kernel
#define FS_EM2_THREADS 256         // variant 2 (expert_matmul_fwd_v2_kernel): 8 warps,
#define FS_EM2_BLOCK_K 32          // k step,
#define FS_EM2_STAGES 3            // cp.async stages in flight (static shared memory <= 48 KB)
#define FS_EM_FINISH_MAX_GRID 65536

// Epilogue modes of the main kernel.
#define FS_EM_STORE 0      // G_out == S: each pair owns one y row; store in x's dtype
#define FS_EM_STORE_F32 1  // G_out < S, deterministic: each pair's fp32 row into a [T, S, d_out] scratch
#define FS_EM_ATOMIC 2     // G_out < S: fp32 atomicAdd into a zeroed [T, G_out, d_out] accumulator

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// Arguments of one call. Strides are in elements; sizes and strides are 64-bit.
// x: [T, G_in, d_in] (last dim contiguous); weight: [E, d_in, d_out], any strides, x's dtype or fp32
// with fp16/bf16 x; gates: NULL or [T, S] (any float dtype, any strides); token, slot: int32 [T * S]
// (contiguous, the pairs in expert order); offsets: int64 [E + 1] (expert e owns sorted positions
// [offsets[e], offsets[e+1])); y: [T, G_out, d_out] in x's dtype (last dim contiguous);
// workspace: fp32, at least plan.workspace_elems elements (contiguous), NULL when that is 0.
typedef struct fs_expert_matmul_args {
  const void* x;
  const void* weight;
  const void* gates;
  const int* token;
  const int* slot;
  const long long* offsets;
  void* y;
  float* workspace;
  int x_dtype;      // FS_DTYPE_* of x and y
  int w_dtype;      // FS_DTYPE_* of weight
  int gates_dtype;  // FS_DTYPE_* of gates (ignored when gates is NULL)
  int deterministic;
  int variant;      // 2: the cp.async / ldmatrix kernel where its preconditions hold; else the plain one
  long long T, S, E, G_in, G_out, d_in, d_out;
  long long x_stride[2];      // t, g
  long long w_stride[3];      // e, k (d_in), n (d_out)
  long long gates_stride[2];  // t, s
  long long y_stride[2];      // t, g
} fs_expert_matmul_args;

// The launch shape chosen for a problem (mirrored by flashswitch/bindings/cupy.py: `expert_matmul_plan`).
typedef struct fs_expert_matmul_plan {
  int block_m;                // pairs per row tile (32, 64, 128)
  int block_n;                // output features per column tile (32, 64, 128)
  int mode;                   // FS_EM_*
  long long grid_m;           // row tiles: ceil(P / block_m) + min(E, P), an upper bound
  long long n_tiles_n;        // column tiles
  long long group_n;          // column tiles per sweep of the row tiles
  long long tiles;            // grid_m * n_tiles_n
  long long grid;             // blocks of the main kernel (min(tiles, 2^31 - 1); they loop over the rest)
  long long workspace_elems;  // fp32 elements of scratch the caller provides
  long long finish_grid;      // blocks of the finishing kernel, 0 when there is none
} fs_expert_matmul_plan;

// Fills `plan`. block_m, block_n, group_n: the tuning config (<= 0: default: block_m 64, block_n the
// power of two covering d_out, all column tiles per sweep). Tiles are rounded down to powers of two in
// [32, 128], block_n to at most the power of two covering d_out, then halved (block_n first) until
// block_m * block_n <= FS_EM_MAX_TILE_ELEMS.
cudaError_t fs_expert_matmul_plan_for(long long T, long long S, long long E, long long G_out, long long d_out,
                                      int deterministic, int block_m, int block_n, long long group_n,
                                      fs_expert_matmul_plan* plan);

// Plans and launches on `stream`: zeroes the workspace (atomic mode), runs the main kernel and, when
// G_out < S, the finishing kernel. No host synchronisation. Returns the launch error, or
// cudaErrorInvalidValue for unsupported arguments.
cudaError_t fs_expert_matmul_fwd(const fs_expert_matmul_args* args, int block_m, int block_n, long long group_n,
                                 cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // __CUDACC_RTC__
