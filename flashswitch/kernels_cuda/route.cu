// Op 3 routing (SPEC.md "Op 3"): sort the routed (token, slot) pairs by expert on the device.
// Every pair p has the key clamp(id[p], -1, E) + 1 in [0, E + 1]; the pairs are stably sorted by key.
//
// Few experts (E + 2 <= kCountBins keys) and up to kCountMaxPairs pairs: a counting sort in two
// kernels (SwitchHead: 10-16 experts):
//   1. count: tile g of kCountTile pairs writes its key histogram into counts[key][g];
//   2. scatter: tile g finds where each key's run starts (keys below it in every tile, plus the same
//      key in the tiles before g), ranks its pairs stably (warp match + per-warp counts, in rounds of
//      blockDim pairs in p order) and writes token = p / S, slot = p % S there; tile 0 also writes
//      offsets[e] = number of pairs with key <= e.
// Otherwise (sigma-MoE: 512 experts) the general path, five launches:
//   1. keys: key[p], value[p] = p;
//   2. a stable LSD radix sort of (key, value) over the low bits that hold E + 1 (cub);
//   3. finish: token = value / S, slot = value % S, and offsets[e] = first sorted position whose key
//      is >= e + 1, written by the position where the key steps past e (each e exactly once).
// Host code only: this file is built by nvcc into the extension (NVRTC, which has no cub, skips it).
#include "route.h"

#ifndef __CUDACC_RTC__
#include <cub/device/device_radix_sort.cuh>

#include <cstdint>

namespace flashswitch {
namespace {

constexpr int kRouteThreads = 256;
constexpr int kRouteMaxBlocks = 4096;
constexpr size_t kAlign = 256;

constexpr int kCountBins = 64;                        // keys of the counting sort: E <= 62
constexpr int kCountThreads = 256;                    // 8 warps
constexpr int kCountRounds = 8;                       // pairs per thread and tile
constexpr int kCountTile = kCountThreads * kCountRounds;
constexpr long long kCountMaxPairs = 1LL << 20;       // <= 512 tiles: each reads every tile's counts

bool counting_path(long long P, long long E) { return E + 2 <= kCountBins && P <= kCountMaxPairs; }

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Bits that hold key values 0 .. E + 1.
int key_bits(long long E) {
  int bits = 1;
  while (bits < 32 && (1ull << bits) <= static_cast<unsigned long long>(E + 1)) ++bits;
  return bits;
}

int grid_for(long long n) {
  const long long blocks = (n + kRouteThreads - 1) / kRouteThreads;
  return static_cast<int>(blocks < kRouteMaxBlocks ? blocks : kRouteMaxBlocks);
}

template <typename Id>
__global__ void route_keys_kernel(const Id* __restrict__ ids, long long P, long long E, unsigned* __restrict__ keys,
                                  int* __restrict__ values) {
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < P; p += step) {
    long long id = static_cast<long long>(ids[p]);
    id = id < -1 ? -1 : (id > E ? E : id);
    keys[p] = static_cast<unsigned>(id + 1);
    values[p] = static_cast<int>(p);
  }
}

__global__ void route_finish_kernel(const unsigned* __restrict__ keys, const int* __restrict__ pairs, long long P,
                                    int S, long long E, int* __restrict__ token, int* __restrict__ slot,
                                    long long* __restrict__ offsets) {
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < P; p += step) {
    const int pair = pairs[p];
    const int t = pair / S;
    token[p] = t;
    slot[p] = pair - t * S;
    // p is the first position with key >= v for every v in (previous key, key]: offsets[v - 1] = p.
    const long long key = keys[p];
    const long long prev = p == 0 ? 0 : static_cast<long long>(keys[p - 1]);
    for (long long e = prev; e < key && e <= E; ++e) offsets[e] = p;
    if (p == P - 1) {
      for (long long e = key; e <= E; ++e) offsets[e] = P;  // experts past the last key: empty, at the end
    }
  }
}

template <typename Id>
__device__ __forceinline__ int route_key(const Id* ids, long long p, long long P, long long E) {
  if (p >= P) return kCountBins;  // past the end: no key
  long long id = static_cast<long long>(ids[p]);
  id = id < -1 ? -1 : (id > E ? E : id);
  return static_cast<int>(id + 1);
}

template <typename Id>
__global__ void __launch_bounds__(kCountThreads) route_count_kernel(const Id* __restrict__ ids, long long P,
                                                                     long long E, int tiles,
                                                                     int* __restrict__ counts) {
  __shared__ int hist[kCountBins];
  const int nbins = static_cast<int>(E) + 2;
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const long long first = static_cast<long long>(blockIdx.x) * kCountTile + threadIdx.x;
  const unsigned lane = threadIdx.x & 31u;
  int keys[kCountRounds];  // all loads in flight at once
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) keys[r] = route_key(ids, first + r * kCountThreads, P, E);
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {
    const int key = keys[r];
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    if (key < kCountBins && (peers & ((1u << lane) - 1u)) == 0u) atomicAdd(&hist[key], __popc(peers));
  }
  __syncthreads();
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) counts[static_cast<long long>(b) * tiles + blockIdx.x] = hist[b];
}

template <typename Id>
__global__ void __launch_bounds__(kCountThreads) route_scatter_kernel(const Id* __restrict__ ids, long long P, int S,
                                                                       long long E, int tiles,
                                                                       const int* __restrict__ counts,
                                                                       int* __restrict__ token, int* __restrict__ slot,
                                                                       long long* __restrict__ offsets) {
  constexpr int kWarps = kCountThreads / 32;
  __shared__ long long before[kCountBins];  // pairs of this key in the tiles before this one
  __shared__ long long total[kCountBins];   // pairs of this key in all tiles
  __shared__ long long start[kCountBins];   // where this tile's run of the key starts
  __shared__ int warp_count[kWarps][kCountBins];
  const int nbins = static_cast<int>(E) + 2;
  const int warp = threadIdx.x >> 5;
  const unsigned lane = threadIdx.x & 31u;
  const long long first = static_cast<long long>(blockIdx.x) * kCountTile + threadIdx.x;
  int keys[kCountRounds];  // loads in flight while the counts are summed
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) keys[r] = route_key(ids, first + r * kCountThreads, P, E);
  // one warp per key: sum its counts over the tiles before this one and over all tiles
  for (int b = warp; b < nbins; b += kWarps) {
    long long lo = 0, all = 0;
    for (int g = lane; g < tiles; g += 32) {
      const long long c = counts[static_cast<long long>(b) * tiles + g];
      all += c;
      if (g < static_cast<int>(blockIdx.x)) lo += c;
    }
    for (int o = 16; o > 0; o >>= 1) {
      lo += __shfl_xor_sync(0xffffffffu, lo, o);
      all += __shfl_xor_sync(0xffffffffu, all, o);
    }
    if (lane == 0) {
      before[b] = lo;
      total[b] = all;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long below = 0;  // pairs with a smaller key, in all tiles
    for (int b = 0; b < nbins; ++b) {
      start[b] = below + before[b];
      below += total[b];
      if (blockIdx.x == 0 && b < nbins - 1) offsets[b] = below;  // offsets[e] = pairs with key <= e
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {
    for (int i = threadIdx.x; i < kWarps * kCountBins; i += blockDim.x) (&warp_count[0][0])[i] = 0;
    __syncthreads();
    const long long p = first + r * kCountThreads;
    const int key = keys[r];
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (key < kCountBins && rank == 0) warp_count[warp][key] = __popc(peers);
    __syncthreads();
    if (key < kCountBins) {
      long long pos = start[key] + rank;
      for (int w = 0; w < warp; ++w) pos += warp_count[w][key];
      const int t = static_cast<int>(p / S);
      token[pos] = t;
      slot[pos] = static_cast<int>(p - static_cast<long long>(t) * S);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < nbins; b += blockDim.x) {
      long long n = 0;
      for (int w = 0; w < kWarps; ++w) n += warp_count[w][b];
      start[b] += n;
    }
    __syncthreads();
  }
}

struct Layout {
  size_t keys_in, keys_out, values_in, values_out, temp, temp_bytes, total;
};

cudaError_t layout_for(long long P, long long E, Layout* l) {
  if (counting_path(P, E)) {  // counts [E + 2][tiles] only
    const long long tiles = (P + kCountTile - 1) / kCountTile;
    *l = Layout{};
    l->total = align_up(static_cast<size_t>((E + 2) * tiles) * sizeof(int));
    return cudaSuccess;
  }
  size_t temp_bytes = 0;
  const cudaError_t err = cub::DeviceRadixSort::SortPairs(
      nullptr, temp_bytes, static_cast<const unsigned*>(nullptr), static_cast<unsigned*>(nullptr),
      static_cast<const int*>(nullptr), static_cast<int*>(nullptr), static_cast<int>(P), 0, key_bits(E));
  if (err != cudaSuccess) return err;
  const size_t keys = align_up(static_cast<size_t>(P) * sizeof(unsigned));
  const size_t values = align_up(static_cast<size_t>(P) * sizeof(int));
  l->keys_in = 0;
  l->keys_out = keys;
  l->values_in = 2 * keys;
  l->values_out = 2 * keys + values;
  l->temp = 2 * keys + 2 * values;
  l->temp_bytes = temp_bytes;
  l->total = l->temp + align_up(temp_bytes);
  return cudaSuccess;
}

}  // namespace
}  // namespace flashswitch

extern "C" cudaError_t fs_route_workspace_bytes(long long P, long long E, size_t* bytes) {
  if (bytes == nullptr || P < 1 || P > 2147483647LL || E < 1 || E >= 2147483647LL) return cudaErrorInvalidValue;
  flashswitch::Layout l{};
  const cudaError_t err = flashswitch::layout_for(P, E, &l);
  if (err == cudaSuccess) *bytes = l.total;
  return err;
}

extern "C" cudaError_t fs_route(const void* ids, int ids_64, long long P, int S, long long E, void* workspace,
                                size_t workspace_bytes, int* token, int* slot, long long* offsets,
                                cudaStream_t stream) {
  using namespace flashswitch;
  if (ids == nullptr || workspace == nullptr || token == nullptr || slot == nullptr || offsets == nullptr ||
      P < 1 || P > 2147483647LL || S < 1 || E < 1 || E >= 2147483647LL ||
      reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
    return cudaErrorInvalidValue;
  }
  Layout l{};
  cudaError_t err = layout_for(P, E, &l);
  if (err != cudaSuccess) return err;
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  char* ws = static_cast<char*>(workspace);
  if (counting_path(P, E)) {
    const int tiles = static_cast<int>((P + kCountTile - 1) / kCountTile);
    int* counts = reinterpret_cast<int*>(ws);
    if (ids_64) {
      const long long* id = static_cast<const long long*>(ids);
      route_count_kernel<long long><<<tiles, kCountThreads, 0, stream>>>(id, P, E, tiles, counts);
      route_scatter_kernel<long long><<<tiles, kCountThreads, 0, stream>>>(id, P, S, E, tiles, counts, token, slot,
                                                                           offsets);
    } else {
      const int* id = static_cast<const int*>(ids);
      route_count_kernel<int><<<tiles, kCountThreads, 0, stream>>>(id, P, E, tiles, counts);
      route_scatter_kernel<int><<<tiles, kCountThreads, 0, stream>>>(id, P, S, E, tiles, counts, token, slot,
                                                                     offsets);
    }
    return cudaGetLastError();
  }
  unsigned* keys_in = reinterpret_cast<unsigned*>(ws + l.keys_in);
  unsigned* keys_out = reinterpret_cast<unsigned*>(ws + l.keys_out);
  int* values_in = reinterpret_cast<int*>(ws + l.values_in);
  int* values_out = reinterpret_cast<int*>(ws + l.values_out);

  const int grid = grid_for(P);
  if (ids_64) {
    route_keys_kernel<long long><<<grid, kRouteThreads, 0, stream>>>(static_cast<const long long*>(ids), P, E,
                                                                     keys_in, values_in);
  } else {
    route_keys_kernel<int><<<grid, kRouteThreads, 0, stream>>>(static_cast<const int*>(ids), P, E, keys_in,
                                                               values_in);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  size_t temp_bytes = l.temp_bytes;
  err = cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys_in, keys_out, values_in, values_out,
                                        static_cast<int>(P), 0, key_bits(E), stream);
  if (err != cudaSuccess) return err;
  route_finish_kernel<<<grid, kRouteThreads, 0, stream>>>(keys_out, values_out, P, S, E, token, slot, offsets);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__
