"""What a call decides from its arguments' metadata, decided once per signature: the one place that plans
an op's call (ops/_opdef.py wires the ops around it).

A public op call validates its arguments, buckets the problem, resolves the backend and looks its
config up; on a small problem that host work costs more than the kernel. All of it depends only on
the arguments' metadata (tensor types, dtypes, shapes, strides, devices; the scalar arguments with
their types), on a few environment settings and on the tuned-config store. Each op keeps an LRU
`PlanCache` keyed by that metadata (`tensor_key`, `scalar_key`): a key seen before was validated
when its plan was made, so a hit skips the checks (a NaN scale, another dtype or a bool where an
int belongs makes another key, which is validated again). Every cache here is emptied when an
environment setting in ENV_VARS changes or the tuned-config store changes (`store.update` in this
process at once, a file written by another process within a second).

`config(table, backend, feats)` is the one config lookup of a kernel call: tuned or default, with
the defaults merged into an incomplete tuned config and the schema checked, read-only. A `Plan`
holds the answers and the forward launch (`forward_launch`); the backward launches it prepares on
first use (`backward_launch`). Nothing here runs on a cached call's fast path but `PlanCache.get`.
"""
from __future__ import annotations

import functools
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Hashable, Mapping, Optional

import torch

from flashswitch import _common as C
from flashswitch import backends
from flashswitch.autotune import schema, space, store

# Settings the call path reads: backend choice, config folder, output poisoning, direct Triton launches
# (kernels_triton/kernel_call.py), the Triton interpreter
ENV_VARS = ("FLASHSWITCH_BACKEND", "FLASHSWITCH_CONFIG_DIR", "FLASHSWITCH_POISON", "FLASHSWITCH_FAST_LAUNCH",
            "TRITON_INTERPRET")
STORE_RECHECK_S = 1.0  # how often the config file's modification time is looked at (as store.lookup does)
_ALL: list["PlanCache"] = []


class PlanCache:
    """A bounded LRU map from a call key to its plan; `get` misses and `put` keeps nothing for a key
    None or an unhashable one (an argument that makes no key is validated on every call)."""

    def __init__(self, maxsize: int = 256):
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._last = None  # the plan most recently put or hit: already at the end, no reordering
        _ALL.append(self)

    def get(self, key: Optional[Hashable]):
        if key is None:
            return None
        check_state()
        try:
            plan = self._data.get(key)
        except Exception:  # unhashable (key_or_none does not hash it: a hit hashes the key once)
            return None
        if plan is not None and plan is not self._last:
            try:
                self._data.move_to_end(key)
            except KeyError:  # another thread evicted it meanwhile: the plan itself is still good
                pass
            self._last = plan
        return plan

    def put(self, key: Optional[Hashable], plan) -> None:
        if key is None:
            return
        try:
            self._data[key] = plan
        except Exception:  # unhashable
            return
        self._data.move_to_end(key)  # a key put again (two threads made its plan) is the most recent too
        self._last = plan
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()
        self._last = None

    def __len__(self) -> int:
        return len(self._data)


def clear_all() -> None:
    for cache in _ALL:
        cache.clear()


# ---------------------------------------------------------------- keys
def tensor_key(t) -> tuple:
    """What the checks of a tensor argument read: its type, dtype, shape, strides and device (raises
    AttributeError / RuntimeError for a non-tensor or a layout without strides: no key then)."""
    return (t.__class__, t.dtype, t.shape, t.stride(), t.device)


def optional_tensor_key(t) -> Optional[tuple]:
    return None if t is None else tensor_key(t)


def scalar_key(x) -> tuple:
    """A scalar argument with its type: 1, 1.0 and True pass different checks but compare equal."""
    return (x.__class__, x)


def key_or_none(build, *args) -> Optional[Hashable]:
    """build(*args), or None where it raises (a non-tensor) or while torch.compile traces: those calls
    take the full path, whose checks raise the right error or trace as before. Not hashed here (hashing
    costs as much as the lookup): PlanCache takes an unhashable key (an unhashable scalar) as none."""
    if torch.compiler.is_compiling():
        return None
    try:
        return build(*args)
    except Exception:
        return None


# ---------------------------------------------------------------- invalidation
def env_snapshot() -> tuple:
    return C.env_raws(ENV_VARS)


_seen = {"env": None, "generation": None, "file": None, "next_file_check": 0.0}


def _file_state() -> tuple:
    path = store._current_file()
    return (None if path is None else str(path), None if path is None else store._mtime(str(path)))


def check_state() -> None:
    """Empty every plan and config cache when a setting of ENV_VARS or the tuned-config store changed."""
    env = env_snapshot()
    generation = store.generation
    now = time.monotonic()
    changed = env != _seen["env"] or generation != _seen["generation"]
    if changed or now >= _seen["next_file_check"]:
        file = _file_state()
        changed = changed or file != _seen["file"]
        _seen.update(env=env, generation=generation, file=file, next_file_check=now + STORE_RECHECK_S)
    if changed:
        clear_all()


# ---------------------------------------------------------------- configs
def resolve_backend(op: str, backend: str, device: torch.device, bucket: Optional[dict],
                    kernels: tuple = backends.KERNELS) -> str:
    """Turn `backend` ('auto' or a name) into a backend that can run here, or raise. kernels: the kernel
    backends that have this op's launchers."""
    items = None if bucket is None else tuple(sorted(bucket.items()))
    return _resolve_backend(op, backend, str(device), items, tuple(kernels))


@torch.compiler.assume_constant_result  # imports and file reads: torch.compile takes the answer as a constant
def _resolve_backend(op: str, backend: str, device: str, bucket: Optional[tuple], kernels: tuple) -> str:
    device = torch.device(device)
    bucket = None if bucket is None else dict(bucket)
    if backend in backends.KERNELS and backend not in kernels:
        raise ValueError(f"backend {backend!r} has no {op} kernels; use 'auto', 'reference' or one of {kernels}")
    if backend == "auto":
        backend = (C.env_get(C.BACKEND_ENV) or "auto").strip() or "auto"
        if backend != "auto" and backend not in backends.NAMES:
            raise ValueError(f"environment variable {C.BACKEND_ENV}={backend!r} is not a backend; expected one of "
                             f"{backends.NAMES} or 'auto'")
        if backend in backends.KERNELS and backend not in kernels:
            return "reference"  # the setting names kernels this op lacks: what 'auto' falls back to
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        best = store.best_backend(op, bucket) if bucket is not None else None
        if best is not None and best in kernels + ("reference",) and backends.available(best, device):
            return best
        for candidate in kernels:
            if backends.available(candidate, device):
                return candidate
        return "reference"
    if not backends.available(backend, device):  # raises for an unknown name
        raise ValueError(f"backend {backend!r} is not available for tensors on {device} "
                         f"(available: {backends.usable(device)}; see `flashswitch info`)")
    return backend


def complete_config(table: str, backend: str, feats: dict, cfg: Optional[Mapping]) -> dict:
    """`cfg` with the heuristic default under it when it lacks a key the launcher requires
    (schema.REQUIRED_KEYS; tables without required keys, the backward ones, take it as it is)."""
    cfg = dict(cfg or {})
    required = schema.REQUIRED_KEYS.get((table, backend), ())
    if any(key not in cfg for key in required):
        cfg = {**space.default_config(table, backend, feats), **cfg}
    return cfg


_CONFIGS = PlanCache(maxsize=1024)


def config(table: str, backend: str, feats: dict) -> Mapping:
    """The config of one kernel call (read-only): tuned (exact or nearest fitting bucket) or default,
    completed and checked against the schema once per bucket."""
    key = (table, backend, tuple(feats.items()))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = complete_config(table, backend, feats, store.lookup(table, backend, feats))
        problems = schema.config_problems(table, backend, cfg)
        if problems:  # stored configs are checked when the file loads: a default the schema does not take
            warnings.warn(f"flashswitch: the {table}/{backend} config {cfg} for {feats} breaks the config "
                          f"schema: {'; '.join(problems)}", RuntimeWarning, stacklevel=2)
        cfg = MappingProxyType(cfg)
        _CONFIGS.put(key, cfg)
    return cfg


# ---------------------------------------------------------------- plans and launches
@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a call decides from its arguments' metadata; an op's plan adds its normalized arguments."""
    backend: str
    kernels: bool  # the backend launches kernels (else the torch reference runs)
    config: Optional[Mapping] = None  # None: the reference, an empty problem, a traced call (looked up per call)
    enqueue: Optional[Callable] = None  # the forward launch of this signature: enqueue(inputs..., outputs...)
    outputs: Optional[list] = None  # the outputs' (shape, dtype), fixed by the signature
    backward: dict = field(default_factory=dict, compare=False)  # the backward's config and prepared launches
    opdef: object = field(default=None, compare=False, repr=False)  # the op's OpDef (ops/_opdef.py)


def resolve(op: str, backend: str, device: torch.device, features: Callable,
            kernels: tuple = backends.KERNELS) -> tuple[str, Optional[dict]]:
    """(the backend that runs this call, the forward's bucket or None): `auto` on a GPU picks by the
    problem's bucket (`features(op)`), computed once here and handed on to the config lookup."""
    bucket = features(op) if device.type == "cuda" else None
    return resolve_backend(op, backend, device, bucket, kernels), bucket


def forward_launch(op: str, backend: str, config: Mapping, scalars: dict, inputs: Optional[tuple] = None,
                   outputs: Optional[tuple] = None) -> Callable:
    """enqueue(inputs..., outputs...) of one signature: the backend's launch prepared from the arguments'
    metadata where it has one and `inputs` are given (outputs may be meta tensors), else its launcher with
    the scalars and config bound."""
    if inputs is not None and backends.TABLE[backend].prepare:
        from flashswitch.kernels_triton.kernel_call import fast_launch_wanted
        return backends.launcher(backend, op, "prepare")(*inputs, *outputs, **scalars, config=config,
                                                           fast=fast_launch_wanted(inputs[0].device))
    return functools.partial(backends.launcher(backend, op), **scalars, config=config)


def backward_launch(op: str, backend: str, plan: Optional[Plan], key, cfg: Optional[Mapping], features: Callable,
                    *args, **scalars) -> Callable:
    """enqueue(...) of the backward kernels that serve `backend` (backends.py), prepared from `args`'
    metadata: kept in `plan` under `key` (the layout of the upstream gradients) where a plan is given,
    its config looked up once per plan (bucket: `features(table)`); else with `cfg` (None: looked up)."""
    table, by = op + ".bwd", backends.TABLE[backend].gradients
    if by is None:
        raise ValueError(f"unknown kernel backend {backend!r}")
    if plan is not None:
        cfg = plan.backward.get("config")
    if cfg is None:
        cfg = config(table, by, features(table))
        if plan is not None:
            plan.backward["config"] = cfg
    fast = {}
    if plan is not None:
        from flashswitch.kernels_triton.kernel_call import fast_launch_wanted
        fast = {"fast": fast_launch_wanted(args[0].device)}
    enqueue = backends.launcher(by, op, "backward")(*args, **scalars, config=cfg, **fast)
    if plan is not None:
        plan.backward[key] = enqueue
    return enqueue


__all__ = ["PlanCache", "Plan", "ENV_VARS", "backward_launch", "check_state", "clear_all", "complete_config",
           "config", "forward_launch", "key_or_none", "optional_tensor_key", "resolve", "scalar_key", "tensor_key"]
