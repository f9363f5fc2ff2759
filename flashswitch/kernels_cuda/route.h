// Host interface of the routing kernels (op 3's `route`, SPEC.md "Op 3"): the routed pairs stably
// sorted by expert on the device, in one call with no host synchronisation.
// Plain C types only: the torch bindings and any other host code can call it.
#pragma once

#include "common.cuh"

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

#include <cstddef>

#ifdef __cplusplus
extern "C" {
#endif

// Bytes of device workspace fs_route needs for P pairs and E experts (few experts: per-tile key
// counts; else sort keys and values, twice, plus the radix sort's own temporary storage).
// P < 2^31 - 1, 1 <= E < 2^31 - 1.
cudaError_t fs_route_workspace_bytes(long long P, long long E, size_t* bytes);

// ids: [P] contiguous, int32 (ids_64 = 0) or int64 (ids_64 = 1); pair p = t * S + s has id ids[p].
// Writes, for the pairs stably sorted by id (ties keep p order): token[i] = p / S, slot[i] = p % S
// (int32 [P]) and offsets[e] = number of pairs with id < e (int64 [E + 1]), so that expert e owns
// sorted positions [offsets[e], offsets[e + 1]). Ids below 0 sort first and ids >= E last: they
// belong to no expert (the same order as a stable sort of the ids clamped to [-1, E]).
// workspace: at least fs_route_workspace_bytes bytes, 256-byte aligned. P >= 1.
cudaError_t fs_route(const void* ids, int ids_64, long long P, int S, long long E, void* workspace,
                     size_t workspace_bytes, int* token, int* slot, long long* offsets, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif  // __CUDACC_RTC__
