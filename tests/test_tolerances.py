"""The accuracy checks themselves, by mutation: each op's and layer's check helper (the function its tests
call) must reject an output off by a relative DELTA of its dtype, one output at a time, and must accept
what the kernel returns. The wrong output is the fp64 oracle's scaled by 1 + DELTA, in the output's dtype;
the other outputs are the oracle's, rounded to their dtypes. Accepted: the kernel's outputs where it runs
in that dtype here (fp32 and fp16; bf16 on the GPU) and the torch reference in that dtype (bf16 on the
CPU: the oracle path). Small problems: the whole file takes seconds on the CPU."""
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

import test_chunk_summaries_backward as CSB
import test_chunk_summaries_kernels as CSK
import test_eva_attention_backward as EAB
import test_eva_attention_kernels as EAK
import test_expert_matmul_backward as EMB
import test_expert_matmul_kernels as EMK
import test_switchhead as SH
import test_switchhead_output as SHO
from conftest import DEVICE, kernel_backends
from flashswitch.nn import SigmaMoE, SwitchHeadAttention
from flashswitch.reference import chunk_summaries as ref_cs
from flashswitch.reference import eva_attention as ref_ea
from flashswitch.reference import expert_matmul as ref_em

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
# errors a check must reject: a few roundings of the dtype (bf16 2.6 u, fp16 4 u); fp32: its old bound
DELTA = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}
KERNEL = "triton" if "triton" in kernel_backends() else None


@dataclass
class Subject:
    """A check helper on one problem. `check(outputs)` calls it on a dict of outputs; `oracle`: the fp64
    oracle's outputs (dtype: the output's, in `dtypes`); `kernel()` / `reference()`: the kernel's outputs
    and the torch reference's in the problem's dtype; `label(name)`: the name the check reports."""
    check: Callable[[dict], None]
    oracle: dict
    dtypes: dict
    kernel: Callable[[], dict]
    reference: Callable[[], dict]
    label: Callable[[str], str] = lambda name: name


def as_dict(names, values) -> dict:
    """name -> tensor for the values that are there (None and missing ones dropped)."""
    return {n: v for n, v in zip(names, values) if v is not None}


def tensors(values, like: dict) -> dict:
    """Arrays or tensors as fp64 tensors on the device, by the names of `like`."""
    return {n: torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v).to(DEVICE, F64)
            for n, v in zip(like, values)}


def in_dtypes(outputs: dict, dtypes: dict, scale: float = 1.0) -> dict:
    """Each output x scale, rounded to its dtype."""
    return {n: (t.to(F64) * scale).to(dtypes[n]) for n, t in outputs.items()}


# ---------------------------------------------------------------- op 1
def chunk_forward(dtype) -> Subject:
    p = ref_cs.random_problem(1, 2, 40, 16, 8, dtype=dtype, device=DEVICE, omega="head", key_weight=True,
                              valid=True, seed=1)
    names = CSK.NAMES
    dtypes = {"k_sum": dtype, "v_sum": dtype, "lse": F32}
    oracle = tensors(ref_cs.numpy_chunk_summaries(**p, return_lse=True), dtypes)
    return Subject(check=lambda out: CSK._check(tuple(out[n] for n in names), p), oracle=oracle, dtypes=dtypes,
                   kernel=lambda: as_dict(names, CSK._run(KERNEL, p)),
                   reference=lambda: as_dict(names, ref_cs.torch_chunk_summaries(**p, return_lse=True)))


def chunk_backward(dtype) -> Subject:
    p = ref_cs.random_problem(1, 2, 40, 16, 8, dtype=dtype, device=DEVICE, omega="chunk", key_weight=True,
                              seed=2)
    g = CSB._grad_outputs(p, seed=3)
    oracle = CSB._ref_grads(p, g)
    return Subject(check=lambda out: CSB._check(out, p, g), oracle=oracle,
                   dtypes={n: p[n].dtype for n in oracle}, kernel=lambda: CSB._grads(KERNEL, p, g),
                   reference=lambda: CSB._ref_grads(p, g, dtype=None), label=lambda n: f"d{n}")


# ---------------------------------------------------------------- op 2
def eva_problem(dtype, seed):
    return ref_ea.random_problem(1, 2, 1, 24, 40, 16, 4, 8, window="sliding", summary_bias="tensor", dtype=dtype,
                                 device=DEVICE, seed=seed)


def eva_forward(dtype) -> Subject:
    p = eva_problem(dtype, 4)
    dtypes = {"o": dtype, "lse": F32}
    oracle = tensors(ref_ea.numpy_eva_attention(**p, return_lse=True), dtypes)
    return Subject(check=lambda out: EAK._check((out["o"], out["lse"]), p), oracle=oracle, dtypes=dtypes,
                   kernel=lambda: as_dict(dtypes, EAK._run(KERNEL, p)),
                   reference=lambda: as_dict(dtypes, ref_ea.torch_eva_attention(**p, return_lse=True)))


def eva_backward(dtype) -> Subject:
    p = eva_problem(dtype, 5)
    do, dlse = EAB._upstream(p, 6)
    names = EAB.op.GRAD_INPUTS
    oracle = as_dict(names, EAB._grads(EAB.torch_eva_attention, p, do, dlse, None, F64))
    dtypes = {n: (p["summary_bias"] if n == "summary_bias" else p[n]).dtype for n in oracle}
    return Subject(check=lambda out: EAB._check(tuple(out.get(n) for n in names), p, do, dlse), oracle=oracle,
                   dtypes=dtypes, kernel=lambda: as_dict(names, EAB._grads(EAB._kernel(KERNEL), p, do, dlse)),
                   reference=lambda: as_dict(names, EAB._grads(EAB.torch_eva_attention, p, do, dlse)),
                   label=lambda n: f"d{n}")


# ---------------------------------------------------------------- op 3
def matmul_problem(dtype, seed):
    return ref_em.random_problem(24, 2, 3, 16, 24, G_out=1, dtype=dtype, device=DEVICE, seed=seed)


def matmul_forward(dtype) -> Subject:
    p = matmul_problem(dtype, 7)
    args = dict(gates=p["gates"], out_groups=p["out_groups"])
    oracle = tensors([ref_em.numpy_expert_matmul(p["x"], p["expert_idx"], p["weight"], **args)], ["y"])
    return Subject(check=lambda out: EMK._check(out["y"], p), oracle=oracle, dtypes={"y": dtype},
                   kernel=lambda: {"y": EMK._call(KERNEL, p)},
                   reference=lambda: {"y": ref_em.torch_expert_matmul(p["x"], p["expert_idx"], p["weight"], **args)})


def matmul_backward(dtype) -> Subject:
    p = matmul_problem(dtype, 8)
    dy = EMB._dy(p)
    names = EMB.op.GRAD_INPUTS
    oracle = as_dict(names, EMB._reference_grads(p, dy))
    return Subject(check=lambda out: EMB._check(tuple(out.get(n) for n in names), p, dy), oracle=oracle,
                   dtypes={n: p[n].dtype for n in oracle}, kernel=lambda: as_dict(names, EMB._grads(KERNEL, p, dy)),
                   reference=lambda: as_dict(names, EMB._reference_grads(p, dy, dtype=dtype)),
                   label=lambda n: f"d{n}")


# ---------------------------------------------------------------- SwitchHead's fused output projection
def fused_output(dtype, master=False) -> Subject:
    """The case of the GPU test named in the tolerance issue, (T, H, E, k, D, d) = (300, 3, 2, 1, 12, 40);
    16-bit a with weights in its dtype or (master) fp32 master weights."""
    p = SHO.with_dy(SHO.make_problem(300, 3, 2, 1, 12, 40, dtype, master=master, seed=300))
    inputs = {n: p[n] for n in SHO.GRADS} | {"dy": p["dy"]}
    dtypes = {"y": dtype, "da": dtype, "dgates": p["gates"].dtype, "dweight": p["weight"].dtype}
    return Subject(check=lambda out: SHO.check(p, out, dtype), oracle=SHO.outputs(inputs, p["ids"], p["E"], F64),
                   dtypes=dtypes, kernel=lambda: SHO.run_public(p),
                   reference=lambda: SHO.outputs(inputs, p["ids"], p["E"], dtype))


def fused_output_master(dtype) -> Subject:
    return fused_output(dtype, master=True)


def fused_output_forward(dtype) -> Subject:
    """check_forward: y alone (the row-scale forward's tests)."""
    p = SHO.make_problem(130, 3, 4, 2, 28, 72, dtype, seed=19)

    def y(dt):
        return {"y": SHO.routed_sum(p["a"], p["ids"], p["gates"], p["weight"], p["E"], dt)}
    return Subject(check=lambda out: SHO.check_forward(p, out["y"], dtype), oracle=y(F64), dtypes={"y": dtype},
                   kernel=lambda: {"y": SHO.op.switchhead_output(p["a"], p["ids"], p["gates"], p["weight"], p["E"],
                                                                 backend=KERNEL)},
                   reference=lambda: y(dtype))


# (subject, dtypes its tests use, dtypes whose kernel runs here only on a GPU)
SUBJECTS = {"chunk_summaries": (chunk_forward, (F32, F16, BF16), (BF16,)),
            "chunk_summaries backward": (chunk_backward, (F32, F16, BF16), (BF16,)),
            "eva_attention": (eva_forward, (F32, F16, BF16), (BF16,)),
            "eva_attention backward": (eva_backward, (F32, F16, BF16), (BF16,)),
            "expert_matmul": (matmul_forward, (F32, F16, BF16), (BF16,)),
            "expert_matmul backward": (matmul_backward, (F32, F16, BF16), (BF16,)),
            "switchhead_output": (fused_output, (F32, F16, BF16), (F16, BF16)),
            "switchhead_output master weights": (fused_output_master, (F16, BF16), (F16, BF16)),
            "switchhead_output forward": (fused_output_forward, (F32,), ())}
gpu = pytest.mark.gpu


def cases(gpu_only: bool = False):
    """(subject, dtype) pairs; with gpu_only the kernel-side pairs, marked gpu where the kernel needs one."""
    for name, (_, dtypes, on_gpu) in SUBJECTS.items():
        for dtype in dtypes:
            marks = [gpu] if gpu_only and dtype in on_gpu else []
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("name,dtype", list(cases()))
def test_check_rejects_each_output_off_by_delta(name, dtype):
    """The oracle's outputs pass; each one scaled by 1 + DELTA fails, with its own name."""
    s = SUBJECTS[name][0](dtype)
    right = in_dtypes(s.oracle, s.dtypes)
    s.check(right)
    for out in s.oracle:
        wrong = {**right, out: in_dtypes({out: s.oracle[out]}, s.dtypes, 1 + DELTA[dtype])[out]}
        with pytest.raises(AssertionError, match=f"^{re.escape(s.label(out))}: relative error"):
            s.check(wrong)


@pytest.mark.parametrize("name,dtype", list(cases()))
def test_check_accepts_the_reference_in_its_dtype(name, dtype):
    s = SUBJECTS[name][0](dtype)
    s.check(s.reference())


@pytest.mark.skipif(KERNEL is None, reason="no kernel backend runs here")
@pytest.mark.parametrize("name,dtype", list(cases(gpu_only=True)))
def test_check_accepts_the_kernel(name, dtype):
    s = SUBJECTS[name][0](dtype)
    s.check(s.kernel())


# ---------------------------------------------------------------- the layers (fp32)
def scale_output(module, factor):
    """A forward hook: the module's output (and so every gradient of the check's loss) x factor."""
    return module.register_forward_hook(lambda m, args, out: out * factor)


def scale_grad(tensor, factor):
    """A tensor hook: the gradient that reaches `tensor` x factor."""
    return tensor.register_hook(lambda g: g * factor)


def scale_input_grad(module, factor):
    """A forward pre-hook: the gradient of the module's input x factor."""
    def pre(module, args):
        scale_grad(args[0], factor)
    return module.register_forward_pre_hook(pre)


def layer_case(kind):
    """A SwitchHead (EVA attention inside) or sigma-MoE layer on the kernel backend, its plain version and
    an input."""
    torch.manual_seed(0)
    backend = KERNEL or "reference"
    if kind == "switchhead":
        layer = SwitchHeadAttention(12, 2, 6, 3, 2, attention="eva", rope_fraction=0.5, backend=backend,
                                    device=DEVICE, **SH.EVA).eval()
        return layer, SH.plain_switchhead, torch.randn(2, 7, 12, device=DEVICE)
    layer = SigmaMoE(12, 4, 8, 2, backend=backend, device=DEVICE).eval()
    return layer, SH.plain_sigma_moe, torch.randn(2, 7, 12, device=DEVICE)


def check_layer(layer, plain, x):
    SH.check_against_plain(layer, plain, x, backward=True, causal_qk=plain is SH.plain_switchhead)


@pytest.mark.parametrize("kind", ["switchhead", "sigma_moe"])
def test_layer_check_rejects_each_output_off_by_delta(kind):
    """check_against_plain passes the layer; the layer's output x (1 + DELTA) (every gradient with it),
    or one parameter's or x's gradient x (1 + DELTA), fails."""
    layer, plain, x = layer_case(kind)
    check_layer(layer, plain, x)
    wrong = 1 + DELTA[F32]
    hook = scale_output(layer, wrong)
    with pytest.raises(AssertionError, match="^y: relative error"):
        check_layer(layer, plain, x)
    hook.remove()
    for name, param in [("x", None), *layer.named_parameters()]:
        hook = scale_input_grad(layer, wrong) if param is None else scale_grad(param, wrong)
        with pytest.raises(AssertionError, match=f"^d{name}: relative error"):
            check_layer(layer, plain, x)
        hook.remove()
