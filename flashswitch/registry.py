"""The ops known to the tooling (tuner, `flashswitch check | demo | bench`), one entry each.

Adding an op to the tooling means adding one `OpSpec` to `OPS`; nothing else in the tuner, the CLI
or the benchmarks names an op. An entry points at the op module (`flashswitch/ops/<op>.py`: `OP`,
`problem_features(**problem)`, `run_kernel(backend, config, **problem)`) and the reference module
(`flashswitch/reference/<op>.py`: `random_problem(**shape, dtype=, device=, seed=)`, `torch_<op>`,
`numpy_<op>`), and says how to count the bytes / flops of a problem for throughput columns.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def as_tuple(out) -> tuple:
    """Outputs of a kernel / reference as a tuple of tensors or arrays."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def nbytes(t) -> int:
    """Bytes of a tensor's elements (0 for None); a broadcast view counts its storage once."""
    if t is None:
        return 0
    if any(s == 0 for s in t.stride()) and t.numel():
        return t.untyped_storage().nbytes()
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class OpSpec:
    """One op as the tooling sees it.

    - `cost(problem) -> {"bytes": ..., "flops": ...}` (either or both) for a problem dict from
      `random_problem`; `unit` is the throughput column shown first ("GB/s" or "TFLOP/s").
    - `reference_kwargs`: extra keywords for `torch_<op>` / `numpy_<op>` so they return the same
      tuple as `run_kernel` (e.g. `return_lse=True`); `reference_args(problem)` may rewrite the
      problem for the references when the public signature differs from theirs.
    - `outputs`: names of the outputs of `run_kernel`, in order, for messages.
    - `check_cases`: small `random_problem` keyword sets for `flashswitch check` (CPU-interpreter
      friendly); `demo_case`: one small problem for `flashswitch demo`.
    - `bench_shapes`: shapes of the quick timing table; `bench_x`: the shape key on the x axis of
      the throughput plot.
    """
    name: str
    ops_module: str
    reference_module: str
    cost: Callable[[dict], dict]
    unit: str = "GB/s"
    outputs: tuple = ()
    reference_kwargs: dict = field(default_factory=dict)
    reference_args: Optional[Callable[[dict], dict]] = None
    check_cases: tuple = ()
    demo_case: dict = field(default_factory=dict)
    bench_shapes: tuple = ()
    bench_x: str = "N"

    # ------------------------------------------------------------ modules
    def ops(self):
        return importlib.import_module(self.ops_module)

    def reference(self):
        return importlib.import_module(self.reference_module)

    def torch_fn(self) -> Callable:
        return getattr(self.reference(), f"torch_{self.name}")

    def numpy_fn(self) -> Callable:
        return getattr(self.reference(), f"numpy_{self.name}")

    # ------------------------------------------------------------ problems and outputs
    def random_problem(self, *, dtype="fp32", device="cpu", seed=0, **shape) -> dict:
        dtype = DTYPES.get(dtype, dtype)
        return self.reference().random_problem(**shape, dtype=dtype, device=device, seed=seed)

    def _ref_args(self, problem: dict) -> dict:
        args = self.reference_args(problem) if self.reference_args else dict(problem)
        args.update(self.reference_kwargs)
        return args

    def torch_outputs(self, problem: dict) -> tuple:
        """The PyTorch reference in the problem's own precision."""
        return as_tuple(self.torch_fn()(**self._ref_args(problem)))

    def torch_callable(self, problem: dict) -> Callable[[], object]:
        fn, args = self.torch_fn(), self._ref_args(problem)
        return lambda: fn(**args)

    def oracle_outputs(self, problem: dict) -> tuple:
        """The fp64 NumPy oracle (plain loops: small problems only)."""
        return as_tuple(self.numpy_fn()(**self._ref_args(problem)))

    def accurate_outputs(self, problem: dict) -> tuple:
        """A high-precision reference for large problems: the PyTorch reference on fp64 copies of
        the floating inputs (fp32 where the reference does not take fp64), on the problem's device."""
        for dtype in (torch.float64, torch.float32):
            try:
                return as_tuple(self.torch_fn()(**self._ref_args(upcast(problem, dtype))))
            except (RuntimeError, TypeError, NotImplementedError):
                if dtype == torch.float32:
                    raise
        raise AssertionError("unreachable")

    def kernel_outputs(self, backend: str, config: Optional[dict], problem: dict) -> tuple:
        """One kernel call; `config=None` uses the tuned / default config of this device."""
        return as_tuple(self.ops().run_kernel(backend, config, **problem))

    def kernel_callable(self, backend: str, config: Optional[dict], problem: dict) -> Callable[[], object]:
        run = self.ops().run_kernel
        return lambda: run(backend, config, **problem)

    def features(self, problem: dict) -> dict:
        return self.ops().problem_features(**problem)

    def output_names(self, n: int) -> list[str]:
        names = list(self.outputs)
        return names[:n] + [f"out{i}" for i in range(len(names), n)]

    def throughput(self, problem: dict, ms: float) -> dict:
        """{"GB/s": ..., "TFLOP/s": ...} (whichever the cost counts) of one call taking `ms`."""
        out = {}
        if not ms or ms <= 0:
            return out
        c = self.cost(problem)
        if c.get("bytes"):
            out["GB/s"] = c["bytes"] / (ms * 1e-3) / 1e9
        if c.get("flops"):
            out["TFLOP/s"] = c["flops"] / (ms * 1e-3) / 1e12
        return out


def upcast(problem: dict, dtype: torch.dtype) -> dict:
    """The problem with every floating-point tensor converted to `dtype` (views become contiguous)."""
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in problem.items()}


def describe(case: dict) -> str:
    """`B=2 H=3 N=50 omega=head` for a shape / options dict (False / None / defaults left out)."""
    parts = []
    for k, v in case.items():
        if v is None or v is False or v == "none" or v == "contiguous":
            continue
        parts.append(k if v is True else f"{k}={v}")
    return " ".join(parts)


# ---------------------------------------------------------------- op 1: chunk_summaries
def _chunk_summaries_cost(p: dict) -> dict:
    """k and v read once (+ omega / key_weight / valid), k_sum and v_sum written once, lse (fp32) written once."""
    k, v = p["k"], p["v"]
    B, H, N, D = k.shape
    Nc = -(-N // p["chunk_size"])
    read = nbytes(k) + nbytes(v) + nbytes(p.get("omega")) + nbytes(p.get("key_weight")) + nbytes(p.get("valid"))
    written = B * H * Nc * D * (k.element_size() + v.element_size()) + B * H * Nc * 4
    return {"bytes": read + written}


CHUNK_SUMMARIES = OpSpec(
    name="chunk_summaries",
    ops_module="flashswitch.ops.chunk_summaries",
    reference_module="flashswitch.reference.chunk_summaries",
    cost=_chunk_summaries_cost,
    unit="GB/s",
    outputs=("k_sum", "v_sum", "lse"),
    reference_kwargs={"return_lse": True},
    check_cases=(
        dict(B=2, H=3, N=50, D=32, C=8),
        dict(B=1, H=2, N=37, D=76, C=16, omega="head", valid=True),
        dict(B=2, H=2, N=64, D=64, C=16, omega="chunk", key_weight=True, layout="strided"),
        dict(B=1, H=2, N=21, D=16, C=1, omega="head"),
        dict(B=1, H=1, N=0, D=16, C=4),
    ),
    demo_case=dict(B=1, H=4, N=256, D=64, C=16, omega="head"),
    bench_shapes=(
        dict(B=1, H=16, N=32768, D=128, C=16),
        dict(B=2, H=16, N=8192, D=128, C=16),
    ),
    bench_x="N",
)

# Ops 2 (eva_attention) and 3 (expert_matmul) are added here as entries of the same kind.
OPS: dict[str, OpSpec] = {spec.name: spec for spec in (CHUNK_SUMMARIES,)}


def get(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OPS)}") from None


def select(names=None) -> list[OpSpec]:
    """The entries named (all when `names` is None or empty), in registry order."""
    if not names:
        return list(OPS.values())
    return [get(n) for n in names]
