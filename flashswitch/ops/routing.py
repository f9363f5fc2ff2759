"""Op 3's routing: `route` sorts the (token, slot) pairs of a routing decision by expert on the device, with
no host synchronisation (optional range check aside), into a `Route`, which `expert_matmul`
(ops/expert_matmul.py) runs over. SPEC.md, "Op 3", defines the math.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from flashswitch import _common as C

INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_PAIRS = 2 ** 31 - 1
ROUTE_ENV = "FLASHSWITCH_ROUTE"  # "device" (default): the extension's one-call sort; "torch": torch ops


@dataclass(frozen=True, eq=False)
class Route:
    """The pairs p = (t, s) of an `expert_idx` [T, S], stably sorted by expert (ties keep p = t·S + s order).

    Tensors (all on expert_idx's device, computed without a host sync):
    - `token`, `slot`: int32 [P] (P = T·S): the token and slot of the i-th pair in expert order.
      Within one expert the pairs are in increasing (t, s) order.
    - `offsets`: int64 [E+1]: expert e owns sorted positions [offsets[e], offsets[e+1]).
    - `expert_idx`: the [T, S] tensor the route was built from (the reference backend reads it;
      None in routes rebuilt from the sorted tensors alone).
    Sizes: `T`, `S`, `E` (= num_experts).

    The backward pass needs `token`, `slot` and `offsets` (d weight[e] = Σ over expert e's rows of
    x_rowᵀ·dy_row, exactly zero for an empty expert; d x and d gates gather the same rows) and
    `position` (the inverse permutation: sorted position of pair t·S + s), computed lazily.

    A Route built by hand is checked when it is made (dtypes, devices, lengths: TypeError / ValueError
    naming the field) and its values once, the first time `expert_matmul` uses it (`validate()`: one
    host sync; call it beforehand to keep the sync out of a CUDA-graph capture). Routes from `route()`
    need no value check.
    """
    token: torch.Tensor
    slot: torch.Tensor
    offsets: torch.Tensor
    expert_idx: Optional[torch.Tensor]
    T: int
    S: int
    E: int

    def __post_init__(self):
        for name in ("T", "S", "E"):
            v = getattr(self, name)
            if isinstance(v, torch.SymInt):  # traced with dynamic shapes: checked when it runs
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "T" else 1):
                raise ValueError(f"Route.{name} must be an int >= {0 if name == 'T' else 1}, got {v!r}")
        P = self.T * self.S
        for name, dtype, n in (("token", torch.int32, P), ("slot", torch.int32, P), ("offsets", torch.int64, self.E + 1)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Route.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"Route.{name} has dtype {t.dtype}; expected {dtype}")
            if tuple(t.shape) != (n,):
                raise ValueError(f"Route.{name} has shape {tuple(t.shape)}; expected ({n},)")
            if t.device != self.offsets.device:
                raise ValueError(f"Route.{name} is on {t.device} but offsets is on {self.offsets.device}")
        if self.expert_idx is not None and (not isinstance(self.expert_idx, torch.Tensor)
                                            or tuple(self.expert_idx.shape) != (self.T, self.S)):
            raise ValueError(f"Route.expert_idx must be None or a [T, S] = [{self.T}, {self.S}] tensor")

    def validate(self) -> "Route":
        """Check the values (one host sync): offsets start at 0, never decrease and end within the pairs;
        tokens and slots are in range. Raises ValueError naming the field; returns the route."""
        if not getattr(self, "_values_ok", False):
            P = self.T * self.S
            off = self.offsets
            bad = None
            if off.numel() and (int(off[0]) != 0 or bool((off[1:] < off[:-1]).any()) or int(off[-1]) > P):
                bad = f"Route.offsets must start at 0, never decrease and end at most at the {P} pairs"
            elif P and (bool(((self.token < 0) | (self.token >= self.T)).any())
                        or bool(((self.slot < 0) | (self.slot >= self.S)).any())):
                bad = f"Route.token / Route.slot hold values outside [0, T) = [0, {self.T}) / [0, S) = [0, {self.S})"
            if bad:
                raise ValueError(bad)
            object.__setattr__(self, "_values_ok", True)
        return self

    @property
    def num_pairs(self) -> int:
        return self.T * self.S

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @property
    def counts(self) -> torch.Tensor:
        """int64 [E]: pairs per expert (device tensor, no sync)."""
        return self.offsets[1:] - self.offsets[:-1]

    @functools.cached_property
    def position(self) -> torch.Tensor:
        """int32 [T·S]: the sorted position of pair p = t·S + s (device, no sync)."""
        P = self.num_pairs
        pos = torch.empty(P, dtype=torch.int32, device=self.device)
        pair = self.token.to(torch.int64) * self.S + self.slot.to(torch.int64)
        pos[pair] = torch.arange(P, dtype=torch.int32, device=self.device)
        return pos


def _sort_key_dtype(E: int) -> torch.dtype:
    """The narrowest signed dtype holding [0, E]: fewer radix passes in the device sort."""
    if E + 1 <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def route(expert_idx: torch.Tensor, num_experts: int, *, check: bool = True) -> Route:
    """Sort the routed (token, slot) pairs of `expert_idx` [T, S] (int32/int64, values in [0, E)) by expert.

    Runs on expert_idx's device with no host synchronisation, except the range check of
    `check=True` (one sync; raises ValueError when an id is outside [0, num_experts)). Pass
    `check=False` inside CUDA-graph capture and torch.compile(fullgraph=True): out-of-range ids are
    then dropped from the route (pairs below 0 or at/above E belong to no expert) and their outputs
    are unspecified.
    """
    if not isinstance(expert_idx, torch.Tensor):
        raise TypeError(f"expert_idx must be a torch.Tensor, got {type(expert_idx).__name__}")
    if expert_idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"expert_idx has dtype {expert_idx.dtype}; expected int32 or int64")
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must be [T, S] (2 dims), got shape {tuple(expert_idx.shape)}")
    E = C.check_positive_int("num_experts", num_experts)
    if E >= 2 ** 31 - 1:
        raise ValueError(f"num_experts must be < 2**31 - 1, got {E}")
    T, S = expert_idx.shape
    if S < 1:
        raise ValueError(f"expert_idx must have at least one slot per token, got shape {tuple(expert_idx.shape)}")
    P = T * S
    if P > _MAX_PAIRS:
        raise ValueError(f"expert_idx has {P} pairs; at most 2**31 - 1 are supported")
    dev = expert_idx.device
    if check and P:
        lo, hi = torch.stack(torch.aminmax(expert_idx)).tolist()  # the one sync
        if lo < 0 or hi >= E:
            raise ValueError(f"expert_idx values {lo}..{hi} out of range [0, num_experts) = [0, {E})")

    # is_compiling first: the availability check imports the extension, which a traced graph cannot
    if dev.type == "cuda" and not torch.compiler.is_compiling() and _device_route_wanted():
        token, slot, offsets = torch.ops.flashswitch_C.route_fwd(expert_idx, E)  # one call, no sync
    else:
        token, slot, offsets = _torch_route(expert_idx, E, clamp=not check)
    if torch.compiler.is_compiling():
        # dynamo (torch 2.11) cannot trace the __dict__ update below; the constructor's checks run at trace time only
        return _trusted(Route(token=token, slot=slot, offsets=offsets, expert_idx=expert_idx, T=T, S=S, E=E))
    # every field right by construction: Route's checks (__post_init__, several microseconds) skipped
    rt = Route.__new__(Route)
    rt.__dict__.update(token=token, slot=slot, offsets=offsets, expert_idx=expert_idx, T=T, S=S, E=E)
    return _trusted(rt)


def _trusted(rt: Route) -> Route:
    """A route whose values are right by construction (route(), or rebuilt inside the custom ops)."""
    object.__setattr__(rt, "_values_ok", True)
    return rt


def _device_route_wanted() -> bool:
    """The extension has the device routing op (kernels_cuda/route.cu) and FLASHSWITCH_ROUTE is not
    "torch": one C++ call instead of ~8 torch launches, most of route()'s cost on a slow host. Both
    give the same route (bitwise, tests/test_expert_matmul_cuda.py)."""
    return C.env_get(ROUTE_ENV) != "torch" and _device_route_available()


@functools.lru_cache(maxsize=None)
def _device_route_available() -> bool:
    from flashswitch.bindings import cuda as B
    return B.available() and hasattr(torch.ops.flashswitch_C, "route_fwd")


def _torch_route(expert_idx: torch.Tensor, E: int, *, clamp: bool = True):
    """(token, slot, offsets) with torch ops: the same order as route_fwd (a stable sort of the ids
    clamped to [-1, E]). `clamp=False` when the ids are known to lie in [0, E)."""
    S = expert_idx.shape[1]
    key_dtype = _sort_key_dtype(E)
    flat = expert_idx.reshape(-1)
    if clamp:
        flat = flat.clamp(-1, E)  # out-of-range ids stay outside [0, E) once narrowed: dropped, never wrapped in
    keys = flat.to(key_dtype)
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(E + 1, dtype=key_dtype, device=expert_idx.device)
    offsets = torch.searchsorted(sorted_keys, bounds)  # int64 [E+1], offsets[e] = #pairs with id < e
    pair = order.to(torch.int32)
    token = torch.div(pair, S, rounding_mode="floor")
    slot = pair % S
    return token, slot, offsets


__all__ = ["ROUTE_ENV", "Route", "route"]
