"""Run 28 fallback: where the Gluon kernel differs from the Triton kernel (max |diff| per 64-row tile,
NaN counts) on plain problems, from the simplest (one chunk window, no summaries) up."""
import torch

from flashswitch.ops import eva_attention as op
from flashswitch.reference.eva_attention import random_problem

cases = [  # (Nq, Nk, D, C, W, window, bias, block_n)
    (128, 128, 64, 16, 2048, "block", None, 64),
    (256, 256, 64, 16, 64, "block", None, 64),
    (256, 256, 64, 16, 64, "block", "log_count", 64),
    (300, 700, 64, 16, 64, "sliding", None, 64),
    (256, 256, 128, 16, 64, "block", None, 128),
]
for Nq, Nk, D, C, W, window, bias, bn in cases:
    p = random_problem(1, 2, 2, Nq, Nk, D, C, W, window=window, summary_bias=bias, q_offset=Nk - Nq,
                       dtype=torch.bfloat16, device="cuda", seed=1)
    cfg = dict(BLOCK_M=64, BLOCK_N=bn, num_warps=4, num_stages=3)
    try:
        ref_o, ref_l = op.run_kernel("triton", cfg, **p)
        o, l = op.run_kernel("triton", dict(cfg, GLUON=True), **p)
        torch.cuda.synchronize()
    except Exception as exc:
        print(Nq, Nk, D, C, W, window, bias, bn, "ERROR", type(exc).__name__, str(exc)[:400])
        continue
    d = (o.float() - ref_o.float()).abs()
    dl = (l.float() - ref_l.float()).abs()
    tiles = [f"{d[..., r:r + 64, :].nan_to_num(1e9).max().item():.3g}" for r in range(0, Nq, 64)]
    print(Nq, Nk, D, C, W, window, bias, bn, "o max/tile", tiles, "nan", int(o.isnan().sum()),
          "lse max", f"{dl.nan_to_num(1e9).max().item():.3g}", "ref |o| max", f"{ref_o.abs().max().item():.3g}")
