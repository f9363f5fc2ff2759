"""Each kernel's configuration space, shape buckets, heuristic defaults and tuning shapes, declared once.

A *bucket* is a small dict of features of a call: categorical strings (dtype, mode) must match
exactly; integer features are compared on a log2 scale when the store looks
for the nearest bucket.
Sizes that only change the grid (token counts) are rounded to a power of two so that a new length
needs no retuning.
"""
from __future__ import annotations

import itertools

import torch

from flashswitch._common import next_pow2  # noqa: F401  (space.next_pow2: the tile rounding of the launchers)


def pow2_bucket(n: int) -> int:
    """Round n >= 1 to the nearest power of two (on a log scale)."""
    n = max(int(n), 1)
    lo = 1 << (n.bit_length() - 1)
    return lo if n < lo * 1.5 else lo * 2


def features(op: str, **kw) -> dict:
    """The bucket of one call of `op`; each op passes its own keywords (see ops/<op>.py)."""
    out = {}
    for name, value in kw.items():
        if isinstance(value, bool) or isinstance(value, str):
            out[name] = value
        elif name in _ROUNDED.get(op, ()):
            out[name] = pow2_bucket(value)
        else:
            out[name] = int(value)
    return out


# features that only change the grid: bucketed to powers of two
_ROUNDED = {
    "chunk_summaries": ("rows",),
    "chunk_summaries.bwd": ("rows",),
    "eva_attention": ("rows", "keys"),
    "eva_attention.bwd": ("rows", "keys"),
    "expert_matmul": ("tokens",),
    "expert_matmul.bwd": ("tokens",),
    "switchhead_output": ("tokens",),
    "switchhead_output.bwd": ("tokens",),
}


# ---------------------------------------------------------------- op 1: chunk_summaries
def _cs_triton_blocks(f: dict) -> tuple[int, int]:
    """(largest BLOCK_J, BLOCK_D) of the Triton kernel: a chunk is read in pieces of at most 64 tokens."""
    return min(next_pow2(f["C"]), 64), next_pow2(f["D"])


def _cs_triton_fits(cb: int, bj: int, block_d: int, w: int) -> bool:
    """Whether a k/v tile and an accumulator fit in registers: <= 72 elements per thread."""
    return cb * (bj + 1) * block_d <= 72 * 32 * w


def _cs_triton_space(f: dict) -> list[dict]:
    # A program holds [BLOCK_CHUNKS, BLOCK_J, BLOCK_D] tiles of k and v and [BLOCK_CHUNKS, BLOCK_D]
    # accumulators; past about 72 elements of one tile plus one accumulator per thread (or with
    # 16 warps) registers spill on sm_90 (measured with ptxas). One warp per program keeps every
    # reduction inside the warp (no shared memory, no barriers); more warps split a chunk's tokens
    # across warps. A BLOCK_J below the chunk size reads the chunk in pieces (online softmax).
    # num_stages does not change this kernel (no load feeds a dot), so it stays 1.
    bj_max, block_d = _cs_triton_blocks(f)
    out = []
    for bj in sorted({bj_max} | {b for b in (8, 16, 32) if b < bj_max}):
        for cb, w in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8)):
            if cb > 1 and bj < bj_max:
                continue
            per_thread = cb * bj * block_d / (32 * w)
            if not _cs_triton_fits(cb, bj, block_d, w) or (w > 1 and per_thread < 16):
                continue
            cfg = {"BLOCK_CHUNKS": cb, "num_warps": w, "num_stages": 1}
            if bj < bj_max:
                cfg["BLOCK_J"] = bj
            out.append(cfg)
    return out or [_cs_triton_default(f)]


def _cs_triton_default(f: dict) -> dict:
    # one warp per program, the largest tile that fits: short chunks are batched (BLOCK_CHUNKS),
    # long ones read in BLOCK_J-token pieces
    bj_max, block_d = _cs_triton_blocks(f)
    bj = bj_max
    while bj > 1 and not _cs_triton_fits(1, bj, block_d, 1):
        bj //= 2
    cb = 1
    while bj == bj_max and cb < 64 and _cs_triton_fits(2 * cb, bj, block_d, 1):
        cb *= 2
    w = 1
    while w < 8 and not _cs_triton_fits(cb, bj, block_d, w):
        w *= 2
    cfg = {"BLOCK_CHUNKS": cb, "num_warps": w, "num_stages": 1}
    if bj < bj_max:
        cfg["BLOCK_J"] = bj
    return cfg


def _cs_bwd_triton_fits(cb: int, bj: int, block_d: int, w: int, per_thread: int = 64) -> bool:
    """Whether the backward's tiles fit in registers: it holds k and v tiles and builds dk and dv
    tiles of the same size, so it allows fewer elements of a tile per thread than the forward
    (at most 64, the launcher's limit; the default aims at 32)."""
    return cb * bj * block_d <= per_thread * 32 * w


def _cs_bwd_triton_space(f: dict) -> list[dict]:
    # Same knobs as the forward (kernels_triton/chunk_summaries_bwd.py). BLOCK_CHUNKS batches short
    # chunks per program; a BLOCK_J below the chunk size reads a chunk in pieces, and a chunk longer
    # than one piece is read twice (statistics, then gradients), so smaller pieces are only offered
    # past 32 tokens. More warps keep a larger tile in registers; with fewer than 8 elements per
    # thread the loads are too narrow. num_stages does not change this kernel (no dot).
    bj_max, block_d = _cs_triton_blocks(f)
    out = []
    for bj in sorted({bj_max} | {b for b in (16, 32) if b < bj_max}):
        for cb, w in itertools.product((1, 2, 4, 8, 16, 32), (1, 2, 4, 8)):
            if cb > 1 and bj < bj_max:
                continue
            if not _cs_bwd_triton_fits(cb, bj, block_d, w) or cb * bj * block_d < 8 * 32 * w:
                continue
            cfg = {"BLOCK_CHUNKS": cb, "num_warps": w, "num_stages": 1}
            if bj < bj_max:
                cfg["BLOCK_J"] = bj
            out.append(cfg)
    return out or [_cs_bwd_triton_default(f)]


def _cs_bwd_triton_default(f: dict) -> dict:
    # the whole chunk in one piece when 8 warps can hold it (one read of k and v), batching short
    # chunks up to about 4096 tile elements per program, with 32 per thread
    bj, block_d = _cs_triton_blocks(f)
    while bj > 1 and not _cs_bwd_triton_fits(1, bj, block_d, 8, 32):
        bj //= 2
    cb = 1
    while cb < 32 and 2 * cb * bj * block_d <= 4096:
        cb *= 2
    w = 1
    while w < 8 and not _cs_bwd_triton_fits(cb, bj, block_d, w, 32):
        w *= 2
    cfg = {"BLOCK_CHUNKS": cb, "num_warps": w, "num_stages": 1}
    if bj < _cs_triton_blocks(f)[0]:
        cfg["BLOCK_J"] = bj
    return cfg


def _cs_cuda_space(f: dict) -> list[dict]:
    # CUDA/CuPy kernel (kernels_cuda/chunk_summaries.cu): threads per block, rows of k and v loaded
    # per lane group before use, and lane groups sharing one chunk (split; 0 = chosen at launch
    # from the grid size, the default). More split only helps long chunks with few of them.
    splits = [0] + [s for s in (1, 2, 4, 8) if s <= max(1, f["C"] // 2)]  # 0: chosen at launch
    return [{"threads": t, "unroll": u, "split": s} for t in (64, 128, 256) for u in (1, 2, 4) for s in splits]


def _cs_cuda_default(f: dict) -> dict:
    return {"threads": 128, "unroll": 4, "split": 0}


# ---------------------------------------------------------------- op 2: eva_attention
def _eva_triton_fits(f: dict, bm: int, bn: int, w: int, stages: int, smem_kb: int = 200) -> bool:
    """Shared memory (q tile + `stages` k/v tiles) within `smem_kb` and a register budget of about
    64 fp32 accumulator values per thread."""
    bd = max(16, next_pow2(f["D"]))
    elt = 4 if f["dtype"] == "fp32" else 2
    smem = (bm * bd + stages * 2 * bn * bd) * elt
    return smem <= smem_kb * 1024 and bm * bd <= 2048 * w and bm * bn <= 4096 * w


def _eva_gluon_fits(f: dict, bn: int, stages: int) -> bool:
    """The Gluon kernel's shared memory: a 128-row q tile and `stages` k and v tiles, plus the
    compiler's 16 KB scratch for the layout conversions, within Hopper's 227 KB."""
    bd = max(16, next_pow2(f["D"]))
    elt = 4 if f["dtype"] == "fp32" else 2
    return (128 * bd + 2 * stages * bn * bd) * elt + 16 * 1024 <= 227 * 1024


def _eva_triton_config_fits(f: dict, cfg: dict) -> bool:
    """Whether a config tuned on another bucket (another D, say) still fits this one's shared memory
    and registers (the tuned buckets' tiles can need more than the hardware has at a larger D)."""
    try:
        bm, bn, w, s = (int(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
    except (KeyError, TypeError, ValueError):
        return True  # a partial config: the launcher fills in the defaults
    if cfg.get("GLUON"):
        return _eva_gluon_fits(f, bn, s)
    return _eva_triton_fits(f, bm, bn, w, s, smem_kb=224)


def _eva_triton_space(f: dict) -> list[dict]:
    # BLOCK_M is clamped to the rows of a (batch, head) at launch; decode also sweeps the number of
    # key-range splits (0 = automatic). fp32 uses IEEE FMA dot products, which hold whole operand
    # rows in registers: only small tiles avoid spilling.
    # The 16-bit spaces keep the tiles that can win on Hopper (each config is a compile: ~1-2 s on
    # the device's CPU), about 16-32 per prefill bucket and 16 compiles x 6 split counts per decode one.
    # FUSE: one loop over all key blocks instead of five (one software pipeline kept full; masks
    # decided per block at run time). It won the sliding W=256 bucket and block D=64 on the H200.
    fp32 = f["dtype"] == "fp32"
    big_d = f["D"] > 128
    fuses = (False,) if fp32 else (False, True)
    out = []
    if f.get("decode"):
        bms = (16,) if fp32 else (16, 64)
        bns = (16, 32) if fp32 else ((32, 64) if big_d else (64, 128))
        warps = (4, 8) if fp32 else ((8,) if big_d else (4,))
        for bm, bn, w, s, fu, sp in itertools.product(bms, bns, warps, (2, 3), fuses, (0, 1, 2, 4, 8, 16)):
            if _eva_triton_fits(f, bm, bn, w, s):
                out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "NUM_SPLITS": sp,
                            **({"FUSE": True} if fu else {})})
        return out
    if fp32:
        grid = itertools.product((16, 32), (16, 32), (4, 8), (1, 2), fuses)
    else:
        tiles = (32, 64) if big_d else (64, 128)
        grid = itertools.product(tiles, tiles, (4, 8), (2, 3), fuses)
    for bm, bn, w, s, fu in grid:
        if _eva_triton_fits(f, bm, bn, w, s):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, **({"FUSE": True} if fu else {})})
    if not fp32 and f["D"] <= 64:
        # the one-loop walk with a deeper pointer pipeline (64 x 64 FUSE tiles win block D = 64; 4
        # stages did not)
        out += [{"BLOCK_M": 64, "BLOCK_N": bn, "num_warps": 4, "num_stages": 4, "FUSE": True} for bn in (64, 128)]
    if not fp32 and f["D"] <= 128:
        # Three programs per SM, so that one program's softmax can overlap another's MMAs: Triton 3.6
        # gives the 64-row, 4-warp tile 192 registers per thread at D = 64 (64x64) and 228 at D = 128
        # (64x32), 2 programs per SM; capped at 168 both compile for sm_90 without spilling (8 bytes at
        # D = 128) and 3 fit in shared memory (57 / 64 KB each). Other tiles spill under the cap.
        bn = 64 if f["D"] <= 64 else 32
        base = [{"BLOCK_M": 64, "BLOCK_N": bn, "num_warps": 4, "num_stages": 3, **({"FUSE": True} if fu else {})}
                for fu in fuses]
        out += [{**c, "maxnreg": 168} for c in base]
    if not fp32 and f["D"] <= 128 and f.get("window") == "block":
        # k/v/summary tiles by TMA (descriptors, no address registers): 64 x 64 and 128 x 128 tiles won
        # on block D = 128 (H200); 4 stages at D = 64; up to the 227 KB of shared memory. A
        # 128-row tile also with one warpgroup where its registers allow (D <= 64), and deeper pipelines
        # (6 stages) where they fit. Register-capped 64 x 64 TMA tiles (3-4 programs per SM) lost at
        # D = 64. First in the list, so that a tuning budget cut short has timed them.
        tma = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "TMA": True}
               for bm, bn, s, w in itertools.product((64, 128), (64, 128), (2, 3, 4, 6), (4, 8))
               if not (bm == 64 and w == 8)
               if _eva_triton_fits(f, bm, bn, w, s, smem_kb=224)]
        out = tma + out
    if not fp32 and f["D"] <= 128 and f["D"] & (f["D"] - 1) == 0:
        # the one-loop walk with k/v/summary tiles by TMA ([B, Hkv, N, D] descriptors cut at the last
        # visible row): no address arithmetic nor load masks per block (304 instead of 352 instructions
        # per 64 x 64 block at D = 64, sm_90 SASS). 256-row tiles (16 warps) read each k/v tile from L2
        # once for 4 warpgroups (L2 traffic limits the 64-row tile at D = 128, Nsight Compute; at D = 128
        # ptxas serializes their wgmma, 1.24 ms vs 1.20 for 128 x 128 on the H200). First, for a tuning
        # budget cut short.
        tiles = ((64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8), (256, 64, 16))
        fused_tma = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "FUSE": True, "TMA": True}
                     for (bm, bn, w), s in itertools.product(tiles, (2, 3, 4))
                     if _eva_triton_fits(f, bm, bn, w, s, smem_kb=224)]
        # q held in registers for q.k (RS wgmma; a loaded q is read from shared memory by each q.k
        # wgmma): no gain at block D = 128, kept as a tuning option; ptxas serializes the wgmma of
        # the tiles with BLOCK_N == D (sm_90 SASS, Triton 3.6 and 3.8), so only the others
        qreg = [{**c, "QREG": True} for c in fused_tma if c["BLOCK_N"] != f["D"] and c["num_warps"] < 16]
        out = qreg + fused_tma + out
    if not fp32 and 32 <= f["D"] <= 128 and f["D"] & (f["D"] - 1) == 0:
        # the warp-specialized Gluon kernel (producer warp, mbarrier ring, two consumer warpgroups of
        # 64 rows; kernels_triton/eva_attention_gluon.py): 128 x 64 with 3 stages won block D = 128
        # (1.11 ms vs 1.18 for the Triton tile on the H200); it lost sliding W = 256 and block D = 64.
        # D >= 32: the D's its GPU tests have passed at. First, for a tuning budget
        # cut short.
        gluon = [{"GLUON": True, "BLOCK_M": 128, "BLOCK_N": bn, "num_warps": 8, "num_stages": s}
                 for bn, s in ((64, 3), (64, 2), (64, 4), (128, 2)) if _eva_gluon_fits(f, bn, s)]
        out = gluon + out
    return out


def _eva_triton_default(f: dict) -> dict:
    D, fp32 = f["D"], f["dtype"] == "fp32"
    if fp32:
        small = D <= 64
        cfg = {"BLOCK_M": 32 if small else 16, "BLOCK_N": 32 if small else 16, "num_warps": 4, "num_stages": 2}
        if f.get("decode"):
            cfg.update(BLOCK_M=16, BLOCK_N=32 if D <= 32 else 16, NUM_SPLITS=0)
        return cfg
    if f.get("decode"):
        return {"BLOCK_M": 64, "BLOCK_N": 32 if D > 128 else 64, "num_warps": 4 if D <= 128 else 8,
                "num_stages": 3, "NUM_SPLITS": 0}
    short = f.get("window") == "sliding" and f.get("W", 1 << 30) < 4 * 128
    if D <= 64 or (short and D <= 128):
        # the tile the tuner picked wherever it ran on these (H200: sliding W 256 at D 128, block W 2048 at
        # D 64): one loop over 64 x 64 blocks, loaded by TMA where the tensors allow, one warpgroup. The
        # five-loop 8-warp tile spills under the launcher's register cap at D 64 (sm_90 SASS).
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "FUSE": True, "TMA": True}
    if D <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def _eva_cuda_space(f: dict) -> list[dict]:
    """The CUDA kernels' one knob (both loaders): the decode kernel for few queries (fp16/bf16)."""
    if f.get("decode") and f["dtype"] in ("fp16", "bf16"):
        return [{"decode": 0}, {"decode": 1}]
    return [{}]


def _eva_bwd_fits(f: dict, bm: int, bn: int, w: int, stages: int, smem_kb: int = 224) -> bool:
    """The dK/dV kernel's two fp32 BLOCK_N x D accumulators within 128 values per thread and its
    BLOCK_N x BLOCK_M logits within 64; its k, v tiles plus `stages` q and dO tiles within shared memory."""
    bd = max(16, next_pow2(f["D"]))
    elt = 4 if f["dtype"] == "fp32" else 2
    return (2 * bn * bd <= 128 * 32 * w and bm * bn <= 64 * 32 * w
            and (2 * bn * bd + stages * 2 * bm * bd) * elt <= smem_kb * 1024)


def _eva_bwd_dq_fits(f: dict, bm: int, bn: int, w: int, stages: int, smem_kb: int = 224) -> bool:
    """The dQ kernel's fp32 BLOCK_M x D accumulator within 128 values per thread and its BLOCK_M x
    BLOCK_N logits within 64; its q, dO tiles plus `stages` k and v tiles within shared memory."""
    bd = max(16, next_pow2(f["D"]))
    elt = 4 if f["dtype"] == "fp32" else 2
    return (bm * bd <= 128 * 32 * w and bm * bn <= 64 * 32 * w
            and (2 * bm * bd + stages * 2 * bn * bd) * elt <= smem_kb * 1024)


def _eva_bwd_config_fits(f: dict, cfg: dict) -> bool:
    """Whether both backward kernels' tiles of a config tuned on another bucket fit this one (a D = 128
    tile needs twice the registers and shared memory at D = 256)."""
    try:
        kv = [int(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")]
        dq = [int(cfg[k]) for k in ("BLOCK_M_DQ", "BLOCK_N_DQ", "num_warps_dq", "num_stages_dq")]
    except (KeyError, TypeError, ValueError):
        return True  # a partial config: the launcher fills in the defaults
    return _eva_bwd_fits(f, *kv) and _eva_bwd_dq_fits(f, *dq)


def _eva_bwd_triton_space(f: dict) -> list[dict]:
    # Two kernels: dK/dV (a program owns BLOCK_N keys or summaries, walks BLOCK_M-query tiles) and dQ
    # (a program owns BLOCK_M_DQ queries, walks BLOCK_N_DQ-key blocks like the forward). The dK/dV
    # kernel keeps four BLOCK_N x D tiles live (k, v, dk, dv), so it wants the wide key side (64 x 128,
    # FlashAttention-2's Hopper choice at D = 128); dQ keeps q, dO, dq: a wide query side (128 x 64).
    # D > 128 halves them. fp32 (IEEE FMA dots) only takes small tiles. num_stages pipelines the
    # walked tiles' loads. Pairs of (dK/dV, dQ) choices and the walk and dS variants: 20-45 configs per
    # bucket.
    fp32 = f["dtype"] == "fp32"
    decode = bool(f.get("decode"))
    if fp32:
        kv = [(bm, bn, 4) for bm, bn in ((16, 16), (16, 32), (32, 32))]
        dq = [(bm, bn, 4) for bm, bn in ((16, 16), (32, 32))]
        stages = (1, 2)
    elif f["D"] > 128:
        kv = [(16 if decode else 32, 64, 8), (16 if decode else 32, 32, 4), (64, 64, 8)]
        dq = [(16 if decode else 64, 32, 8), (16 if decode else 64, 64, 8)]
        stages = (1, 2)
    else:
        kv = [(16 if decode else 32, 128, 8), (16 if decode else 64, 128, 8), (64, 64, 4), (128, 128, 8)]
        dq = [(16 if decode else 128, 64, 8), (16 if decode else 64, 64, 4), (128, 128, 8)]
        stages = (2, 3)
    out = []
    for (bm, bn, w), s, (bm2, bn2, w2) in itertools.product(kv, stages, dq):
        if not (_eva_bwd_fits(f, bm, bn, w, s) and _eva_bwd_dq_fits(f, bm2, bn2, w2, s)):
            continue
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s,
                    "BLOCK_M_DQ": bm2, "BLOCK_N_DQ": bn2, "num_warps_dq": w2, "num_stages_dq": s})
    default = _eva_bwd_triton_default(f)
    if not fp32 and not decode:
        # pieces per summary tile (the early summaries are seen by nearly every query: few long programs
        # unless cut; absent = automatic), on the default tiles
        out += [{**default, "SUM_SPLITS": sp} for sp in (1, 2, 4, 8)]
    # the dK/dV kernel's query walk in three loops (masked lead, unmasked middle, masked trail) on each
    # dK/dV tile with the default dQ tiles, and with pieces per summary tile on the default tiles; the
    # default tiles with the other walk than the default's
    dq_default = {key: default[key] for key in ("BLOCK_M_DQ", "BLOCK_N_DQ", "num_warps_dq", "num_stages_dq")}
    split = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, **dq_default, "KV_SPLIT_LOOPS": True}
             for (bm, bn, w), s in itertools.product(kv, stages) if _eva_bwd_fits(f, bm, bn, w, s)]
    out += [{**default, "KV_SPLIT_LOOPS": not default.get("KV_SPLIT_LOOPS", False)}] + split
    if not fp32 and not decode:
        out += [{**default, "SUM_SPLITS": sp, "KV_SPLIT_LOOPS": True} for sp in (2, 4)]
    # dS stored by the dK/dV kernel and read by the dQ kernel (one product per pair there instead of three,
    # no exp; a scratch write and read), prefill only: each dK/dV tile with the default dQ tiles, and each
    # dQ tile with the default dK/dV tiles, at the default's stages; the dK/dV walk in three loops (in
    # one, Triton 3.6 / ptxas serialize its wgmma at D = 64)
    kv_ds = dq_ds = []
    if not decode:
        ks = default["num_stages"]
        kv_ds = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": ks, **dq_default, "KV_SPLIT_LOOPS": True,
                  "DS_STORE": True} for bm, bn, w in kv if _eva_bwd_fits(f, bm, bn, w, ks)]
        dq_ds = [{**default, "BLOCK_M_DQ": bm2, "BLOCK_N_DQ": bn2, "num_warps_dq": w2, "KV_SPLIT_LOOPS": True,
                  "DS_STORE": True} for bm2, bn2, w2 in dq
                 if _eva_bwd_dq_fits(f, bm2, bn2, w2, default["num_stages_dq"])]
    out += kv_ds + dq_ds
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq or [_eva_bwd_triton_default(f)]


def _eva_bwd_triton_default(f: dict) -> dict:
    D, decode = f["D"], bool(f.get("decode"))
    if f["dtype"] == "fp32":
        t = 32 if D <= 64 else 16
        return {"BLOCK_M": 16 if decode else t, "BLOCK_N": t, "num_warps": 4, "num_stages": 2,
                "BLOCK_M_DQ": 16 if decode else t, "BLOCK_N_DQ": t, "num_warps_dq": 4, "num_stages_dq": 2}
    # 16-bit prefill: the dK/dV walk in three loops (unmasked middle) is 8-20% faster on the H200's
    # block and sliding buckets; decode shapes keep one loop (not measured there)
    split_loops = {} if decode else {"KV_SPLIT_LOOPS": True}
    if D <= 64 and not decode:
        # the tiles the tuner picked at every D = 64 bucket it ran (H100: SmolLM2's sliding W 256 at
        # 8 x 2048 and 2 x 8192; H200: block W 2048): 64 x 64, one warpgroup, for both kernels
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                "BLOCK_M_DQ": 64, "BLOCK_N_DQ": 64, "num_warps_dq": 4, "num_stages_dq": 3}
    if D <= 128:
        return {"BLOCK_M": 16 if decode else 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2,
                "BLOCK_M_DQ": 16 if decode else 128, "BLOCK_N_DQ": 64, "num_warps_dq": 8, "num_stages_dq": 2,
                **split_loops}
    return {"BLOCK_M": 16 if decode else 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
            "BLOCK_M_DQ": 16 if decode else 64, "BLOCK_N_DQ": 32, "num_warps_dq": 8, "num_stages_dq": 2,
            **split_loops}


# ---------------------------------------------------------------- op 3: expert_matmul
_EM_L2_BUDGET = 16 << 20  # bytes of accumulator / weights a schedule tries to keep in L2


def _em_facts(f: dict) -> dict:
    S, G_out = f["S"], f["G_out"]
    pairs = f["tokens"] * S
    return dict(pairs=pairs, per_expert=pairs / max(f["E"], 1),
                atomic=G_out < S and not f.get("deterministic", False),
                welt=4 if f.get("wdtype", f["dtype"]) == "fp32" else 2,
                elt=4 if f["dtype"] == "fp32" else 2)


def _em_group_n(f: dict, bn: int, interleave: bool = False) -> int:
    """Column tiles per sweep: all of them (the gathered A rows of a row tile are then read once from
    memory), unless atomics hit an fp32 accumulator larger than the L2 budget at random rows (expert-
    major order); then a slice [T, G_out, GROUP_N * BLOCK_N] of it is finished before the next. The
    interleaved order already keeps the live rows of the accumulator to a narrow window."""
    n_tiles = -(-f["d_out"] // bn)
    if (interleave or not _em_facts(f)["atomic"]
            or f["tokens"] * f["G_out"] * f["d_out"] * 4 <= _EM_L2_BUDGET):
        return n_tiles
    return max(1, min(n_tiles, _EM_L2_BUDGET // (f["tokens"] * f["G_out"] * bn * 4)))


def _em_interleave(f: dict, bm: int) -> bool:
    """Interleave experts' row tiles when there are few experts with many tiles each and all weights
    fit in L2 (SwitchHead); many small experts (sigma-MoE) keep expert-major order for weight reuse."""
    ff = _em_facts(f)
    return (f["E"] <= 64 and ff["per_expert"] >= 4 * bm
            and f["E"] * f["d_in"] * f["d_out"] * ff["welt"] <= _EM_L2_BUDGET)


def _em_triton_fits(f: dict, bm: int, bn: int, bk: int, w: int, s: int) -> bool:
    """Shared memory of `s` A/B stages within ~200 KB; at most 128 fp32 accumulators per thread."""
    ff = _em_facts(f)
    smem = s * (bm * bk * ff["elt"] + bk * bn * max(ff["elt"], ff["welt"]))
    return smem <= 200 * 1024 and bm * bn <= 128 * 32 * w


def _em_triton_space(f: dict) -> list[dict]:
    """Tile shapes x schedules, pruned to about 30-60 configs: one warp count per tile size (4 up to
    64x128, 8 above), 2 stages for a single K step, and the heuristic schedule plus its variants
    (all column tiles per sweep when the accumulator is large; the other row-tile order for few experts)."""
    ff = _em_facts(f)
    fp32 = f["dtype"] == "fp32"
    bn_max = max(16, next_pow2(f["d_out"]))
    bk_max = max(16, next_pow2(f["d_in"]))
    # 256-row tiles halve the weight tiles streamed per pair (the gathered rows and weight tiles come
    # from L2, whose bandwidth bounds a few-expert shape like SwitchHead V); 8 warps hold them without
    # spilling on sm_90 (ptxas: 255 registers, 16 bytes spilled)
    bms = (32, 64, 128) if ff["per_expert"] < 512 else (64, 128) if ff["per_expert"] < 2048 else (64, 128, 256)
    bns = sorted({min(b, bn_max) for b in ((128, 256) if f["d_out"] >= 512 else (64, 128, 256))})
    bks = sorted({min(b, bk_max) for b in ((16, 32, 64) if fp32 else (64, 128))})
    out = []
    for bm, bn, bk in itertools.product(bms, bns, bks):
        w = 8 if bm * bn >= 16384 else 4
        for s in ((2,) if bk >= f["d_in"] else (3,)):  # (4 stages never won where tried; each config is a compile)
            if not _em_triton_fits(f, bm, bn, bk, w, s):
                continue
            il = _em_interleave(f, bm)
            schedules = {(_em_group_n(f, bn, il), il), (_em_group_n(f, bn, False), il)}
            if f["E"] <= 64:
                schedules |= {(_em_group_n(f, bn, not il), not il), (_em_group_n(f, bn, False), not il)}
            for g, i in sorted(schedules):
                out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_N": g, "INTERLEAVE": i,
                            "num_warps": w, "num_stages": s})
    if ff["atomic"] and not fp32:
        # slot reduction: fp32 atomics, or per-pair rows + an ordered sum (no contention, more traffic).
        # The schedule knobs matter most for the atomics' accumulator in L2: ordered takes one config
        # per tile shape, with all column tiles per sweep and the heuristic row-tile order.
        ordered = {}
        for c in out:
            ordered.setdefault((c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]), {
                **c, "GROUP_N": -(-f["d_out"] // c["BLOCK_N"]), "INTERLEAVE": _em_interleave(f, c["BLOCK_M"]),
                "REDUCE": "ordered"})
        out += list(ordered.values())
        # partials in the output dtype (PARTIALS "out": one rounding per pair before the slot sum, as
        # torch's grouped_mm pipeline): a half-size ordered scratch, or with at most two slots per
        # group 16-bit atomics straight into y (the launcher sums more in order); on each tile shape's
        # ordered sweep and heuristic schedule
        two = f["S"] // f["G_out"] <= 2
        out += [{**c, "PARTIALS": "out"} for c in out
                if c.get("REDUCE") == "ordered" or (two and c["INTERLEAVE"] == _em_interleave(f, c["BLOCK_M"]) and
                                                    c["GROUP_N"] == _em_group_n(f, c["BLOCK_N"], c["INTERLEAVE"]))]
    if _em_master_weights(f):
        # fp32 master weights: the same tiles on a 16-bit copy of the weights (CAST_W), whose B tiles
        # skip the in-register conversion at the price of one cast pass per call
        out += [{**c, "CAST_W": True} for c in out]
    if _em_dense_fits(f, "G_out", 4):
        # DENSE_Z (kernels_triton/expert_matmul.py): y = Z · W_cat, one dense GEMM at G_out·E / S times
        # the pairs' MACs, no slot reduction; the tiles above are unused then
        out.append({**_em_triton_default(f), "DENSE_Z": True})
    return out


def _em_master_weights(f: dict) -> bool:
    """fp32 weights under 16-bit x (config CAST_W may pay)."""
    return f.get("wdtype", f["dtype"]) != f["dtype"]


def _em_triton_default(f: dict) -> dict:
    ff = _em_facts(f)
    fp32 = f["dtype"] == "fp32"
    per_expert = ff["per_expert"]
    bm = 128 if per_expert >= 1024 else 64 if per_expert >= 96 else 32 if per_expert >= 24 else 16
    if fp32:
        bm = min(bm, 64)
    bn = min(128, max(16, next_pow2(f["d_out"])))
    bk = min(32 if fp32 else 64, max(16, next_pow2(f["d_in"])))
    w = 8 if bm * bn >= 16384 else 4
    s = 2 if bk >= f["d_in"] else 3
    il = _em_interleave(f, bm)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_N": _em_group_n(f, bn, il), "INTERLEAVE": il,
            "num_warps": w, "num_stages": s}

def _em_cuda_tiles(f: dict) -> tuple[list[int], list[int]]:
    """BLOCK_M / BLOCK_N values of the CUDA kernel (kernels_cuda/expert_matmul.cu): 32, 64 or 128,
    BLOCK_N no wider than d_out needs; the launcher also caps BLOCK_M * BLOCK_N at 8192."""
    bn_fit = min(128, max(32, next_pow2(f["d_out"])))
    return [32, 64, 128], [b for b in (32, 64, 128) if b <= bn_fit]


def _em_v2_applies(f: dict) -> bool:
    """Whether the CUDA kernel's variant 2 (cp.async + ldmatrix) can run this bucket: fp16/bf16 x with
    a weight of the same dtype, d_in and d_out multiples of 8 (the launcher also checks alignment)."""
    return (f["dtype"] in ("fp16", "bf16") and f.get("wdtype", f["dtype"]) == f["dtype"]
            and f["d_in"] % 8 == 0 and f["d_out"] % 8 == 0)


def _em_cuda_space(f: dict) -> list[dict]:
    """Tile shapes x {all column tiles per sweep, the L2-sized sweep}: at most 16 configs; plus
    variant 2 on its tiles (64 or 128, at most 8192 elements) and the ordered slot sum."""
    bms, bns = _em_cuda_tiles(f)
    out = []
    for bm, bn in itertools.product(bms, bns):
        if bm * bn > 8192:
            continue
        for gn in sorted({_em_group_n(f, bn), -(-f["d_out"] // bn)}):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_N": gn})
            if _em_v2_applies(f) and bm >= 64 and bn >= 64:
                out.append({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_N": gn, "variant": 2})
    if _em_facts(f)["atomic"]:  # the ordered slot sum instead of atomics, on each tile shape's first sweep
        seen = set()
        for c in list(out):
            key = (c["BLOCK_M"], c["BLOCK_N"], c.get("variant", 1))
            if key not in seen:
                seen.add(key)
                out.append({**c, "GROUP_N": -(-f["d_out"] // c["BLOCK_N"]), "REDUCE": "ordered"})
    return out


def _em_cuda_default(f: dict) -> dict:
    per_expert = _em_facts(f)["per_expert"]
    bm = 128 if per_expert >= 1024 else 64 if per_expert >= 96 else 32
    bn = _em_cuda_tiles(f)[1][-1]
    bm = min(bm, 8192 // bn)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_N": _em_group_n(f, bn)}


# op 3 backward (kernels_triton/expert_matmul_bwd.py): the dx kernel (pair rows x d_in columns, K = d_out;
# d gates fused in its epilogue) and the dW kernel (d_in x d_out tiles per expert, K = the expert's pairs,
# SPLIT_K programs per tile). One config holds both kernels' knobs (DX_*, DW_*).
_EM_BWD_PROGRAMS = 2 * 132  # dW programs wanted: two waves of an H200's SMs


def _em_bwd_dx(f: dict, bm: int, bn: int, partials: str = "fp32") -> dict:
    fp32 = f["dtype"] == "fp32"
    bk = min(32 if fp32 else 64, max(16, next_pow2(f["d_out"])))
    return {"DX_BLOCK_M": bm, "DX_BLOCK_N": bn, "DX_BLOCK_K": bk, "DX_INTERLEAVE": _em_interleave(f, bm),
            "DX_PARTIALS": partials, "DX_num_warps": 8 if bm * bn >= 16384 else 4,
            "DX_num_stages": 2 if bk >= f["d_out"] else 3}


def _em_bwd_split(f: dict, bm: int, bn: int, bk: int) -> int:
    """Split each expert's pairs until the dW grid fills about two waves, keeping >= 4 K steps per split
    (few experts with many pairs, SwitchHead: E=16 gives only 128 tiles of 128 x 128)."""
    programs = f["E"] * -(-f["d_in"] // bm) * -(-f["d_out"] // bn)
    per_expert = _em_facts(f)["per_expert"]
    split = 1
    while split < 16 and programs * split < _EM_BWD_PROGRAMS and per_expert / (2 * split) >= 4 * bk:
        split *= 2
    return split


def _em_bwd_dw(f: dict, bm: int, bn: int, split: int = 0) -> dict:
    fp32 = f["dtype"] == "fp32"
    bk = max(16, min(32 if fp32 else 64, next_pow2(int(_em_facts(f)["per_expert"]))))
    # fp32: the IEEE dot of a transposed 64 x 64 tile takes 255 registers with 4 warps, 169 with 8 (sm_90, ptxas)
    warps = 8 if bm * bn >= (4096 if fp32 else 16384) else 4
    return {"DW_BLOCK_M": bm, "DW_BLOCK_N": bn, "DW_BLOCK_K": bk, "SPLIT_K": split or _em_bwd_split(f, bm, bn, bk),
            "DW_num_warps": warps, "DW_num_stages": 3}


def _em_bwd_tiles(f: dict) -> tuple[int, int, int]:
    """(largest tile side, largest d_in tile, largest d_out tile): 64 for fp32 (IEEE FMA dots hold
    operand rows in registers), else 128."""
    cap = 64 if f["dtype"] == "fp32" else 128
    return cap, min(cap, max(16, next_pow2(f["d_in"]))), min(cap, max(16, next_pow2(f["d_out"])))


def _em_dense_fits(f: dict, groups: str, waste: int) -> bool:
    """Whether DENSE_Z may pay, on the side whose rows sum several slots (the forward's output groups,
    "G_out"; the backward's dx rows, "G_in"): 16-bit (fp32 dense GEMMs are slow), rows that sum
    several slots, and dense GEMMs doing at most `waste` times the pairs' MACs (groups·E / S)."""
    return f["dtype"] != "fp32" and f[groups] < f["S"] and f[groups] * f["E"] <= waste * f["S"]


def _em_dense_config_fits(modes: dict):
    """A config with a dense mode (key -> the groups its Z has rows for) fits a bucket whose dense Z
    stays within 4x the pairs' MACs (and memory): a nearest-bucket config must not turn a many-expert
    shape into a huge dense GEMM."""
    def fits(f: dict, cfg: dict) -> bool:
        return all(not cfg.get(key) or (f[g] < f["S"] and f[g] * f["E"] <= 4 * f["S"]) for key, g in modes.items())
    return fits


def _em_triton_config_fits(f: dict, cfg: dict) -> bool:
    """A forward config fits when its dense mode may run here and its A/B stages fit shared memory at
    this bucket's dtypes (fp32 weights double the B tiles)."""
    tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    if all(isinstance(cfg.get(k), int) for k in tiles) and not _em_triton_fits(f, *(cfg[k] for k in tiles)):
        return False
    return _em_dense_config_fits({"DENSE_Z": "G_out"})(f, cfg)


def _em_bwd_triton_default(f: dict) -> dict:
    cap, bin_, bout = _em_bwd_tiles(f)
    per_expert = _em_facts(f)["per_expert"]
    bm = 128 if per_expert >= 1024 else 64 if per_expert >= 96 else 32 if per_expert >= 24 else 16
    # dense Z at <= 2x the MACs: the scratch path writes S / G_in fp32 rows of d_in per dx row, the
    # dense GEMMs stream Z once at tensor-core rate
    return {**_em_bwd_dx(f, min(bm, cap), bin_), **_em_bwd_dw(f, bin_, bout),
            "DENSE_Z": _em_dense_fits(f, "G_in", 2)}


def _em_bwd_triton_space(f: dict) -> list[dict]:
    """dx variants x dW variants, about 8-24 configs (both kernels run in one timed backward, so their
    knobs are swept jointly; each distinct kernel config is one compile):
    - dx: row tile (64 / 128 pairs: fewer weight tiles streamed per pair vs. less padding per expert),
      and, when dx rows sum several slots (G_in < S), partials in fp32 or x's dtype (half the
      scratch traffic, one rounding per pair as a grouped_mm pipeline does);
    - dW: d_in x d_out tile, and SPLIT_K at the heuristic value and twice it (more programs for few
      experts; more partial traffic);
    - DENSE_Z where it may pay (few experts per input group): dx and dW as dense GEMMs over Z."""
    default = _em_bwd_triton_default(f)
    cap, bin_, bout = _em_bwd_tiles(f)
    partials = ("fp32",) if f["dtype"] == "fp32" or f["G_in"] == f["S"] else ("fp32", "out")
    dxs = [_em_bwd_dx(f, bm, bin_, p) for bm in sorted({min(64, cap), cap}) for p in partials]
    dw_tiles = sorted({(bin_, bout), (bin_, min(bout, 64)), (min(bin_, 64), bout)})
    dws = []
    for bm, bn in dw_tiles:
        base = _em_bwd_dw(f, bm, bn)
        dws += [base] + ([{**base, "SPLIT_K": 2 * base["SPLIT_K"]}] if base["SPLIT_K"] < 16 else [])
    out = [default] + [{**dx, **dw, "DENSE_Z": False} for dx in dxs for dw in dws]
    if _em_master_weights(f):  # each dx variant on a 16-bit copy of the weights (CAST_W), default dW
        out += [{**default, **dx, "DENSE_Z": False, "CAST_W": True} for dx in dxs]
    if _em_dense_fits(f, "G_in", 4):  # dense Z on the default dx tiles (dW then needs no kernel)
        out += [{**default, "DENSE_Z": True}, {**default, **_em_bwd_dx(f, min(64, cap), bin_), "DENSE_Z": True}]
    if _em_dense_fits(f, "G_out", 4):  # the forward's dense Z: dW and dZ as dense GEMMs, no tile kernels
        out.append({**default, "DENSE_Z": False, "DENSE_X": True})
    seen, unique = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


# ---------------------------------------------------------------- switchhead_output (SwitchHead's fused O)
# Tiles of kernels_triton/switchhead_output(_bwd).py. BT: tokens per tile, BN: output columns, BK / BM: rows
# of W_cat; FORM / DW_FORM: the forward's / weight gradient's form ("columns": Z tiles built per column,
# "rows": per expert block, a row scale of a's head tile). The first config of each list is the default (it
# runs either form: a config without FORM runs the kernel module's FORWARD_FORM / DWEIGHT_FORM).
SHO_FORWARD_COLUMNS = (
    dict(BT=128, BN=128, BK=64, GROUP_T=8, num_warps=8, num_stages=3),
    dict(BT=128, BN=128, BK=64, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=64, BK=64, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=64, BN=128, BK=64, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=128, BK=128, GROUP_T=8, num_warps=8, num_stages=2),
    dict(BT=64, BN=64, BK=64, GROUP_T=8, num_warps=4, num_stages=3),
)
# the row-scale form: BK is the K step inside an expert block (at most BD, the padded head dim; HEAD_LOOP
# steps by BD), a smaller step pads less (D = 76: 80 rows at 16, 96 at 32, 128 at 64 or more)
SHO_FORWARD_ROWS = (
    dict(BT=128, BN=128, BK=64, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=3),
    dict(BT=128, BN=128, BK=128, HEAD_LOOP=True, GROUP_T=8, num_warps=8, num_stages=2),
    dict(BT=128, BN=64, BK=128, HEAD_LOOP=True, GROUP_T=8, num_warps=4, num_stages=3),
    dict(BT=128, BN=128, BK=128, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=2),
    dict(BT=128, BN=64, BK=64, HEAD_LOOP=False, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=128, BK=32, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=4),
    dict(BT=64, BN=128, BK=32, HEAD_LOOP=False, GROUP_T=8, num_warps=4, num_stages=4),
    dict(BT=128, BN=128, BK=16, HEAD_LOOP=False, GROUP_T=8, num_warps=8, num_stages=5),
)
# the backward's da / gate-table gradient kernel (config keys DA_<key>)
SHO_DA_DW = (
    dict(BT=64, BN=64, num_warps=4, num_stages=3),
    dict(BT=64, BN=128, num_warps=8, num_stages=3),
    dict(BT=128, BN=64, num_warps=8, num_stages=3),
    dict(BT=64, BN=64, num_warps=8, num_stages=4),
)
# the weight gradient (config keys DW_<key>); rows form: BM rows of one expert block (at most BD)
SHO_DWEIGHT_COLUMNS = (
    dict(BM=128, BN=128, BT=64, num_warps=8, num_stages=3),
    dict(BM=128, BN=128, BT=64, num_warps=4, num_stages=4),
    dict(BM=64, BN=128, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=64, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=128, BT=128, num_warps=8, num_stages=3),
)
SHO_DWEIGHT_ROWS = (
    dict(BM=128, BN=128, BT=64, num_warps=8, num_stages=3),
    dict(BM=64, BN=128, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=64, BT=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=128, BT=128, num_warps=8, num_stages=3),
    dict(BM=32, BN=128, BT=128, num_warps=4, num_stages=4),
)


def sho_backward_config(da_dw: dict, dweight: dict, form=None) -> dict:
    """One backward config from a da/dw kernel config and a weight-gradient one (form: its DW_FORM)."""
    return {**{f"DA_{k}": v for k, v in da_dw.items()}, **{f"DW_{k}": v for k, v in dweight.items()},
            **({"DW_FORM": form} if form else {})}


def _sho_triton_space(f: dict) -> list[dict]:
    return ([{**c, "FORM": "columns"} for c in SHO_FORWARD_COLUMNS]
            + [{**c, "FORM": "rows"} for c in SHO_FORWARD_ROWS])


def _sho_triton_default(f: dict) -> dict:
    return dict(SHO_FORWARD_COLUMNS[0])


def _sho_bwd_triton_space(f: dict) -> list[dict]:
    # both kernels run in one timed backward: their knobs are swept jointly (4 x 10 configs)
    return [sho_backward_config(da, dw, form) for da in SHO_DA_DW
            for form, dws in (("columns", SHO_DWEIGHT_COLUMNS), ("rows", SHO_DWEIGHT_ROWS)) for dw in dws]


def _sho_bwd_triton_default(f: dict) -> dict:
    return sho_backward_config(SHO_DA_DW[0], SHO_DWEIGHT_COLUMNS[0])


# ---------------------------------------------------------------- registry
SPACES = {
    ("chunk_summaries", "triton"): _cs_triton_space,
    ("chunk_summaries", "cuda"): _cs_cuda_space,
    ("chunk_summaries", "cupy"): _cs_cuda_space,
    ("chunk_summaries.bwd", "triton"): _cs_bwd_triton_space,
    ("eva_attention", "triton"): _eva_triton_space,
    ("eva_attention.bwd", "triton"): _eva_bwd_triton_space,
    ("eva_attention", "cuda"): _eva_cuda_space,
    ("eva_attention", "cupy"): _eva_cuda_space,
    ("expert_matmul", "triton"): _em_triton_space,
    ("expert_matmul.bwd", "triton"): _em_bwd_triton_space,
    ("expert_matmul", "cuda"): _em_cuda_space,
    ("expert_matmul", "cupy"): _em_cuda_space,
    ("switchhead_output", "triton"): _sho_triton_space,
    ("switchhead_output.bwd", "triton"): _sho_bwd_triton_space,
}
DEFAULTS = {
    ("chunk_summaries", "triton"): _cs_triton_default,
    ("chunk_summaries", "cuda"): _cs_cuda_default,
    ("chunk_summaries", "cupy"): _cs_cuda_default,
    ("chunk_summaries.bwd", "triton"): _cs_bwd_triton_default,
    ("eva_attention", "triton"): _eva_triton_default,
    ("eva_attention.bwd", "triton"): _eva_bwd_triton_default,
    ("expert_matmul", "triton"): _em_triton_default,
    ("expert_matmul.bwd", "triton"): _em_bwd_triton_default,
    ("expert_matmul", "cuda"): _em_cuda_default,
    ("expert_matmul", "cupy"): _em_cuda_default,
    ("switchhead_output", "triton"): _sho_triton_default,
    ("switchhead_output.bwd", "triton"): _sho_bwd_triton_default,
}
FITS = {
    ("eva_attention", "triton"): _eva_triton_config_fits,
    ("eva_attention.bwd", "triton"): _eva_bwd_config_fits,
    ("expert_matmul", "triton"): _em_triton_config_fits,
    ("expert_matmul.bwd", "triton"): _em_dense_config_fits({"DENSE_Z": "G_in", "DENSE_X": "G_out"}),
}

# Shapes `flashswitch autotune` sweeps: keyword arguments of each op's bench/tune problem builder.
# op 3's tuning shapes, forward and backward: keyword arguments of reference.expert_matmul.random_problem
# (its paper_shapes), then what the 262M layers run under autocast (fp32 master weights, read and cast by
# the kernels)
_EXPERT_MATMUL_SHAPES = [
    dict(T=16384, S=8, E=16, d_in=1024, d_out=112, G_out=4, gated=True),            # SwitchHead-262M V
    dict(T=16384, S=8, E=16, d_in=112, d_out=1024, G_in=4, G_out=1, gated=True),    # SwitchHead-262M O
    dict(T=16384, S=8, E=512, d_in=1024, d_out=128, G_out=8, gated=False),          # sigma-MoE up
    dict(T=16384, S=8, E=512, d_in=128, d_out=1024, G_in=8, G_out=1, gated=True),   # sigma-MoE down
    dict(T=16384, S=6, E=10, d_in=412, d_out=76, G_out=2, gated=True),              # SwitchHead-47M V
    dict(T=16384, S=6, E=10, d_in=76, d_out=412, G_in=2, G_out=1, gated=True),      # SwitchHead-47M O
    dict(T=16384, S=8, E=16, d_in=1024, d_out=112, G_out=4, gated=True, weight_dtype=torch.float32),
    dict(T=16384, S=8, E=16, d_in=112, d_out=1024, G_in=4, G_out=1, gated=True, weight_dtype=torch.float32),
    # SwitchAll-262M's sigma-MoE MLP (32 experts of 128, k = 4) up and down
    dict(T=16384, S=4, E=32, d_in=1024, d_out=128, G_out=4, gated=False, weight_dtype=torch.float32),
    dict(T=16384, S=4, E=32, d_in=128, d_out=1024, G_in=4, G_out=1, gated=True, weight_dtype=torch.float32),
]

# the fused SwitchHead output projection: the 262M and 47M layers (reference.switchhead_output.random_problem),
# as under autocast (bf16 / fp16 a, fp32 master weights) and with weights in a's dtype
_SWITCHHEAD_OUTPUT_SHAPES = [
    dict(T=16384, H=4, E=4, k=2, D=112, d=1024),
    dict(T=16384, H=2, E=5, k=3, D=76, d=412),
    dict(T=16384, H=4, E=4, k=2, D=112, d=1024, weight_dtype=torch.float32),
    dict(T=16384, H=2, E=5, k=3, D=76, d=412, weight_dtype=torch.float32),
]

TUNE_SHAPES = {
    "chunk_summaries": [
        dict(B=1, H=16, N=32768, D=128, C=16),
        dict(B=2, H=16, N=8192, D=128, C=16),
        dict(B=1, H=16, N=32768, D=64, C=16),
        dict(B=1, H=16, N=32768, D=128, C=32),
        dict(B=4, H=8, N=4096, D=128, C=64),
    ],
    "eva_attention": [  # keyword arguments of reference.eva_attention.random_problem; the first
        dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=16, W=2048, window="block"),
        dict(B=2, H=16, Hkv=16, Nk=16384, D=64, C=16, W=2048, window="block"),
        dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=32, W=256, window="sliding"),
        dict(B=32, H=16, Hkv=16, Nq=1, Nk=32768, D=128, C=32, W=256, window="block"),
        dict(B=2, H=16, Hkv=4, Nk=8192, D=128, C=16, W=1024, window="block"),
        dict(B=1, H=16, Hkv=16, Nk=32768, D=64, C=16, W=2048, window="block"),
        dict(B=8, H=32, Hkv=8, Nq=1, Nk=16384, D=128, C=16, W=1024, window="sliding"),
        # the bench's sequence-length sweep (block D=128), whose other lengths borrow the N=32768 tile
        dict(B=1, H=16, Hkv=16, Nk=8192, D=128, C=16, W=2048, window="block"),
        dict(B=1, H=16, Hkv=16, Nk=65536, D=128, C=16, W=2048, window="block"),
    ],
    "expert_matmul": _EXPERT_MATMUL_SHAPES,
    # backward passes (the tuner times forward + backward): the training shapes of the benchmarks
    "chunk_summaries.bwd": [
        dict(B=1, H=16, N=32768, D=128, C=16),
        dict(B=1, H=16, N=32768, D=64, C=16),
    ],
    "eva_attention.bwd": [
        dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=16, W=2048, window="block"),
        dict(B=2, H=16, Hkv=16, Nk=16384, D=64, C=16, W=2048, window="block"),
        dict(B=1, H=16, Hkv=16, Nk=32768, D=128, C=32, W=256, window="sliding"),
        dict(B=2, H=16, Hkv=4, Nk=8192, D=128, C=16, W=1024, window="block"),
    ],
    "expert_matmul.bwd": _EXPERT_MATMUL_SHAPES,
    "switchhead_output": _SWITCHHEAD_OUTPUT_SHAPES,
    "switchhead_output.bwd": _SWITCHHEAD_OUTPUT_SHAPES,
}


def config_space(op: str, backend: str, feats: dict) -> list[dict]:
    fn = SPACES.get((op, backend))
    return fn(feats) if fn else [{}]


def default_config(op: str, backend: str, feats: dict) -> dict:
    fn = DEFAULTS.get((op, backend))
    return fn(feats) if fn else {}


def config_fits(op: str, backend: str, feats: dict, cfg: dict) -> bool:
    """Whether `cfg` can launch on a problem of bucket `feats` (true where the resources a config
    needs do not depend on the problem)."""
    fn = FITS.get((op, backend))
    return fn(feats, cfg) if fn else True
