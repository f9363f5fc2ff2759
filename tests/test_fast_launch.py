"""Prepared Triton launches (kernels_triton/<op>.prepare, kernel_call.KernelCall) and direct launches of the
compiled kernels (on CUDA by default; FLASHSWITCH_FAST_LAUNCH=0 turns them off).

A launch prepared from one problem's metadata, enqueued on another problem with the same metadata
(other values, other addresses, 16-byte alignment broken) gives what `launch` gives on it, and the
oracle's result; a call plan's prepared launch goes and comes with the plan. On the GPU: direct
launches are bitwise the normal ones, skip Triton's JITFunction.run, and capture into CUDA graphs.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE
import flashswitch
from flashswitch import _common as C
from flashswitch import backends, registry
from flashswitch.kernels_triton import kernel_call
from flashswitch.ops import call_plan, chunk_summaries as cs_op, eva_attention as eva_op, expert_matmul as em_op
from flashswitch.testing import assert_close

GPU = DEVICE == "cuda"
OPS = ("chunk_summaries", "eva_attention", "expert_matmul")
needs_triton = pytest.mark.skipif(not backends.available("triton", torch.device(DEVICE)),
                                  reason="triton cannot run here")

# per op: (shape for random_problem, explicit config or None = the call plan's) pairs
CASES = {
    "chunk_summaries": [
        (dict(B=1, H=2, N=19, D=16, C=4, omega="head", key_weight=True, valid=True), None),
        (dict(B=2, H=1, N=21, D=12, C=5, omega="chunk", layout="strided"), {"BLOCK_CHUNKS": 2, "num_warps": 1,
                                                                          "num_stages": 1}),
    ],
    "eva_attention": [
        (dict(B=1, H=4, Hkv=2, Nq=3, Nk=40, D=16, C=4, W=8, summary_bias="tensor"), None),
        (dict(B=1, H=2, Hkv=2, Nq=1, Nk=37, D=16, C=4, W=8, summary_bias="log_count"),
         {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "NUM_SPLITS": 3}),
        (dict(B=1, H=2, Hkv=1, Nq=20, Nk=20, D=12, C=4, W=8, window="sliding", layout="strided"),
         {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "FUSE": True}),
    ],
    "expert_matmul": [
        (dict(T=9, S=4, E=3, d_in=16, d_out=16, G_out=2), dict(deterministic=True)),
        (dict(T=7, S=2, E=3, d_in=12, d_out=20, gated=False), None),
        (dict(T=8, S=4, E=5, d_in=16, d_out=8, G_out=1), dict(deterministic=False)),
    ],
}


def _relocated(t, shift: int):
    """t's values in a fresh buffer `shift` elements in: same shape, strides and dtype, another address
    (a shift of a few elements breaks 16-byte alignment)."""
    if not isinstance(t, torch.Tensor):
        return t
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    buf = torch.zeros(span + shift, dtype=t.dtype, device=t.device)
    out = buf.as_strided(t.shape, t.stride(), shift)
    out.copy_(t)
    return out


def _problem(op: str, shape: dict, seed: int, dtype=torch.float32, shift: int = 0) -> dict:
    p = registry.get(op).random_problem(**shape, dtype=dtype, device=DEVICE, seed=seed)
    return {n: _relocated(t, shift) for n, t in p.items()}


def _kernel_args(op: str, p: dict, extra):
    """(kernels module, inputs, output (shape, dtype) list, keyword arguments) of the op's Triton launcher.
    extra: an explicit config (None: the call plan's), for expert_matmul {"deterministic": bool}."""
    if op == "chunk_summaries":
        from flashswitch.kernels_triton import chunk_summaries as K
        k, C_ = p["k"], p["chunk_size"]
        B, H, N, D = k.shape
        Nc = -(-N // C_)
        inputs = cs_op._kernel_inputs(k, p["v"], C_, p.get("omega"), p.get("key_weight"), p.get("valid"), None)
        outs = [((B, H, Nc, D), k.dtype), ((B, H, Nc, D), k.dtype), ((B, H, Nc), torch.float32)]
        feats = cs_op.problem_features(**p)
        kw = dict(chunk_size=C_, scale=C.check_scale(p.get("scale"), D))
    elif op == "eva_attention":
        from flashswitch.kernels_triton import eva_attention as K
        q, k = p["q"], p["k"]
        B, H, Nq, D = q.shape
        scale, q_offset, bias, log_count = eva_op._validate(q, k, p["v"], p["k_sum"], p["v_sum"], p["chunk_size"],
                                                            p["window_size"], p.get("window", "block"), None,
                                                            p.get("summary_bias"), p.get("q_offset"))
        inputs = (q, k, p["v"], p["k_sum"], p["v_sum"], eva_op._kernel_bias(bias))
        outs = [((B, H, Nq, D), q.dtype), ((B, H, Nq), torch.float32)]
        feats = eva_op.problem_features(**p)
        kw = dict(chunk_size=p["chunk_size"], window_size=p["window_size"],
                  sliding=p.get("window", "block") == "sliding", scale=scale, q_offset=q_offset, log_count=log_count)
    else:
        from flashswitch.kernels_triton import expert_matmul as K
        extra = dict(extra or {})
        det = extra.pop("deterministic", True)
        rt = flashswitch.route(p["expert_idx"], p["num_experts"])
        x3 = em_op._x3(p["x"])
        G_in, G_out = em_op._validate(p["x"], rt, p["weight"], p["gates"], p["out_groups"], det)
        inputs = (x3, p["weight"], p["gates"], rt)
        outs = [((x3.shape[0], G_out, p["weight"].shape[2]), x3.dtype)]
        feats = em_op.problem_features(**p, deterministic=det)
        kw = dict(G_in=G_in, G_out=G_out, deterministic=det)
    config = call_plan.complete_config(op, "triton", feats, None if op == "expert_matmul" else extra)
    return K, inputs, outs, dict(kw, config=config)


def _outputs(outs, device):
    return [C.new_output(shape, dtype, device) for shape, dtype in outs]


def _prepare(op, p, extra, fast=False):
    K, inputs, outs, kw = _kernel_args(op, p, extra)
    meta = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in outs]
    return K.prepare(*inputs, *meta, **kw, fast=fast)


def _enqueue(enqueue, op, p, extra) -> list:
    _, inputs, outs, _ = _kernel_args(op, p, extra)
    out = _outputs(outs, DEVICE)
    enqueue(*inputs, *out)
    return out


def _launch(op, p, extra) -> list:
    K, inputs, outs, kw = _kernel_args(op, p, extra)
    out = _outputs(outs, DEVICE)
    K.launch(*inputs, *out, **kw)
    return out


def _check_oracle(op, p, out, extra):
    spec = registry.get(op)
    args = dict(p)
    if op == "expert_matmul":
        args = {n: p[n] for n in ("x", "expert_idx", "num_experts", "weight", "gates", "out_groups")}
    oracle, base = spec.oracle_outputs(args), spec.torch_outputs(args)
    for name, o, r, b in zip(spec.outputs, out, oracle, base):
        assert_close(name, o, r, torch.float32 if name == "lse" else o.dtype, baseline=b)


# ---------------------------------------------------------------- prepared == launch (CPU and GPU)
@needs_triton
@pytest.mark.parametrize("op", OPS)
@settings(max_examples=4 if DEVICE == "cpu" else 20)
@given(case=st.integers(0, 2), seed=st.integers(1, 2 ** 16), shift=st.integers(0, 5))
def test_prepared_launch_matches_launch(op, case, seed, shift):
    """Prepared from one problem, enqueued on another with the same metadata (other values, an address
    `shift` elements on): bitwise what `launch` gives on it, and the oracle's result (outputs poisoned)."""
    shape, extra = CASES[op][case % len(CASES[op])]
    enqueue = _prepare(op, _problem(op, shape, 0), extra)
    p = _problem(op, shape, seed, shift=shift)
    got, want = _enqueue(enqueue, op, p, extra), _launch(op, p, extra)
    atomic = op == "expert_matmul" and not (extra or {}).get("deterministic", True)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if not (atomic and GPU):  # float atomics add in any order on the GPU
            assert torch.equal(g, w)
    _check_oracle(op, p, got, extra)


def test_kernel_call_binds_the_kernel_signature():
    """The arguments after the tensors: the runtime scalars in order, then every constexpr by name."""
    from flashswitch.kernels_triton.expert_matmul import _group_sum
    call = kernel_call.KernelCall(_group_sum, (3,), 2, (5, 7, 2), dict(BLOCK_N=16, BLOCK_R=4), dict(num_warps=4))
    assert call.tail == (5, 7, 2, 4, 16) and call.grid == (3, 1, 1) and not call.fast
    with pytest.raises(ValueError, match="constexprs"):
        kernel_call.KernelCall(_group_sum, (3,), 2, (5, 7, 2), dict(BLOCK_R=4), {})
    with pytest.raises(ValueError, match="constexprs"):
        kernel_call.KernelCall(_group_sum, (3,), 2, (5, 7), dict(BLOCK_N=16, BLOCK_R=4), {})


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_specialization_varies_only_with_alignment(op):
    """Triton's own binder over a prepared launch's arguments: the same argument list Triton hands its
    launcher, and a specialization key that changes between two calls only where a tensor's 16-byte
    alignment does, which is what the direct launches are keyed by."""
    jit = pytest.importorskip("triton.runtime.jit")
    make_binder = getattr(jit, "create_function_from_signature", None)
    try:
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        CUDABackend = None
    if make_binder is None or CUDABackend is None:
        pytest.skip("this Triton has no binder to compare with")
    shape, extra = CASES[op][0]
    enqueue = _prepare(op, _problem(op, shape, 0), extra)
    per_call = []  # per enqueue: (alignment, specialization) of each launch
    for seed, shift in ((1, 0), (2, 0), (3, 1)):
        p = _problem(op, shape, seed, shift=shift)
        _, inputs, outs, _ = _kernel_args(op, p, extra)
        records = []
        for call in enqueue.calls:  # record the argument lists instead of launching
            call.kernel = _Recorder(call.kernel, records)
        try:
            enqueue(*inputs, *_outputs(outs, DEVICE))
        finally:
            for call in enqueue.calls:
                call.kernel = call.kernel.inner
        launches = []
        for kernel, args, options in records:
            jf = kernel if isinstance(kernel, jit.JITFunction) else jit.JITFunction(kernel.fn)
            params, spec, _ = make_binder(jf.signature, jf.params, CUDABackend)(*args, **options)
            assert list(params.values()) == list(args)  # what Triton hands its launcher, in this order
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            launches.append((kernel_call._alignment(tensors), spec))
        per_call.append(launches)
    first, same_alignment, shifted = per_call
    assert len(first) == len(same_alignment) == len(shifted) >= 1
    assert first == same_alignment  # other values and addresses, same alignment: same compiled kernel
    for (a1, s1), (a3, s3) in zip(first, shifted):
        pointers = [i for i, x in enumerate(s1) if x[0].startswith("*")]
        assert [x for i, x in enumerate(s1) if i not in pointers] == [x for i, x in enumerate(s3) if i not in pointers]
    assert any(a1 != a3 for (a1, _), (a3, _) in zip(first, shifted))


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **options)` records instead of launching."""

    def __init__(self, inner, records):
        self.inner, self.records, self.arg_names = inner, records, inner.arg_names

    def __getitem__(self, grid):
        return lambda *args, **options: self.records.append((self.inner, args, options))


# ---------------------------------------------------------------- direct-launch bookkeeping (fakes)
class _FakeCompiled:
    """Stands in for a CompiledKernel: `compiled[grid](*args)` logs a direct launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _FakeKernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **options)` logs a normal launch."""
    arg_names = ["x_ptr", "y_ptr", "n", "BLOCK"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        return lambda *args, **options: self.log.append(("normal", grid, args, options)) or _FakeCompiled(self.log)


def _raising(*args):
    raise RuntimeError("launch failed")


def test_direct_launch_bookkeeping(monkeypatch):
    """The first launch of a (device, alignment) goes through the kernel (Triton's JITFunction.run) and
    keeps its compiled kernel; the next ones launch that directly with every argument in signature order;
    another alignment or device starts over; a direct launch that raises falls back to the normal one
    and is retired for good."""
    monkeypatch.setattr(kernel_call, "_is_compiled", lambda k: isinstance(k, _FakeCompiled))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = _FakeKernel()
    call = kernel_call.KernelCall(kernel, (4, 2), 2, (7,), dict(BLOCK=16), dict(num_warps=2), fast=True)
    x, y = torch.zeros(8), torch.zeros(8)
    kinds = lambda: [e[0] for e in kernel.log]  # noqa: E731
    call(x, y)
    call(x, torch.zeros(8))  # another aligned tensor: the same key
    assert kinds() == ["normal", "direct"]
    assert kernel.log[0][1:] == ((4, 2, 1), (x, y, 7, 16), dict(num_warps=2))
    assert kernel.log[1][1] == (4, 2, 1) and kernel.log[1][2][2:] == (7, 16)
    assert kernel_call.direct_launches(call) == 1
    odd = torch.zeros(9)[1:]  # 4 bytes past an aligned start
    call(x, odd)
    call(x, odd)
    assert kinds()[2:] == ["normal", "direct"] and kernel_call.direct_launches(call) == 2
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    call(x, y)
    call(x, y)
    assert kinds()[4:] == ["normal", "direct"]
    call._direct[(1, kernel_call._alignment((x, y)))] = _raising
    call(x, y)
    call(x, y)
    assert kinds()[6:] == ["normal", "normal"] and kernel_call.direct_launches(call) == 2
    call.fast = False
    call(x, y)
    assert kinds()[8:] == ["normal"]


# ---------------------------------------------------------------- the plan's prepared launch
@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_prepared_launch_lives_and_dies_with_the_plan(op, monkeypatch):
    """A plan on the Triton backend holds its prepared launch (none for the reference backend); a hit
    reuses it; a changed setting of call_plan.ENV_VARS (FLASHSWITCH_FAST_LAUNCH among them) or
    clear_all makes a new plan with a new one. Direct launches only where Triton compiles (CUDA)."""
    module = {"chunk_summaries": cs_op, "eva_attention": eva_op, "expert_matmul": em_op}[op]
    call_plan.clear_all()
    monkeypatch.setenv("FLASHSWITCH_FAST_LAUNCH", "0")
    shape, _ = CASES[op][0]
    p = _problem(op, shape, 0)
    rt = flashswitch.route(p["expert_idx"], p["num_experts"]) if op == "expert_matmul" else None

    def call(backend="triton"):
        if op == "chunk_summaries":
            return flashswitch.chunk_summaries(**p, return_lse=True, backend=backend)
        if op == "eva_attention":
            return flashswitch.eva_attention(**p, return_lse=True, backend=backend)
        return (flashswitch.expert_matmul(p["x"], rt, p["weight"], gates=p["gates"], out_groups=p["out_groups"],
                                          deterministic=True, backend=backend),)

    def plan():
        (only,) = module.OPDEF.plans._data.values()
        return only

    first = call()
    enqueue = plan().enqueue
    assert enqueue is not None and enqueue.calls and not any(c.fast for c in enqueue.calls)
    second = call()
    assert plan().enqueue is enqueue
    monkeypatch.setenv("FLASHSWITCH_FAST_LAUNCH", "1")
    third = call()
    fast_enqueue = plan().enqueue
    assert fast_enqueue is not enqueue
    assert all(c.fast for c in fast_enqueue.calls) == (DEVICE == "cuda")
    call_plan.clear_all()
    fourth = call()
    assert plan().enqueue is not fast_enqueue
    for outs in (second, third, fourth):
        for a, b in zip(first, outs):
            assert torch.equal(a, b)
    call_plan.clear_all()
    call("reference")
    assert plan().enqueue is None
    call_plan.clear_all()


@needs_triton
def test_prepared_launch_follows_the_test_switches(monkeypatch):
    """Module switches the tests flip (chunk_summaries.FORCE_OFFS_64, eva_attention.MAX_GRID_Y) take effect
    on a launch prepared before the flip."""
    from flashswitch.kernels_triton import chunk_summaries as KC, eva_attention as KE
    shape, extra = CASES["chunk_summaries"][0]
    enqueue = _prepare("chunk_summaries", _problem("chunk_summaries", shape, 0), extra)
    seen = []
    real = KC.launch
    monkeypatch.setattr(KC, "launch", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    monkeypatch.setattr(KC, "FORCE_OFFS_64", True)
    p = _problem("chunk_summaries", shape, 1)
    _check_oracle("chunk_summaries", p, _enqueue(enqueue, "chunk_summaries", p, extra), extra)
    assert seen
    shape = dict(B=5, H=4, Hkv=2, Nq=1, Nk=40, D=16, C=4, W=8, summary_bias="tensor")
    enqueue = _prepare("eva_attention", _problem("eva_attention", shape, 0), None)
    monkeypatch.setattr(KE, "MAX_GRID_Y", 7)
    p = _problem("eva_attention", shape, 1)
    _check_oracle("eva_attention", p, _enqueue(enqueue, "eva_attention", p, None), None)


# ---------------------------------------------------------------- GPU: direct launches
def _count_jit_runs(monkeypatch) -> list:
    """Record every launch through Triton's JITFunction.run."""
    from triton.runtime import jit
    runs, real = [], jit.JITFunction.run
    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, **kw: runs.append(self) or real(self, *a, **kw))
    return runs


TMA = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "TMA": True}
GPU_CASES = {  # per op: (shape, extra) with the CPU cases, launched in fp32, fp16 and bf16 at shifts 0, 1, 3, 8
    "chunk_summaries": CASES["chunk_summaries"] + [
        (dict(B=2, H=3, N=100, D=64, C=16, valid=True), None),
        (dict(B=1, H=2, N=70, D=76, C=32, omega="chunk", key_weight=True, layout="strided"), None)],
    "eva_attention": CASES["eva_attention"] + [
        (dict(B=2, H=8, Hkv=2, Nq=1, Nk=300, D=64, C=16, W=64), None),
        (dict(B=1, H=4, Hkv=4, Nq=64, Nk=200, D=128, C=16, W=64, window="sliding", layout="strided"), None),
        (dict(B=1, H=4, Hkv=2, Nq=70, Nk=200, D=64, C=16, W=64), TMA),  # descriptors where aligned (fp16/bf16)
        (dict(B=2, H=4, Hkv=4, Nq=2, Nk=150, D=64, C=16, W=64, window="sliding"), dict(TMA, FUSE=True, NUM_SPLITS=2))],
    "expert_matmul": CASES["expert_matmul"] + [
        (dict(T=64, S=8, E=16, d_in=64, d_out=48, G_out=4), dict(deterministic=True)),
        (dict(T=33, S=2, E=4, d_in=76, d_out=40, G_in=2), None)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_direct_launch_is_bitwise_the_normal_one(op, dtype, monkeypatch):
    """Over shapes, strides (strided layouts, stride-0 views) and addresses (views at odd offsets, which
    break the 16-byte alignment Triton specializes on): the direct launch gives bitwise what the normal
    launch gives, and the second call of an alignment launches without JITFunction.run."""
    runs = _count_jit_runs(monkeypatch)
    for shape, extra in GPU_CASES[op]:
        if op == "expert_matmul":
            extra = dict(deterministic=True)  # float atomics add in any order: not bitwise run to run
        enqueue = _prepare(op, _problem(op, shape, 0, dtype), extra, fast=True)
        for seed, shift in ((1, 0), (2, 1), (3, 3), (4, 8), (5, 0)):
            p = _problem(op, shape, seed, dtype, shift=shift)
            want = _launch(op, p, extra)
            for attempt in range(2):
                before = len(runs)
                got = _enqueue(enqueue, op, p, extra)
                for g, w in zip(got, want):
                    assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (shape, shift, attempt)
                if attempt:  # the first call of this alignment kept the compiled kernel
                    assert len(runs) == before, (shape, shift)
        assert any(kernel_call.direct_launches(c) for c in enqueue.calls), shape


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_public_calls_with_direct_launches(op, monkeypatch):
    """Direct launches on the public call (the tuned or default config): bitwise the results of
    FLASHSWITCH_FAST_LAUNCH=0, and the kernels launch directly from the second call on (unless a Gluon config runs)."""
    call_plan.clear_all()
    shapes = {"chunk_summaries": dict(B=1, H=2, N=64, D=64, C=16),
              "eva_attention": dict(B=1, H=8, Hkv=8, Nq=1, Nk=256, D=64, C=16, W=64),
              "expert_matmul": dict(T=16, S=2, E=4, d_in=64, d_out=64)}
    p = _problem(op, shapes[op], 0, torch.bfloat16)
    rt = flashswitch.route(p["expert_idx"], p["num_experts"]) if op == "expert_matmul" else None

    def call():
        if op == "chunk_summaries":
            return flashswitch.chunk_summaries(**p, return_lse=True, backend="triton")
        if op == "eva_attention":
            return flashswitch.eva_attention(**p, return_lse=True, backend="triton")
        return (flashswitch.expert_matmul(p["x"], rt, p["weight"], gates=p["gates"], deterministic=True,
                                          backend="triton"),)

    monkeypatch.setenv("FLASHSWITCH_FAST_LAUNCH", "0")
    want = call()
    monkeypatch.setenv("FLASHSWITCH_FAST_LAUNCH", "1")
    runs = _count_jit_runs(monkeypatch)
    call()
    n = len(runs)
    for _ in range(3):
        got = call()
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert len(runs) == n
    call_plan.clear_all()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_training_calls_launch_directly(op, monkeypatch):
    """A forward + backward through the eager autograd path (inputs that need gradients): from the second
    step on, every forward and backward kernel launches directly (no JITFunction.run in either thread)."""
    call_plan.clear_all()
    monkeypatch.setenv("FLASHSWITCH_FAST_LAUNCH", "1")
    shapes = {"chunk_summaries": dict(B=1, H=2, N=64, D=64, C=16, omega="head", key_weight=True),
              "eva_attention": dict(B=1, H=8, Hkv=8, Nq=1, Nk=256, D=64, C=16, W=64, summary_bias="tensor"),
              "expert_matmul": dict(T=16, S=2, E=4, d_in=64, d_out=64)}
    p = _problem(op, shapes[op], 0, torch.bfloat16)
    rt = flashswitch.route(p.pop("expert_idx"), p.pop("num_experts")) if op == "expert_matmul" else None
    leaves = {n: t.detach().requires_grad_() for n, t in p.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    kw = {**p, **leaves}

    def step():
        if op == "expert_matmul":
            outs = (flashswitch.expert_matmul(kw["x"], rt, kw["weight"], gates=kw.get("gates"), backend="triton"),)
        else:
            outs = getattr(flashswitch, op)(**kw, backend="triton")
        outs = [o for o in outs if o.is_floating_point()]
        torch.autograd.grad(outs, list(leaves.values()), [torch.ones_like(o) for o in outs])

    step()
    step()
    runs = _count_jit_runs(monkeypatch)
    n0 = kernel_call.normal_launches()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    assert len(runs) == 0 and kernel_call.normal_launches() == n0
    call_plan.clear_all()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_direct_launches_capture_into_a_cuda_graph(op, monkeypatch):
    """A public call with direct launches captured in a CUDA graph, replayed on new input values: the
    eager normal launch's results on those values, bitwise."""
    call_plan.clear_all()
    monkeypatch.setenv("FLASHSWITCH_FAST_LAUNCH", "1")
    shapes = {"chunk_summaries": dict(B=2, H=2, N=80, D=64, C=16, omega="head", valid=True),
              "eva_attention": dict(B=2, H=8, Hkv=2, Nq=1, Nk=300, D=64, C=16, W=64, summary_bias="tensor"),
              "expert_matmul": dict(T=32, S=4, E=8, d_in=64, d_out=64, G_out=2)}
    static = _problem(op, shapes[op], 0, torch.bfloat16)
    new = _problem(op, shapes[op], 1, torch.bfloat16)
    rt = flashswitch.route(static["expert_idx"], static["num_experts"]) if op == "expert_matmul" else None

    def call(p, route=None):
        if op == "chunk_summaries":
            return flashswitch.chunk_summaries(**p, return_lse=True, backend="triton")
        if op == "eva_attention":
            return flashswitch.eva_attention(**p, return_lse=True, backend="triton")
        return (flashswitch.expert_matmul(p["x"], route, p["weight"], gates=p["gates"], out_groups=p["out_groups"],
                                          deterministic=True, backend="triton"),)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, keep the compiled kernels, launch directly
            call(static, rt)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call(static, rt)
    for name, t in static.items():
        if isinstance(t, torch.Tensor):
            t.copy_(new[name])
    if op == "expert_matmul":  # the route of the new ids, into the captured route's tensors
        fresh = flashswitch.route(new["expert_idx"], new["num_experts"])
        for f in ("token", "slot", "offsets"):
            getattr(rt, f).copy_(getattr(fresh, f))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setenv("FLASHSWITCH_FAST_LAUNCH", "0")
    want = call(new, flashswitch.route(new["expert_idx"], new["num_experts"]) if op == "expert_matmul" else None)
    for g, w in zip(outs, want):
        assert torch.equal(g, w)
    call_plan.clear_all()
