// torch glue of op 1: checks, device guard, current stream, then the extern "C" launcher.
//
// Ops (namespace flashswitch_C):
//   chunk_summaries_fwd(k, v, omega?, key_weight?, valid?, k_sum!, v_sum!, lse!, chunk_size, scale,
//                       threads, unroll, split) -> ()       writes k_sum, v_sum, lse (CUDA tensors)
//   chunk_summaries_plan(D, elem_size, align, chunk_size, nchunks, threads, unroll, split) -> int[]
//       the launch shape [vec, vpl, lanes, split, threads, unroll, grid, smem_bytes] (for tests)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "chunk_summaries.h"

namespace {

using namespace flashswitch::checks;

constexpr const char* kOp = "chunk_summaries_fwd";

void chunk_summaries_fwd(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& omega,
                         const std::optional<at::Tensor>& key_weight, const std::optional<at::Tensor>& valid,
                         at::Tensor& k_sum, at::Tensor& v_sum, at::Tensor& lse, int64_t chunk_size, double scale,
                         int64_t threads, int64_t unroll, int64_t split) {
  TORCH_CHECK(k.is_cuda(), "chunk_summaries_fwd: k must be a CUDA tensor, got ", k.device());
  TORCH_CHECK(k.dim() == 4, "chunk_summaries_fwd: k must be [B, H, N, D], got shape ", k.sizes());
  TORCH_CHECK(chunk_size >= 1, "chunk_summaries_fwd: chunk_size must be >= 1, got ", chunk_size);
  check_float(kOp, "k", k);
  const int64_t B = k.size(0), H = k.size(1), N = k.size(2), D = k.size(3);
  const int64_t Nc = (N + chunk_size - 1) / chunk_size;
  TORCH_CHECK(D <= FS_CS_MAX_D, "chunk_summaries_fwd: head dim D = ", D, " is larger than the CUDA kernel's limit ",
              FS_CS_MAX_D);
  check_last_contiguous(kOp, "k", k);

  check_on(kOp, "v", v, k);
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "chunk_summaries_fwd: v has dtype ", v.scalar_type(),
              " but k has ", k.scalar_type());
  check_shape(kOp, "v", v, k.sizes());
  check_last_contiguous(kOp, "v", v);

  const void* omega_ptr = nullptr;
  int omega_dtype = 0;
  int64_t omega_stride[3] = {0, 0, 0};
  if (omega.has_value()) {
    const at::Tensor& o = *omega;
    check_on(kOp, "omega", o, k);
    check_float(kOp, "omega", o);
    check_shape(kOp, "omega", o, {B, H, Nc, D});
    check_last_contiguous(kOp, "omega", o);
    omega_ptr = o.data_ptr();
    omega_dtype = dtype_code(o.scalar_type());
    for (int i = 0; i < 3; ++i) omega_stride[i] = o.stride(i);
  }

  const void* kw_ptr = nullptr;
  int kw_dtype = 0;
  int64_t kw_stride = 0;
  if (key_weight.has_value()) {
    const at::Tensor& w = *key_weight;
    check_on(kOp, "key_weight", w, k);
    check_float(kOp, "key_weight", w);
    check_shape(kOp, "key_weight", w, {H, D});
    check_last_contiguous(kOp, "key_weight", w);
    kw_ptr = w.data_ptr();
    kw_dtype = dtype_code(w.scalar_type());
    kw_stride = w.stride(0);
  }

  const unsigned char* valid_ptr = nullptr;
  int64_t valid_stride[2] = {0, 0};
  if (valid.has_value()) {
    const at::Tensor& m = *valid;
    check_on(kOp, "valid", m, k);
    TORCH_CHECK(m.scalar_type() == at::kBool, "chunk_summaries_fwd: valid must be bool, got ", m.scalar_type());
    check_shape(kOp, "valid", m, {B, N});
    valid_ptr = static_cast<const unsigned char*>(m.data_ptr());
    valid_stride[0] = m.stride(0);
    valid_stride[1] = m.stride(1);
  }

  for (const auto& [name, out] : {std::pair<const char*, const at::Tensor*>{"k_sum", &k_sum}, {"v_sum", &v_sum}}) {
    check_on(kOp, name, *out, k);
    check_dtype(kOp, name, *out, k.scalar_type());
    check_shape(kOp, name, *out, {B, H, Nc, D});
    check_last_contiguous(kOp, name, *out);
  }
  check_on(kOp, "lse", lse, k);
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "chunk_summaries_fwd: lse must be float32, got ", lse.scalar_type());
  check_shape(kOp, "lse", lse, {B, H, Nc});

  fs_chunk_summaries_args a{};
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.omega = omega_ptr;
  a.key_weight = kw_ptr;
  a.valid = valid_ptr;
  a.k_sum = k_sum.data_ptr();
  a.v_sum = v_sum.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.dtype = dtype_code(k.scalar_type());
  a.omega_dtype = omega_dtype;
  a.key_weight_dtype = kw_dtype;
  a.B = B;
  a.H = H;
  a.N = N;
  a.D = D;
  a.C = chunk_size;
  for (int i = 0; i < 3; ++i) {
    a.k_stride[i] = k.stride(i);
    a.v_stride[i] = v.stride(i);
    a.omega_stride[i] = omega_stride[i];
    a.k_sum_stride[i] = k_sum.stride(i);
    a.v_sum_stride[i] = v_sum.stride(i);
    a.lse_stride[i] = lse.stride(i);
  }
  a.key_weight_stride = kw_stride;
  a.valid_stride[0] = valid_stride[0];
  a.valid_stride[1] = valid_stride[1];
  a.scale = static_cast<float>(scale);

  const c10::cuda::CUDAGuard guard(k.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(k.get_device()).stream();
  const cudaError_t err = fs_chunk_summaries_fwd(&a, static_cast<int>(threads), static_cast<int>(unroll),
                                                 static_cast<int>(split), stream);
  TORCH_CHECK(err == cudaSuccess, "chunk_summaries_fwd: kernel launch failed (B=", B, ", H=", H, ", N=", N,
              ", D=", D, ", chunk_size=", chunk_size, ", ", k.scalar_type(), ", threads=", threads,
              ", unroll=", unroll, ", split=", split, "): ", cudaGetErrorString(err));
}

std::vector<int64_t> chunk_summaries_plan(int64_t D, int64_t elem_size, int64_t align, int64_t chunk_size,
                                          int64_t nchunks, int64_t threads, int64_t unroll, int64_t split) {
  fs_chunk_summaries_plan p{};
  const cudaError_t err = fs_chunk_summaries_plan_for(D, static_cast<int>(elem_size), align, chunk_size, nchunks,
                                                      static_cast<int>(threads), static_cast<int>(unroll),
                                                      static_cast<int>(split), &p);
  TORCH_CHECK(err == cudaSuccess, "chunk_summaries_plan: unsupported arguments (D=", D, ", elem_size=", elem_size,
              ", align=", align, ", chunk_size=", chunk_size, ")");
  return {p.vec, p.vpl, p.lanes, p.split, p.threads, p.unroll, p.grid, p.smem_bytes};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashswitch_C, m) {
  m.def(
      "chunk_summaries_fwd(Tensor k, Tensor v, Tensor? omega, Tensor? key_weight, Tensor? valid, "
      "Tensor(a!) k_sum, Tensor(b!) v_sum, Tensor(c!) lse, int chunk_size, float scale, int threads, int unroll, "
      "int split) -> ()");
  m.def(
      "chunk_summaries_plan(int D, int elem_size, int align, int chunk_size, int nchunks, int threads, "
      "int unroll, int split) -> int[]",
      &chunk_summaries_plan);
}

TORCH_LIBRARY_IMPL(flashswitch_C, CUDA, m) { m.impl("chunk_summaries_fwd", &chunk_summaries_fwd); }
