// torch glue of op 3: checks, device guard, current stream, fp32 workspace, then the extern "C" launcher.
//
// Ops (namespace flashswitch_C):
//   expert_matmul_fwd(x3, weight, gates?, token, slot, offsets, y!, S, G_out, deterministic, block_m, block_n,
//                     group_n, variant=1) -> ()        writes y [T, G_out, d_out] (CUDA tensors, no host sync);
//                                                      variant 2: the cp.async / ldmatrix kernel where it applies
//   expert_matmul_plan(T, S, E, G_out, d_out, deterministic, block_m, block_n, group_n) -> int[]
//       the launch shape [block_m, block_n, mode, grid_m, n_tiles_n, group_n, tiles, grid, workspace_elems,
//       finish_grid] (for tests)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "checks.h"
#include "expert_matmul.h"

namespace {

using namespace flashswitch::checks;

constexpr const char* kOp = "expert_matmul_fwd";

void em_check_index(const char* name, const at::Tensor& t, const at::Tensor& x, at::ScalarType dtype,
                    int64_t numel) {
  check_on(kOp, name, t, x);
  check_dtype(kOp, name, t, dtype);
  TORCH_CHECK(t.dim() == 1 && t.numel() == numel, "expert_matmul_fwd: ", name, " has shape ", t.sizes(),
              ", expected [", numel, "]");
  TORCH_CHECK(t.is_contiguous(), "expert_matmul_fwd: ", name, " must be contiguous");
}

void expert_matmul_fwd(const at::Tensor& x3, const at::Tensor& weight, const std::optional<at::Tensor>& gates,
                       const at::Tensor& token, const at::Tensor& slot, const at::Tensor& offsets, at::Tensor& y,
                       int64_t S, int64_t G_out, bool deterministic, int64_t block_m, int64_t block_n,
                       int64_t group_n, int64_t variant) {
  TORCH_CHECK(x3.is_cuda(), "expert_matmul_fwd: x must be a CUDA tensor, got ", x3.device());
  TORCH_CHECK(x3.dim() == 3, "expert_matmul_fwd: x must be [T, G_in, d_in], got shape ", x3.sizes());
  check_float(kOp, "x", x3);
  const int x_dtype = dtype_code(x3.scalar_type());
  check_last_contiguous(kOp, "x", x3);
  const int64_t T = x3.size(0), G_in = x3.size(1), d_in = x3.size(2);
  TORCH_CHECK(S >= 1, "expert_matmul_fwd: S must be >= 1, got ", S);
  TORCH_CHECK(G_in >= 1 && S % G_in == 0, "expert_matmul_fwd: x has G_in = ", G_in, " groups, which must divide S = ",
              S);
  TORCH_CHECK(G_out >= 1 && S % G_out == 0, "expert_matmul_fwd: G_out = ", G_out, " must divide S = ", S);

  check_on(kOp, "weight", weight, x3);
  TORCH_CHECK(weight.dim() == 3, "expert_matmul_fwd: weight must be [E, d_in, d_out], got shape ", weight.sizes());
  const int w_dtype = dtype_code(weight.scalar_type());
  TORCH_CHECK(w_dtype == x_dtype || (w_dtype == FS_DTYPE_F32 && x_dtype != FS_DTYPE_F32),
              "expert_matmul_fwd: weight has dtype ", weight.scalar_type(), " but x has ", x3.scalar_type(),
              "; weight must match x or be float32 with float16/bfloat16 x");
  const int64_t E = weight.size(0), d_out = weight.size(2);
  TORCH_CHECK(E >= 1, "expert_matmul_fwd: weight must hold at least one expert, got shape ", weight.sizes());
  TORCH_CHECK(weight.size(1) == d_in, "expert_matmul_fwd: weight has d_in = ", weight.size(1), " but x has d_in = ",
              d_in);

  em_check_index("token", token, x3, at::kInt, T * S);
  em_check_index("slot", slot, x3, at::kInt, T * S);
  em_check_index("offsets", offsets, x3, at::kLong, E + 1);

  const void* gates_ptr = nullptr;
  int gates_dtype = 0;
  int64_t gates_stride[2] = {0, 0};
  if (gates.has_value()) {
    const at::Tensor& g = *gates;
    check_on(kOp, "gates", g, x3);
    check_float(kOp, "gates", g);
    gates_dtype = dtype_code(g.scalar_type());
    TORCH_CHECK(g.dim() == 2 && g.size(0) == T && g.size(1) == S, "expert_matmul_fwd: gates has shape ", g.sizes(),
                ", expected [", T, ", ", S, "]");
    gates_ptr = g.data_ptr();
    gates_stride[0] = g.stride(0);
    gates_stride[1] = g.stride(1);
  }

  check_on(kOp, "y", y, x3);
  check_dtype(kOp, "y", y, x3.scalar_type());
  TORCH_CHECK(y.dim() == 3 && y.size(0) == T && y.size(1) == G_out && y.size(2) == d_out,
              "expert_matmul_fwd: y has shape ", y.sizes(), ", expected [", T, ", ", G_out, ", ", d_out, "]");
  check_last_contiguous(kOp, "y", y);

  fs_expert_matmul_plan plan{};
  cudaError_t err = fs_expert_matmul_plan_for(T, S, E, G_out, d_out, deterministic ? 1 : 0,
                                              static_cast<int>(block_m), static_cast<int>(block_n), group_n, &plan);
  TORCH_CHECK(err == cudaSuccess, "expert_matmul_fwd: unsupported sizes (T=", T, ", S=", S, ", E=", E,
              ", G_out=", G_out, ", d_out=", d_out, ")");

  const c10::cuda::CUDAGuard guard(x3.device());
  at::Tensor workspace;  // allocated on the current stream by the caching allocator (no sync)
  if (plan.workspace_elems > 0) workspace = at::empty({plan.workspace_elems}, x3.options().dtype(at::kFloat));

  fs_expert_matmul_args a{};
  a.x = x3.data_ptr();
  a.weight = weight.data_ptr();
  a.gates = gates_ptr;
  a.token = token.data_ptr<int>();
  a.slot = slot.data_ptr<int>();
  a.offsets = reinterpret_cast<const long long*>(offsets.data_ptr<int64_t>());
  a.y = y.data_ptr();
  a.workspace = plan.workspace_elems > 0 ? workspace.data_ptr<float>() : nullptr;
  a.x_dtype = x_dtype;
  a.w_dtype = w_dtype;
  a.gates_dtype = gates_dtype;
  a.deterministic = deterministic ? 1 : 0;
  a.variant = static_cast<int>(variant);
  a.T = T;
  a.S = S;
  a.E = E;
  a.G_in = G_in;
  a.G_out = G_out;
  a.d_in = d_in;
  a.d_out = d_out;
  a.x_stride[0] = x3.stride(0);
  a.x_stride[1] = x3.stride(1);
  for (int i = 0; i < 3; ++i) a.w_stride[i] = weight.stride(i);
  a.gates_stride[0] = gates_stride[0];
  a.gates_stride[1] = gates_stride[1];
  a.y_stride[0] = y.stride(0);
  a.y_stride[1] = y.stride(1);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x3.get_device()).stream();
  err = fs_expert_matmul_fwd(&a, static_cast<int>(block_m), static_cast<int>(block_n), group_n, stream);
  TORCH_CHECK(err == cudaSuccess, "expert_matmul_fwd: kernel launch failed (T=", T, ", S=", S, ", E=", E,
              ", G_in=", G_in, ", G_out=", G_out, ", d_in=", d_in, ", d_out=", d_out, ", ", x3.scalar_type(),
              " x, ", weight.scalar_type(), " weight, block_m=", block_m, ", block_n=", block_n,
              ", group_n=", group_n, "): ", cudaGetErrorString(err));
}

std::vector<int64_t> expert_matmul_plan(int64_t T, int64_t S, int64_t E, int64_t G_out, int64_t d_out,
                                        bool deterministic, int64_t block_m, int64_t block_n, int64_t group_n) {
  fs_expert_matmul_plan p{};
  const cudaError_t err = fs_expert_matmul_plan_for(T, S, E, G_out, d_out, deterministic ? 1 : 0,
                                                    static_cast<int>(block_m), static_cast<int>(block_n), group_n,
                                                    &p);
  TORCH_CHECK(err == cudaSuccess, "expert_matmul_plan: unsupported arguments (T=", T, ", S=", S, ", E=", E,
              ", G_out=", G_out, ", d_out=", d_out, ")");
  return {p.block_m, p.block_n, p.mode, p.grid_m, p.n_tiles_n, p.group_n, p.tiles, p.grid, p.workspace_elems,
          p.finish_grid};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashswitch_C, m) {
  m.def(
      "expert_matmul_fwd(Tensor x3, Tensor weight, Tensor? gates, Tensor token, Tensor slot, Tensor offsets, "
      "Tensor(a!) y, int S, int G_out, bool deterministic, int block_m, int block_n, int group_n, "
      "int variant=1) -> ()");
  m.def(
      "expert_matmul_plan(int T, int S, int E, int G_out, int d_out, bool deterministic, int block_m, "
      "int block_n, int group_n) -> int[]",
      &expert_matmul_plan);
}

TORCH_LIBRARY_IMPL(flashswitch_C, CUDA, m) { m.impl("expert_matmul_fwd", &expert_matmul_fwd); }
