"""flashswitch.nn.llama and bench/e2e/e2e_generation.py: the decoder's generation (prefill, then single- and
multi-token steps) gives the logits of its full-sequence forward, with EVA on an EvaCache (reference
backend; Triton under the interpreter on the CPU) and with exact attention on a StaticKVCache (masked
SDPA); each StaticKVCache decode kernel ("masked", "gqa"; on the GPU "flash") is exact attention over
each sequence's own keys for 1, 2 and 4 query heads per kv head (on the GPU also: "gqa" runs on cuDNN's
attention, and CUDA-graph replay); an EVA model whose window covers the sequence equals the exact one
(the two attention paths cross-check); the MAC and KV-read counts on hand-counted cases; the
benchmark's --help, its merging of partial runs and its tables and plots; and (GPU only) a short run of
the benchmark itself.
"""
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, dense_causal, kernel_backends
from flashswitch.nn.llama import (LLAMA_SHAPES, LlamaConfig, LlamaLM, SdpaAttention, StaticKVCache, keys_per_query,
                                  keys_seen, macs_per_token)
from flashswitch.testing import assert_close

ROOT = Path(__file__).resolve().parent.parent
TINY = LlamaConfig(vocab_size=40, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=6,
                   intermediate_size=32, tie_embeddings=False)


def load_bench():
    spec = importlib.util.spec_from_file_location("e2e_generation", ROOT / "bench" / "e2e" / "e2e_generation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model(attention="sdpa", seed=0, dtype=torch.float32, cfg=TINY, **kw):
    model = LlamaLM(cfg, attention=attention, seed=seed, device=DEVICE, dtype=dtype, **kw)
    with torch.no_grad():  # weights large enough that attention is far from uniform: position errors show
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(15.0)
    return model


def generate(model, tokens, P, steps, lengths=None):
    """Logits of the prefill of tokens[:, :P] then of steps of the given sizes, concatenated."""
    B, N = tokens.shape
    cache = model.new_cache(B, N)
    outs = [model(tokens[:, :P], cache, lengths=lengths)]
    at = P
    for n in steps:
        outs.append(model(tokens[:, at:at + n], cache))
        at += n
    return torch.cat(outs, 1)


def check_generation(model, P, steps, ragged, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, N = 2, P + sum(steps)
    tokens = torch.randint(0, model.cfg.vocab_size, (B, N), generator=g).to(DEVICE)
    lengths = torch.tensor([P, max(1, P - 3)] if ragged else [P, P])
    with torch.no_grad():
        got = generate(model, tokens, P, steps, lengths.to(DEVICE) if ragged else None)
        for b in range(B):
            L = int(lengths[b])
            seq = torch.cat([tokens[b:b + 1, :L], tokens[b:b + 1, P:]], 1)  # sequence b without its padding
            want = model(seq)
            assert_close(f"logits (sequence {b})", torch.cat([got[b:b + 1, :L], got[b:b + 1, P:]], 1), want, dtype)


# ---------------------------------------------------------------- generation == full forward
@given(window=st.sampled_from(["block", "sliding"]), C=st.sampled_from([1, 2, 3]), Wc=st.sampled_from([1, 2]),
       P=st.integers(1, 9), steps=st.lists(st.sampled_from([1, 1, 2]), min_size=1, max_size=6), ragged=st.booleans(),
       seed=st.integers(0, 99))
def test_eva_generation_matches_full_forward(window, C, Wc, P, steps, ragged, seed):
    model = make_model("eva", seed=seed, chunk_size=C, window_size=C * Wc, window=window, backend="reference")
    check_generation(model, P, steps, ragged, seed)


@pytest.mark.parametrize("backend", kernel_backends())
def test_eva_generation_on_kernels(backend):
    """The same through the kernels (Triton under the interpreter on the CPU): one case, token by token."""
    model = make_model("eva", chunk_size=2, window_size=4, window="sliding", backend=backend)
    check_generation(model, 5, [1] * 4, ragged=True)


@given(P=st.integers(1, 9), steps=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=1, max_size=6),
       ragged=st.booleans(), seed=st.integers(0, 99))
def test_static_cache_generation_matches_full_forward(P, steps, ragged, seed):
    check_generation(make_model("sdpa", seed=seed), P, steps, ragged, seed)


@pytest.mark.parametrize("decode", ["masked", "gqa", pytest.param("flash", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_static_cache_decode_is_exact_attention(decode, G):
    """Each decode kernel's steps (one token at a time, then two: "flash" takes those through the masked
    path) over right-padded prompts == exact causal attention over each sequence's own keys in fp64,
    with G query heads per kv head (head h reads kv head h // G)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # flash attention: 16-bit only
    B, Hkv, D, P, steps = 3, 2, 64, 40, [1, 1, 1, 2]
    g = torch.Generator().manual_seed(G)
    q, k, v = (torch.randn(B, h, P + sum(steps), D, generator=g).to(DEVICE, dtype) for h in (G * Hkv, Hkv, Hkv))
    lengths = torch.tensor([P, 17, 1])
    cache = StaticKVCache(B, Hkv, D, max_seq_len=P + sum(steps), dtype=dtype, device=DEVICE, decode=decode)
    cache.prefill(q[:, :, :P], k[:, :, :P], v[:, :, :P], lengths=lengths.to(DEVICE))
    got, at = [], P
    for n in steps:
        got.append(cache.step(q[:, :, at:at + n], k[:, :, at:at + n], v[:, :, at:at + n]))
        at += n
    got = torch.cat(got, 2)
    for b in range(B):
        L = int(lengths[b])
        keys, values = (torch.cat([t[b:b + 1, :, :L], t[b:b + 1, :, P:]], 2) for t in (k, v))
        want = dense_causal(q[b:b + 1, :, P:], keys, values)[0]  # the new tokens follow the sequence's L keys
        assert_close(f"{decode} decode, sequence {b}", got[b:b + 1], want, dtype)


@pytest.mark.parametrize("window", ["block", "sliding"])
def test_wide_window_eva_model_equals_exact_model(window):
    """With W >= N, EVA is exact attention: the EVA model (set_attention, shared weights) gives the
    SDPA model's logits, full forward and token-by-token."""
    model = make_model("sdpa")
    tokens = torch.randint(0, TINY.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        exact, exact_gen = model(tokens), generate(model, tokens, 6, [1] * 8)
        weights = {n: p for n, p in model.named_parameters()}
        model.set_attention("eva", chunk_size=2, window_size=16, window=window, backend="reference")
        assert all(p is weights[n] for n, p in model.named_parameters())
        assert_close("full forward", model(tokens), exact, torch.float32)
        assert_close("generation", generate(model, tokens, 6, [1] * 8), exact_gen, torch.float32)
        model.set_attention("eva", chunk_size=2, window_size=4, window=window, backend="reference")
        assert (model(tokens) - exact).abs().max() > 1e-3  # a window shorter than N changes the logits


def test_last_only_picks_each_sequences_last_position():
    model = make_model("sdpa")
    tokens = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    lengths = torch.tensor([7, 4], device=DEVICE)
    with torch.no_grad():
        full = model(tokens)
        last = model(tokens, model.new_cache(2, 7), lengths=lengths, last_only=True)
    assert last.shape == (2, 1, TINY.vocab_size)
    assert_close("last", last[:, 0], torch.stack([full[0, 6], full[1, 3]]), torch.float32)


def test_decoder_is_the_plain_pre_norm_formula():
    """The blocks' fused residual stream (each add taken with the norm after it) against
    x = x + attn(norm(x)); x = x + mlp(norm(x)) written out over the same modules."""
    model = make_model("sdpa")
    tokens = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        x = model.embed(tokens)
        for block in model.layers:
            x = x + block.attn(block.input_norm(x))
            x = x + block.mlp(block.post_norm(x))
        want = torch.nn.functional.linear(model.norm(x), model.lm_head.weight)
        assert_close("logits", model(tokens), want, torch.float32)
        assert_close("block", model.layers[0](x), x + model.layers[0].attn(model.layers[0].input_norm(x))
                     + model.layers[0].mlp(model.layers[0].post_norm(x + model.layers[0].attn(
                         model.layers[0].input_norm(x)))), torch.float32)


def test_weights_depend_on_names_and_seed_only():
    a, b = LlamaLM(TINY, seed=3), LlamaLM(TINY, attention="eva", chunk_size=2, window_size=4, seed=3)
    for (na, pa), (nb, pb) in zip(sorted(a.named_parameters()), sorted(b.named_parameters())):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(LlamaLM(TINY, seed=4).embed.weight, a.embed.weight)
    assert sum(p.numel() for p in a.parameters()) == TINY.num_params()
    assert LLAMA_SHAPES["llama-1b"].num_params() == 1_235_814_400  # Llama 3.2 1B's count
    assert LLAMA_SHAPES["smollm2-135m"].num_params() == 134_515_008


def test_bad_arguments():
    with pytest.raises(ValueError, match="attention"):
        LlamaLM(TINY, attention="linear")
    with pytest.raises(ValueError, match="chunk_size"):
        LlamaLM(TINY, attention="eva")
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4,
                    intermediate_size=8)
    with pytest.raises(ValueError, match="context_length"):
        dataclasses.replace(TINY, context_length=0)
    with pytest.raises(ValueError, match="decode"):
        StaticKVCache(1, 1, 4, max_seq_len=4, decode="paged")
    with pytest.raises(TypeError, match="tokens"):
        LlamaLM(TINY)(torch.zeros(1, 3))
    attn = SdpaAttention(8, 2, num_kv_heads=1)
    cache = attn.new_cache(1, 3)
    with torch.no_grad():
        attn(torch.randn(1, 3, 8), cache)
        with pytest.raises(ValueError, match="max_seq_len"):
            attn(torch.randn(1, 1, 8), cache)


# ---------------------------------------------------------------- cost
def test_keys_per_query_counts_the_spec_rule():
    """Hand-counted N=8, C=2, W=4 (SPEC op 2: exact keys [start(t), t], summaries c < start(t)/C)."""
    assert keys_per_query(8) == 4.5
    assert keys_per_query(8, attention="eva", chunk_size=2, window_size=4, window="block") == 28 / 8
    assert keys_per_query(8, attention="eva", chunk_size=2, window_size=4, window="sliding") == 32 / 8
    for window in ("block", "sliding"):  # a window covering the sequence is exact attention
        assert keys_per_query(100, attention="eva", chunk_size=4, window_size=128, window=window) == keys_per_query(100)


def test_kv_read_bytes_count_the_keys_each_step_reads():
    """The benchmark's KV read bytes: K and V of each key the new token attends to (exact: all up to it;
    EVA: llama.keys_seen), every layer and sequence, at the timed steps' positions."""
    bench = load_bench()
    assert list(bench.timed_positions(100, 3)) == [100 + 1 + bench.WARM_REPLAYS + i for i in range(3)]
    per_key = TINY.num_layers * TINY.num_kv_heads * 2 * TINY.head_dim * 2  # bf16 K and V, every layer
    assert bench.kv_read_bytes(TINY, {"attention": "sdpa"}, [10, 11], 3, 2) == 3 * per_key * 11.5
    eva = dict(attention="eva", chunk_size=2, window_size=4, window="block")
    assert list(keys_seen([7, 8], **eva)) == [4 + 2, 1 + 4]  # t=7: keys 4..7, summaries 0, 1; t=8: 8, 0..3
    assert bench.kv_read_bytes(TINY, eva, [7, 8], 1, 2) == per_key * 5.5
    row = bench.kv_read(TINY, "sdpa", 10, 2, {"batch": 2, "ms": 0.5}, copy_GBps=1.0)
    want = bench.kv_read_bytes(TINY, {"attention": "sdpa"}, bench.timed_positions(10, 2), 2, 2)
    assert row["kv_read_bytes_per_step"] == want and row["kv_read_GBps"] == pytest.approx(want / 0.5e-3 / 1e9)
    assert row["kv_read_pct_of_copy"] == pytest.approx(100 * row["kv_read_GBps"])


def test_macs_ideal_speedup_grows_with_context():
    cfg = LLAMA_SHAPES["llama-1b"]
    eva = dict(attention="eva", chunk_size=32, window_size=256, window="sliding")
    m = macs_per_token(cfg, 4096)
    assert m["projections"] == 16 * 2048 * 64 * (2 * 32 + 2 * 8) and m["mlp"] == 16 * 3 * 2048 * 8192
    ratios = [macs_per_token(cfg, n)["total"] / macs_per_token(cfg, n, **eva)["total"] for n in (4096, 16384, 32768)]
    assert 1 < ratios[0] < ratios[1] < ratios[2] < 3


# ---------------------------------------------------------------- the benchmark script
def test_bench_help():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e" / "e2e_generation.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for flag in ("--sizes", "--contexts", "--methods", "--steps", "--batches", "--budget-gb"):
        assert flag in out.stdout


def fake_rows():
    rows = []
    for method in ("sdpa", "eva-sliding"):
        for n in (4096, 32768):
            base = dict(size="smollm2-135m", method=method, context=n, device="fake", torch="x", triton="y",
                        decode_kernel="gqa" if method == "sdpa" else "eva", commit="abc", date="d")
            rows.append({**base, "kind": "prefill", "batch": 1, "batch_label": "1", "ms": 10.0 * n / 4096,
                         "tokens_per_s": 4e5, "peak_bytes": 3 << 30})
            for label, B in (("1", 1), ("16", 16), ("max", 500 if method == "sdpa" else 5000)):
                rows.append({**base, "kind": "decode", "batch": B, "batch_label": label, "ms": 5.0,
                             "tokens_per_s": B * 200.0, "kv_bytes_per_seq": (n if method == "sdpa" else 300) * 23040,
                             "peak_bytes": 4 << 30, "kv_read_GBps": 1234.5, "kv_read_pct_of_copy": 29.06})
    return rows


def test_partial_run_merges_into_the_results(tmp_path):
    bench = load_bench()
    path = tmp_path / "e2e_generation.json"
    rows = fake_rows()
    path.write_text(json.dumps(bench.merge(path, rows, [])))
    again = {**rows[1], "tokens_per_s": 1.0}  # a rerun of one case replaces it and keeps every other
    data = bench.merge(path, [again], bench.macs_rows(["smollm2-135m"], [4096], ["eva-sliding"]))
    assert len(data["rows"]) == len(rows)
    assert [r for r in data["rows"] if bench.row_key(r) == bench.row_key(again)] == [again]
    assert data["macs"][0]["ideal_speedup"] > 1
    assert [r["kind"] for r in data["rows"][:4]] == ["prefill", "decode", "decode", "decode"]
    assert set(data) >= {"commit", "date"}  # the latest write's


def test_tables_and_plots(tmp_path):
    bench = load_bench()
    data = bench.merge(tmp_path / "none.json", fake_rows(), bench.macs_rows(["smollm2-135m"], [4096, 32768],
                                                                             ["sdpa", "eva-sliding"]))
    written = bench.render(data, tmp_path)
    assert {p.name for p in written} == {"e2e_generation.md", "e2e_generation_throughput.png",
                                         "e2e_generation_memory.png"}
    md = (tmp_path / "e2e_generation.md").read_text()
    assert "| smollm2-135m | 32768 | eva-sliding | eva | 5000 (max) | 5.00 | 1,000,000 | 10.00x | 1,234 | 29.1 |" in md
    assert f"Last written: commit {data['commit'] or 'unknown'}, {data['date']}." in md
    assert "weaker baseline" not in md  # the gqa baseline: no warning under the table
    for kernel in ("flash", "masked"):
        weak = [{**r, "decode_kernel": kernel, "commit": "def"} if r["method"] == "sdpa" else r for r in data["rows"]]
        bench.render({**data, "rows": weak}, tmp_path)
        md_weak = (tmp_path / "e2e_generation.md").read_text()
        assert f"decoded with `{kernel}`" in md_weak and "weaker baseline" in md_weak
        assert "the rows come from commits abc, def" in md_weak
    assert "| smollm2-135m | 32768 | eva-sliding | 80.0 | 400,000 | 1.00x |" in md


# ---------------------------------------------------------------- GPU
GPU_CFG = LlamaConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=64,
                      intermediate_size=512)


@pytest.mark.gpu
def test_gqa_decode_runs_on_cudnn():
    """The model's "gqa" decode step (q as the layer passes it) runs with SDPA held to cuDNN's attention,
    as the benchmark runs it: no fallback to the math backend, which copies every kv head G times; and
    it gives the masked decode's logits."""
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = LlamaLM(GPU_CFG, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator("cuda").manual_seed(0)
    tokens = torch.randint(0, GPU_CFG.vocab_size, (3, 101), device="cuda", generator=g)
    out = {}
    with torch.no_grad():
        for decode in ("gqa", "masked"):
            model.set_attention("sdpa", decode=decode)
            cache = model.new_cache(3, 101)
            model(tokens[:, :100], cache)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if decode == "gqa" else nullcontext():
                out[decode] = model(tokens[:, 100:], cache)
    assert_close("gqa decode logits", out["gqa"], out["masked"].float(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa-flash", "sdpa-gqa", "eva"])
def test_captured_model_step_equals_eager(attention):
    """The benchmark's decode: one captured model step replayed token after token == eager steps (bf16)."""
    cfg = GPU_CFG
    kw = dict(chunk_size=16, window_size=64, window="sliding") if attention == "eva" else dict(
        decode=attention.split("-")[1])
    model = LlamaLM(cfg, attention=attention.split("-")[0], device="cuda", dtype=torch.bfloat16, **kw)
    B, P, T = 3, 150, 20
    g = torch.Generator("cuda").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, P + T), device="cuda", generator=g)
    with torch.no_grad():
        eager, graphed = model.new_cache(B, P + T), model.new_cache(B, P + T)
        for c in (eager, graphed):
            model(tokens[:, :P], c)
        want = torch.cat([model(tokens[:, t:t + 1], eager) for t in range(P, P + T)], 1)
        tok = tokens[:, P:P + 1].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = [model(tok, graphed).clone()]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(tok, graphed)
        for t in range(P + 1, P + T):
            tok.copy_(tokens[:, t:t + 1])
            graph.replay()
            got.append(out.clone())
    assert_close("logits", torch.cat(got, 1), want.float(), torch.bfloat16)


@pytest.mark.gpu
def test_bench_short_run(tmp_path):
    """A short run of the benchmark writes its JSON, table and plots with every case checked."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e" / "e2e_generation.py"), "--sizes", "smollm2-135m",
                          "--contexts", "1024", "--batches", "1", "4", "--steps", "4", "--reps", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "e2e_generation.json").read_text())
    assert len(data["rows"]) == 3 * 3 and all(r["finite"] and r["lengths_ok"] for r in data["rows"]
                                               if r["kind"] == "decode")
    assert (tmp_path / "e2e_generation_throughput.png").exists()
