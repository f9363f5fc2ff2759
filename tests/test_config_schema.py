"""Tuned-config files that are valid JSON but break the schema give one warning and fall back to the
defaults (never an exception at lookup); every config of every tuning space passes the schema; writes
are atomic, leave the umask alone, and two writers at once keep each other's buckets."""
import json
import multiprocessing as mp
import os
import warnings

import pytest

from flashswitch.autotune import schema, space, store
from flashswitch.backends import KERNELS

DEV = "Fake GPU 9000"
OP = "expert_matmul"


@pytest.fixture
def cfg_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSWITCH_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(store, "device_name", lambda: DEV)
    monkeypatch.setattr(store, "_file_memo", {})
    store._entry_memo.clear()
    return tmp_path


def _feats():
    return space.features(OP, dtype="bf16", wdtype="bf16", d_in=1024, d_out=112, E=16, S=8, G_in=1, G_out=4,
                          tokens=16384, deterministic=False)


def _good_entry(cfg=None, best="triton"):
    cfg = cfg or {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_N": 1, "INTERLEAVE": True,
                  "num_warps": 8, "num_stages": 3}
    return {"features": _feats(), "best": best, "backends": {"triton": {"config": cfg, "ms": 0.1}}}


def _write(folder, text):
    (folder / (store.device_slug(DEV) + ".json")).write_text(text if isinstance(text, str) else json.dumps(text))


def _ops(entry):
    return {"device": DEV, "ops": {OP: {store.bucket_key(_feats()): entry}}}


BAD_FILES = {
    "op table is a list": {"device": DEV, "ops": {OP: [1, 2]}},
    "entry is a string": _ops("fast"),
    "null feature": _ops({**_good_entry(), "features": {**_feats(), "D": None}}),
    "unknown backend in best": _ops(_good_entry(best="tensorrt")),
    "non-integer tile": _ops(_good_entry({**_good_entry()["backends"]["triton"]["config"], "BLOCK_M": 96.5})),
    "non-power-of-two tile": _ops(_good_entry({**_good_entry()["backends"]["triton"]["config"], "BLOCK_N": 96})),
    "oversized tile": _ops(_good_entry({**_good_entry()["backends"]["triton"]["config"], "BLOCK_M": 1 << 20})),
    "unknown key": _ops(_good_entry({**_good_entry()["backends"]["triton"]["config"], "BLOCK_Q": 64})),
    "config is null": _ops({**_good_entry(), "backends": {"triton": {"config": None, "ms": 0.1}}}),
    "bool as a tile": _ops(_good_entry({**_good_entry()["backends"]["triton"]["config"], "num_warps": True})),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_entry_warns_once_and_falls_back(cfg_dir, name):
    _write(cfg_dir, BAD_FILES[name])
    f = _feats()
    with pytest.warns(RuntimeWarning, match="invalid entries|unreadable") as rec:
        cfg = store.lookup(OP, "triton", f)
        store.lookup(OP, "triton", f)
        store.best_backend(OP, f)
    assert cfg == space.default_config(OP, "triton", f)
    assert sum("invalid entries" in str(w.message) or "unreadable" in str(w.message) for w in rec) == 1


def test_warning_names_the_unknown_key(cfg_dir):
    _write(cfg_dir, BAD_FILES["unknown key"])
    with pytest.warns(RuntimeWarning, match="BLOCK_Q"):
        store.lookup(OP, "triton", _feats())


def test_deeply_nested_json_falls_back(cfg_dir):
    _write(cfg_dir, '{"ops": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert store.lookup(OP, "triton", _feats()) == space.default_config(OP, "triton", _feats())


def test_valid_entries_survive_beside_invalid_ones(cfg_dir):
    good = _good_entry()
    other = space.features(OP, dtype="bf16", wdtype="bf16", d_in=112, d_out=1024, E=16, S=8, G_in=4, G_out=1,
                           tokens=16384, deterministic=False)
    data = _ops(good)
    data["ops"][OP][store.bucket_key(other)] = "garbage"
    _write(cfg_dir, data)
    with pytest.warns(RuntimeWarning, match="1 invalid"):
        assert store.lookup(OP, "triton", _feats()) == good["backends"]["triton"]["config"]


def test_other_device_warns_but_loads(cfg_dir):
    _write(cfg_dir, {**_ops(_good_entry()), "device": "Other GPU"})
    with pytest.warns(RuntimeWarning, match="Other GPU"):
        assert store.lookup(OP, "triton", _feats())["BLOCK_M"] == 128


def test_committed_config_files_pass_the_schema():
    for path in store.config_files(store.PACKAGE_CONFIGS):
        _, problems = schema.clean(json.loads(path.read_text()))
        assert problems == [], f"{path.name}: {problems[:3]}"


def _forward_buckets():
    """Bucket features of every forward tuning shape, in every dtype."""
    for dt in ("bf16", "fp16", "fp32"):
        for s in space.TUNE_SHAPES["chunk_summaries"]:
            yield "chunk_summaries", space.features("chunk_summaries", dtype=dt, D=s["D"], C=s["C"],
                                                    rows=s["B"] * s["H"] * s["N"])
        for s in space.TUNE_SHAPES["eva_attention"]:
            nq = s.get("Nq", s["Nk"])
            yield "eva_attention", space.features("eva_attention", dtype=dt, D=s["D"], C=s["C"], W=s["W"],
                                                  window=s["window"], decode=nq <= 16, rows=s["B"] * s["H"] * nq,
                                                  keys=s["Nk"])
        for s in space.TUNE_SHAPES["expert_matmul"]:
            for det in (False, True):
                yield "expert_matmul", space.features(
                    "expert_matmul", dtype=dt, wdtype=dt, d_in=s["d_in"], d_out=s["d_out"], E=s["E"], S=s["S"],
                    G_in=s.get("G_in", 1), G_out=s.get("G_out", s["S"]), tokens=s["T"], deterministic=det)
        for s in space.TUNE_SHAPES["switchhead_output"]:
            yield "switchhead_output", _sho_features("switchhead_output", dt, s)


def _backward_buckets():
    """Bucket features of every backward tuning shape, in every dtype."""
    for dt in ("bf16", "fp16", "fp32"):
        for s in space.TUNE_SHAPES["chunk_summaries.bwd"]:
            yield "chunk_summaries.bwd", space.features("chunk_summaries.bwd", dtype=dt, D=s["D"], C=s["C"],
                                                        rows=s["B"] * s["H"] * s["N"])
        for s in space.TUNE_SHAPES["eva_attention.bwd"]:
            for decode in (False, True):
                yield "eva_attention.bwd", space.features(
                    "eva_attention.bwd", dtype=dt, D=s["D"], C=s["C"], W=s["W"], window=s["window"], decode=decode,
                    rows=s["B"] * s["H"] * s["Nk"], keys=s["Nk"])
        for s in space.TUNE_SHAPES["expert_matmul.bwd"]:
            yield "expert_matmul.bwd", space.features(
                "expert_matmul.bwd", dtype=dt, wdtype=dt, d_in=s["d_in"], d_out=s["d_out"], E=s["E"], S=s["S"],
                G_in=s.get("G_in", 1), G_out=s.get("G_out", s["S"]), tokens=s["T"], gated=s["gated"])
        for s in space.TUNE_SHAPES["switchhead_output.bwd"]:
            yield "switchhead_output.bwd", _sho_features("switchhead_output.bwd", dt, s)


def _sho_features(table: str, dt: str, s: dict) -> dict:
    wdtype = "fp32" if s.get("weight_dtype") is not None else dt
    return space.features(table, dtype=dt, wdtype=wdtype, H=s["H"], E=s["E"], D=s["D"], d=s["d"], tokens=s["T"])


def test_every_space_config_passes_the_schema():
    n = 0
    for op, f in list(_forward_buckets()) + list(_backward_buckets()):
        for backend in KERNELS:
            for cfg in space.config_space(op, backend, f) + [space.default_config(op, backend, f)]:
                assert schema.config_problems(op, backend, cfg) == [], (op, backend, cfg)
                n += 1
    assert n > 1000


def test_save_leaves_the_umask_alone(tmp_path, monkeypatch):
    def no_umask(*_):
        raise AssertionError("save must not change the process umask")
    monkeypatch.setattr(os, "umask", no_umask)
    path = tmp_path / "dev.json"
    store.save({"ops": {}}, path)
    assert json.loads(path.read_text()) == {"ops": {}}


def _writer(path, table, n):
    for i in range(n):
        store.update(path, {table: {f"k{i}": _good_entry()}})


def test_two_writers_keep_each_others_buckets(tmp_path):
    path = tmp_path / "dev.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, t, 25)) for t in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    ops = json.loads(path.read_text())["ops"]
    assert sorted(ops) == ["a", "b"] and len(ops["a"]) == 25 and len(ops["b"]) == 25
    assert [p.name for p in tmp_path.iterdir()] == ["dev.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert schema.clean(json.loads(path.read_text()))[1] == []
