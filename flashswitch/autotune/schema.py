"""The typed schema of a tuned-config file: what each bucket entry and each kernel config may hold.

A file is checked once when it loads (store._load): an entry that breaks the schema (a wrong type, an
unknown key, a tile that is not a power of two or past the launch limits, a backend that does not
exist) is dropped with one warning per file naming what is wrong, and its buckets fall back to the
nearest valid entry or the heuristic default. Configs are checked key by key against KEYS; which keys
a kernel takes is CONFIG_KEYS[(table, backend)] (tables: the op's name for the forward pass,
"<op>.bwd" for the backward). tests/test_config_schema.py checks that every config of every tuning
space passes, so that a new knob cannot be forgotten here.
"""
from __future__ import annotations

from typing import Callable

from flashswitch.backends import NAMES as BACKENDS


def _pow2(lo: int, hi: int) -> Callable:
    def check(v):
        return _is_int(v) and lo <= v <= hi and v & (v - 1) == 0, f"a power of two in [{lo}, {hi}]"
    return check


def _int(lo: int, hi: int, multiple: int = 1) -> Callable:
    def check(v):
        return _is_int(v) and lo <= v <= hi and v % multiple == 0, (
            f"an integer in [{lo}, {hi}]" + (f", a multiple of {multiple}" if multiple > 1 else ""))
    return check


def _one_of(*values) -> Callable:
    def check(v):
        return any(v == x and type(v) is type(x) for x in values), f"one of {list(values)}"
    return check


def _bool(v):
    return isinstance(v, bool), "true or false"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Every config key a kernel launcher reads, with its valid values. Tile sides stop at 256 (TMA boxes,
# registers) and the split counts at the grid limits the launchers assume.
KEYS: dict[str, Callable] = {
    "BLOCK_M": _pow2(16, 256), "BLOCK_N": _pow2(16, 256), "BLOCK_K": _pow2(16, 256),
    "BLOCK_CHUNKS": _pow2(1, 64), "BLOCK_J": _pow2(1, 64),
    "num_warps": _one_of(1, 2, 4, 8, 16), "num_stages": _int(1, 8),
    "GROUP_N": _int(1, 4096), "INTERLEAVE": _bool, "PARTIALS": _one_of("out", "fp32"), "REDUCE": _one_of("ordered", "atomic"),
    "NUM_SPLITS": _int(0, 128), "PACK_GQA": _bool, "FUSE": _bool, "TMA": _bool, "QREG": _bool, "GLUON": _bool,
    "maxnreg": _int(24, 255, 8),
    "threads": _one_of(32, 64, 128, 256, 512), "unroll": _int(1, 8), "split": _int(0, 64),
    "variant": _one_of(1, 2), "decode": _one_of(0, 1),
    # backward kernels: op 2's dQ kernel, op 3's dx and dW kernels, split counts of fixed-order partial sums
    "BLOCK_M_DQ": _pow2(16, 256), "BLOCK_N_DQ": _pow2(16, 256), "num_warps_dq": _one_of(1, 2, 4, 8, 16),
    "num_stages_dq": _int(1, 8), "SUM_SPLITS": _int(0, 128), "KV_SPLIT_LOOPS": _bool, "DS_STORE": _bool,
    "DX_BLOCK_M": _pow2(16, 256), "DX_BLOCK_N": _pow2(16, 256), "DX_BLOCK_K": _pow2(16, 256),
    "DX_INTERLEAVE": _bool, "DX_PARTIALS": _one_of("out", "fp32"), "DX_num_warps": _one_of(1, 2, 4, 8, 16),
    "DX_num_stages": _int(1, 8), "DW_BLOCK_M": _pow2(16, 256), "DW_BLOCK_N": _pow2(16, 256),
    "DW_BLOCK_K": _pow2(16, 256), "DW_num_warps": _one_of(1, 2, 4, 8, 16), "DW_num_stages": _int(1, 8),
    "SPLIT_K": _int(1, 128), "DENSE_Z": _bool, "DENSE_X": _bool, "CAST_W": _bool,
    # the fused SwitchHead output projection: forward tiles and form, the backward's da/dw (DA_) and
    # weight-gradient (DW_) kernels
    "BT": _pow2(16, 256), "BN": _pow2(16, 256), "BK": _pow2(16, 256), "GROUP_T": _int(1, 64), "HEAD_LOOP": _bool,
    "FORM": _one_of("columns", "rows"), "DA_BT": _pow2(16, 256), "DA_BN": _pow2(16, 256),
    "DA_num_warps": _one_of(1, 2, 4, 8, 16), "DA_num_stages": _int(1, 8), "DW_BM": _pow2(16, 256),
    "DW_BN": _pow2(16, 256), "DW_BT": _pow2(16, 256), "DW_FORM": _one_of("columns", "rows"),
}

_TRITON_BASE = {"num_warps", "num_stages"}
CONFIG_KEYS: dict[tuple, set] = {
    ("chunk_summaries", "triton"): _TRITON_BASE | {"BLOCK_CHUNKS", "BLOCK_J"},
    ("chunk_summaries", "cuda"): {"threads", "unroll", "split"},
    ("chunk_summaries", "cupy"): {"threads", "unroll", "split"},
    ("eva_attention", "triton"): _TRITON_BASE | {"BLOCK_M", "BLOCK_N", "NUM_SPLITS", "PACK_GQA", "FUSE", "TMA",
                                                 "QREG", "GLUON", "maxnreg"},
    ("eva_attention", "cuda"): {"decode"},
    ("eva_attention", "cupy"): {"decode"},
    ("expert_matmul", "triton"): _TRITON_BASE | {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_N", "INTERLEAVE",
                                                 "PARTIALS", "REDUCE", "DENSE_Z", "CAST_W"},
    ("expert_matmul", "cuda"): {"BLOCK_M", "BLOCK_N", "GROUP_N", "REDUCE", "variant"},
    ("expert_matmul", "cupy"): {"BLOCK_M", "BLOCK_N", "GROUP_N", "REDUCE", "variant"},
    ("chunk_summaries.bwd", "triton"): _TRITON_BASE | {"BLOCK_CHUNKS", "BLOCK_J"},
    ("eva_attention.bwd", "triton"): _TRITON_BASE | {"BLOCK_M", "BLOCK_N", "BLOCK_M_DQ", "BLOCK_N_DQ", "num_warps_dq",
                                                     "num_stages_dq", "SUM_SPLITS", "KV_SPLIT_LOOPS",
                                                     "DS_STORE"},
    ("expert_matmul.bwd", "triton"): {"DX_BLOCK_M", "DX_BLOCK_N", "DX_BLOCK_K", "DX_INTERLEAVE", "DX_PARTIALS",
                                      "DX_num_warps", "DX_num_stages", "DW_BLOCK_M", "DW_BLOCK_N", "DW_BLOCK_K",
                                      "DW_num_warps", "DW_num_stages", "SPLIT_K", "DENSE_Z", "DENSE_X", "CAST_W"},
    ("switchhead_output", "triton"): _TRITON_BASE | {"BT", "BN", "BK", "GROUP_T", "HEAD_LOOP", "FORM"},
    ("switchhead_output.bwd", "triton"): {"DA_BT", "DA_BN", "DA_num_warps", "DA_num_stages", "DW_BM", "DW_BN",
                                          "DW_BT", "DW_num_warps", "DW_num_stages", "DW_FORM"},
}


# Keys a forward Triton launcher reads without a fallback: a config lacking one gets the heuristic default
# under it (call_plan.complete_config). Backward configs must be complete; the other keys are optional.
REQUIRED_KEYS: dict[tuple, tuple] = {
    ("chunk_summaries", "triton"): ("BLOCK_CHUNKS", "num_warps", "num_stages"),
    ("eva_attention", "triton"): ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
    ("expert_matmul", "triton"): ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_N", "INTERLEAVE", "num_warps", "num_stages"),
    ("switchhead_output", "triton"): ("BT", "BN", "BK", "GROUP_T", "num_warps", "num_stages"),
}


def config_problems(table: str, backend: str, cfg) -> list[str]:
    """What is wrong with one kernel config (empty when it is valid). Tables without a declared key set
    (an op the tooling was extended with) are checked for types only."""
    if not isinstance(cfg, dict):
        return [f"config is {type(cfg).__name__}, not an object"]
    allowed = CONFIG_KEYS.get((table, backend))
    out = []
    for key, value in cfg.items():
        if allowed is not None and key not in allowed:
            out.append(f"unknown config key {key!r} for {table}/{backend}")
            continue
        check = KEYS.get(key)
        if check is None:
            if allowed is not None or not isinstance(value, (bool, int, float, str)):
                out.append(f"config key {key!r} has no declared type")
            continue
        ok, want = check(value)
        if not ok:
            out.append(f"config {key} must be {want}, got {value!r}")
    return out


def entry_problems(table: str, entry) -> list[str]:
    """What is wrong with one bucket entry {"features", "best", "backends": {b: {"config", "ms"}}}."""
    if not isinstance(entry, dict):
        return [f"entry is {type(entry).__name__}, not an object"]
    out = []
    feats = entry.get("features")
    if not isinstance(feats, dict) or not all(isinstance(k, str) and isinstance(v, (bool, int, str))
                                              for k, v in feats.items()):
        out.append("features must map names to integers, strings or booleans")
    backends = entry.get("backends")
    if not isinstance(backends, dict) or not backends:
        return out + ["backends must be a non-empty object"]
    for b, rec in backends.items():
        if b not in BACKENDS:
            out.append(f"unknown backend {b!r}")
        elif not isinstance(rec, dict):
            out.append(f"backends.{b} is {type(rec).__name__}, not an object")
        else:
            ms = rec.get("ms")
            if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float))):
                out.append(f"backends.{b}.ms must be a number")
            if b != "reference":
                out += [f"backends.{b}: {p}" for p in config_problems(table, b, rec.get("config", {}))]
    best = entry.get("best")
    if best is not None and best not in BACKENDS:
        out.append(f"best {best!r} is not a backend")
    return out


def clean(data) -> tuple[dict, list[str]]:
    """(the file's valid part, what was dropped and why): entries that break the schema are left out."""
    if not isinstance(data, dict) or not isinstance(data.get("ops"), dict):
        raise ValueError("no 'ops' table")
    problems, ops = [], {}
    for table, entries in data["ops"].items():
        if not isinstance(entries, dict):
            problems.append(f"ops.{table} is {type(entries).__name__}, not an object")
            continue
        kept = {}
        for key, entry in entries.items():
            bad = entry_problems(table, entry)
            if bad:
                problems.append(f"{table} [{key}]: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""))
            else:
                kept[key] = entry
        ops[table] = kept
    return {**data, "ops": ops}, problems
