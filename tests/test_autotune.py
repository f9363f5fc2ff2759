"""Tuned-config store (lookup, fallbacks, atomic writes) and the tuner's selection logic (CPU)."""
import json
import math
import sys
import types
import warnings

import pytest
import torch

from flashswitch import registry
from flashswitch.autotune import space, store, tune as T

DEV = "Fake GPU 9000"


@pytest.fixture
def cfg_dir(tmp_path, monkeypatch):
    """An empty config folder for a fake device, through FLASHSWITCH_CONFIG_DIR."""
    monkeypatch.setenv("FLASHSWITCH_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(store, "device_name", lambda: DEV)
    monkeypatch.setattr(store, "_file_memo", {})
    return tmp_path


def _feats(dtype="bf16", D=128, C=16, rows=1 << 19):
    return space.features("chunk_summaries", dtype=dtype, D=D, C=C, rows=rows)


def _write(folder, buckets):
    ops = {"chunk_summaries": {store.bucket_key(f): {"features": f, "best": best,
                                                      "backends": {"triton": {"config": cfg, "ms": 0.1}}}
                               for f, cfg, best in buckets}}
    store.save({"device": DEV, "ops": ops}, store.device_file(folder=folder))


# ---------------------------------------------------------------- store
def test_config_dir_override(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHSWITCH_CONFIG_DIR", raising=False)
    assert store.config_dir() == store.PACKAGE_CONFIGS
    monkeypatch.setenv("FLASHSWITCH_CONFIG_DIR", str(tmp_path))
    assert store.config_dir() == tmp_path
    monkeypatch.setattr(store, "device_name", lambda: "NVIDIA H200 (x)")
    assert store.device_file() == tmp_path / "NVIDIA_H200_x.json"


def test_lookup_exact_nearest_default(cfg_dir):
    exact = {"BLOCK_CHUNKS": 4, "num_warps": 4, "num_stages": 2}
    far = {"BLOCK_CHUNKS": 1, "num_warps": 8, "num_stages": 3}
    _write(cfg_dir, [(_feats(rows=1 << 19), exact, "triton"), (_feats(rows=1 << 12), far, "cuda")])
    assert store.lookup("chunk_summaries", "triton", _feats(rows=1 << 19)) == exact
    assert store.best_backend("chunk_summaries", _feats(rows=1 << 19)) == "triton"
    # nearest on a log scale: 2^18 is closer to 2^19 than to 2^12
    assert store.lookup("chunk_summaries", "triton", _feats(rows=1 << 18)) == exact
    assert store.lookup("chunk_summaries", "triton", _feats(rows=1 << 13)) == far
    assert store.best_backend("chunk_summaries", _feats(rows=1 << 13)) == "cuda"
    # a categorical feature that matches nothing: the heuristic default
    f = _feats(dtype="fp32")
    assert store.lookup("chunk_summaries", "triton", f) == space.default_config("chunk_summaries", "triton", f)
    assert store.best_backend("chunk_summaries", f) is None
    # a backend the file does not know: its default
    f = _feats()
    assert store.lookup("chunk_summaries", "cuda", f) == space.default_config("chunk_summaries", "cuda", f)


def test_lookup_skips_configs_that_do_not_fit(cfg_dir):
    # the D=128 winner (128 x 128 tiles, 3 stages: 224 KB of k/v at D=128) would need 448 KB at D=256
    def feats(D):
        return space.features("eva_attention", dtype="bf16", D=D, C=16, W=2048, window="block", decode=False,
                              rows=1 << 19, keys=1 << 15)
    big = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True}
    small = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}

    def save(entries):
        ops = {"eva_attention": {store.bucket_key(feats(D)): {"features": feats(D), "best": "triton",
                                                              "backends": {"triton": {"config": c, "ms": 1.0}}}
                                 for D, c in entries}}
        store.save({"device": DEV, "ops": ops}, store.device_file(folder=cfg_dir))

    save([(128, big)])
    assert store.lookup("eva_attention", "triton", feats(128)) == big
    assert store.lookup("eva_attention", "triton", feats(64)) == big  # nearest, and it fits at D=64
    f = feats(256)
    assert not space.config_fits("eva_attention", "triton", f, big)
    assert store.lookup("eva_attention", "triton", f) == space.default_config("eva_attention", "triton", f)
    assert space.config_fits("eva_attention", "triton", f, space.default_config("eva_attention", "triton", f))
    # a farther bucket whose config fits wins over the nearest one that does not
    save([(128, big), (16, small)])
    assert store.lookup("eva_attention", "triton", f) == small
    assert store.lookup("eva_attention", "triton", feats(64)) == big


def test_backward_lookup_skips_tiles_that_do_not_fit(cfg_dir):
    # the tuned D=128 backward (dK/dV 64 x 128 keys, 8 warps) needs twice its registers at D=256
    def feats(D):
        return space.features("eva_attention.bwd", dtype="bf16", D=D, C=16, W=2048, window="block", decode=False,
                              rows=1 << 19, keys=1 << 15)
    tuned = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2,
             "BLOCK_M_DQ": 64, "BLOCK_N_DQ": 64, "num_warps_dq": 4, "num_stages_dq": 2}
    ops = {"eva_attention.bwd": {store.bucket_key(feats(128)): {
        "features": feats(128), "best": "triton", "backends": {"triton": {"config": tuned, "ms": 1.0}}}}}
    store.save({"device": DEV, "ops": ops}, store.device_file(folder=cfg_dir))
    assert store.lookup("eva_attention.bwd", "triton", feats(64)) == tuned
    f = feats(256)
    assert not space.config_fits("eva_attention.bwd", "triton", f, tuned)
    assert store.lookup("eva_attention.bwd", "triton", f) == space.default_config("eva_attention.bwd", "triton", f)
    # a dQ tile too big for this D alone is enough to refuse a config
    assert not space.config_fits("eva_attention.bwd", "triton", f, {**space.default_config(
        "eva_attention.bwd", "triton", f), "BLOCK_M_DQ": 128, "BLOCK_N_DQ": 128, "num_stages_dq": 3})


def test_fp32_master_weights_do_not_take_a_16bit_weight_bucket(cfg_dir):
    """Layers under autocast pass fp32 master weights: a bucket tuned with bf16 weights of the same shape
    does not serve them (its configs cost the sigma-MoE layers more host work per eager step than the
    defaults saved on the GPU); a bucket tuned with fp32 weights does."""
    def feats(wdtype):
        return space.features("expert_matmul", dtype="bf16", wdtype=wdtype, d_in=1024, d_out=112, E=16, S=8,
                              G_in=1, G_out=4, tokens=16384, deterministic=False)
    tuned = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_N": 1, "INTERLEAVE": True, "num_warps": 8,
             "num_stages": 3}

    def save(entries):
        ops = {"expert_matmul": {store.bucket_key(f): {"features": f, "best": "triton",
                                                       "backends": {"triton": {"config": c, "ms": 1.0}}}
                                 for f, c in entries}}
        store.save({"device": DEV, "ops": ops}, store.device_file(folder=cfg_dir))

    f32 = feats("fp32")
    save([(feats("bf16"), tuned)])
    assert store.lookup("expert_matmul", "triton", feats("bf16")) == tuned
    assert store.lookup("expert_matmul", "triton", f32) == space.default_config("expert_matmul", "triton", f32)
    assert store.best_backend("expert_matmul", f32) is None
    own = {**tuned, "BLOCK_M": 64}
    save([(feats("bf16"), tuned), (f32, own)])
    assert store.lookup("expert_matmul", "triton", f32) == own


@pytest.mark.parametrize("op", ["expert_matmul", "expert_matmul.bwd"])
@pytest.mark.parametrize("wdtype", ["bf16", "fp32"])
def test_expert_matmul_space_and_default_configs_fit(op, wdtype):
    """Every config of op 3's spaces, and the default, passes the fits check the store applies, on
    each paper shape with 16-bit and fp32 weights."""
    from flashswitch.reference.expert_matmul import paper_shapes
    for shape in paper_shapes().values():
        mode = dict(deterministic=False) if op == "expert_matmul" else dict(gated=shape["gated"])
        f = space.features(op, dtype="bf16", wdtype=wdtype, d_in=shape["d_in"], d_out=shape["d_out"],
                           E=shape["E"], S=shape["S"], G_in=shape.get("G_in", 1), G_out=shape.get("G_out", 1),
                           tokens=shape["T"], **mode)
        for cfg in [space.default_config(op, "triton", f)] + space.config_space(op, "triton", f):
            assert space.config_fits(op, "triton", f, cfg), (f, cfg)


@pytest.mark.parametrize("op", ["eva_attention", "eva_attention.bwd"])
@pytest.mark.parametrize("D", [16, 64, 76, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_space_and_default_configs_fit(op, D, dtype):
    """Every config a space offers, and the default, passes the fits check the store applies."""
    for window, decode in (("block", False), ("sliding", False), ("block", True)):
        f = space.features(op, dtype=dtype, D=D, C=16, W=256, window=window, decode=decode, rows=1 << 16,
                           keys=1 << 14)
        for cfg in [space.default_config(op, "triton", f)] + space.config_space(op, "triton", f):
            assert space.config_fits(op, "triton", f, cfg), (f, cfg)


def test_gluon_tiles_fit_shared_memory():
    """The Gluon kernel's shared memory: q (32 KB at D = 128), the k and v ring and 16 KB of compiler
    scratch within 227 KB. 128 x 128 fits with 2 stages at D = 128 (176 KB), not with 3 (240 KB)."""
    f = dict(D=128, dtype="bf16")
    assert space._eva_gluon_fits(f, 128, 2) and not space._eva_gluon_fits(f, 128, 3)
    assert space._eva_gluon_fits(f, 64, 5) and not space._eva_gluon_fits(f, 64, 6)
    assert space._eva_gluon_fits(dict(D=64, dtype="bf16"), 128, 4)


def test_missing_file_gives_defaults(cfg_dir):
    f = _feats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.lookup("chunk_summaries", "triton", f) == space.default_config("chunk_summaries", "triton", f)
        assert store.best_backend("chunk_summaries", f) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"device": "x"}'])
def test_corrupt_file_warns_and_falls_back(cfg_dir, text):
    store.device_file().write_text(text)
    f = _feats()
    with pytest.warns(RuntimeWarning, match="unreadable"):
        cfg = store.lookup("chunk_summaries", "triton", f)
    assert cfg == space.default_config("chunk_summaries", "triton", f)


def test_atomic_save_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "dev.json"
    store.save({"ops": {"a": {}}}, path)
    store.save({"ops": {"b": {}}}, path)
    assert [p.name for p in path.parent.iterdir()] == ["dev.json"]
    assert json.loads(path.read_text()) == {"ops": {"b": {}}}
    # a write that fails half-way keeps the old file and leaves nothing behind
    with pytest.raises(TypeError):
        store.save({"ops": {"c": object()}}, path)
    assert [p.name for p in path.parent.iterdir()] == ["dev.json"]
    assert json.loads(path.read_text()) == {"ops": {"b": {}}}


# ---------------------------------------------------------------- sweep / selection
def _fake_time(table):
    def time_fn(fn, cfg):
        fn()
        t = table[cfg["id"]]
        if isinstance(t, Exception):
            raise t
        return t
    return time_fn


def test_sweep_picks_fastest_and_records_failures():
    configs = [{"id": i} for i in range(5)]
    table = {0: 3.0, 1: RuntimeError("out of resources: shared memory"), 2: 1.0, 3: float("nan"), 4: 2.0}
    ran = []
    res = T.sweep_configs(configs, make_fn=lambda c: (lambda: ran.append(c["id"])), time_fn=_fake_time(table),
                          final_rounds=0)
    assert res["config"] == {"id": 2} and res["ms"] == 1.0
    assert res["timed"] == 3 and res["complete"]
    assert res["runners_up"] == [{"config": {"id": 4}, "ms": 2.0}, {"config": {"id": 0}, "ms": 3.0}]
    assert {f["config"]["id"] for f in res["failed"]} == {1, 3}
    assert "shared memory" in next(f["error"] for f in res["failed"] if f["config"]["id"] == 1)
    assert ran == [0, 1, 2, 3, 4]


def test_sweep_final_rounds_rank_by_median():
    """A config whose sweep timing was a lucky draw loses the final to one that is faster round after
    round; configs outside the final keep their sweep times; one failing in the final drops out."""
    configs = [{"id": i} for i in range(8)]
    draws = {0: [1.0, 3.0, 3.0, 3.0], 1: [1.5, 2.0, 2.0, 2.0], 2: [1.6, 1.6, 1.6, 9.0],
             3: [1.7, RuntimeError("launch failed")], 4: [1.8] * 4, 5: [1.9] * 4, 6: [5.0], 7: [6.0]}
    calls = {i: 0 for i in draws}

    def time_fn(fn, cfg):
        t = draws[cfg["id"]][min(calls[cfg["id"]], len(draws[cfg["id"]]) - 1)]
        calls[cfg["id"]] += 1
        if isinstance(t, Exception):
            raise t
        return t

    res = T.sweep_configs(configs, lambda c: (lambda: None), time_fn, final_rounds=3)
    assert res["config"] == {"id": 2} and res["ms"] == 1.6
    assert [r["config"]["id"] for r in res["runners_up"]] == [4, 1, 0, 5]  # the final first, then the sweep
    assert [r["ms"] for r in res["runners_up"]] == [1.8, 2.0, 3.0, 1.9]
    assert calls[5] == 1 and calls[6] == 1 and calls[1] == 4
    assert any(f["config"]["id"] == 3 and f["error"].startswith("final round") for f in res["failed"])


def test_sweep_never_returns_a_wrong_config():
    configs = [{"id": i} for i in range(4)]
    table = {0: 4.0, 1: 1.0, 2: 2.0, 3: 3.0}

    def verify(cfg):
        if cfg["id"] in (1, 2):
            raise AssertionError("v_sum: relative error nan")

    res = T.sweep_configs(configs, lambda c: (lambda: None), _fake_time(table), verify=verify)
    assert res["config"] == {"id": 3} and res["runners_up"] == [{"config": {"id": 0}, "ms": 4.0}]
    assert [f["config"]["id"] for f in res["failed"]] == [1, 2]
    assert all(f["error"].startswith("wrong result") for f in res["failed"])
    res = T.sweep_configs(configs, lambda c: (lambda: None), _fake_time(table),
                          verify=lambda c: (_ for _ in ()).throw(AssertionError("bad")))
    assert res["config"] is None and res["ms"] is None


def test_verify_judges_outputs_at_the_inputs_precision():
    """A bf16 problem with fp32 master weights returns an fp32 weight gradient computed from bf16 x and
    dy: the tuner judges it by bf16's bound, as the tests do (by fp32's, no config of such a bucket
    passed and the bucket was never tuned); lse keeps fp32's bound. The baseline: the torch reference in
    bf16 (its output's rounding), for lse in fp32."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 32, generator=g, dtype=torch.float64)
    noisy = (ref * (1 + 4e-3 * torch.randn(ref.shape, generator=g, dtype=torch.float64))).float()
    spec = types.SimpleNamespace(kernel_outputs=lambda backend, cfg, problem: (noisy,),
                                 output_names=lambda n, problem=None: ["dweight"][:n])
    T._verify_fn(spec, "triton", {}, torch.bfloat16, (ref,), (ref.bfloat16().float(),))({})
    with pytest.raises(AssertionError, match="lse"):
        spec = types.SimpleNamespace(kernel_outputs=lambda backend, cfg, problem: (noisy,),
                                     output_names=lambda n, problem=None: ["lse"][:n])
        T._verify_fn(spec, "triton", {}, torch.bfloat16, (ref,), (ref.float(),))({})


def test_sweep_stops_at_deadline():
    configs = [{"id": i} for i in range(4)]
    res = T.sweep_configs(configs, lambda c: (lambda: None), _fake_time({i: 1.0 for i in range(4)}), deadline=0.0)
    assert res["config"] is None and not res["complete"] and res["timed"] == 0


def test_choose_best():
    assert T.choose_best({"triton": 1.0, "cuda": 0.5, "reference": 2.0}) == "cuda"
    assert T.choose_best({"triton": 1.0, "reference": 0.8}) == "reference"  # auto never slower than it
    assert T.choose_best({"triton": 1.0, "reference": 1.0}) == "reference"
    assert T.choose_best({"triton": None, "reference": 1.0}) == "reference"
    assert T.choose_best({"triton": math.inf}) is None
    assert T.choose_best({}) is None


# ---------------------------------------------------------------- the whole tuner on a fake op
FAKE = "fake_op"


def _fake_modules(monkeypatch, wrong=()):
    """A registry entry whose kernel is the reference itself, except for the configs in `wrong`."""
    ref = types.ModuleType("fake_op_reference")

    def torch_fake_op(x, *, scale=2.0):
        return x.float().mul(scale).to(x.dtype)

    def numpy_fake_op(x, *, scale=2.0):
        return x.detach().cpu().double().numpy() * scale

    def random_problem(n=8, *, dtype=torch.float32, device="cpu", seed=0, weight_dtype=None):
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(n, generator=g).to(dtype=dtype, device=device)}

    ref.torch_fake_op, ref.numpy_fake_op, ref.random_problem = torch_fake_op, numpy_fake_op, random_problem
    ops = types.ModuleType("fake_op_ops")
    ops.OP = FAKE
    ops.problem_features = lambda x: space.features(FAKE, dtype=str(x.dtype).replace("torch.", ""), n=x.numel())

    def run_kernel(backend, config, x):
        out = torch_fake_op(x)
        return out + 1 if config and config["b"] in wrong else out

    ops.run_kernel = run_kernel
    monkeypatch.setitem(sys.modules, "fake_op_reference", ref)
    monkeypatch.setitem(sys.modules, "fake_op_ops", ops)
    spec = registry.OpSpec(name=FAKE, ops_module="fake_op_ops", reference_module="fake_op_reference",
                           cost=lambda p: {"bytes": 2 * p["x"].numel() * p["x"].element_size()})
    monkeypatch.setitem(registry.OPS, FAKE, spec)
    monkeypatch.setitem(space.SPACES, (FAKE, "triton"), lambda f: [{"b": b} for b in (1, 2, 3, 4)])
    monkeypatch.setitem(space.TUNE_SHAPES, FAKE, [dict(n=8), dict(n=64)])
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # makes "triton" a usable backend on CPU tensors


def _timer(ref_ms):
    def time_fn(fn, *, backend, config):
        fn()
        return ref_ms if backend == "reference" else {1: 0.4, 2: 0.1, 3: 0.2, 4: 0.3}[config["b"]]
    return time_fn


def test_tune_end_to_end_on_a_fake_op(tmp_path, monkeypatch):
    _fake_modules(monkeypatch, wrong=(2,))  # the fastest config is wrong: never saved
    other = {"device": "cpu", "ops": {"chunk_summaries": {"k": {"features": {}, "best": "triton", "backends": {
        "triton": {"config": {"BLOCK_CHUNKS": 2, "num_warps": 1, "num_stages": 1}, "ms": 0.5}}}}}}
    store.save(other, tmp_path / "cpu.json")
    res = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                 time_fn=_timer(1.0), progress=False, budget_s=60)
    assert res["path"] == tmp_path / "cpu.json" and res["buckets"] == 2
    data = json.loads(res["path"].read_text())
    assert data["ops"]["chunk_summaries"] == other["ops"]["chunk_summaries"]  # merged, not replaced
    for key in ("device", "capability", "versions", "created", "budget_s"):
        assert key in data
    assert set(data["versions"]) >= {"torch", "triton", "cuda", "python"}
    table = data["ops"][FAKE]
    assert len(table) == 2
    for rec in table.values():
        assert rec["best"] == "triton"
        assert rec["backends"]["triton"]["config"] == {"b": 3} and rec["backends"]["triton"]["ms"] == 0.2
        assert rec["backends"]["reference"]["ms"] == 1.0
        assert rec["backends"]["triton"]["GB/s"] > 0
        assert [f["config"] for f in rec["failures"]["triton"]["first"]] == [{"b": 2}]
    assert [p.name for p in tmp_path.iterdir()] == ["cpu.json"]
    # the store reads what the tuner wrote
    monkeypatch.setenv("FLASHSWITCH_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(store, "device_name", lambda: "cpu")
    monkeypatch.setattr(store, "_file_memo", {})
    feats = next(iter(table.values()))["features"]
    assert store.lookup(FAKE, "triton", feats) == {"b": 3}


def test_tune_records_shapes_with_dtypes(tmp_path, monkeypatch):
    """A tune shape naming a dtype (op 3's fp32 master weights) is written to the JSON file by name."""
    _fake_modules(monkeypatch)
    monkeypatch.setitem(space.TUNE_SHAPES, FAKE, [dict(n=8, weight_dtype=torch.float32)])
    res = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                 time_fn=_timer(1.0), progress=False)
    assert res["buckets"] == 1
    rec, = json.loads(res["path"].read_text())["ops"][FAKE].values()
    assert rec["shape"] == {"n": 8, "weight_dtype": "float32"}


def test_tune_prefers_a_faster_reference_and_keeps_budget(tmp_path, monkeypatch):
    _fake_modules(monkeypatch)
    res = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                 time_fn=_timer(0.05), progress=False)
    assert {rec["best"] for rec in res["data"]["ops"][FAKE].values()} == {"reference"}
    # a spent budget: nothing tuned, nothing written, no error
    res = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path / "b0", device="cpu",
                 time_fn=_timer(1.0), progress=False, budget_s=0)
    assert res["buckets"] == 0 and res["stopped"] == "budget" and not (tmp_path / "b0").exists()


def test_tune_resume_keeps_complete_buckets(tmp_path, monkeypatch):
    _fake_modules(monkeypatch)
    first = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                   time_fn=_timer(1.0), progress=False)
    calls = []

    def counting(fn, *, backend, config):
        calls.append(backend)
        return _timer(1.0)(fn, backend=backend, config=config)

    again = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                   time_fn=counting, progress=False, resume=True)
    assert calls == [] and again["buckets"] == 0
    assert json.loads(first["path"].read_text())["ops"][FAKE] == first["data"]["ops"][FAKE]


def test_tune_resume_tunes_again_when_the_space_changed(tmp_path, monkeypatch):
    """A complete bucket swept over an older space (a config option added since) is tuned again by
    --resume; one swept over the current space is kept."""
    _fake_modules(monkeypatch)
    T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
           time_fn=_timer(1.0), progress=False)
    monkeypatch.setitem(space.SPACES, (FAKE, "triton"), lambda f: [{"b": b} for b in (1, 2, 3, 4, 5)])
    timer = _timer(1.0)

    def with_five(fn, *, backend, config):
        return 0.05 if config.get("b") == 5 else timer(fn, backend=backend, config=config)

    again = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                   time_fn=with_five, progress=False, resume=True)
    assert again["buckets"] == 2
    assert all(r["backends"]["triton"]["config"] == {"b": 5} for r in again["data"]["ops"][FAKE].values())
    calls = []
    T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
           time_fn=lambda fn, **kw: calls.append(kw) or 1.0, progress=False, resume=True)
    assert calls == []


def test_tune_keeps_backends_it_did_not_sweep(tmp_path, monkeypatch):
    """Re-tuning one backend of a bucket keeps the others' entries; "best" is chosen over all."""
    _fake_modules(monkeypatch)
    first = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                   time_fn=_timer(1.0), progress=False)
    data = first["data"]
    for rec in data["ops"][FAKE].values():
        rec["backends"]["cuda"] = {"config": {"threads": 64}, "ms": 0.05}
    store.save(data, first["path"])
    again = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                   time_fn=_timer(1.0), progress=False)
    for rec in again["data"]["ops"][FAKE].values():
        assert rec["backends"]["cuda"] == {"config": {"threads": 64}, "ms": 0.05}
        assert rec["backends"]["triton"]["ms"] == 0.1 and rec["best"] == "cuda"


def test_tune_skips_bucket_without_a_valid_kernel(tmp_path, monkeypatch):
    _fake_modules(monkeypatch, wrong=(1, 2, 3, 4))
    res = T.tune(ops=[FAKE], backends=["triton"], dtypes=("fp32",), out_dir=tmp_path, device="cpu",
                 time_fn=_timer(1.0), progress=False)
    assert res["buckets"] == 0 and not (tmp_path / "cpu.json").exists()


def test_tune_refuses_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match="GPU"):
        T.tune(ops=["chunk_summaries"], progress=False)


def test_bench_ms_signature():
    """`do_bench(..., return_mode="median")` exists in the installed triton (3.6 and later)."""
    import inspect
    from triton.testing import do_bench
    params = inspect.signature(do_bench).parameters
    assert "return_mode" in params and "quantiles" in params


def test_registry_cost_of_op1():
    spec = registry.get("chunk_summaries")
    p = spec.random_problem(B=1, H=2, N=40, D=8, C=16, dtype="fp16")
    # k, v read (2 x 1*2*40*8*2 bytes) + k_sum, v_sum (2 x 1*2*3*8*2) + lse (1*2*3*4)
    assert spec.cost(p)["bytes"] == 2 * 1280 + 2 * 96 + 24
    assert spec.throughput(p, 1.0)["GB/s"] == pytest.approx((2 * 1280 + 2 * 96 + 24) / 1e6)
    with pytest.raises(ValueError, match="unknown op"):
        registry.get("nope")
