"""torch.func transforms and forward-mode AD over the ops. The kernel backends differentiate through
torch.autograd (reverse mode, their Triton backward) and batch under torch.vmap; torch.func's grad /
jvp transforms and forward-mode AD reach only the PyTorch reference: backend "auto" then runs it, a
kernel backend asked for by name raises ValueError naming `backend` (before, grad raised torch's
internal error and jvp returned a zero tangent)."""
import pytest
import torch
from torch.autograd import forward_ad

from conftest import kernel_backends
import flashswitch
from flashswitch import registry

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(op: str) -> tuple[dict, str]:
    """(problem, name of the input to differentiate in) of a small fp32 problem."""
    spec = registry.get(op)
    if op == "chunk_summaries":
        return spec.random_problem(B=1, H=2, N=19, D=16, C=4, omega="head", key_weight=True,
                                   device=DEVICE, seed=1), "k"
    if op == "eva_attention":
        return spec.random_problem(B=1, H=4, Hkv=2, Nq=12, Nk=40, D=16, C=4, W=8, summary_bias="tensor",
                                   device=DEVICE, seed=1), "k"
    p = spec.random_problem(T=9, S=4, E=3, d_in=16, d_out=16, G_out=2, device=DEVICE, seed=1)
    p["route"] = flashswitch.route(p.pop("expert_idx"), p.pop("num_experts"))
    return p, "x"


def _fn(op: str, p: dict, name: str, backend: str):
    """t -> a scalar loss of the op's outputs with input `name` replaced by t."""
    def f(t):
        q = {**p, name: t}
        if op == "expert_matmul":
            out = (flashswitch.expert_matmul(q["x"], q["route"], q["weight"], gates=q["gates"],
                                             out_groups=q["out_groups"], backend=backend),)
        else:
            out = getattr(flashswitch, op)(**q, return_lse=True, backend=backend)
        return sum((o.float() * (i + 1)).square().sum() for i, o in enumerate(out))
    return f


OPS = ["chunk_summaries", "eva_attention", "expert_matmul"]


@pytest.fixture
def auto_is_a_kernel(monkeypatch):
    """backend "auto" resolves to the first kernel backend here (on the CPU: Triton under the
    interpreter), as it does on a GPU."""
    backends = kernel_backends()
    if not backends:
        pytest.skip("no kernel backend here")
    monkeypatch.setenv("FLASHSWITCH_BACKEND", backends[0])
    return backends[0]


@pytest.mark.parametrize("op", OPS)
def test_func_grad_and_jvp_run_the_reference_under_auto(op, auto_is_a_kernel):
    p, name = _problem(op)
    t = p[name]
    ref, auto = _fn(op, p, name, "reference"), _fn(op, p, name, "auto")
    torch.testing.assert_close(torch.func.grad(auto)(t), torch.func.grad(ref)(t), rtol=1e-5, atol=1e-6)
    tangent = torch.randn_like(t)
    torch.testing.assert_close(torch.func.jvp(auto, (t,), (tangent,))[1],
                               torch.func.jvp(ref, (t,), (tangent,))[1], rtol=1e-5, atol=1e-5)
    batched = torch.stack([t, 2 * t])
    torch.testing.assert_close(torch.vmap(torch.func.grad(auto))(batched),
                               torch.vmap(torch.func.grad(ref))(batched), rtol=1e-5, atol=1e-6)
    # reverse-mode autograd and a no-grad call still run the kernels: the reference's results to rounding
    leaf = t.detach().requires_grad_()
    g, = torch.autograd.grad(auto(leaf), leaf)
    torch.testing.assert_close(g, torch.func.grad(ref)(t), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("op", OPS)
def test_kernel_backend_refuses_func_transforms_and_forward_ad(op, backend):
    p, name = _problem(op)
    t, f = p[name], _fn(op, p, name, backend)
    with pytest.raises(ValueError, match=f"backend '{backend}'.*grad transform"):
        torch.func.grad(f)(t)
    with pytest.raises(ValueError, match=f"backend '{backend}'.*jvp transform"):
        torch.func.jvp(f, (t,), (torch.ones_like(t),))
    with forward_ad.dual_level(), pytest.raises(ValueError, match=f"backend '{backend}'.*forward-mode AD"):
        f(forward_ad.make_dual(t, torch.ones_like(t)))


@pytest.mark.parametrize("op", OPS)
def test_forward_ad_runs_the_reference_under_auto(op, auto_is_a_kernel):
    p, name = _problem(op)
    t, tangent = p[name], torch.randn_like(p[name])
    with forward_ad.dual_level():
        got = forward_ad.unpack_dual(_fn(op, p, name, "auto")(forward_ad.make_dual(t, tangent))).tangent
        want = forward_ad.unpack_dual(_fn(op, p, name, "reference")(forward_ad.make_dual(t, tangent))).tangent
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_layer_kernels_step_aside_under_transforms():
    """The layers' fused Triton kernels (ops/layers.py) run only where C.eager_fast_path /
    eager_autograd_path allow: never under a functorch transform or a forward-mode AD level, whose
    tangents and batching only the torch versions carry."""
    from flashswitch import _common as C
    t = torch.randn(4, device=DEVICE)
    assert C.eager_fast_path(t) and C.eager_autograd_path(t)
    with forward_ad.dual_level():
        assert not C.eager_fast_path(t) and not C.eager_autograd_path(t)
    seen = []

    def f(x):
        seen.append((C.eager_fast_path(x), C.eager_autograd_path(x)))
        return x.sum()
    torch.func.grad(f)(t)
    torch.vmap(f)(t[None])
    torch.func.jvp(f, (t,), (t,))
    assert seen == [(False, False)] * 3
