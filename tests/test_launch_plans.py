"""One launch plan per problem and config for both CUDA backends: the C planners of kernels_cuda/*.cu
(fs_<op>_plan_for, which the AOT extension's launchers call; exposed as torch.ops.flashswitch_C.<op>_plan)
and their Python mirrors in bindings/cupy.py (which the CuPy launchers use) give the same grid, block,
shared memory, tile and kernel choice for every config of the CUDA spaces (autotune/space.py), at
every tuning shape plus small and odd ones, in every dtype and alignment. The configs go through the
same parsing the launchers apply (bindings/cuda.py). CPU only: needs the built extension, no GPU.
"""
import pytest

from cuda_helpers import extension_op
from flashswitch.autotune import space
from flashswitch.bindings import cuda as aot

DTYPES = {"fp32": (0, 4), "fp16": (1, 2), "bf16": (2, 2)}  # name: (FS_DTYPE_* code, element size)
ALIGNS = (1, 2, 4, 8, 16)


def _configs(op, feats):
    """Every config the CUDA and CuPy spaces hold for a bucket (the two share one space), plus the
    default and the empty config (the launchers' own defaults)."""
    cfgs = space.config_space(op, "cuda", feats) + space.config_space(op, "cupy", feats)
    cfgs += [space.default_config(op, "cuda", feats), {}]
    out = []
    for c in cfgs:
        if c not in out:
            out.append(c)
    return out


# ---------------------------------------------------------------- op 1
CS_SHAPES = space.TUNE_SHAPES["chunk_summaries"] + [dict(B=1, H=1, N=1, D=1, C=1), dict(B=2, H=3, N=50, D=76, C=3),
                                                    dict(B=1, H=2, N=7, D=256, C=64)]


@pytest.mark.parametrize("shape", CS_SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_chunk_summaries_plans_agree(shape):
    c_plan = extension_op("chunk_summaries_plan")
    from flashswitch.bindings.cupy import plan
    B, H, N, D, C = (shape[k] for k in ("B", "H", "N", "D", "C"))
    C = min(C, max(N, 1))  # as both launchers clamp it
    nchunks = B * H * -(-N // C)
    n = 0
    for dtype, (_, es) in DTYPES.items():
        feats = space.features("chunk_summaries", dtype=dtype, D=D, C=C, rows=B * H * N)
        for cfg in _configs("chunk_summaries", feats):
            threads, unroll, split = aot.chunk_summaries_config(cfg)
            for align in ALIGNS:
                if align < es and align != 1:
                    continue
                args = (D, es, align, C, nchunks, threads, unroll, split)
                assert list(plan(*args)) == list(c_plan(*args)), (cfg, args)
                n += 1
    assert n > 0


# ---------------------------------------------------------------- op 2
EVA_SHAPES = space.TUNE_SHAPES["eva_attention"] + [dict(B=1, H=2, Hkv=1, Nq=1, Nk=9, D=3, C=2, W=4, window="block"),
                                                   dict(B=2, H=3, Hkv=3, Nq=16, Nk=70, D=76, C=4, W=8,
                                                        window="sliding"),
                                                   dict(B=1, H=4, Hkv=2, Nk=130, D=200, C=2, W=8, window="block"),
                                                   dict(B=0, H=4, Hkv=2, Nq=5, Nk=5, D=64, C=1, W=1,
                                                        window="block")]


@pytest.mark.parametrize("shape", EVA_SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_eva_attention_plans_agree(shape):
    c_plan = extension_op("eva_attention_plan")
    from flashswitch.bindings.cupy import EVA_KERNEL_DECODE, eva_plan
    B, H, Nk, D = shape["B"], shape["H"], shape["Nk"], shape["D"]
    Nq = shape.get("Nq", Nk)
    kernels = set()
    for dtype, (code, _) in DTYPES.items():
        feats = space.features("eva_attention", dtype=dtype, D=D, C=shape["C"], W=shape["W"], window=shape["window"],
                               decode=Nq <= 16, rows=B * H * Nq, keys=Nk)
        for cfg in _configs("eva_attention", feats):
            decode = int(bool(cfg.get("decode", 0)))  # as both launchers read it
            for align in ALIGNS:
                args = (D, code, align, B, H, Nq, decode)
                p = eva_plan(*args)
                assert list(p) == list(c_plan(*args)), (cfg, args)
                kernels.add(p.kernel)
    if Nq <= 16 and D > 0:
        assert EVA_KERNEL_DECODE in kernels  # the space reaches the decode kernel


# ---------------------------------------------------------------- op 3
EM_SHAPES = space.TUNE_SHAPES["expert_matmul"] + [dict(T=1, S=1, E=1, d_in=3, d_out=1, G_out=1, gated=False),
                                                  dict(T=300, S=6, E=5, d_in=76, d_out=19, G_out=3, gated=True),
                                                  dict(T=7, S=8, E=512, d_in=128, d_out=1024, G_out=8,
                                                       gated=False),
                                                  dict(T=0, S=2, E=4, d_in=8, d_out=8, G_out=1, gated=True)]


@pytest.mark.parametrize("shape", EM_SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_expert_matmul_plans_agree(shape):
    c_plan = extension_op("expert_matmul_plan")
    from flashswitch.bindings.cupy import expert_matmul_plan
    T, S, E, d_in, d_out, G_out = (shape[k] for k in ("T", "S", "E", "d_in", "d_out", "G_out"))
    G_in = shape.get("G_in", 1)
    for dtype in DTYPES:
        for wdtype in {dtype, "fp32"}:
            for det in (False, True):
                feats = space.features("expert_matmul", dtype=dtype, wdtype=wdtype, d_in=d_in, d_out=d_out, E=E, S=S,
                                       G_in=G_in, G_out=G_out, tokens=T, deterministic=det)
                for cfg in _configs("expert_matmul", feats):
                    block_m, block_n, group_n = aot.expert_matmul_config(cfg)
                    args = (T, S, E, G_out, d_out, aot.expert_matmul_ordered(cfg, det), block_m, block_n, group_n)
                    assert list(expert_matmul_plan(*args)) == list(c_plan(*args)), (cfg, args)
