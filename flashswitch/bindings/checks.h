// Argument checks shared by the torch bindings of the ops. Every message starts with the op's name
// (`op`, e.g. "eva_attention_fwd") followed by ": " and names the offending argument.
#pragma once

#include <ATen/ATen.h>

#include "common.cuh"

namespace flashswitch::checks {

// FS_DTYPE_* code of a floating dtype the kernels take; -1 for any other dtype.
inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FS_DTYPE_F32;
    case at::kHalf: return FS_DTYPE_F16;
    case at::kBFloat16: return FS_DTYPE_BF16;
    default: return -1;
  }
}

// t is float16, bfloat16 or float32.
inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(dtype_code(t.scalar_type()) >= 0, op, ": ", name, " has dtype ", t.scalar_type(),
              "; expected float16, bfloat16 or float32");
}

// t is a CUDA tensor on the same device as ref.
inline void check_on(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), op, ": ", name, " is on ", t.device(), ", expected ",
              ref.device());
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " has shape ", t.sizes(), ", expected ", shape);
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", want);
}

// Unit stride along the last dim (any stride is fine when that dim has at most one element).
inline void check_last_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name, " must be contiguous in its last dim (stride ",
              t.stride(-1), ")");
}

}  // namespace flashswitch::checks
