"""The op calls a Llama-style model makes, per op and pass: what `flashswitch autotune --model NAME`
tunes. A model with EVA attention runs op 1 (chunk_summaries over the kv heads) and op 2
(eva_attention over the query heads) in its full-sequence forward (prefill, batch 1) and in training
(forward and backward, B x T). Shapes that land in one tuned bucket are listed once. Decode steps run
the cache's own step kernels, which take no tuned config.
"""
from __future__ import annotations

import torch

PREFILL_LENS = (2048, 4096, 8192, 16384, 32768)
TRAIN_SHAPES = ((8, 2048), (2, 8192))
WINDOWS = ("sliding", "block")


def model_shapes(cfg, *, seq_lens=PREFILL_LENS, train=TRAIN_SHAPES, chunk_size: int = 32, window_size: int = 256,
                 windows=WINDOWS, dtype: str = "bf16") -> dict[str, list[dict]]:
    """{op: [random_problem shape, ...]} for a model config with num_heads, num_kv_heads and head_dim:
    prefill at batch 1 for each of `seq_lens`, training steps at each (B, T) of `train`, EVA with
    `chunk_size`, `window_size` and each of `windows`."""
    from flashswitch.autotune import store
    H, Hkv, D, C, W = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, int(chunk_size), int(window_size)
    forward = [(1, int(n)) for n in seq_lens] + [(int(b), int(n)) for b, n in train]
    training = [(int(b), int(n)) for b, n in train]
    wanted = {
        "chunk_summaries": [dict(B=b, H=Hkv, N=n, D=D, C=C) for b, n in forward],
        "chunk_summaries.bwd": [dict(B=b, H=Hkv, N=n, D=D, C=C) for b, n in training],
        "eva_attention": [dict(B=b, H=H, Hkv=Hkv, Nk=n, D=D, C=C, W=W, window=w) for w in windows for b, n in forward],
        "eva_attention.bwd": [dict(B=b, H=H, Hkv=Hkv, Nk=n, D=D, C=C, W=W, window=w) for w in windows
                              for b, n in training],
    }
    out = {}
    for op, shapes in wanted.items():
        seen = set()
        for shape in shapes:
            key = store.bucket_key(_features(op, shape, dtype))
            if key not in seen:
                seen.add(key)
                out.setdefault(op, []).append(shape)
    return out


def _features(op: str, shape: dict, dtype: str) -> dict:
    """The bucket of a shape, read off meta tensors (no memory, no data) by the op's own features."""
    from flashswitch.ops import chunk_summaries as op1, eva_attention as op2
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    name, _, bwd = op.partition(".")
    if name == "chunk_summaries":
        k = torch.empty(shape["B"], shape["H"], shape["N"], shape["D"], dtype=dt, device="meta")
        return (op1.problem_features_bwd if bwd else op1.problem_features)(k, k, shape["C"])
    B, H, Hkv, N, D = (shape[n] for n in ("B", "H", "Hkv", "Nk", "D"))
    q = torch.empty(B, H, N, D, dtype=dt, device="meta")
    k = torch.empty(B, Hkv, N, D, dtype=dt, device="meta")
    return (op2.problem_features_bwd if bwd else op2.problem_features)(q, k, k, k, k, shape["C"], shape["W"],
                                                                        shape["window"])
