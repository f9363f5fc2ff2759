"""SwitchHead's fused output projection (ops/switchhead_output.py, its kernels in
kernels_triton/switchhead_output(_bwd).py) against an fp64 oracle: the
gated routed sum y[t] = Σ_s gates[t, s] · a[t, ids[t, s] // E] @ weight[ids[t, s]], written slot by slot,
and its autograd gradients (da, dgates, dweight). Each output passes the SPEC rule (testing.assert_close)
with the same routed sum in the kernels' precision as baseline, widened where the output's terms cancel
(testing.conditioning_tol). On the CPU the kernels run under the Triton
interpreter in fp32 (tiny shapes); bf16 / fp16 (with fp32 master weights, as the layer passes them) on
the GPU. Both forms of the forward and of the weight gradient (K.FORMS: Z tiles built per column, or per
expert block as a row scale of a) pass the same checks. Outputs start as NaN (FLASHSWITCH_POISON, set by
conftest), so a tile left unwritten fails. Every test starts with empty call plans: a plan keeps the form it
was prepared in."""
import pytest
import torch

from conftest import DEVICE, cuda_graph_capture, gpu_spread
from flashswitch.autotune import space
from flashswitch.kernels_triton import switchhead_output as K, switchhead_output_bwd as KB
from flashswitch.nn import SwitchHeadAttention
from flashswitch.nn import switchhead as SH
from flashswitch.ops import call_plan, switchhead_output as op
from flashswitch.ops.expert_matmul import expert_matmul, route
from flashswitch.reference.switchhead_output import random_problem as reference_problem, torch_switchhead_output
from flashswitch.testing import assert_close, conditioning_tol

F64 = torch.float64
GRADS = ("a", "gates", "weight")
FWD = space.default_config(op.OP, "triton", {})  # the default configs (the space's first of each list)
BWD = space.default_config(op.OP_BWD, "triton", {})


@pytest.fixture(autouse=True)
def fresh_plans():
    call_plan.clear_all()
    yield
    call_plan.clear_all()


def use_form(monkeypatch, form):
    """The kernels' default form (forward and weight gradient) for the test."""
    monkeypatch.setattr(K, "FORWARD_FORM", form)
    monkeypatch.setattr(KB, "DWEIGHT_FORM", form)
    call_plan.clear_all()


def bwd_config(da_dw=None, dweight=None) -> dict:
    """A backward config: the default's tiles where not given."""
    return space.sho_backward_config(da_dw or space.SHO_DA_DW[0], dweight or space.SHO_DWEIGHT_COLUMNS[0])


def make_problem(T, H, E, k, D, d, dtype=torch.float32, *, master=False, seed=0, device=DEVICE):
    """The reference's random problem (reference/switchhead_output.py), its weight fp32 master weights with
    `master`, else in a's dtype; E for num_experts."""
    p = reference_problem(T, H, E, k, D, d, dtype=dtype, weight_dtype=torch.float32 if master else None,
                          device=device, seed=seed)
    p["E"] = p.pop("num_experts")
    return p


def routed_sum(a, ids, gates, weight, E, dtype):
    """The gated routed sum slot by slot, in `dtype` (fp64: the oracle)."""
    a, gates, weight = a.to(dtype), gates.to(dtype), weight.to(dtype)
    rows = a[torch.arange(a.shape[0], device=a.device)[:, None], ids // E]  # [T, S, D]
    return torch.einsum("tsj,tsjn,ts->tn", rows, weight[ids], gates)


def outputs(inputs, ids, E, dtype):
    """y and the gradients of a, gates and weight for the cotangent inputs["dy"]: the routed sum of the
    inputs rounded to `dtype`, summed in fp32 (as the kernels and torch's 16-bit GEMMs accumulate; the
    16-bit backward of the gather would sum dweight's tokens in 16 bits, 4 roundings off on the CPU), each
    output rounded to the dtype the kernels return it in. fp64: the oracle."""
    acc = F64 if dtype == F64 else torch.float32
    leaves = {n: inputs[n].detach().to(dtype).to(acc).requires_grad_() for n in GRADS}
    with torch.enable_grad():
        y = routed_sum(leaves["a"], ids, leaves["gates"], leaves["weight"], E, acc)
        grads = torch.autograd.grad(y, [leaves[n] for n in GRADS], inputs["dy"].to(dtype).to(acc))
    out = {"y": y.detach(), **{f"d{n}": g for n, g in zip(GRADS, grads)}}
    kept = {"y": dtype, "da": dtype, "dgates": inputs["gates"].dtype, "dweight": inputs["weight"].dtype}
    return {n: t.to(F64 if dtype == F64 else kept[n]) for n, t in out.items()}


def check(p, got: dict, dtype):
    """Every output of `got` (y, da, dgates, dweight) within the SPEC rule of the fp64 oracle."""
    inputs = {n: p[n] for n in GRADS} | {"dy": p["dy"]}
    ref = outputs(inputs, p["ids"], p["E"], F64)
    base = outputs(inputs, p["ids"], p["E"], dtype)
    tols = conditioning_tol(lambda i: outputs(i, p["ids"], p["E"], F64), inputs, dtype)
    for name, out in got.items():
        assert out.shape == ref[name].shape, name
        assert_close(name, out, ref[name], dtype, baseline=base[name], tol=tols[name])


def run_public(p, *, backend="triton"):
    """y and the gradients through switchhead_output (autograd), with the cotangent p["dy"]."""
    leaves = {n: p[n].detach().clone().requires_grad_() for n in GRADS}
    y = op.switchhead_output(leaves["a"], p["ids"], leaves["gates"], leaves["weight"], p["E"], backend=backend)
    assert y.dtype == p["a"].dtype and y.shape == (p["a"].shape[0], p["weight"].shape[2])
    y.backward(p["dy"])
    assert leaves["weight"].grad.dtype == p["weight"].dtype and leaves["gates"].grad.dtype == p["gates"].dtype
    return {"y": y.detach(), **{f"d{n}": leaves[n].grad for n in GRADS}}


def with_dy(p, seed=1):
    g = torch.Generator().manual_seed(seed)
    p["dy"] = torch.randn(p["a"].shape[0], p["weight"].shape[2], generator=g).to(p["a"].device, p["a"].dtype)
    return p


# (T, H, E, k, D, d): T not a multiple of any tile, head dims that are no power of two (12, 28 = 4·7
# like 112 = 16·7), one and three heads, E in {2, 4, 5}, k in {1, 2}
CASES = [(37, 3, 5, 2, 12, 20), (70, 1, 2, 1, 12, 24), (130, 3, 4, 2, 28, 72), (9, 2, 4, 2, 16, 16),
         (23, 3, 2, 1, 20, 36), (5, 1, 5, 2, 12, 8)]
SMALL = dict(forward=dict(BT=16, BN=16, BK=16, GROUP_T=2, num_warps=4, num_stages=2),
             forward_rows=dict(BT=16, BN=16, BK=16, HEAD_LOOP=False, GROUP_T=2, num_warps=4, num_stages=2),
             forward_head_loop=dict(BT=16, BN=16, BK=16, HEAD_LOOP=True, GROUP_T=2, num_warps=4, num_stages=2),
             dweight_rows=dict(BM=16, BN=16, BT=16, num_warps=4, num_stages=2),
             da_dw=dict(BT=16, BN=16, num_warps=4, num_stages=2),
             dweight=dict(BM=16, BN=16, BT=16, num_warps=4, num_stages=2))


def _fp32_spread(T, H, E, k, D, d, form):
    """On the GPU each case in one form, the forms alternating over CASES (three cases each)."""
    return K.FORMS.index(form) == CASES.index((T, H, E, k, D, d)) % 2


@gpu_spread(_fp32_spread)
@pytest.mark.parametrize("form", K.FORMS)
@pytest.mark.parametrize("T,H,E,k,D,d", CASES)
def test_matches_oracle_fp32(T, H, E, k, D, d, form, monkeypatch):
    """Forward and backward through the public call (the config store's configs: here the defaults),
    each form of the kernels as the module's default. The GPU runs each case in one form
    (`_fp32_spread`): every case, both forms, every tiling edge the cases hold (T = 130 past BT = 128, T
    and d below every tile); the CPU runs them all."""
    use_form(monkeypatch, form)
    p = with_dy(make_problem(T, H, E, k, D, d, seed=T + D))
    check(p, run_public(p), torch.float32)


@pytest.mark.parametrize("T,H,E,k,D,d", [CASES[0], CASES[1]])
def test_small_tiles_and_split_token_sum(T, H, E, k, D, d):
    """16-wide tiles: many token, column and K tiles (a K block spanning up to three experts of D = 12 and
    two heads), and dweight's token sum split in three ranges added by _sum_splits."""
    p = with_dy(make_problem(T, H, E, k, D, d, seed=3))
    w = K.gate_table(p["ids"], p["gates"], H * E)
    y = K.forward(p["a"], w, p["weight"], config=SMALL["forward"])
    da, dg, dw = KB.backward(p["dy"], p["a"], p["ids"], p["gates"], p["weight"], True, True, True,
                             config=bwd_config(SMALL["da_dw"], SMALL["dweight"]), splits=3)
    check(p, {"y": y, "da": da, "dgates": dg, "dweight": dw}, torch.float32)


@pytest.mark.parametrize("T,H,E,k,D,d", [CASES[2], CASES[4], CASES[0]])
@pytest.mark.parametrize("kind", ["forward_rows", "forward_head_loop"])
def test_row_scale_forward_small_tiles(T, H, E, k, D, d, kind):
    """The row-scale forward with 16-wide tiles: K steps of 16 inside an expert block of D = 28 or 20
    (padded to 32: the second step masked) or D = 12 (one step of 16), and the head loop (a's head tile
    once for its E experts)."""
    p = make_problem(T, H, E, k, D, d, seed=19)
    w = K.gate_table(p["ids"], p["gates"], H * E)
    y = K.forward(p["a"], w, p["weight"], config=SMALL[kind], form="rows")
    check_forward(p, y, torch.float32)


@pytest.mark.parametrize("T,H,E,k,D,d", [CASES[2], CASES[0]])
def test_row_scale_weight_gradient_small_tiles_and_splits(T, H, E, k, D, d):
    """The row-scale weight gradient with 16 rows of an expert block per program (D = 28: two blocks, the
    second masked; D = 12: one) and the token sum split in three ranges."""
    p = with_dy(make_problem(T, H, E, k, D, d, seed=23))
    dw = KB.backward(p["dy"], p["a"], p["ids"], p["gates"], p["weight"], False, False, True,
                     config=bwd_config(dweight=SMALL["dweight_rows"]), splits=3, form="rows")[2]
    inputs = {n: p[n] for n in GRADS} | {"dy": p["dy"]}
    ref = outputs(inputs, p["ids"], p["E"], F64)["dweight"]
    base = outputs(inputs, p["ids"], p["E"], torch.float32)["dweight"]
    assert_close("dweight", dw, ref, torch.float32, baseline=base)


def check_forward(p, y, dtype):
    """y alone within the SPEC rule of the fp64 oracle (check's rule without the gradients)."""
    def fwd(i, dt):
        return {"y": routed_sum(i["a"], p["ids"], i["gates"], i["weight"], p["E"], dt)}
    inputs = {n: p[n] for n in GRADS}
    ref = fwd(inputs, F64)["y"]
    base = fwd(inputs, torch.float32 if dtype == torch.float32 else dtype)["y"]
    tol = conditioning_tol(lambda i: fwd(i, F64), inputs, dtype)["y"]
    assert y.shape == ref.shape
    assert_close("y", y, ref, dtype, baseline=base, tol=tol)


def test_forward_form_is_checked():
    p = make_problem(6, 2, 3, 2, 8, 8)
    with pytest.raises(ValueError, match="form"):
        K.forward(p["a"], K.gate_table(p["ids"], p["gates"], 6), p["weight"], config=FWD, form="diagonal")
    with pytest.raises(ValueError, match="form"):
        KB.backward(p["a"][:, 0], p["a"], p["ids"], p["gates"], p["weight"], False, False, True, config=BWD,
                    form="diagonal")


def test_every_listed_config_agrees():
    """Each config of the five lists of the config space (autotune/space.py; the calls run the first of each
    by default). On the GPU a config whose fp32 tiles exceed the shared memory is skipped, as the tuner
    skips it."""
    from triton.runtime.errors import OutOfResources
    p = with_dy(make_problem(37, 3, 5, 2, 12, 20, seed=5))
    w = K.gate_table(p["ids"], p["gates"], 15)
    ref = outputs(p, p["ids"], 5, F64)
    ran = 0

    def run(fn):
        nonlocal ran
        try:
            out = fn()
        except OutOfResources:
            assert DEVICE == "cuda"
            return None
        ran += 1
        return out
    for cfg in space.SHO_FORWARD_COLUMNS:
        if (y := run(lambda: K.forward(p["a"], w, p["weight"], config=cfg))) is not None:
            assert_close(f"y {cfg}", y, ref["y"], torch.float32)
    for cfg in space.SHO_FORWARD_ROWS:
        if (y := run(lambda: K.forward(p["a"], w, p["weight"], config=cfg, form="rows"))) is not None:
            assert_close(f"y rows {cfg}", y, ref["y"], torch.float32)
    for cfg in space.SHO_DA_DW:
        if (out := run(lambda: KB.backward(p["dy"], p["a"], p["ids"], p["gates"], p["weight"], True, True, False,
                                           config=bwd_config(da_dw=cfg)))) is not None:
            assert_close(f"da {cfg}", out[0], ref["da"], torch.float32)
            assert_close(f"dgates {cfg}", out[1], ref["dgates"], torch.float32)
    for cfg in space.SHO_DWEIGHT_COLUMNS:
        if (out := run(lambda: KB.backward(p["dy"], p["a"], p["ids"], p["gates"], p["weight"], False, False, True,
                                           config=bwd_config(dweight=cfg), splits=2))) is not None:
            assert_close(f"dweight {cfg}", out[2], ref["dweight"], torch.float32)
    for cfg in space.SHO_DWEIGHT_ROWS:
        if (out := run(lambda: KB.backward(p["dy"], p["a"], p["ids"], p["gates"], p["weight"], False, False, True,
                                           config=bwd_config(dweight=cfg), splits=2, form="rows"))) is not None:
            assert_close(f"dweight rows {cfg}", out[2], ref["dweight"], torch.float32)
    listed = sum(map(len, (space.SHO_FORWARD_COLUMNS, space.SHO_FORWARD_ROWS, space.SHO_DA_DW,
                           space.SHO_DWEIGHT_COLUMNS, space.SHO_DWEIGHT_ROWS)))
    assert ran >= listed - (8 if DEVICE == "cuda" else 0)


def test_wanted_gradients_only_and_deterministic():
    """Each gradient alone equals its value among all three; a repeated backward is bitwise equal."""
    p = with_dy(make_problem(40, 2, 4, 2, 12, 24, seed=7))
    args = (p["dy"], p["a"], p["ids"], p["gates"], p["weight"])
    full = KB.backward(*args, True, True, True, config=BWD)
    again = KB.backward(*args, True, True, True, config=BWD)
    for i in range(3):
        want = [False] * 3
        want[i] = True
        alone = KB.backward(*args, *want, config=BWD)
        assert all(g is None for j, g in enumerate(alone) if j != i)
        assert torch.equal(alone[i], full[i]) and torch.equal(again[i], full[i])


def test_out_of_range_ids_are_dropped_and_duplicates_add():
    """check=False: an id outside [0, H·E) contributes nothing (and gets a zero gate gradient); one expert
    picked twice by a token adds up, as in op 3."""
    p = with_dy(make_problem(20, 2, 4, 2, 12, 16, seed=9))
    ids = p["ids"].clone()
    ids[3, 1], ids[7, 2], ids[11, 0] = -1, 8, 99
    ids[5, 3] = ids[5, 2]  # a duplicate
    keep = (ids >= 0) & (ids < 8)
    q = p | {"ids": ids.clamp(0, 7), "gates": torch.where(keep, p["gates"], 0.0)}
    leaves = {n: p[n].detach().clone().requires_grad_() for n in GRADS}
    y = op.switchhead_output(leaves["a"], ids, leaves["gates"], leaves["weight"], 4, check=False, backend="triton")
    y.backward(p["dy"])
    ref = outputs(q, q["ids"], 4, F64)
    assert_close("y", y, ref["y"], torch.float32)
    assert_close("da", leaves["a"].grad, ref["da"], torch.float32)
    assert_close("dweight", leaves["weight"].grad, ref["dweight"], torch.float32)
    dg = leaves["gates"].grad
    assert torch.all(dg[~keep] == 0)
    assert_close("dgates", dg[keep], ref["dgates"][keep], torch.float32)


def test_reference_matches_oracle():
    """torch_switchhead_output (backend "reference", and the CPU's "auto") is the same function."""
    p = with_dy(make_problem(37, 3, 5, 2, 12, 20, seed=11))
    check(p, run_public(p, backend="reference"), torch.float32)
    if DEVICE == "cpu":
        assert torch.equal(op.switchhead_output(p["a"], p["ids"], p["gates"], p["weight"], 5),
                           torch_switchhead_output(p["a"], p["ids"], p["gates"], p["weight"], 5))


@pytest.mark.parametrize("T,D,d", [(0, 12, 16), (6, 0, 16), (6, 12, 0)])
def test_empty_sizes(T, D, d):
    p = with_dy(make_problem(T, 2, 3, 2, D, d, seed=2))
    got = run_public(p)
    assert torch.all(got["y"] == 0) and torch.all(got["dweight"] == 0) and torch.all(got["dgates"] == 0)


def test_outputs_are_poisoned_before_launch(monkeypatch):
    """With the launches stubbed out every output is NaN: an element a kernel leaves unwritten cannot
    pass the oracle comparisons above."""
    class Stub:
        def __init__(self, kernel):
            self.arg_names = kernel.arg_names  # what a prepared launch checks its arguments against

        def __getitem__(self, grid):
            return lambda *args, **kwargs: None
    for module, names in ((K, ("_forward_kernel", "_forward_rows_kernel", "_gate_table_kernel")),
                          (KB, ("_da_dw_kernel", "_dweight_kernel", "_dweight_rows_kernel", "_gate_grad_kernel",
                                "_sum_splits"))):
        for name in names:
            monkeypatch.setattr(module, name, Stub(getattr(module, name)))
    p = with_dy(make_problem(10, 2, 4, 2, 12, 16))
    w = K.gate_table(p["ids"], p["gates"], 8)
    args = (p["dy"], p["a"], p["ids"], p["gates"], p["weight"])
    outs = [w, K.forward(p["a"], w, p["weight"], config=FWD, form="columns"),
            K.forward(p["a"], w, p["weight"], config=FWD, form="rows"),
            *KB.backward(*args, True, True, True, config=BWD, splits=2),
            KB.backward(*args, False, False, True, config=BWD, splits=2, form="rows")[2],
            op.switchhead_output(p["a"], p["ids"], p["gates"], p["weight"], 4, backend="triton")]
    assert all(t.isnan().all() for t in outs)


def test_custom_op_and_compile():
    """The custom op (what torch.compile and tensor subclasses reach) passes torch.library.opcheck, and a
    compiled call (fullgraph) gives the eager call's outputs and gradients."""
    p = with_dy(make_problem(12, 2, 4, 2, 12, 16, seed=13))
    args = (p["a"].requires_grad_(), p["ids"], p["gates"].requires_grad_(), p["weight"].requires_grad_())
    torch.library.opcheck(op.OPDEF.op, (*args, "triton"), test_utils=("test_schema", "test_autograd_registration",
                                                                      "test_faketensor"))
    torch._dynamo.reset()

    def f(a, ids, gates, weight):
        return op.switchhead_output(a, ids, gates, weight, 4, check=False, backend="triton")
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y, yc = f(*args), compiled(*args)
    torch.testing.assert_close(yc, y, rtol=0, atol=0)
    g = torch.autograd.grad(y, [args[0], args[2], args[3]], p["dy"])
    gc = torch.autograd.grad(yc, [args[0], args[2], args[3]], p["dy"])
    for x, z in zip(gc, g):
        torch.testing.assert_close(x, z, rtol=0, atol=0)


def _bad(**change):
    p = make_problem(6, 2, 3, 2, 8, 8)
    kw = dict(a=p["a"], ids=p["ids"], gates=p["gates"], weight=p["weight"], num_experts=3) | change
    return lambda: op.switchhead_output(kw.pop("a"), kw.pop("ids"), kw.pop("gates"), kw.pop("weight"),
                                        kw.pop("num_experts"), **kw)


@pytest.mark.parametrize("make, name", [
    (_bad(a=torch.randn(6, 16)), "a"),
    (_bad(a=torch.randn(6, 2, 8, dtype=F64)), "a"),
    (_bad(a="a"), "a"),
    (_bad(weight=torch.randn(5, 8, 8)), "weight"),
    (_bad(weight=torch.randn(6, 7, 8)), "weight"),
    (_bad(weight=torch.randn(6, 8, 8, dtype=torch.float16)), "weight"),
    (_bad(ids=torch.zeros(6, 4)), "ids"),
    (_bad(ids=torch.zeros(5, 4, dtype=torch.int64)), "ids"),
    (_bad(ids=torch.full((6, 4), 6)), "ids"),
    (_bad(gates=torch.rand(6, 3)), "gates"),
    (_bad(gates=torch.zeros(6, 4, dtype=torch.int64)), "gates"),
    (_bad(num_experts=0), "num_experts"),
    (_bad(num_experts=2.0), "num_experts"),
    (_bad(check=1), "check"),
    (_bad(backend="cuda"), "backend"),
])
def test_bad_inputs_name_the_argument(make, name):
    with pytest.raises((ValueError, TypeError), match=name):
        make()


# ---------------------------------------------------------------- the layer
def test_layer_uses_fused_output_where_it_pays(monkeypatch):
    """SwitchHeadAttention's output projection runs the fused kernel on the Triton backend when E / k <= 2
    (op 3 otherwise, and on the reference backend), with the layer's numbers unchanged: output and every
    gradient equal op 3's path within fp32 rounding."""
    def layer(E, k, backend="triton"):
        torch.manual_seed(0)
        return SwitchHeadAttention(16, 2, 12, E, k, backend=backend, fused_output=True, device=DEVICE).eval()
    x2 = torch.randn(3, 16, device=DEVICE)
    w = torch.randn(8, 12, 16, device=DEVICE)
    assert layer(4, 2).fused_output_wanted(x2, w) and layer(3, 2).fused_output_wanted(x2, w)
    assert not SwitchHeadAttention(16, 2, 12, 4, 2, backend="triton", device=DEVICE).fused_output_wanted(x2, w)
    assert not layer(5, 2).fused_output_wanted(x2, w) and not layer(4, 1).fused_output_wanted(x2, w)
    assert not layer(4, 2, "reference").fused_output_wanted(x2, w)
    if DEVICE == "cpu":
        assert not layer(4, 2, "auto").fused_output_wanted(x2, w)  # auto on the CPU: the reference
    monkeypatch.setenv("FLASHSWITCH_BACKEND", "reference")
    assert not layer(4, 2, "auto").fused_output_wanted(x2, w)
    monkeypatch.delenv("FLASHSWITCH_BACKEND")

    m = layer(4, 2)
    x = torch.randn(2, 9, 16, device=DEVICE)
    seen = []
    real = op.switchhead_output
    monkeypatch.setattr(op, "switchhead_output", lambda *a, **kw: seen.append(1) or real(*a, **kw))

    def run():
        xx = x.clone().requires_grad_()
        y = m(xx)
        grads = torch.autograd.grad(y.square().sum(), [xx, *m.parameters()])
        return y, grads
    y, grads = run()
    assert seen
    monkeypatch.setattr(SH, "FUSED_OUTPUT_MAX_MAC_RATIO", 0)  # op 3's path
    seen.clear()
    y3, grads3 = run()
    assert not seen
    torch.testing.assert_close(y, y3, rtol=1e-5, atol=1e-6)
    for g, g3 in zip(grads, grads3):
        torch.testing.assert_close(g, g3, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", K.FORMS)
def test_fused_equals_op3_on_the_layers_routing(form, monkeypatch):
    """With the layer's slot layout the fused call (either form of the kernels) is
    expert_matmul(..., out_groups=1)."""
    use_form(monkeypatch, form)
    p = make_problem(33, 3, 4, 2, 12, 20, seed=17)
    fused = op.switchhead_output(p["a"], p["ids"], p["gates"], p["weight"], 4, backend="triton")
    op3 = expert_matmul(p["a"], route(p["ids"], 12), p["weight"], gates=p["gates"], out_groups=1, backend="triton")
    torch.testing.assert_close(fused, op3[:, 0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GPU: half precision, CUDA graphs
HALF_CASES = [(1000, 4, 4, 2, 112, 256), (777, 2, 5, 3, 76, 412), (300, 3, 2, 1, 12, 40), (4100, 1, 4, 2, 64, 128)]
HALF_DTYPES = [torch.float16, torch.bfloat16]


def _half_spread(dtype, master, T, H, E, k, D, d, form):
    """Every (shape, dtype, form) once, master weights on for half of them so that every pair of values of
    any two parameters occurs (16 of the 32 combinations)."""
    i, j, f = HALF_CASES.index((T, H, E, k, D, d)), HALF_DTYPES.index(dtype), K.FORMS.index(form)
    return master == bool((i + j + f) % 2)


@pytest.mark.gpu
@gpu_spread(_half_spread)
@pytest.mark.parametrize("form", K.FORMS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("master", [True, False])
@pytest.mark.parametrize("T,H,E,k,D,d", HALF_CASES)
def test_half_precision_on_gpu(dtype, master, T, H, E, k, D, d, form, monkeypatch):
    """bf16 / fp16 a with fp32 master weights (the layer under autocast) or weights in a's dtype, each form
    of the kernels. Each combination compiles its kernels anew: the GPU runs the pairwise spread
    `_half_spread`. The shapes stay: each crosses tiling edges of the kernels (T past BT = 128 and,
    at 4100, a token sum split in ranges of DWEIGHT_MIN_SPLIT_TOKENS or more; d past BN = 128; H·E·D past BK and
    not a multiple of it)."""
    use_form(monkeypatch, form)
    p = with_dy(make_problem(T, H, E, k, D, d, dtype, master=master, seed=T))
    check(p, run_public(p), dtype)


@pytest.mark.gpu
def test_split_token_sum_on_gpu():
    """dweight's token sum split over several ranges (the GPU default at long T) passes the same rule
    against the fp64 oracle as one range. The two differ by rounding, not bitwise: the ranges reorder
    the fp32 sums (and the tensor cores' accumulation)."""
    p = with_dy(make_problem(5000, 4, 4, 2, 112, 256, torch.bfloat16, master=True, seed=3))
    for splits in (1, 4):
        dw = KB.backward(p["dy"], p["a"], p["ids"], p["gates"], p["weight"], False, False, True, config=BWD,
                         splits=splits)[2]
        check(p, {"dweight": dw}, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_graph_capture():
    """Forward and backward captured in one CUDA graph (after a warm-up that makes the call plan) and replayed
    on new inputs equal eager: no host sync."""
    p = with_dy(make_problem(512, 4, 4, 2, 112, 256, torch.bfloat16, master=True))
    a = p["a"].clone().requires_grad_()
    gates = p["gates"].clone().requires_grad_()
    weight = p["weight"].clone().requires_grad_()

    def step():
        y = op.switchhead_output(a, p["ids"], gates, weight, 4, check=False)
        return (y, *torch.autograd.grad(y, [a, gates, weight], p["dy"]))
    graph, static = cuda_graph_capture(step)
    with torch.no_grad():
        a.copy_(torch.randn_like(a))
        gates.copy_(torch.rand_like(gates))
    graph.replay()
    torch.cuda.synchronize()
    for x, z in zip(static, step()):
        torch.testing.assert_close(x, z, rtol=0, atol=0)


def test_bench_script_smoke(tmp_path):
    """bench/tools/switchhead_output.py --smoke (tiny shapes; on the CPU under the interpreter) writes its
    JSON and table: every implementation and pass per shape, both fused forms' errors against op 3 small."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "tools"))
    import switchhead_output as bench
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "switchhead_output.json").read_text())
    assert data["smoke"] and data["date"] and data["command"].startswith("python bench/tools/switchhead_output.py")
    assert {(r["shape"], r["pass"], r["impl"]) for r in data["rows"]} == {
        (s, p, i) for s in bench.SMOKE_SHAPES for p in ("fwd", "fwd+bwd") for i in bench.IMPLS}
    assert all(r["ms"] > 0 and r["routed_TFLOPs"] > 0 for r in data["rows"])
    fused = [r for r in data["rows"] if r["impl"] in bench.FUSED]
    assert {r["impl"] for r in fused} == {"fused", "fused, row scale"}
    tol = 1e-5 if data["dtype"] == "float32" else 3e-2
    assert all(e < tol for r in fused for e in r["rel_error_vs_op3"].values())
    md = (tmp_path / "switchhead_output.md").read_text()
    assert "| shape |" in md and f"commit {data['commit'] or 'unknown'}, {data['date']}" in md
    assert bench.paper_shape("262M") == dict(T=16384, H=4, E=4, k=2, D=112, d=1024)
    assert bench.paper_shape("47M") == dict(T=16384, H=2, E=5, k=3, D=76, d=412)
