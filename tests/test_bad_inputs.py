"""Bad arguments give a TypeError/ValueError whose message names the offending argument.

One section per op. Messages are matched on the argument's name at the start of the message
(`match="^k "`), so an error about another argument cannot pass by accident.
"""
import pytest
import torch

from conftest import DEVICE
import flashswitch

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


# ================================================================ op 1: chunk_summaries
def _cs_args(B=2, H=3, N=10, D=8, C=4, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, H, N, D, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(B, H, N, D, generator=g).to(dtype=dtype, device=device)
    return k, v, C


def _cs(**kw):
    """chunk_summaries on a valid problem with the given arguments replaced."""
    k, v, C = _cs_args()
    args = dict(k=k, v=v, chunk_size=C)
    args.update(kw)
    k, v, C = args.pop("k"), args.pop("v"), args.pop("chunk_size")
    return flashswitch.chunk_summaries(k, v, C, **args)


def test_cs_valid_problem_runs():
    k, v, C = _cs_args()
    k_sum, v_sum = flashswitch.chunk_summaries(k, v, C)
    assert k_sum.shape == v_sum.shape == (2, 3, 3, 8)


@pytest.mark.parametrize("name", ["k", "v"])
def test_cs_not_a_tensor(name):
    with pytest.raises(TypeError, match=f"^{name} "):
        _cs(**{name: [[1.0]]})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.float64])
def test_cs_k_dtype(dtype):
    k, v, C = _cs_args()
    with pytest.raises(TypeError, match="^k "):
        _cs(k=k.to(dtype), v=v.to(dtype))


def test_cs_v_dtype_mismatch():
    k, v, C = _cs_args()
    with pytest.raises(TypeError, match="^v "):
        _cs(v=v.half())
    with pytest.raises(TypeError, match="^v "):
        _cs(v=v.int())


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("shape", [(3, 10, 8), (1, 2, 3, 10, 8), ()])
def test_cs_ndim(name, shape):
    k, v, C = _cs_args()
    with pytest.raises(ValueError, match=f"^{name} "):
        _cs(**{name: torch.randn(shape, device=DEVICE)})


@pytest.mark.parametrize("shape", [(2, 3, 11, 8), (2, 3, 10, 7), (1, 3, 10, 8), (2, 1, 10, 8)])
def test_cs_v_shape(shape):
    with pytest.raises(ValueError, match="^v "):
        _cs(v=torch.randn(shape, device=DEVICE))


@pytest.mark.parametrize("shape", [(3, 7), (2, 8), (8,), (3, 1, 8), (2, 3, 2, 8), (2, 3, 3, 7), (1, 3, 3, 8),
                                   (2, 3, 10, 8)])
def test_cs_omega_shape(shape):
    with pytest.raises(ValueError, match="^omega "):
        _cs(omega=torch.randn(shape, device=DEVICE))


def test_cs_omega_dtype_and_type():
    with pytest.raises(TypeError, match="^omega "):
        _cs(omega=torch.ones(3, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="^omega "):
        _cs(omega=[[0.0] * 8] * 3)


@pytest.mark.parametrize("shape", [(3, 7), (2, 8), (8,), (1, 3, 8)])
def test_cs_key_weight_shape(shape):
    with pytest.raises(ValueError, match="^key_weight "):
        _cs(key_weight=torch.randn(shape, device=DEVICE))


def test_cs_key_weight_dtype():
    with pytest.raises(TypeError, match="^key_weight "):
        _cs(key_weight=torch.ones(3, 8, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("shape", [(2, 11), (1, 10), (10,), (2, 1, 10)])
def test_cs_valid_shape(shape):
    with pytest.raises(ValueError, match="^valid "):
        _cs(valid=torch.ones(shape, dtype=torch.bool, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.uint8])
def test_cs_valid_dtype(dtype):
    with pytest.raises(TypeError, match="^valid "):
        _cs(valid=torch.ones(2, 10, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("value,error", [(0, ValueError), (-3, ValueError), (4.0, TypeError), (True, TypeError),
                                         (None, TypeError), ("4", TypeError)])
def test_cs_chunk_size(value, error):
    with pytest.raises(error, match="^chunk_size "):
        _cs(chunk_size=value)


@pytest.mark.parametrize("value", ["0.5", True, torch.tensor(0.5)])
def test_cs_scale(value):
    with pytest.raises(TypeError, match="^scale "):
        _cs(scale=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 0.0, -0.5])
def test_scale_must_be_finite_and_positive(value):
    """A NaN, infinite or non-positive scale is refused by name (it would give NaN or a meaningless softmax)."""
    with pytest.raises(ValueError, match="^scale "):
        _cs(scale=value)
    k = torch.randn(1, 2, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="^scale "):
        flashswitch.eva_attention(k, k, k, k[:, :, :2], k[:, :, :2], chunk_size=4, window_size=4, scale=value)


@pytest.mark.parametrize("name", ["k", "v", "omega", "key_weight"])
def test_cs_last_dim_not_contiguous(name):
    k, v, C = _cs_args()
    full = {"k": k, "v": v, "omega": torch.randn(2, 3, 3, 8, device=DEVICE),
            "key_weight": torch.randn(3, 8, device=DEVICE)}[name]
    strided = full.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, last stride != 1
    assert strided.stride(-1) != 1
    with pytest.raises(ValueError, match=f"^{name} .*contiguous"):
        _cs(**{name: strided})


@pytest.mark.parametrize("backend", ["numpy", "Triton", "", None])
def test_cs_unknown_backend(backend):
    with pytest.raises(ValueError, match="^backend "):
        _cs(backend=backend)


@pytest.mark.skipif(HAS_GPU, reason="CPU tensors only")
@pytest.mark.parametrize("backend", ["cuda", "cupy"])
def test_cs_gpu_backend_on_cpu(backend):
    with pytest.raises(ValueError, match=f"^backend '{backend}' is not available"):
        _cs(backend=backend)


@needs_gpu
@pytest.mark.parametrize("name", ["v", "omega", "key_weight", "valid"])
def test_cs_device_mix(name):
    k, v, C = _cs_args(device="cuda")
    cpu = {"v": v.cpu(), "omega": torch.randn(3, 8), "key_weight": torch.randn(3, 8),
           "valid": torch.ones(2, 10, dtype=torch.bool)}[name]
    with pytest.raises(ValueError, match=f"^{name} .*device"):
        _cs(**{"k": k, "v": v, name: cpu})


@needs_gpu
def test_cs_k_on_cpu_v_on_gpu():
    k, v, C = _cs_args()
    with pytest.raises(ValueError, match="^v "):
        _cs(k=k.cpu(), v=v.cuda())


# ================================================================ op 2: eva_attention
def _ea_args(**head_dims):
    """q, k, v, k_sum, v_sum of a small valid problem (head dim 8), `head_dims` giving some another."""
    g = torch.Generator().manual_seed(0)
    shapes = dict(q=(1, 4, 8), k=(1, 2, 8), v=(1, 2, 8), k_sum=(1, 2, 2), v_sum=(1, 2, 2))
    return {name: torch.randn(*shape, head_dims.get(name, 8), generator=g).to(DEVICE)
            for name, shape in shapes.items()}


def test_ea_valid_problem_runs():
    assert flashswitch.eva_attention(**_ea_args(), chunk_size=4, window_size=4).shape == (1, 4, 8, 8)


@pytest.mark.parametrize("changed,message", [
    (dict(q=16, k=32, v=32, k_sum=32, v_sum=32), "k has head dim 32 but q has head dim 16"),
    (dict(q=16), "k has head dim 8 but q has head dim 16"),
    (dict(v=4), "v has head dim 4 but k has head dim 8"),
    (dict(k_sum=16), "k_sum has head dim 16 but k has head dim 8"),
    (dict(v_sum=4), "v_sum has head dim 4 but k_sum has head dim 8"),
])
def test_ea_head_dims_that_differ_are_named(changed, message):
    """A head dim that differs is reported as such, with the tensor it must match (not as a whole shape
    against an expected one assembled from several tensors)."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        flashswitch.eva_attention(**_ea_args(**changed), chunk_size=4, window_size=4)


def _window_users():
    """Every constructor or call that takes chunk_size and window_size, as f(chunk_size, window_size)."""
    from flashswitch.nn import EvaAttention
    yield "eva_attention", lambda C, W: flashswitch.eva_attention(**_ea_args(), chunk_size=C, window_size=W)
    yield "EvaCache", lambda C, W: flashswitch.EvaCache(1, 2, 8, chunk_size=C, window_size=W, max_seq_len=16)
    yield "EvaAttention", lambda C, W: EvaAttention(16, 2, chunk_size=C, window_size=W)


@pytest.mark.parametrize("user", [name for name, _ in _window_users()])
@pytest.mark.parametrize("C,W,message", [
    (8, 4, r"window_size must be >= chunk_size \(and a multiple of it\), got window_size=4, chunk_size=8"),
    (4, 6, r"window_size must be a multiple of chunk_size, got window_size=6, chunk_size=4"),
], ids=["below the chunk", "not a multiple"])
def test_ea_window_size_rule(user, C, W, message):
    """SPEC "Op 2": W >= C and W % C == 0. A window below the chunk is told as that, not as "not a multiple"."""
    call = dict(_window_users())[user]
    with pytest.raises(ValueError, match=f"^{message}$"):
        call(C, W)


# ---------------------------------------------------------------- environment variables
def test_bad_backend_variable_names_it(monkeypatch):
    monkeypatch.setenv("FLASHSWITCH_BACKEND", "tritn")
    k = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="FLASHSWITCH_BACKEND"):
        flashswitch.chunk_summaries(k, k, 4)


@pytest.mark.parametrize("value,on", [("0", False), ("false", False), ("No", False), ("OFF", False), ("", False),
                                      ("1", True), ("yes", True), ("true", True)])
def test_poison_variable_reads_off_words(monkeypatch, value, on):
    from flashswitch._common import new_output, poison_outputs
    monkeypatch.setenv("FLASHSWITCH_POISON", value)
    assert poison_outputs() == on
    if on:
        assert torch.isnan(new_output((3,), torch.float32, torch.device("cpu"))).all()
        assert (new_output((3,), torch.int64, torch.device("cpu")) == torch.iinfo(torch.int64).min).all()


# ---------------------------------------------------------------- hand-built routes (op 3)
def _route_parts(T=6, S=2, E=3):
    rt = flashswitch.route(torch.randint(0, E, (T, S), device=DEVICE), E)
    return dict(token=rt.token, slot=rt.slot, offsets=rt.offsets, expert_idx=None, T=T, S=S, E=E)


@pytest.mark.parametrize("field,value,err", [
    ("token", lambda p: p["token"].long(), TypeError),
    ("slot", lambda p: p["slot"][:-1], ValueError),
    ("offsets", lambda p: p["offsets"].int(), TypeError),
    ("offsets", lambda p: p["offsets"][:-1], ValueError),
    ("token", lambda p: [0] * 12, TypeError),
    ("E", lambda p: 0, ValueError),
])
def test_hand_built_route_fields(field, value, err):
    p = _route_parts()
    p[field] = value(p)
    with pytest.raises(err, match=f"^Route.{field} "):
        flashswitch.Route(**p)


@pytest.mark.parametrize("break_it", ["offsets past the pairs", "offsets decrease", "token out of range",
                                      "slot out of range"])
def test_hand_built_route_values_are_checked_before_any_kernel(break_it):
    p = _route_parts()
    if break_it == "offsets past the pairs":
        p["offsets"] = p["offsets"].clone()
        p["offsets"][-1] = 1000
    elif break_it == "offsets decrease":
        p["offsets"] = torch.tensor([0, 8, 4, 12], dtype=torch.int64, device=DEVICE)
    elif break_it == "token out of range":
        p["token"] = p["token"].clone()
        p["token"][0] = 6
    else:
        p["slot"] = p["slot"].clone()
        p["slot"][0] = -1
    rt = flashswitch.Route(**p)
    x = torch.randn(6, 4, device=DEVICE)
    w = torch.randn(3, 4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="^Route."):
        flashswitch.expert_matmul(x, rt, w, backend="triton")


def test_routes_from_route_need_no_sync_check():
    rt = flashswitch.route(torch.randint(0, 3, (6, 2), device=DEVICE), 3)
    assert getattr(rt, "_values_ok", False)
    p = _route_parts()
    hand = flashswitch.Route(**p)
    assert hand.validate() is hand and hand._values_ok
