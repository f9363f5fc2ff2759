// torch glue of op 2: checks, device guard, current stream, then the extern "C" launcher.
//
// Ops (namespace flashswitch_C):
//   eva_attention_fwd(q, k, v, k_sum, v_sum, bias?, o!, lse!, chunk_size, window_size, sliding, scale,
//                     q_offset, log_count, decode=0) -> ()   writes o, lse (CUDA tensors); decode=1: the
//                     decode kernel (one block per query row) for fp16/bf16 with Nq <= 16
//   eva_attention_plan(D, dtype, align, B, H, Nq, decode=0) -> int[]
//       the launch shape [head_dim, block_m, block_n, vec_bytes, threads, grid, smem_bytes, kernel] (for
//       tests); dtype is an FS_DTYPE_* code (0 fp32, 1 fp16, 2 bf16), kernel an FS_EVA_KERNEL_* code
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "checks.h"
#include "eva_attention.h"

namespace {

using namespace flashswitch::checks;

constexpr const char* kOp = "eva_attention_fwd";

void eva_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_sum,
                       const at::Tensor& v_sum, const std::optional<at::Tensor>& bias, at::Tensor& o,
                       at::Tensor& lse, int64_t chunk_size, int64_t window_size, bool sliding, double scale,
                       int64_t q_offset, bool log_count, int64_t decode) {
  TORCH_CHECK(q.is_cuda(), "eva_attention_fwd: q must be a CUDA tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 4, "eva_attention_fwd: q must be [B, H, Nq, D], got shape ", q.sizes());
  check_float(kOp, "q", q);
  TORCH_CHECK(k.dim() == 4, "eva_attention_fwd: k must be [B, Hkv, Nk, D], got shape ", k.sizes());
  TORCH_CHECK(k_sum.dim() == 4, "eva_attention_fwd: k_sum must be [B, Hkv, Nc, D], got shape ", k_sum.sizes());
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), Nc = k_sum.size(2);
  TORCH_CHECK(D <= FS_EVA_MAX_D, "eva_attention_fwd: head dim D = ", D, " is larger than the CUDA kernel's limit ",
              FS_EVA_MAX_D);
  TORCH_CHECK(chunk_size >= 1, "eva_attention_fwd: chunk_size must be >= 1, got ", chunk_size);
  TORCH_CHECK(window_size >= 1 && window_size % chunk_size == 0,
              "eva_attention_fwd: window_size must be a positive multiple of chunk_size, got window_size=",
              window_size, ", chunk_size=", chunk_size);
  TORCH_CHECK((Hkv == 0 && H == 0) || (Hkv > 0 && H % Hkv == 0), "eva_attention_fwd: q has ", H,
              " heads and k has ", Hkv, ": H must be a multiple of Hkv");
  TORCH_CHECK(q_offset >= 0 && q_offset + Nq <= Nk, "eva_attention_fwd: q_offset must satisfy 0 <= q_offset and ",
              "q_offset + Nq <= Nk, got q_offset=", q_offset, ", Nq=", Nq, ", Nk=", Nk);
  check_last_contiguous(kOp, "q", q);

  const struct {
    const char* name;
    const at::Tensor* t;
    std::vector<int64_t> shape;
  } inputs[] = {{"k", &k, {B, Hkv, Nk, D}},
                {"v", &v, {B, Hkv, Nk, D}},
                {"k_sum", &k_sum, {B, Hkv, Nc, D}},
                {"v_sum", &v_sum, {B, Hkv, Nc, D}},
                {"o", &o, {B, H, Nq, D}}};
  for (const auto& in : inputs) {
    check_on(kOp, in.name, *in.t, q);
    check_dtype(kOp, in.name, *in.t, q.scalar_type());
    check_shape(kOp, in.name, *in.t, in.shape);
    check_last_contiguous(kOp, in.name, *in.t);
  }
  check_on(kOp, "lse", lse, q);
  check_dtype(kOp, "lse", lse, at::kFloat);
  check_shape(kOp, "lse", lse, {B, H, Nq});

  fs_eva_attention_args a{};
  a.decode_kernel = decode != 0 ? 1 : 0;
  a.bias_mode = log_count ? FS_EVA_BIAS_LOG_COUNT : FS_EVA_BIAS_NONE;
  if (bias.has_value()) {
    const at::Tensor& t = *bias;
    check_on(kOp, "bias", t, q);
    check_dtype(kOp, "bias", t, at::kFloat);
    check_shape(kOp, "bias", t, {B, Hkv, Nc});
    a.bias = t.data_ptr<float>();
    a.bias_mode = FS_EVA_BIAS_TENSOR;
    for (int i = 0; i < 3; ++i) a.bias_stride[i] = t.stride(i);
  }
  if (B * H * Nq == 0) return;
  if (Nc == 0) {  // no summaries: nothing reads k_sum, v_sum or a bias, which may be empty (null) tensors
    a.bias_mode = FS_EVA_BIAS_NONE;
    a.bias = nullptr;
  }

  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.k_sum = k_sum.data_ptr();
  a.v_sum = v_sum.data_ptr();
  a.o = o.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.dtype = dtype_code(q.scalar_type());
  a.sliding = sliding ? 1 : 0;
  a.B = B;
  a.H = H;
  a.Hkv = Hkv;
  a.Nq = Nq;
  a.Nk = Nk;
  a.Nc = Nc;
  a.D = D;
  a.C = chunk_size;
  a.W = window_size;
  a.q_offset = q_offset;
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = q.stride(i);
    a.k_stride[i] = k.stride(i);
    a.v_stride[i] = v.stride(i);
    a.k_sum_stride[i] = k_sum.stride(i);
    a.v_sum_stride[i] = v_sum.stride(i);
    a.o_stride[i] = o.stride(i);
    a.lse_stride[i] = lse.stride(i);
  }
  a.scale = static_cast<float>(scale);

  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const cudaError_t err = fs_eva_attention_fwd(&a, stream);
  TORCH_CHECK(err == cudaSuccess, "eva_attention_fwd: kernel launch failed (B=", B, ", H=", H, ", Hkv=", Hkv,
              ", Nq=", Nq, ", Nk=", Nk, ", Nc=", Nc, ", D=", D, ", chunk_size=", chunk_size, ", window_size=",
              window_size, ", ", q.scalar_type(), "): ", cudaGetErrorString(err));
}

std::vector<int64_t> eva_attention_plan(int64_t D, int64_t dtype, int64_t align, int64_t B, int64_t H, int64_t Nq,
                                        int64_t decode) {
  fs_eva_attention_plan p{};
  const cudaError_t err =
      fs_eva_attention_plan_for(D, static_cast<int>(dtype), align, B, H, Nq, decode != 0 ? 1 : 0, &p);
  TORCH_CHECK(err == cudaSuccess, "eva_attention_plan: unsupported arguments (D=", D, ", dtype=", dtype,
              ", align=", align, ")");
  return {p.head_dim, p.block_m, p.block_n, p.vec_bytes, p.threads, p.grid, p.smem_bytes, p.kernel};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashswitch_C, m) {
  m.def(
      "eva_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor k_sum, Tensor v_sum, Tensor? bias, Tensor(a!) o, "
      "Tensor(b!) lse, int chunk_size, int window_size, bool sliding, float scale, int q_offset, bool log_count, "
      "int decode=0) -> ()");
  m.def("eva_attention_plan(int D, int dtype, int align, int B, int H, int Nq, int decode=0) -> int[]",
        &eva_attention_plan);
}

TORCH_LIBRARY_IMPL(flashswitch_C, CUDA, m) { m.impl("eva_attention_fwd", &eva_attention_fwd); }
