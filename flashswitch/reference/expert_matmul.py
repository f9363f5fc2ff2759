"""Op 3 references: `numpy_expert_matmul` (fp64 oracle, one (token, slot) pair at a time) and
`torch_expert_matmul` (vectorized gather -> per-expert GEMM -> scatter, differentiable), the same as one
custom op for traced calls (`torch_expert_matmul_op`), plus `random_problem` and `paper_shapes` used by
tests, check, bench and tune."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from flashswitch.testing import to_numpy64

ROUTINGS = ("random", "one_hot", "duplicates", "sparse")


def _groups(S: int, x_ndim: int, x_shape, out_groups):
    """(G_in, G_out) with the SPEC's divisibility rules, or ValueError naming the argument."""
    if x_ndim == 2:
        G_in = 1
    elif x_ndim == 3:
        G_in = x_shape[1]
        if G_in < 1 or S % G_in:
            raise ValueError(f"x has {G_in} input groups, which must divide the {S} slots of expert_idx")
    else:
        raise ValueError(f"x must be [T, d_in] or [T, G_in, d_in], got shape {tuple(x_shape)}")
    G_out = S if out_groups is None else int(out_groups)
    if G_out < 1 or S % G_out:
        raise ValueError(f"out_groups must divide the {S} slots of expert_idx, got {out_groups}")
    return G_in, G_out


def _check_ids(expert_idx, E: int) -> None:
    if expert_idx.size and (expert_idx.min() < 0 or expert_idx.max() >= E):
        raise ValueError(f"expert_idx values must lie in [0, {E}), got range "
                         f"[{int(expert_idx.min())}, {int(expert_idx.max())}]")


# ---------------------------------------------------------------- fp64 oracle
def numpy_expert_matmul(x, expert_idx, weight, *, gates=None, out_groups=None):
    """fp64 oracle. x [T, d_in] or [T, G_in, d_in]; expert_idx [T, S]; weight [E, d_in, d_out];
    returns numpy float64 y [T, G_out, d_out]."""
    x, weight, gates = to_numpy64(x), to_numpy64(weight), to_numpy64(gates)
    idx = expert_idx.detach().cpu().numpy() if isinstance(expert_idx, torch.Tensor) else np.asarray(expert_idx)
    idx = idx.astype(np.int64)
    T, S = idx.shape
    E, d_in, d_out = weight.shape
    G_in, G_out = _groups(S, x.ndim, x.shape, out_groups)
    _check_ids(idx, E)
    y = np.zeros((T, G_out, d_out))
    for t in range(T):
        for s in range(S):
            row = x[t] if x.ndim == 2 else x[t, s // (S // G_in)]
            g = 1.0 if gates is None else gates[t, s]
            y[t, s // (S // G_out)] += g * (row @ weight[idx[t, s]])
    return y


# ---------------------------------------------------------------- vectorized reference
def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pair_rows(t: torch.Tensor, S: int, acc: torch.dtype) -> torch.Tensor:
    """[T·S, d] in acc: the row of t ([T, d] or [T, G, d]) that pair p = t·S + s reads, (t, s // (S / G))."""
    T, d = t.shape[0], t.shape[-1]
    G = 1 if t.dim() == 2 else t.shape[1]
    pair = torch.arange(T * S, device=t.device)
    return t.to(acc).reshape(T * G, d)[pair // S * G + pair % S // (S // G)]


def _by_expert(expert_idx: torch.Tensor, E: int, device) -> tuple[torch.Tensor, list]:
    """(the pairs with an id in [0, E), stably sorted by expert; their count per expert, a host list).
    Ids outside [0, E) sort past the last expert and are cut off: their pairs belong to no expert."""
    idx = expert_idx.to(device=device, dtype=torch.int64).reshape(-1)  # pair p = t * S + s
    key = torch.where((idx >= 0) & (idx < E), idx, E)
    counts = torch.bincount(key, minlength=E + 1).tolist()[:E]
    return torch.sort(key, stable=True).indices[:sum(counts)], counts


def torch_expert_matmul(x, expert_idx, weight, *, gates=None, out_groups=None, check=True):
    """Pairs sorted by expert, one GEMM per expert, scattered back: fp32 math (fp64 for fp64 x),
    differentiable in x, weight and gates. Returns y [T, G_out, d_out] in x's dtype.
    check: ids outside [0, E) raise ValueError (one more host sync); False drops their pairs, as
    route(check=False) does."""
    T, S = expert_idx.shape
    E, d_in, d_out = weight.shape
    _, G_out = _groups(S, x.dim(), tuple(x.shape), out_groups)
    acc = _acc(x.dtype)
    dev = x.device
    if check and expert_idx.numel() and (int(expert_idx.min()) < 0 or int(expert_idx.max()) >= E):
        raise ValueError(f"expert_idx values must lie in [0, {E}), got range "
                         f"[{int(expert_idx.min())}, {int(expert_idx.max())}]")
    rows = _pair_rows(x, S, acc)  # [P, d_in]
    order, counts = _by_expert(expert_idx, E, dev)
    w = weight.to(acc)
    pieces = [rows[sel] @ w[e] for e, sel in enumerate(torch.split(order, counts)) if counts[e]]
    out_sorted = torch.cat(pieces) if pieces else rows.new_zeros(0, d_out)
    out = torch.zeros(T * S, d_out, dtype=acc, device=dev).index_copy(0, order, out_sorted)
    if gates is not None:
        out = out * gates.to(acc).reshape(-1, 1)
    y = out.reshape(T, G_out, S // G_out, d_out).sum(2)
    return y.to(x.dtype)


def torch_expert_matmul_dweight(x, expert_idx, dy, num_experts: int, *, gates=None):
    """d weight of torch_expert_matmul (ids outside [0, E) dropped) for the upstream gradient dy
    [T, G_out, d_out]: [E, d_in, d_out] in fp32 (fp64 for fp64 x), expert e's input rows times their
    gated rows of dy, summed over its pairs; zero for an expert with no pairs."""
    S = expert_idx.shape[1]
    acc = _acc(x.dtype)
    rows, dout = _pair_rows(x, S, acc), _pair_rows(dy, S, acc)
    if gates is not None:
        dout = dout * gates.to(acc).reshape(-1, 1)
    order, counts = _by_expert(expert_idx, num_experts, x.device)
    dw = rows.new_zeros(num_experts, rows.shape[1], dout.shape[1])
    for e, sel in enumerate(torch.split(order, counts)):
        if counts[e]:
            dw[e] = rows[sel].T @ dout[sel]
    return dw


# ---------------------------------------------------------------- the reference, traced
# A traced graph cannot hold the reference's per-expert split (its sizes are the ids' counts, read on the
# host), so a traced call on the reference backend (ops/expert_matmul.py) runs it as one opaque op.
# Eager calls run the torch code itself, which torch.func and forward-mode AD differentiate; the op's
# backward is written with the op and a d weight op of the same kind.
@torch.library.custom_op("flashswitch::expert_matmul_reference", mutates_args=())
def torch_expert_matmul_op(x: torch.Tensor, expert_idx: torch.Tensor, weight: torch.Tensor,
                           gates: Optional[torch.Tensor], G_out: int) -> torch.Tensor:
    return torch_expert_matmul(x, expert_idx, weight, gates=gates, out_groups=G_out, check=False)


@torch_expert_matmul_op.register_fake
def _(x, expert_idx, weight, gates, G_out):
    return x.new_empty((x.shape[0], G_out, weight.shape[2]))


@torch.library.custom_op("flashswitch::expert_matmul_reference_dweight", mutates_args=())
def torch_expert_matmul_dweight_op(x: torch.Tensor, expert_idx: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
                                   gates: Optional[torch.Tensor]) -> torch.Tensor:
    return torch_expert_matmul_dweight(x, expert_idx, dy, weight.shape[0], gates=gates).to(weight.dtype)


@torch_expert_matmul_dweight_op.register_fake
def _(x, expert_idx, weight, dy, gates):
    return weight.new_empty(weight.shape)


def _op_setup_context(ctx, inputs, output):
    x, expert_idx, weight, gates, G_out = inputs
    ctx.save_for_backward(x, expert_idx, weight, gates)


def _op_backward(ctx, dy):
    x, expert_idx, weight, gates = ctx.saved_tensors
    need_x, _, need_weight, need_gates = ctx.needs_input_grad[:4]
    acc = _acc(x.dtype)  # the reference's math: fp32, fp64 for fp64 x
    S = expert_idx.shape[1]
    dx = dw = dg = None
    if need_x:  # y is linear in x: dx is the op over dy and the transposed experts, summed per input group
        G_in = 1 if x.dim() == 2 else x.shape[1]
        dx = torch_expert_matmul_op(dy.to(acc), expert_idx, weight.transpose(1, 2), gates, G_in).view(x.shape)
        dx = dx.to(x.dtype)
    if need_weight:
        dw = torch_expert_matmul_dweight_op(x, expert_idx, weight, dy, gates)
    if need_gates and gates is not None:  # dgates[t, s] = <x_row(t, s) @ W[id], dy[t, s // (S / G_out)]>
        pairs = torch_expert_matmul_op(x.to(acc), expert_idx, weight, None, S)  # ungated, one output group per slot
        dg = (pairs * dy.to(acc).repeat_interleave(S // dy.shape[1], 1)).sum(-1).to(gates.dtype)
    return dx, None, dw, dg, None


torch_expert_matmul_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ---------------------------------------------------------------- test problems
def _routing(T: int, S: int, E: int, routing: str, g: torch.Generator) -> torch.Tensor:
    """[T, S] int64 expert ids following one of ROUTINGS."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")

    def pick(pool: int) -> torch.Tensor:  # S ids per token from [0, pool): distinct when possible
        if S <= pool:
            return torch.rand(T, pool, generator=g).argsort(-1)[:, :S]
        return torch.randint(0, pool, (T, S), generator=g)

    if routing == "one_hot":
        e = int(torch.randint(0, E, (1,), generator=g))
        return torch.full((T, S), e, dtype=torch.int64)
    if routing == "sparse":  # only even experts receive pairs (odd ones stay empty when E >= 2)
        return pick((E + 1) // 2) * 2
    idx = pick(E)
    if routing == "duplicates" and S >= 2 and T:
        dup = torch.rand(T, generator=g) < 0.5
        dup[0] = True
        idx[dup, 1] = idx[dup, 0]
    return idx


def random_problem(T=64, S=4, E=6, d_in=40, d_out=24, *, G_in=None, G_out=None, gated=True, routing="random",
                   dtype=torch.float32, weight_dtype=None, device="cpu", seed=0, index_dtype=torch.int64):
    """Fresh random inputs for op 3 (never zeros): dict(x, expert_idx, num_experts, weight, gates,
    out_groups). G_in None -> x is [T, d_in]; G_out None -> out_groups None (= S). `routing`:
    "random" (distinct experts per token), "one_hot" (every pair on one expert), "duplicates" (tokens
    picking one expert twice), "sparse" (odd experts get no pairs). weight_dtype None -> dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    x_shape = (T, d_in) if G_in is None else (T, G_in, d_in)
    x = torch.randn(*x_shape, generator=g)
    weight = torch.randn(E, d_in, d_out, generator=g) * (max(d_in, 1) ** -0.5)
    expert_idx = _routing(T, S, E, routing, g)
    gates = torch.sigmoid(torch.randn(T, S, generator=g)) if gated else None
    return dict(x=x.to(dtype=dtype, device=device),
                expert_idx=expert_idx.to(dtype=index_dtype, device=device),
                num_experts=E,
                weight=weight.to(dtype=weight_dtype, device=device),
                gates=None if gates is None else gates.to(dtype=dtype, device=device),
                out_groups=G_out)


def paper_shapes(T: int = 16384) -> dict:
    """Keyword arguments of `random_problem` for the paper cases of SPEC "Op 3", with T tokens.

    SwitchHead 262M: d_model 1024, 4 heads x 4 experts (16), k 2 (S 8), d_head 112.
    SwitchHead 47M: d_model 412, 2 heads x 5 experts (10), k 3 (S 6), d_head 76.
    sigma-MoE: d_model 1024, 512 experts of size 128, k 8."""
    return {
        "switchhead262m_v": dict(T=T, S=8, E=16, d_in=1024, d_out=112, G_out=4, gated=True),
        "switchhead262m_o": dict(T=T, S=8, E=16, d_in=112, d_out=1024, G_in=4, G_out=1, gated=True),
        "sigma_moe_up": dict(T=T, S=8, E=512, d_in=1024, d_out=128, G_out=8, gated=False),
        "sigma_moe_down": dict(T=T, S=8, E=512, d_in=128, d_out=1024, G_in=8, G_out=1, gated=True),
        "switchhead47m_v": dict(T=T, S=6, E=10, d_in=412, d_out=76, G_out=2, gated=True),
        "switchhead47m_o": dict(T=T, S=6, E=10, d_in=76, d_out=412, G_in=2, G_out=1, gated=True),
    }
