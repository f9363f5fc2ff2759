"""The op-2 CUDA kernels (kernels_cuda/eva_attention.cu) through both loaders: the NVRTC compile of every
instantiation (no GPU needed), the launch plan and its Python mirror, and GPU smoke tests of the
AOT (`cuda`) and JIT (`cupy`) backends against the fp64 NumPy oracle: every head-dim template, fp32,
each summary-bias mode, GQA, strided and misaligned layouts (narrower global accesses), decode, and
offsets past 2^31 elements.

Correctness over many shapes and the SPEC properties are in test_eva_attention_kernels.py (via the
`backend` fixture).
"""
import math

import pytest
import torch

from conftest import DEVICE
from cuda_helpers import available_loaders, extension_op, need_loader, nvrtc_compile
from flashswitch.reference.eva_attention import numpy_eva_attention, random_problem, torch_eva_attention
from flashswitch.testing import assert_close

F32 = torch.float32
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
NVRTC_NAMES = ([f"flashswitch::eva_attention_fwd_kernel<{dt},{hd}>" for dt in (1, 2) for hd in HEAD_DIMS]
               + [f"flashswitch::eva_attention_fwd_f32_kernel<{e}>" for e in (2, 4, 8)]
               + [f"flashswitch::eva_attention_decode_kernel<{dt},{e}>" for dt in (1, 2) for e in (2, 4, 8)])


# ---------------------------------------------------------------- NVRTC (no GPU)
@pytest.mark.parametrize("names", [NVRTC_NAMES[i::3] for i in range(3)], ids=["a", "b", "c"])
def test_nvrtc_compiles_every_instantiation(names):
    """Every template the launchers name compiles under NVRTC for sm_90 (the CuPy path), no local memory."""
    lowered, cubin_bytes = nvrtc_compile("eva_attention.cu", names, "-ftz=true")
    for name in names:
        assert "eva_attention_fwd" in lowered[name] or "eva_attention_decode" in lowered[name]
    assert cubin_bytes > 1000


# ---------------------------------------------------------------- launch plan
def test_plan_shapes():
    from flashswitch.bindings.cupy import EVA_BLOCK_M, eva_plan
    for D in range(0, 257):
        for dtype in (1, 2):
            for align in (1, 2, 4, 8, 16):
                p = eva_plan(D, dtype, align, 2, 3, 130)
                assert p.head_dim in HEAD_DIMS and p.head_dim >= D and p.head_dim % 16 == 0
                assert p.block_n == (32 if p.head_dim > 128 else 64)
                assert p.vec_bytes in (2, 4, 8, 16) and (2 * D) % p.vec_bytes == 0
                assert p.vec_bytes == 2 or align % p.vec_bytes == 0
                assert p.smem_bytes == (EVA_BLOCK_M + 2 * p.block_n) * (p.head_dim + 8) * 2 <= 227 * 1024
                assert p.grid == 2 * 3 * 3 and p.threads == 128
        p = eva_plan(D, 0, 16, 2, 3, 130)
        assert p.head_dim >= max(D, 64) and p.grid == -(-2 * 3 * 130 // 4) and p.smem_bytes == 0
    assert eva_plan(128, 1, 16, 1, 1, 1).vec_bytes == 16
    assert eva_plan(76, 1, 16, 1, 1, 1).vec_bytes == 8     # 152-byte rows
    assert eva_plan(75, 2, 16, 1, 1, 1).vec_bytes == 2     # odd D
    assert eva_plan(128, 1, 4, 1, 1, 1).vec_bytes == 4     # 4-byte aligned strides
    assert eva_plan(64, 1, 16, 0, 4, 100).grid == 0
    assert eva_plan(64, 1, 16, 1 << 20, 64, 1 << 20).grid == 0x7FFFFFFF  # the kernel loops over the rest
    with pytest.raises(ValueError, match="D"):
        eva_plan(257, 1, 16, 1, 1, 1)


def test_plan_mirror_matches_c():
    """bindings/cupy.eva_plan is a line-for-line mirror of fs_eva_attention_plan_for."""
    c_plan = extension_op("eva_attention_plan")
    from flashswitch.bindings.cupy import eva_plan
    for D in (0, 1, 3, 16, 32, 33, 64, 76, 96, 100, 128, 129, 192, 200, 256):
        for dtype in (0, 1, 2):
            for align in (1, 2, 4, 8, 16):
                for B, H, Nq in ((1, 1, 1), (2, 3, 64), (2, 3, 65), (0, 2, 5), (4, 8, 1000)):
                    args = (D, dtype, align, B, H, Nq)
                    assert list(eva_plan(*args)) == list(c_plan(*args)), args


def test_extension_registers_the_op():
    op = extension_op("eva_attention_fwd")
    schema = str(op.default._schema)
    for arg in ("Tensor? bias", "Tensor(a!) o", "Tensor(b!) lse", "int chunk_size", "int window_size",
                "bool sliding", "float scale", "int q_offset", "bool log_count"):
        assert arg in schema, schema


# ---------------------------------------------------------------- GPU smoke tests
def _misalign(t):
    """The same values in a view whose base and row strides are only 2-byte aligned (16-bit types)."""
    pad = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=t.device)
    pad[..., 1:] = t
    return pad[..., 1:]


def _check(loader, p, scale=None):
    from flashswitch.ops import eva_attention as op
    o, lse = op.run_kernel(loader, None, **p, scale=scale)
    torch.cuda.synchronize()
    ref_o, ref_l = numpy_eva_attention(**p, scale=scale, return_lse=True)
    base_o, base_l = torch_eva_attention(**p, scale=scale, return_lse=True)
    assert o.dtype == p["q"].dtype and lse.dtype == F32
    assert_close("o", o, ref_o, p["q"].dtype, baseline=base_o)
    assert_close("lse", lse, ref_l, F32, baseline=base_l)


def _case_problem(case, dtype, seed):
    """The random problem of a CASES / DECODE_CASES entry."""
    (B, H, Hkv, Nq, Nk, D, C, W), window, bias, extra = case
    return random_problem(B, H, Hkv, Nq, Nk, D, C, W, window=window, summary_bias=bias, dtype=dtype, device=DEVICE,
                          seed=seed, **extra)


# (B, H, Hkv, Nq, Nk, D, C, W), window, summary_bias, extra random_problem keywords
CASES = [
    ((2, 4, 2, None, 300, 64, 16, 64), "block", None, {}),
    ((1, 2, 1, None, 257, 128, 8, 32), "sliding", "log_count", dict(layout="strided")),
    ((1, 2, 2, 5, 700, 76, 4, 16), "sliding", "tensor", {}),
    ((2, 2, 1, 130, 400, 256, 16, 128), "block", "tensor", dict(q_offset=200)),
    ((1, 3, 1, 70, 200, 40, 2, 8), "sliding", None, dict(q_offset=50)),
    ((1, 2, 2, None, 190, 96, 4, 8), "block", "log_count", {}),
    ((1, 2, 1, None, 150, 160, 3, 12), "sliding", "tensor", {}),
    ((1, 2, 2, None, 100, 3, 1, 4), "block", None, {}),
    ((1, 2, 2, 1, 999, 20, 5, 25), "block", "log_count", {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["cuda", "cupy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_smoke_vs_reference(loader, dtype, case):
    need_loader(loader)
    p = _case_problem(CASES[case], dtype, seed=case)
    _check(loader, p)
    _check(loader, p, scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["cuda", "cupy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 76, 75])
def test_misaligned_layouts(loader, dtype, D):
    """Base addresses and row strides only 2-byte aligned: the 2-byte access path (and 4/8-byte ones)."""
    need_loader(loader)
    p = random_problem(1, 2, 1, None, 150, D, 4, 16, window="sliding", summary_bias="tensor", dtype=dtype,
                       device=DEVICE, seed=D)
    for name in ("q", "k", "v", "k_sum", "v_sum"):
        p[name] = _misalign(p[name])
    _check(loader, p)


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["cuda", "cupy"])
def test_switched_off_summaries(loader):
    """A -inf tensor bias removes summaries, whole key tiles of them included."""
    need_loader(loader)
    p = random_problem(1, 2, 1, None, 600, 64, 2, 8, summary_bias="tensor", dtype=torch.bfloat16, device=DEVICE)
    bias = p["summary_bias"].clone()
    bias[..., :100] = float("-inf")
    bias[..., 150] = float("-inf")
    p["summary_bias"] = bias
    _check(loader, p)


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["cuda", "cupy"])
def test_offsets_past_int32(loader):
    """One kv head holding more than 2^31 elements: offsets must be computed in 64 bits."""
    need_loader(loader)
    D, C, W, Nc, Nq = 128, 16, 64, 8, 3
    Nk = (1 << 31) // D + 3 * W + 5
    g = torch.Generator(device=DEVICE).manual_seed(0)
    k = torch.randn(1, 1, Nk, D, dtype=torch.bfloat16, device=DEVICE, generator=g)
    v = torch.randn(1, 1, Nk, D, dtype=torch.bfloat16, device=DEVICE, generator=g)
    assert k.numel() > 2 ** 31
    q = torch.randn(1, 2, Nq, D, dtype=torch.bfloat16, device=DEVICE, generator=g)
    ks = torch.randn(1, 1, Nc, D, dtype=torch.bfloat16, device=DEVICE, generator=g)
    vs = torch.randn(1, 1, Nc, D, dtype=torch.bfloat16, device=DEVICE, generator=g)
    from flashswitch.ops import eva_attention as op
    o, lse = op.run_kernel(loader, None, q, k, v, ks, vs, C, W, window="block", summary_bias="log_count")
    torch.cuda.synchronize()
    # dense fp64 reference over what the queries see: exact keys [start, t] (start = start(t) for all
    # three) and the Nc summaries, all of complete chunks (log n_c = log C)
    start = W * ((Nk - Nq) // W)
    assert start // C >= Nc and start * D > 2 ** 31 and W * ((Nk - 1) // W) == start
    kk, vv = k[0, 0, start:].double(), v[0, 0, start:].double()
    t = torch.arange(Nq, device=DEVICE) + (Nk - Nq - start)
    logits_k = (q.double() @ kk.T) * D ** -0.5
    logits_k = logits_k.masked_fill(torch.arange(Nk - start, device=DEVICE)[None, :] > t[:, None], float("-inf"))
    logits_s = (q.double() @ ks[0, 0].double().T) * D ** -0.5 + math.log(C)
    logits = torch.cat([logits_k, logits_s], -1)
    ref_o = torch.softmax(logits, -1) @ torch.cat([vv, vs[0, 0].double()], 0)
    ref_l = torch.logsumexp(logits, -1)
    assert_close("o", o, ref_o, torch.bfloat16)
    assert_close("lse", lse, ref_l, F32)
    del k, v


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["cuda", "cupy"])
def test_loaders_agree_bitwise(loader):
    """Both loaders run the same kernel source: identical outputs."""
    need_loader(loader)
    loaders = available_loaders()
    if len(loaders) < 2:
        pytest.skip("needs both the cuda and the cupy backend")
    from flashswitch.ops import eva_attention as op
    p = random_problem(2, 4, 2, None, 333, 76, 4, 16, window="sliding", summary_bias="log_count",
                       dtype=torch.float16, device=DEVICE)
    a = op.run_kernel("cuda", None, **p)
    b = op.run_kernel("cupy", None, **p)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- decode kernel (config {"decode": 1})
def _check_decode(p, scale=None, loader="cuda"):
    """A CUDA loader with the decode kernel asked for, against the fp64 oracle."""
    from flashswitch.ops import eva_attention as op
    o, lse = op.run_kernel(loader, {"decode": 1}, **p, scale=scale)
    torch.cuda.synchronize()
    ref_o, ref_l = numpy_eva_attention(**p, scale=scale, return_lse=True)
    base_o, base_l = torch_eva_attention(**p, scale=scale, return_lse=True)
    assert_close("o", o, ref_o, p["q"].dtype, baseline=base_o)
    assert_close("lse", lse, ref_l, F32, baseline=base_l)


# (B, H, Hkv, Nq, Nk, D, C, W), window, summary_bias, extra random_problem keywords
DECODE_CASES = [
    ((4, 8, 8, 1, 2000, 128, 32, 256), "block", "log_count", {}),
    ((2, 8, 2, 1, 3001, 64, 16, 128), "sliding", "tensor", {}),       # GQA, a tensor bias
    ((2, 4, 4, 16, 1500, 256, 8, 64), "block", None, {}),             # 16 queries, D = 256
    ((1, 4, 1, 3, 777, 96, 4, 16), "sliding", "log_count", dict(q_offset=500)),
    ((1, 2, 2, 1, 40, 40, 4, 8), "block", "tensor", {}),              # few keys: warps with nothing to do
    ((1, 2, 2, 5, 300, 20, 2, 6), "sliding", None, dict(layout="strided")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["cuda", "cupy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_kernel_vs_reference(loader, dtype, case):
    need_loader(loader)
    p = _case_problem(DECODE_CASES[case], dtype, seed=case)
    _check_decode(p, loader=loader)
    _check_decode(p, scale=0.3, loader=loader)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 76, 75, 128])
def test_decode_kernel_misaligned(D):
    """Rows only 2-byte aligned (and D not a multiple of the lane's elements): element-wise loads."""
    need_loader("cuda")
    p = random_problem(2, 4, 2, 2, 500, D, 4, 16, window="sliding", summary_bias="tensor", dtype=torch.bfloat16,
                       device=DEVICE, seed=D)
    for name in ("q", "k", "v", "k_sum", "v_sum"):
        p[name] = _misalign(p[name])
    _check_decode(p)


@pytest.mark.gpu
def test_decode_kernel_switched_off_summaries():
    need_loader("cuda")
    p = random_problem(1, 2, 1, 1, 900, 64, 2, 8, summary_bias="tensor", dtype=torch.bfloat16, device=DEVICE)
    bias = p["summary_bias"].clone()
    bias[..., :300] = float("-inf")
    p["summary_bias"] = bias
    _check_decode(p)


def test_decode_kernel_in_the_cuda_space():
    from flashswitch.autotune import space
    f = dict(dtype="bf16", D=128, C=32, W=256, window="block", decode=True, rows=512, keys=32768)
    assert space.config_space("eva_attention", "cuda", f) == [{"decode": 0}, {"decode": 1}]
    assert space.config_space("eva_attention", "cupy", f) == [{"decode": 0}, {"decode": 1}]
    assert space.config_space("eva_attention", "cuda", {**f, "decode": False}) == [{}]
    assert space.config_space("eva_attention", "cuda", {**f, "dtype": "fp32"}) == [{}]


@pytest.mark.gpu
def test_decode_kernel_loaders_agree_bitwise():
    """Same source, same launch rule: the AOT and NVRTC builds of the decode kernel give identical outputs."""
    from flashswitch.ops import eva_attention as op
    need_loader("cuda")
    need_loader("cupy")
    p = random_problem(4, 8, 2, 2, 1000, 128, 16, 64, window="sliding", summary_bias="log_count",
                       dtype=torch.bfloat16, device=DEVICE, seed=3)
    a = op.run_kernel("cuda", {"decode": 1}, **p)
    b = op.run_kernel("cupy", {"decode": 1}, **p)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
