"""Per-signature call plans (flashswitch/ops/call_plan.py): a cached call gives the uncached call's results,
a cache hit skips the checks, the backend choice and the config lookup but still rejects every bad
argument, and a write to the tuned-config store or a changed environment setting starts the caches
over."""
import importlib
import json
import math
import os
import re
import time
import warnings
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DEVICE, dtypes_here, kernel_backends
import flashswitch
from flashswitch import _common as C
from flashswitch import registry
from flashswitch.autotune import schema, space, store
from flashswitch.ops import call_plan, chunk_summaries as cs_op, eva_attention as eva_op, expert_matmul as em_op
from flashswitch.ops import switchhead_output as sho_op
from flashswitch.testing import assert_close

MODULES = {"chunk_summaries": cs_op, "eva_attention": eva_op, "expert_matmul": em_op, "switchhead_output": sho_op}
DEV = "Fake GPU 9000"
FAST = settings(max_examples=3 if DEVICE == "cpu" else 20,  # fixtures: the caches are cleared inside the test
                suppress_health_check=list(settings().suppress_health_check) + [HealthCheck.function_scoped_fixture])


def _problem(op: str, seed: int = 0, dtype=torch.float32) -> dict:
    spec = registry.get(op)
    if op == "chunk_summaries":
        return spec.random_problem(B=1, H=2, N=19, D=16, C=4, omega="head", key_weight=True, valid=True,
                                   dtype=dtype, device=DEVICE, seed=seed)
    if op == "eva_attention":
        return spec.random_problem(B=1, H=4, Hkv=2, Nq=3, Nk=40, D=16, C=4, W=8, summary_bias="tensor",
                                   dtype=dtype, device=DEVICE, seed=seed)
    if op == "switchhead_output":
        return spec.random_problem(T=11, H=2, E=3, k=2, D=12, d=16, dtype=dtype, device=DEVICE, seed=seed)
    return spec.random_problem(T=9, S=4, E=3, d_in=16, d_out=16, G_out=2, dtype=dtype, device=DEVICE, seed=seed)


def _call(op: str, p: dict, backend: str, **kw) -> tuple:
    """The public call of `op` on problem `p` (keyword arguments replaced by `kw`), its outputs as a tuple."""
    p = {**p, **kw}
    if op == "chunk_summaries":
        return flashswitch.chunk_summaries(**p, return_lse=True, backend=backend)
    if op == "eva_attention":
        return flashswitch.eva_attention(**p, return_lse=True, backend=backend)
    if op == "switchhead_output":
        return (sho_op.switchhead_output(**p, backend=backend),)
    rt = p.pop("route", None) or flashswitch.route(p["expert_idx"], p["num_experts"])
    y = flashswitch.expert_matmul(p["x"], rt, p["weight"], gates=p["gates"], out_groups=p["out_groups"],
                                  deterministic=p.get("deterministic", True), backend=backend)
    return (y,)


def _count_plans(monkeypatch, module) -> list:
    """Record every uncached plan of `module`'s op (one entry per call of its OpDef's `make_plan`)."""
    made, real = [], module.OPDEF.make_plan
    monkeypatch.setattr(module.OPDEF, "make_plan", lambda *a: made.append(a) or real(*a))
    return made


def _plans(module) -> list:
    return list(module.OPDEF.plans._data.values())


@pytest.fixture(autouse=True)
def fresh_caches():
    call_plan.clear_all()
    yield
    call_plan.clear_all()


# ---------------------------------------------------------------- same results, fewer steps
@pytest.mark.parametrize("op", list(MODULES))
@FAST
@given(seed=st.integers(0, 2 ** 16))
def test_cached_call_matches_uncached(op, seed, backend):
    """The first call makes the plan, the second uses it, a third after clearing makes it again: all
    three give bitwise the same outputs, which match the fp64 oracle."""
    module = MODULES[op]
    dtype = dtypes_here()[-1]
    p = _problem(op, seed, dtype)
    call_plan.clear_all()
    first = _call(op, p, backend)
    assert len(module.OPDEF.plans) == 1 and _plans(module)[0].backend == backend
    second = _call(op, p, backend)
    assert len(module.OPDEF.plans) == 1
    call_plan.clear_all()
    third = _call(op, p, backend)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)
    spec = registry.get(op)
    oracle, baseline = spec.oracle_outputs(p), spec.torch_outputs(p)
    assert_close("out", first[0], oracle[0], dtype, baseline=baseline[0])


@pytest.mark.parametrize("op", list(MODULES))
def test_hit_skips_checks_backend_choice_and_lookup(op, monkeypatch):
    """On a hit no argument check, backend resolution, bucket or config lookup runs (the plan holds
    their answers); a miss runs each once."""
    module = MODULES[op]
    backend = (kernel_backends() or ["reference"])[0]
    p = _problem(op)
    counts = {"validate": 0, "resolve": 0, "features": 0, "lookup": 0}

    def counting(name, fn):
        def wrapper(*a, **kw):
            counts[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(module, "_validate", counting("validate", module._validate))
    monkeypatch.setattr(call_plan, "resolve_backend", counting("resolve", call_plan.resolve_backend))
    monkeypatch.setattr(space, "features", counting("features", space.features))
    monkeypatch.setattr(store, "lookup", counting("lookup", store.lookup))
    rt = flashswitch.route(p["expert_idx"], p["num_experts"]) if op == "expert_matmul" else None
    kw = {"route": rt} if rt is not None else {}
    _call(op, p, backend, **kw)
    first = dict(counts)
    assert first["validate"] == first["resolve"] == 1
    assert first["lookup"] == (backend != "reference")
    for _ in range(3):
        _call(op, p, backend, **kw)
    assert counts == first


def test_plan_holds_a_complete_read_only_config():
    """The plan's config has every key its launcher requires, passes the schema and cannot be changed."""
    backend = "triton" if "triton" in kernel_backends() else None
    if backend is None:
        pytest.skip("triton is not usable here")
    for op, module in MODULES.items():
        _call(op, _problem(op), backend)
        cfg = _plans(module)[0].config
        assert isinstance(cfg, MappingProxyType)
        assert set(schema.REQUIRED_KEYS[(op, backend)]) <= set(cfg)
        assert schema.config_problems(op, backend, dict(cfg)) == []
        with pytest.raises(TypeError):
            cfg["num_warps"] = 1


def test_complete_config_merges_defaults_only_where_keys_are_missing():
    f = space.features("chunk_summaries", dtype="fp32", D=16, C=4, rows=64)
    default = space.default_config("chunk_summaries", "triton", f)
    assert call_plan.complete_config("chunk_summaries", "triton", f, {"BLOCK_CHUNKS": 2}) == {**default,
                                                                                              "BLOCK_CHUNKS": 2}
    full = {"BLOCK_CHUNKS": 2, "num_warps": 2, "num_stages": 1}
    assert call_plan.complete_config("chunk_summaries", "triton", f, full) == full
    # backward configs are taken as given (an incomplete one is the launcher's error); cuda ones too
    assert call_plan.complete_config("chunk_summaries.bwd", "triton", f, {"BLOCK_CHUNKS": 2}) == {"BLOCK_CHUNKS": 2}
    assert call_plan.complete_config("chunk_summaries", "cuda", f, {"split": 2}) == {"split": 2}


# ---------------------------------------------------------------- bad arguments on a hit
def _warm_backend() -> str:
    return "triton" if "triton" in kernel_backends() else "reference"


def _expect(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def test_chunk_summaries_hit_keeps_every_check():
    backend = _warm_backend()
    p = _problem("chunk_summaries")
    _call("chunk_summaries", p, backend, chunk_size=1)  # a plan whose chunk_size compares equal to True
    _call("chunk_summaries", p, backend, scale=0.5)
    assert len(cs_op.OPDEF.plans) == 2
    bad = [
        (ValueError, "^scale", dict(scale=float("nan"))), (ValueError, "^scale", dict(scale=-0.5)),
        (TypeError, "^scale", dict(scale=True)), (TypeError, "^chunk_size", dict(chunk_size=True)),
        (TypeError, "^chunk_size", dict(chunk_size=1.0)), (TypeError, "^v ", dict(v=p["v"].half())),
        (TypeError, "^k ", dict(k=p["k"].double(), v=p["v"].double())),
        (TypeError, "^valid", dict(valid=p["valid"].int())),
        (ValueError, "^k ", dict(k=p["k"].transpose(-1, -2).contiguous().transpose(-1, -2))),
        (TypeError, "^k ", dict(k=p["k"].tolist())), (ValueError, "^backend", dict(backend_="nope")),
    ]
    for exc, match, kw in bad:
        be = kw.pop("backend_", backend)
        _expect(exc, match, lambda: _call("chunk_summaries", p, be, **kw))
    assert len(cs_op.OPDEF.plans) == 2  # no bad call left a plan behind


def test_eva_attention_hit_keeps_every_check():
    backend = _warm_backend()
    p = _problem("eva_attention")
    _call("eva_attention", p, backend, chunk_size=1, window_size=8)
    _call("eva_attention", p, backend, q_offset=37, scale=0.25)
    assert len(eva_op.OPDEF.plans) == 2
    q, k = p["q"], p["k"]
    bad = [
        (ValueError, "^scale", dict(q_offset=37, scale=float("nan"))),
        (ValueError, "^scale", dict(q_offset=37, scale=math.inf)),
        (TypeError, "^scale", dict(q_offset=37, scale=True)),
        (TypeError, "^q_offset", dict(q_offset=37.0, scale=0.25)),
        (ValueError, "^q_offset", dict(q_offset=38, scale=0.25)),
        (TypeError, "^chunk_size", dict(chunk_size=True, window_size=8)),
        (ValueError, "^window_size", dict(chunk_size=3, window_size=8)),
        (ValueError, "^window ", dict(window="Block")),
        (TypeError, "^k ", dict(k=k.half())),
        (ValueError, "^q ", dict(q=q.transpose(-1, -2).contiguous().transpose(-1, -2))),
        (ValueError, "^summary_bias", dict(summary_bias="log_count ")),
        (ValueError, "^summary_bias", dict(summary_bias=p["summary_bias"][..., :-1])),
        (TypeError, "^summary_bias", dict(summary_bias=[1.0])),
    ]
    for exc, match, kw in bad:
        _expect(exc, match, lambda: _call("eva_attention", p, backend, **kw))
    assert len(eva_op.OPDEF.plans) == 2


def test_expert_matmul_hit_keeps_every_check():
    backend = _warm_backend()
    p = _problem("expert_matmul")
    rt = flashswitch.route(p["expert_idx"], p["num_experts"])
    _call("expert_matmul", p, backend, route=rt, out_groups=1)
    assert len(em_op.OPDEF.plans) == 1
    # a hand-built route of the same sizes with bad values: checked on its first use, plan or no plan
    off = rt.offsets.clone()
    off[1] = off[2] + 1
    bad_rt = em_op.Route(token=rt.token, slot=rt.slot, offsets=off, expert_idx=None, T=rt.T, S=rt.S, E=rt.E)
    bad = [
        (TypeError, "^deterministic", dict(deterministic=1)),
        (TypeError, "^out_groups", dict(out_groups=True)),
        (ValueError, "^out_groups", dict(out_groups=3)),
        (TypeError, "^weight ", dict(weight=p["weight"].half())),
        (ValueError, "^gates", dict(gates=p["gates"][:, :2])),
        (ValueError, "^Route.offsets", dict(route=bad_rt, out_groups=1)),
        (TypeError, "^route", dict(route=(rt.token, rt.slot, rt.offsets), out_groups=1)),
    ]
    for exc, match, kw in bad:
        kw.setdefault("route", rt)
        _expect(exc, match, lambda: _call("expert_matmul", p, backend, **kw))
    assert all(plan.G_out == 1 for plan in _plans(em_op))


def test_switchhead_output_hit_keeps_every_check():
    backend = _warm_backend()
    p = _problem("switchhead_output")
    _call("switchhead_output", p, backend)
    assert len(sho_op.OPDEF.plans) == 1
    bad_ids = p["ids"].clone()
    bad_ids[2, 1] = 6  # past H·E: the values are checked on every call that asks (check=True)
    bad = [
        (TypeError, "^check", dict(check=1)),
        (TypeError, "^num_experts", dict(num_experts=3.0)),
        (ValueError, "^weight", dict(num_experts=2)),
        (TypeError, "^weight ", dict(weight=p["weight"].half())),
        (ValueError, "^gates", dict(gates=p["gates"][:, :2])),
        (TypeError, "^ids", dict(ids=p["ids"].float())),
        (ValueError, "^ids values", dict(ids=bad_ids)),
    ]
    for exc, match, kw in bad:
        _expect(exc, match, lambda: _call("switchhead_output", p, backend, **kw))
    _call("switchhead_output", p, backend, ids=bad_ids, check=False)  # dropped, not refused


def test_backends_without_the_ops_kernels(monkeypatch):
    """switchhead_output has Triton kernels only: cuda or cupy named raise naming the backend; named by
    FLASHSWITCH_BACKEND (for every op), 'auto' falls back to the reference for it."""
    p = _problem("switchhead_output")
    for backend in ("cuda", "cupy"):
        _expect(ValueError, f"^backend '{backend}' has no switchhead_output kernels",
                lambda: _call("switchhead_output", p, backend))
        monkeypatch.setenv("FLASHSWITCH_BACKEND", backend)
        assert call_plan.resolve_backend("switchhead_output", "auto", torch.device(DEVICE), None,
                                         sho_op.OPDEF.kernel_backends) == "reference"
        assert not sho_op.runs_kernels("auto", DEVICE)
        (y,) = _call("switchhead_output", p, "auto")
        assert _plans(sho_op)[-1].backend == "reference"
        monkeypatch.delenv("FLASHSWITCH_BACKEND")
    assert sho_op.runs_kernels("triton", DEVICE) == ("triton" in kernel_backends())


# ---------------------------------------------------------------- invalidation
@pytest.fixture
def cfg_dir(tmp_path, monkeypatch):
    """An empty config folder for a fake device, through FLASHSWITCH_CONFIG_DIR."""
    monkeypatch.setenv("FLASHSWITCH_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(store, "device_name", lambda: DEV)
    monkeypatch.setattr(store, "_file_memo", {})
    return tmp_path


def _entry(feats: dict, cfg: dict) -> dict:
    return {store.bucket_key(feats): {"features": feats, "best": "triton",
                                       "backends": {"triton": {"config": cfg, "ms": 0.1}}}}


def test_store_writes_start_the_plans_over(cfg_dir, monkeypatch):
    """store.update in this process is seen by the next call; a file another process rewrote at the next
    look at the file (every call_plan.STORE_RECHECK_S, with the store's own stat interval)."""
    if "triton" not in kernel_backends():
        pytest.skip("triton is not usable here")
    p = _problem("chunk_summaries")
    feats = cs_op.problem_features(**p)
    path = store.device_file(folder=cfg_dir)
    expect = registry.get("chunk_summaries").oracle_outputs(p)
    configs = [{"BLOCK_CHUNKS": 1, "num_warps": 1, "num_stages": 1},
               {"BLOCK_CHUNKS": 2, "num_warps": 2, "num_stages": 1},
               {"BLOCK_CHUNKS": 4, "num_warps": 1, "num_stages": 1}]
    store.update(path, {"chunk_summaries": _entry(feats, configs[0])})
    out = _call("chunk_summaries", p, "triton")
    assert dict(_plans(cs_op)[0].config) == configs[0]
    store.update(path, {"chunk_summaries": _entry(feats, configs[1])})
    out2 = _call("chunk_summaries", p, "triton")
    assert [dict(x.config) for x in _plans(cs_op)] == [configs[1]]
    # the next look at the file is due STORE_RECHECK_S after that call (a loaded machine can take longer
    # than that to reach the next one): from here on, only store.update or a due look tells
    monkeypatch.setitem(call_plan._seen, "next_file_check", math.inf)
    # another process's write: no store.update here, only a newer file
    data = json.loads(path.read_text())
    data["ops"]["chunk_summaries"] = _entry(feats, configs[2])
    path.write_text(json.dumps(data))
    mtime = os.stat(path).st_mtime + 10
    os.utime(path, (mtime, mtime))
    out3 = _call("chunk_summaries", p, "triton")  # not seen before the next look at the file
    assert [dict(x.config) for x in _plans(cs_op)] == [configs[1]]
    monkeypatch.setattr(store, "_STAT_INTERVAL_S", 0.0)
    monkeypatch.setitem(call_plan._seen, "next_file_check", time.monotonic())  # due: STORE_RECHECK_S passed
    out3 = _call("chunk_summaries", p, "triton")
    assert [dict(x.config) for x in _plans(cs_op)] == [configs[2]]
    for o in (out, out2, out3):
        assert_close("k_sum", o[0], expect[0], torch.float32)


def test_env_changes_start_the_plans_over(monkeypatch):
    """FLASHSWITCH_BACKEND, FLASHSWITCH_POISON (and the other call_plan.ENV_VARS) take effect on the
    next call."""
    if "triton" not in kernel_backends():
        pytest.skip("triton is not usable here")
    monkeypatch.delenv("FLASHSWITCH_BACKEND", raising=False)
    made = _count_plans(monkeypatch, cs_op)
    p = _problem("chunk_summaries")
    _call("chunk_summaries", p, "auto")
    auto = _plans(cs_op)[0].backend
    _call("chunk_summaries", p, "auto")
    assert len(made) == 1
    monkeypatch.setenv("FLASHSWITCH_BACKEND", "reference" if auto != "reference" else "triton")
    _call("chunk_summaries", p, "auto")
    assert len(made) == 2 and _plans(cs_op)[0].backend != auto
    monkeypatch.setenv("FLASHSWITCH_BACKEND", "nope")
    with pytest.raises(ValueError, match="FLASHSWITCH_BACKEND"):
        _call("chunk_summaries", p, "auto")
    monkeypatch.delenv("FLASHSWITCH_BACKEND")
    _call("chunk_summaries", p, "auto")
    assert _plans(cs_op)[0].backend == auto
    n = len(made)
    monkeypatch.setenv("FLASHSWITCH_POISON", "0")
    _call("chunk_summaries", p, "auto")
    assert len(made) == n + 1
    assert set(call_plan.ENV_VARS) >= {"FLASHSWITCH_BACKEND", "FLASHSWITCH_CONFIG_DIR", "FLASHSWITCH_POISON",
                                       "TRITON_INTERPRET"}


# ---------------------------------------------------------------- the cache itself
def test_plan_cache_is_a_bounded_lru():
    cache = call_plan.PlanCache(maxsize=3)
    call_plan.check_state()  # settle the state first: a change since the last check would empty the caches
    for i in range(3):
        cache.put(i, f"plan {i}")
    assert cache.get(0) == "plan 0"  # 0 is now the most recent: 1 goes first
    cache.put(3, "plan 3")
    assert len(cache) == 3 and cache.get(1) is None and cache.get(0) == "plan 0"
    cache.put(None, "never")
    assert cache.get(None) is None and len(cache) == 3
    call_plan.clear_all()
    assert len(cache) == 0


def test_keys_tell_types_apart_and_refuse_what_they_cannot_hash(monkeypatch):
    t = torch.zeros(2, 3)
    key = lambda *a: call_plan.key_or_none(lambda *b: tuple(call_plan.scalar_key(x) for x in b), *a)  # noqa: E731
    assert len({key(1), key(1.0), key(True)}) == 3
    cache = call_plan.PlanCache()
    cache.put(key([1]), "plan")  # unhashable: the cache keeps nothing, the call is checked in full
    assert len(cache) == 0 and cache.get(key([1])) is None
    assert call_plan.key_or_none(call_plan.tensor_key, [[1.0]]) is None
    assert call_plan.key_or_none(call_plan.tensor_key, t) != call_plan.key_or_none(call_plan.tensor_key, t.t())
    assert call_plan.key_or_none(call_plan.tensor_key, t) != call_plan.key_or_none(call_plan.tensor_key,
                                                                                   torch.nn.Parameter(t))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert call_plan.key_or_none(call_plan.tensor_key, t) is None  # traced calls take the full path


def test_env_get_reads_what_os_environ_holds(monkeypatch):
    monkeypatch.setenv("FLASHSWITCH_TEST_SETTING", "ü 1")
    assert C.env_get("FLASHSWITCH_TEST_SETTING") == os.environ.get("FLASHSWITCH_TEST_SETTING") == "ü 1"
    monkeypatch.delenv("FLASHSWITCH_TEST_SETTING")
    assert C.env_get("FLASHSWITCH_TEST_SETTING") is None


def test_launchers_do_not_import_autotune():
    """Kernel launchers get a complete config from the op module: no lookup or default of their own."""
    root = Path(__file__).resolve().parent.parent / "flashswitch"
    files = sorted((root / "kernels_triton").glob("*.py")) + sorted((root / "bindings").glob("*.py"))
    assert files
    for f in files:
        assert not re.search(r"^\s*(from|import)\s+flashswitch(\.autotune|\s+import\s+autotune)", f.read_text(),
                             re.M), f.name


def test_host_time_bench_writes_its_table(tmp_path):
    """bench/tools/host_time.py runs (here: Triton launches stubbed, tiny shapes) and writes one row per op
    and backend, and one per op for a forward + backward, next to the bare Triton launch; the bound
    only catches a path gone badly wrong."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    subprocess.run([sys.executable, str(root / "bench" / "tools" / "host_time.py"), "--calls", "20", "--tiny-only", "--stub",
                    "--out", str(tmp_path)], check=True, env=env, cwd=root, timeout=600, capture_output=True)
    data = json.loads((tmp_path / "host_time.json").read_text())
    rows = {(r["op"], r["label"], r["backend"]): r["host_us"] for r in data["rows"]}
    assert ("baseline", "tiny", "triton bare") in rows
    for op in MODULES:
        assert any(k[0] == op and k[2] == "triton" for k in rows), op
        assert any(k[0] == f"{op} fwd+bwd" and k[2] == "triton" for k in rows), op  # a training step's call
    assert all(0 < us < 20_000 for us in rows.values()), rows
    md = (tmp_path / "host_time.md").read_text()
    assert md.count("\n|") >= len(rows) + 1
    assert data["meta"]["date"] and f"Run: commit {data['meta']['commit'] or 'unknown'}, {data['meta']['date']}." in md


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU run: no device's results")
def test_host_time_bench_without_gpu_writes_nothing_unasked(tmp_path):
    """Without a GPU and without --out, bench/tools/host_time.py prints its rows and writes no file (it wrote
    a bench/results/cpu/ folder into the tree)."""
    import shutil
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    work = tmp_path / "repo"
    (work / "bench" / "tools").mkdir(parents=True)
    for f in ("tools/host_time.py", "common.py"):
        shutil.copy(root / "bench" / f, work / "bench" / f)
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(work / "bench" / "tools" / "host_time.py"), "--calls", "5", "--tiny-only",
                           "--stub", "--ops", "expert_matmul", "--no-backward"], env=env, cwd=work, timeout=600,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not written" in proc.stdout
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if "__pycache__" not in p.parts) == \
        ["bench", "bench/common.py", "bench/tools", "bench/tools/host_time.py"]


# ---------------------------------------------------------------- the eager autograd path
@pytest.mark.parametrize("op", list(MODULES))
def test_eager_autograd_path_equals_the_custom_op(op, monkeypatch):
    """An eager call that needs gradients runs the op's torch.autograd.Function (the same kernels, the
    call plan's configs, no dispatcher layers): outputs and gradients bitwise those of the custom op,
    which it never calls; the custom op keeps traced and subclass calls (C.eager_autograd_path)."""
    backend = kernel_backends()[0]
    module = MODULES[op]
    p = _problem(op, seed=3)
    diff = [n for n, t in p.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]

    def run():
        leaves = {n: p[n].detach().clone().requires_grad_() for n in diff}
        outs = [o for o in _call(op, {**p, **leaves}, backend) if o.is_floating_point()]
        g = torch.Generator().manual_seed(5)
        ups = [torch.randn(o.shape, generator=g).to(o) for o in outs]
        return outs, torch.autograd.grad(outs, list(leaves.values()), ups)

    calls, real = [], module.OPDEF.op
    monkeypatch.setattr(module.OPDEF, "op", lambda *a: calls.append(1) or real(*a))
    outs, grads = run()
    assert not calls
    # a second call of the signature: its backward is prepared already (no config lookup, no prepare)
    lookups, real_config = [], call_plan.config
    monkeypatch.setattr(call_plan, "config", lambda *a, **kw: lookups.append(a) or real_config(*a, **kw))
    bwd = importlib.import_module(f"flashswitch.kernels_triton.{op}_bwd")
    monkeypatch.setattr(bwd, "prepare", lambda *a, **kw: lookups.append("prepare"))
    again, grads_again = run()
    assert not lookups and not calls
    for a, b in zip(outs + list(grads), again + list(grads_again)):
        assert torch.equal(a, b)
    monkeypatch.undo()
    monkeypatch.setattr(module.OPDEF, "op", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(C, "eager_autograd_path", lambda *tensors: False)
    outs2, grads2 = run()
    assert calls
    for a, b in zip(outs + list(grads), outs2 + list(grads2)):
        assert torch.equal(a, b)


VMAPPED = {"chunk_summaries": ("k", "v"), "eva_attention": ("q", "k", "v", "k_sum", "v_sum"), "expert_matmul": ("x",),
           "switchhead_output": ("a", "gates")}


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("op", list(MODULES))
def test_vmap_without_gradients_runs_through_the_custom_op(op, backend):
    """Under torch.vmap a call that needs no gradient still takes the custom op (whose batching falls
    back to one call per slice), never the eager fast path, which would hand the kernels batched
    tensors: each slice of the result is the call on that slice."""
    p0, p1 = _problem(op, seed=3), _problem(op, seed=4)
    if op == "expert_matmul":
        p0["route"] = flashswitch.route(p0.pop("expert_idx"), p0.pop("num_experts"))
        p1 = {**p0, "x": p1["x"]}
    names = VMAPPED[op]

    def f(*ts):
        return _call(op, {**p0, **dict(zip(names, ts))}, backend)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note that the batching rule is a loop
        batched = torch.vmap(f)(*(torch.stack([p0[n], p1[n]]) for n in names))
        for i, p in enumerate((p0, p1)):
            for got, want in zip(batched, f(*(p[n] for n in names))):
                assert torch.equal(got[i], want)
