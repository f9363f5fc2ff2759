// Op 3 routing (SPEC.md "Op 3"): sort the routed (token, slot) pairs by expert on the device.
//
//   1. keys: key[p] = clamp(id[p], -1, E) + 1 (an unsigned value in [0, E + 1]), value[p] = p;
//   2. a stable LSD radix sort of (key, value) over the low bits that hold E + 1 (cub), so few
//      experts take one or two passes;
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

struct Layout {
  size_t keys_in, keys_out, values_in, values_out, temp, temp_bytes, total;
};

cudaError_t layout_for(long long P, long long E, Layout* l) {
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
