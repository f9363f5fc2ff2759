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
from typing import Callable, Optional, Union

import torch

from flashswitch._common import DTYPES  # the tooling's dtype names
from flashswitch.backends import KERNELS


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
    - `bench_compare`: bench backends the result tables give speedups against (baselines in the same
      run); `bench_roof`: a bench backend whose throughput is the roof ("% of roof" column);
      `bench_plot`: {"kind": "throughput"} (throughput vs `bench_x`), {"kind": "speedup", "over": B}
      (speedup over backend B vs `bench_x`) or {"kind": "bars"} (throughput per shape).
    - `torch_reference`: a callable replacing `torch_<op>` where the plain reference does not fit
      large problems in memory (same keywords, same outputs).
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
    bench_compare: tuple = ("reference",)
    bench_roof: Optional[str] = None
    bench_plot: dict = field(default_factory=lambda: {"kind": "throughput"})
    # also time over rotating input sets and by CUDA-graph replay (bench/common.py): True, False, or a
    # predicate of the bench shape (memory-bound or host-bound cases)
    bench_rotate: Union[bool, Callable[[dict], bool]] = False
    torch_reference: Optional[Callable] = None
    # the kernel backends the tooling tunes, checks and benchmarks for this entry
    kernel_backends: tuple = KERNELS
    pass_: str = "fwd"

    @property
    def slug(self) -> str:
        """The entry's name in file names (`bench_<slug>.py`, `<slug>.json`)."""
        return self.name.replace(".", "_")

    # ------------------------------------------------------------ modules
    def ops(self):
        return importlib.import_module(self.ops_module)

    def reference(self):
        return importlib.import_module(self.reference_module)

    def torch_fn(self) -> Callable:
        if self.torch_reference is not None:
            return self.torch_reference
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

    def output_names(self, n: int, problem: Optional[dict] = None) -> list[str]:
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


# the headline shapes of each op, by name: the bench suite's tables, the regression gate and the issues
CHUNK_SUMMARIES_SHAPES = {
    "n32768": dict(B=1, H=16, N=32768, D=128, C=16),
    "b2_n8192": dict(B=2, H=16, N=8192, D=128, C=16),
}

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
    bench_shapes=tuple(CHUNK_SUMMARIES_SHAPES.values()),
    bench_x="N",
    bench_rotate=True,
)


# ---------------------------------------------------------------- op 2: eva_attention
def _eva_reach(p: dict) -> tuple[int, int, int]:
    """(Nq, exact keys read, summaries read) per (batch, kv head): the exact keys visible to some query,
    [start(first query), last query], and the summaries visible to the last query (start(t) never
    decreases with t)."""
    from flashswitch.reference.eva_attention import default_q_offset, start_position
    q, k, k_sum = p["q"], p["k"], p["k_sum"]
    Nq, Nk, Nc = q.shape[2], k.shape[2], k_sum.shape[2]
    if Nq == 0:
        return 0, 0, 0
    off = default_q_offset(Nq, Nk, p.get("q_offset"))
    kw = dict(chunk_size=p["chunk_size"], window_size=p["window_size"], window=p.get("window", "block"))
    first, last = start_position(off, **kw), start_position(off + Nq - 1, **kw)
    return Nq, max(0, min(Nk, off + Nq) - first), max(0, min(Nc, last // p["chunk_size"]))


def _eva_attention_cost(p: dict) -> dict:
    """flops: 4·D per visible (query, key or summary) pair (q·k and p·v), times B·H. bytes: q read, the
    exact keys and values visible to some query and the visible summaries read once (in decode just the
    exact buffer and the summaries, read in place), a tensor bias read, o and lse (fp32) written."""
    from flashswitch.reference.eva_attention import visible_pairs
    q, k, k_sum = p["q"], p["k"], p["k_sum"]
    B, H, Nq, D = q.shape
    Hkv = k.shape[1]
    pairs = visible_pairs(Nq, k.shape[2], k_sum.shape[2], chunk_size=p["chunk_size"],
                          window_size=p["window_size"], window=p.get("window", "block"), q_offset=p.get("q_offset"))
    _, n_exact, n_sum = _eva_reach(p)
    bias = p.get("summary_bias")
    read = (nbytes(q) + B * Hkv * (n_exact + n_sum) * D * 2 * k.element_size()
            + (B * Hkv * n_sum * bias.element_size() if isinstance(bias, torch.Tensor) else 0))
    written = B * H * Nq * D * q.element_size() + B * H * Nq * 4
    return {"flops": 4 * D * pairs * B * H, "bytes": read + written}


EVA_REFERENCE_BLOCK = 1 << 27  # logits per call of the dense reference: bigger problems go in query blocks


def eva_reference_blocked(q, k, v, k_sum, v_sum, *, chunk_size, window_size, window="block", scale=None,
                          summary_bias=None, q_offset=None, return_lse=False):
    """`torch_eva_attention` over blocks of queries, so that long sequences fit in memory: the dense
    [rows, Nk + Nc] logits of one call stay under EVA_REFERENCE_BLOCK elements. A block of queries
    ending at position e reads the keys [0, e] only (the later ones are invisible to it). Same
    keywords and outputs as `torch_eva_attention`."""
    from flashswitch.reference.eva_attention import default_q_offset, torch_eva_attention
    B, H, Nq, D = q.shape
    Nk, Nc = k.shape[2], k_sum.shape[2]
    off = default_q_offset(Nq, Nk, q_offset)
    kw = dict(chunk_size=chunk_size, window_size=window_size, window=window, summary_bias=summary_bias,
              scale=(D ** -0.5 if D > 0 else 1.0) if scale is None else scale, return_lse=True)
    rows = max(1, EVA_REFERENCE_BLOCK // max(1, B * H * (Nk + Nc)))
    if Nq <= rows:
        o, lse = torch_eva_attention(q, k, v, k_sum, v_sum, q_offset=off, **kw)
    else:
        outs = []
        for i in range(0, Nq, rows):
            n = min(rows, Nq - i)
            end = min(Nk, off + i + n)
            outs.append(torch_eva_attention(q[:, :, i:i + n], k[:, :, :end], v[:, :, :end], k_sum, v_sum,
                                            q_offset=off + i, **kw))
        o, lse = torch.cat([a for a, _ in outs], 2), torch.cat([b for _, b in outs], 2)
    return (o, lse) if return_lse else o


EVA_ATTENTION_SHAPES = {
    "block_d128": dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=16, W=2048, window="block"),
    "block_d64_b2": dict(B=2, H=16, Hkv=16, Nk=16384, D=64, C=16, W=2048, window="block"),
    "sliding_w256": dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=32, W=256, window="sliding"),
    # one query at position 32767 (q_offset defaults to Nk - Nq)
    "decode": dict(B=32, H=16, Hkv=16, Nq=1, Nk=32768, D=128, C=32, W=256, window="block"),
}

EVA_ATTENTION = OpSpec(
    name="eva_attention",
    ops_module="flashswitch.ops.eva_attention",
    reference_module="flashswitch.reference.eva_attention",
    cost=_eva_attention_cost,
    unit="TFLOP/s",
    outputs=("o", "lse"),
    reference_kwargs={"return_lse": True},
    torch_reference=eva_reference_blocked,
    check_cases=(
        dict(B=1, H=2, Hkv=1, Nk=40, D=16, C=4, W=8),
        dict(B=1, H=2, Hkv=2, Nk=37, D=24, C=2, W=8, window="sliding", summary_bias="log_count"),
        dict(B=1, H=4, Hkv=2, Nq=5, Nk=29, D=16, C=4, W=12, window="sliding", layout="strided"),
        dict(B=2, H=4, Hkv=2, Nq=1, Nk=50, D=16, C=4, W=8, summary_bias="tensor"),
        dict(B=1, H=2, Hkv=2, Nk=0, D=16, C=4, W=8),
    ),
    demo_case=dict(B=1, H=4, Hkv=2, Nk=128, D=32, C=8, W=32),
    bench_shapes=tuple(EVA_ATTENTION_SHAPES.values()),
    bench_x="Nk",
    bench_compare=("flex", "sdpa_causal"),
    bench_plot={"kind": "speedup", "over": "sdpa_causal"},
    # decode is memory-bound and shorter than the host's work per call: time the kernel apart
    bench_rotate=lambda shape: shape.get("Nq", shape.get("Nk", 0)) <= 16,
)


# ---------------------------------------------------------------- op 3: expert_matmul
def _expert_matmul_cost(p: dict) -> dict:
    """flops: 2·d_in·d_out per routed (token, slot) pair, P = T·S pairs. bytes: x read once, the
    weights read once, y written once."""
    x, w, idx = p["x"], p["weight"], p["expert_idx"]
    T, S = idx.shape
    _, d_in, d_out = w.shape
    G_out = S if p.get("out_groups") is None else int(p["out_groups"])
    return {"flops": 2 * T * S * d_in * d_out,
            "bytes": nbytes(x) + nbytes(w) + T * G_out * d_out * x.element_size()}


def _expert_matmul_reference_args(p: dict) -> dict:
    """The references take the routing decision itself (no `num_experts`, no `deterministic`)."""
    return {k: v for k, v in p.items() if k not in ("num_experts", "deterministic")}


EXPERT_MATMUL_SHAPES = {  # the papers' 262M models at T = 16384 tokens
    "switchhead262m_v": dict(T=16384, S=8, E=16, d_in=1024, d_out=112, G_out=4, gated=True),
    "switchhead262m_o": dict(T=16384, S=8, E=16, d_in=112, d_out=1024, G_in=4, G_out=1, gated=True),
    "sigma_moe_up": dict(T=16384, S=8, E=512, d_in=1024, d_out=128, G_out=8, gated=False),
    "sigma_moe_down": dict(T=16384, S=8, E=512, d_in=128, d_out=1024, G_in=8, G_out=1, gated=True),
}

EXPERT_MATMUL = OpSpec(
    name="expert_matmul",
    ops_module="flashswitch.ops.expert_matmul",
    reference_module="flashswitch.reference.expert_matmul",
    cost=_expert_matmul_cost,
    unit="TFLOP/s",
    outputs=("y",),
    reference_args=_expert_matmul_reference_args,
    check_cases=(
        dict(T=20, S=4, E=6, d_in=24, d_out=16, G_out=2),
        dict(T=13, S=6, E=10, d_in=20, d_out=12, G_in=2, G_out=1),
        dict(T=9, S=2, E=3, d_in=16, d_out=8, gated=False, routing="duplicates"),
        dict(T=11, S=3, E=5, d_in=8, d_out=20, G_in=3, routing="sparse"),
        dict(T=7, S=4, E=4, d_in=16, d_out=16, G_out=1, routing="one_hot"),
        dict(T=0, S=2, E=3, d_in=8, d_out=8),
    ),
    demo_case=dict(T=64, S=4, E=8, d_in=64, d_out=32, G_out=2),
    bench_shapes=tuple(EXPERT_MATMUL_SHAPES.values()),
    bench_x="T",
    bench_compare=("grouped_mm_pipeline",),
    bench_roof="dense_equal_macs",
    bench_plot={"kind": "bars"},
    bench_rotate=True,  # per-call host work (routing launches) is large next to the GEMM: time it apart
)

# ---------------------------------------------------------------- switchhead_output (SwitchHead's fused O)
def _switchhead_output_cost(p: dict) -> dict:
    """flops: 2·D·d per routed (token, slot) pair, op 3's count for the same projection (the kernels do
    E / k times as many as one dense GEMM). bytes: a, ids, gates and weight read once, y written once."""
    a, ids, w = p["a"], p["ids"], p["weight"]
    T, S = ids.shape
    D, d = w.shape[1], w.shape[2]
    return {"flops": 2 * T * S * D * d,
            "bytes": nbytes(a) + nbytes(ids) + nbytes(p["gates"]) + nbytes(w) + T * d * a.element_size()}


SWITCHHEAD_OUTPUT_SHAPES = {  # the papers' output projections at T = 16384 tokens
    "switchhead262m": dict(T=16384, H=4, E=4, k=2, D=112, d=1024),
    "switchhead47m": dict(T=16384, H=2, E=5, k=3, D=76, d=412),
}

SWITCHHEAD_OUTPUT = OpSpec(
    name="switchhead_output",
    ops_module="flashswitch.ops.switchhead_output",
    reference_module="flashswitch.reference.switchhead_output",
    cost=_switchhead_output_cost,
    unit="TFLOP/s",
    outputs=("y",),
    check_cases=(
        dict(T=37, H=3, E=5, k=2, D=12, d=20),
        dict(T=70, H=1, E=2, k=1, D=12, d=24),
        dict(T=9, H=2, E=4, k=2, D=16, d=16),
        dict(T=0, H=2, E=3, k=2, D=8, d=8),
    ),
    demo_case=dict(T=64, H=2, E=4, k=2, D=32, d=48),
    bench_shapes=tuple(SWITCHHEAD_OUTPUT_SHAPES.values()),
    bench_x="T",
    bench_compare=("reference",),
    bench_plot={"kind": "bars"},
    kernel_backends=("triton",),
)

OPS: dict[str, OpSpec] = {spec.name: spec for spec in (CHUNK_SUMMARIES, EVA_ATTENTION, EXPERT_MATMUL,
                                                       SWITCHHEAD_OUTPUT)}


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


# ---------------------------------------------------------------- backward passes
@dataclass(frozen=True)
class BackwardSpec(OpSpec):
    """The backward pass of an op as the tooling sees it: entry `<op>.bwd`, the op's second table in the
    tuned-config store and its own spaces in autotune/space.py.

    A problem is the forward's plus `grad_outputs`: seeded random cotangents of the forward's outputs
    (`cotangents(problem)` gives their shapes and dtypes; the lse cotangent only when the shape asks
    for `dlse=True`). Outputs are the gradients of the op's differentiable inputs (`GRAD_INPUTS` of
    the op module) that the problem holds as tensors. A timed call runs forward + backward, what a
    training step pays. References differentiate the PyTorch reference with autograd: in the
    problem's precision (`torch_outputs`) and on fp64 copies (`oracle_outputs`, `accurate_outputs`).
    """
    forward: str = ""
    cotangents: Optional[Callable[[dict], list]] = None  # [(shape, dtype) per forward output]
    grad_reference: Optional[Callable] = None  # (fwd spec, problem, names) -> grads, for large problems

    def fwd(self) -> OpSpec:
        return OPS[self.forward]

    def random_problem(self, *, dtype="fp32", device="cpu", seed=0, **shape) -> dict:
        want_dlse = bool(shape.pop("dlse", False))
        problem = self.fwd().random_problem(dtype=dtype, device=device, seed=seed, **shape)
        g = torch.Generator(device=device).manual_seed(seed + 7919)
        grads = []
        for i, (shp, dt) in enumerate(self.cotangents(problem)):
            is_lse = i == len(self.fwd().outputs) - 1 and self.fwd().outputs[-1] == "lse"
            if is_lse and not want_dlse:
                grads.append(None)
                continue
            grads.append(torch.randn(shp, generator=g, device=device, dtype=torch.float32).to(dt))
        problem["grad_outputs"] = tuple(grads)
        return problem

    @staticmethod
    def forward_problem(problem: dict) -> dict:
        return {k: v for k, v in problem.items() if k != "grad_outputs"}

    def grad_names(self, problem: dict) -> list[str]:
        return [n for n in self.ops().GRAD_INPUTS if isinstance(problem.get(n), torch.Tensor)]

    def output_names(self, n: int, problem: Optional[dict] = None) -> list[str]:
        names = [f"d{x}" for x in (self.grad_names(problem) if problem is not None else self.ops().GRAD_INPUTS)]
        return names[:n] + [f"out{i}" for i in range(len(names), n)]

    def _present(self, grads, problem: dict) -> tuple:
        by_name = dict(zip(self.ops().GRAD_INPUTS, grads))
        return tuple(by_name[n] for n in self.grad_names(problem))

    # ------------------------------------------------------------ kernels: forward + backward
    def kernel_outputs(self, backend: str, config: Optional[dict], problem: dict) -> tuple:
        grads = self.ops().run_backward(backend, config, problem["grad_outputs"], **self.forward_problem(problem))
        return self._present(grads, problem)

    def kernel_callable(self, backend: str, config: Optional[dict], problem: dict) -> Callable[[], object]:
        run, grad_outputs, fwd_problem = self.ops().run_backward, problem["grad_outputs"], self.forward_problem(problem)
        present = self._present(self.ops().GRAD_INPUTS, problem)  # names of the gradients the problem has
        keep = [i for i, n in enumerate(self.ops().GRAD_INPUTS) if n in present]

        def step():  # one forward + backward
            grads = run(backend, config, grad_outputs, **fwd_problem)
            return tuple(grads[i] for i in keep)
        return step

    def features(self, problem: dict) -> dict:
        return self.ops().problem_features_bwd(**self.forward_problem(problem))

    # ------------------------------------------------------------ references: autograd of torch_<op>
    def reference_grads(self, problem: dict) -> tuple:
        """Gradients of the PyTorch reference in the problem's own dtypes."""
        names = self.grad_names(problem)
        if self.grad_reference is not None:
            return tuple(self.grad_reference(self.fwd(), problem, names))
        return tuple(autograd_grads(self.fwd(), problem, names))

    def torch_outputs(self, problem: dict) -> tuple:
        return self.reference_grads(problem)

    def torch_callable(self, problem: dict) -> Callable[[], object]:
        return lambda: self.reference_grads(problem)

    def oracle_outputs(self, problem: dict) -> tuple:
        """fp64 autograd of the PyTorch reference on the CPU (the NumPy oracle has no gradients)."""
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in problem.items() if k != "grad_outputs"}
        cpu["grad_outputs"] = tuple(None if g is None else g.cpu().to(torch.float64) for g in problem["grad_outputs"])
        return self.reference_grads(upcast(cpu, torch.float64))

    def accurate_outputs(self, problem: dict) -> tuple:
        prob = upcast(self.forward_problem(problem), torch.float64)
        prob["grad_outputs"] = tuple(None if g is None else g.to(torch.float64) for g in problem["grad_outputs"])
        return self.reference_grads(prob)

    def throughput(self, problem: dict, ms: float) -> dict:
        return OpSpec.throughput(self, problem, ms)


def autograd_grads(fwd: OpSpec, problem: dict, names: list[str], outputs_of=None) -> list:
    """d(sum_i <out_i, grad_outputs_i>) / d(problem[n]) for n in `names` by autograd of the forward's
    PyTorch reference (zeros where an input does not reach the outputs). `outputs_of(args)` replaces
    the reference call (e.g. one query block of it)."""
    prob = {k: v for k, v in problem.items() if k != "grad_outputs"}
    leaves = {n: prob[n].detach().requires_grad_(True) for n in names}
    prob.update(leaves)
    args = fwd._ref_args(prob)
    with torch.enable_grad():
        outs = as_tuple(outputs_of(args) if outputs_of else fwd.torch_fn()(**args))
        pairs = [(o, g) for o, g in zip(outs, problem["grad_outputs"]) if g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], [leaves[n] for n in names],
                                    [g.to(o.dtype) for o, g in pairs], allow_unused=True)
    return [torch.zeros_like(leaves[n]) if d is None else d for n, d in zip(names, grads)]


def _eva_grads_blocked(fwd: OpSpec, problem: dict, names: list[str]) -> list:
    """autograd_grads of op 2 one query block at a time (the loss is a sum over query rows, so the
    gradients of k, v, k_sum, v_sum and the bias add up over blocks and dq is blockwise): the dense
    reference's [rows, Nk + Nc] logits of one block at a time fit in memory at N = 32768."""
    from flashswitch.reference.eva_attention import default_q_offset, torch_eva_attention
    q, k, k_sum = problem["q"], problem["k"], problem["k_sum"]
    B, H, Nq, D = q.shape
    Nk, Nc = k.shape[2], k_sum.shape[2]
    rows = max(1, EVA_REFERENCE_BLOCK // max(1, B * H * (Nk + Nc)))
    if Nq <= rows:
        return autograd_grads(fwd, problem, names)
    off = default_q_offset(Nq, Nk, problem.get("q_offset"))
    total = {n: torch.zeros_like(problem[n]) for n in names}
    for i in range(0, Nq, rows):
        n = min(rows, Nq - i)
        end = min(Nk, off + i + n)
        part = dict(problem)
        part["q"] = q[:, :, i:i + n]
        part["grad_outputs"] = tuple(None if g is None else g[:, :, i:i + n] for g in problem["grad_outputs"])
        grads = autograd_grads(fwd, part, names, outputs_of=lambda a, i=i, end=end: torch_eva_attention(
            **{**a, "k": a["k"][:, :, :end], "v": a["v"][:, :, :end], "q_offset": off + i, "return_lse": True}))
        for name, d in zip(names, grads):
            if name == "q":
                total["q"][:, :, i:i + n] = d
            else:
                total[name] += d
    return [total[n] for n in names]


def _with_bwd_flops(cost: Callable[[dict], dict], factor: float, bwd_bytes: Callable[[dict], int]):
    """A forward cost scaled to forward + backward: flops x `factor`, bytes plus the backward's."""
    def fwd_bwd(p: dict) -> dict:
        c = cost(p)
        out = {}
        if c.get("flops"):
            out["flops"] = c["flops"] * factor
        if c.get("bytes"):
            out["bytes"] = c["bytes"] + bwd_bytes(p)
        return out
    return fwd_bwd


def _chunk_summaries_bwd_bytes(p: dict) -> int:
    """The backward's essential traffic: k, v, dk_sum, dv_sum (and a per-chunk omega) read, dk, dv (and
    d omega per chunk) written."""
    k = p["k"]
    B, H, N, D = k.shape
    Nc = -(-N // p["chunk_size"])
    per_chunk = nbytes(p["omega"]) if p.get("omega") is not None and p["omega"].dim() == 4 else 0
    return 2 * nbytes(k) + 2 * nbytes(p["v"]) + 2 * B * H * Nc * D * k.element_size() + 2 * per_chunk


def _chunk_summaries_cotangents(p: dict) -> list:
    """(shape, dtype) of k_sum, v_sum and lse."""
    B, H, N, D = p["k"].shape
    Nc = -(-N // p["chunk_size"])
    return [((B, H, Nc, D), p["k"].dtype), ((B, H, Nc, D), p["v"].dtype), ((B, H, Nc), torch.float32)]


def _eva_bwd_bytes(p: dict) -> int:
    return 2 * _eva_attention_cost(p)["bytes"]


def _expert_matmul_bwd_bytes(p: dict) -> int:
    return 2 * _expert_matmul_cost(p)["bytes"]


CHUNK_SUMMARIES_BWD = BackwardSpec(
    name="chunk_summaries.bwd", pass_="bwd", forward="chunk_summaries",
    ops_module="flashswitch.ops.chunk_summaries", reference_module="flashswitch.reference.chunk_summaries",
    cost=_with_bwd_flops(_chunk_summaries_cost, 3.0, _chunk_summaries_bwd_bytes), unit="GB/s",
    cotangents=lambda p: _chunk_summaries_cotangents(p),
    reference_kwargs={"return_lse": True},
    check_cases=(
        dict(B=2, H=3, N=50, D=32, C=8),
        dict(B=1, H=2, N=37, D=76, C=16, omega="head", valid=True, dlse=True),
        dict(B=2, H=2, N=64, D=64, C=16, omega="chunk", key_weight=True, layout="strided"),
        dict(B=1, H=2, N=21, D=16, C=1, omega="head", key_weight=True),
    ),
    demo_case=dict(B=1, H=2, N=64, D=16, C=8, omega="head"),
    bench_shapes=(dict(B=1, H=16, N=32768, D=128, C=16), dict(B=2, H=16, N=8192, D=128, C=16)),
    bench_x="N", bench_compare=("reference",), bench_rotate=True, kernel_backends=("triton",),
)

EVA_ATTENTION_BWD = BackwardSpec(
    name="eva_attention.bwd", pass_="bwd", forward="eva_attention",
    ops_module="flashswitch.ops.eva_attention", reference_module="flashswitch.reference.eva_attention",
    cost=_with_bwd_flops(_eva_attention_cost, 3.5, _eva_bwd_bytes), unit="TFLOP/s",
    cotangents=lambda p: [(p["q"].shape, p["q"].dtype), (p["q"].shape[:3], torch.float32)],
    reference_kwargs={"return_lse": True}, torch_reference=eva_reference_blocked,
    grad_reference=_eva_grads_blocked,
    check_cases=(
        dict(B=1, H=2, Hkv=1, Nk=40, D=16, C=4, W=8),
        dict(B=1, H=2, Hkv=2, Nk=37, D=24, C=2, W=8, window="sliding", summary_bias="log_count", dlse=True),
        dict(B=1, H=4, Hkv=2, Nq=5, Nk=29, D=16, C=4, W=12, window="sliding", layout="strided"),
        dict(B=2, H=4, Hkv=2, Nq=1, Nk=50, D=16, C=4, W=8, summary_bias="tensor"),
    ),
    demo_case=dict(B=1, H=2, Hkv=1, Nk=48, D=16, C=4, W=16),
    bench_shapes=EVA_ATTENTION.bench_shapes[:3],
    bench_x="Nk", bench_compare=("flex", "sdpa_causal"), bench_plot={"kind": "speedup", "over": "flex"},
    kernel_backends=("triton",),
)

EXPERT_MATMUL_BWD = BackwardSpec(
    name="expert_matmul.bwd", pass_="bwd", forward="expert_matmul",
    ops_module="flashswitch.ops.expert_matmul", reference_module="flashswitch.reference.expert_matmul",
    cost=_with_bwd_flops(_expert_matmul_cost, 3.0, _expert_matmul_bwd_bytes), unit="TFLOP/s",
    cotangents=lambda p: [((p["expert_idx"].shape[0],
                            p["expert_idx"].shape[1] if p.get("out_groups") is None else int(p["out_groups"]),
                            p["weight"].shape[2]), p["x"].dtype)],
    reference_args=_expert_matmul_reference_args,
    check_cases=EXPERT_MATMUL.check_cases[:4],
    demo_case=dict(T=32, S=4, E=4, d_in=16, d_out=16, G_out=2),
    bench_shapes=EXPERT_MATMUL.bench_shapes + (
        dict(T=16384, S=6, E=10, d_in=412, d_out=76, G_out=2, gated=True),
        dict(T=16384, S=6, E=10, d_in=76, d_out=412, G_in=2, G_out=1, gated=True)),
    bench_x="T", bench_compare=("grouped_mm_pipeline",), bench_roof="dense_equal_macs",
    bench_plot={"kind": "bars"}, bench_rotate=True, kernel_backends=("triton",),
)

SWITCHHEAD_OUTPUT_BWD = BackwardSpec(
    name="switchhead_output.bwd", pass_="bwd", forward="switchhead_output",
    ops_module="flashswitch.ops.switchhead_output", reference_module="flashswitch.reference.switchhead_output",
    cost=_with_bwd_flops(_switchhead_output_cost, 3.0, lambda p: 2 * _switchhead_output_cost(p)["bytes"]),
    unit="TFLOP/s",
    cotangents=lambda p: [((p["a"].shape[0], p["weight"].shape[2]), p["a"].dtype)],
    check_cases=SWITCHHEAD_OUTPUT.check_cases[:3],
    demo_case=dict(T=32, H=2, E=4, k=2, D=16, d=16),
    bench_shapes=SWITCHHEAD_OUTPUT.bench_shapes,
    bench_x="T", bench_compare=("reference",), bench_plot={"kind": "bars"}, kernel_backends=("triton",),
)

OPS.update({spec.name: spec for spec in (CHUNK_SUMMARIES_BWD, EVA_ATTENTION_BWD, EXPERT_MATMUL_BWD,
                                         SWITCHHEAD_OUTPUT_BWD)})
