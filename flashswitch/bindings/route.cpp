// torch glue of op 3's routing: checks, device guard, current stream, workspace, then the extern "C"
// launcher (kernels_cuda/route.cu).
//
// Op (namespace flashswitch_C):
//   route_fwd(expert_idx, num_experts) -> (token, slot, offsets)
//       expert_idx: int32/int64 [T, S] (CUDA); token, slot: int32 [T * S]; offsets: int64 [E + 1].
//       No host sync; ids outside [0, E) belong to no expert (route() checks the range when asked).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "route.h"

namespace {

constexpr int64_t kMaxIndex = 2147483647LL;  // pairs and experts are indexed with int32

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_fwd(const at::Tensor& expert_idx, int64_t num_experts) {
  TORCH_CHECK(expert_idx.is_cuda(), "route_fwd: expert_idx must be a CUDA tensor, got ", expert_idx.device());
  TORCH_CHECK(expert_idx.scalar_type() == at::kInt || expert_idx.scalar_type() == at::kLong,
              "route_fwd: expert_idx has dtype ", expert_idx.scalar_type(), "; expected int32 or int64");
  TORCH_CHECK(expert_idx.dim() == 2 && expert_idx.size(1) >= 1,
              "route_fwd: expert_idx must be [T, S] with S >= 1, got shape ", expert_idx.sizes());
  TORCH_CHECK(num_experts >= 1 && num_experts < kMaxIndex, "route_fwd: num_experts must be in [1, 2^31 - 1), got ",
              num_experts);
  const int64_t T = expert_idx.size(0), S = expert_idx.size(1), P = T * S;
  TORCH_CHECK(P <= kMaxIndex, "route_fwd: expert_idx has ", P, " pairs; at most 2^31 - 1");

  const c10::cuda::CUDAGuard guard(expert_idx.device());
  const at::Tensor ids = expert_idx.contiguous();
  const auto opts = ids.options();
  at::Tensor token = at::empty({P}, opts.dtype(at::kInt));
  at::Tensor slot = at::empty({P}, opts.dtype(at::kInt));
  at::Tensor offsets = at::empty({num_experts + 1}, opts.dtype(at::kLong));
  if (P == 0) {
    offsets.zero_();
    return {token, slot, offsets};
  }
  size_t bytes = 0;
  cudaError_t err = fs_route_workspace_bytes(P, num_experts, &bytes);
  TORCH_CHECK(err == cudaSuccess, "route_fwd: workspace query failed (P=", P, ", E=", num_experts,
              "): ", cudaGetErrorString(err));
  // the caching allocator hands out 512-byte aligned blocks (fs_route needs 256)
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, opts.dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ids.get_device()).stream();
  err = fs_route(ids.data_ptr(), ids.scalar_type() == at::kLong ? 1 : 0, P, static_cast<int>(S), num_experts,
                 workspace.data_ptr(), bytes, token.data_ptr<int>(), slot.data_ptr<int>(),
                 reinterpret_cast<long long*>(offsets.data_ptr<int64_t>()), stream);
  TORCH_CHECK(err == cudaSuccess, "route_fwd: launch failed (T=", T, ", S=", S, ", E=", num_experts, "): ",
              cudaGetErrorString(err));
  return {token, slot, offsets};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashswitch_C, m) {
  m.def("route_fwd(Tensor expert_idx, int num_experts) -> (Tensor token, Tensor slot, Tensor offsets)");
}

TORCH_LIBRARY_IMPL(flashswitch_C, CUDA, m) { m.impl("route_fwd", &route_fwd); }
