"""flashswitch.nn.EvaAttention: the full-sequence forward is EVA (exact causal attention when the
window covers the sequence), generation through an EvaCache (prefill + single- and multi-token steps)
reproduces the full-sequence forward at every position, gradients reach every parameter on the
reference backend, and `from_llama` reproduces a transformers Llama attention layer (where
transformers is installed)."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, dense_causal, kernel_backends
from flashswitch import chunk_summaries, eva_attention
from flashswitch.nn import EvaAttention
from flashswitch.nn.rotary import apply_rotary
from flashswitch.testing import assert_close

BACKENDS = ["reference"] + kernel_backends()


def make_layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = EvaAttention(**{**dict(hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=6, chunk_size=2,
                                   window_size=4), **kw}).to(DEVICE)
    with torch.no_grad():  # learnt values, not the zero start
        if layer.key_weight is not None:
            layer.key_weight.normal_(0, 0.5), layer.omega.normal_(0, 0.5)
        if layer.summary_logit_bias is not None:
            layer.summary_logit_bias.normal_(0, 1.0)
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_window_is_causal_attention_with_rotary(backend):
    """W >= N: EVA is exact causal softmax attention of the rotated q, k (fp64 check of the wiring)."""
    layer = make_layer(window_size=16, chunk_size=4, backend=backend)
    x = torch.randn(2, 13, 24, device=DEVICE)
    with torch.no_grad():
        got = layer(x)
        B, N = x.shape[:2]
        q = layer.q_proj(x).view(B, N, 4, 6).transpose(1, 2)
        k = layer.k_proj(x).view(B, N, 2, 6).transpose(1, 2)
        v = layer.v_proj(x).view(B, N, 2, 6).transpose(1, 2)
        cos, sin = layer.rotary.cos_sin(torch.arange(N, device=DEVICE))
        o = dense_causal(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)[0]
        want = layer.o_proj.to(torch.float64)(o.transpose(1, 2).reshape(B, N, 24))
    assert_close("y", got, want, torch.float32)


def check_generation(backend, window, summaries, C, Wc, P, steps, ragged, summary_bias):
    layer = make_layer(window=window, summaries=summaries, chunk_size=C, window_size=C * Wc, backend=backend,
                       summary_bias=summary_bias)
    B, N = 2, P + sum(steps)
    x = torch.randn(B, N, 24, device=DEVICE)
    lengths = torch.tensor([P, P // 2] if ragged else [P, P])
    with torch.no_grad():
        cache = layer.new_cache(B, N)
        outs = [layer(x[:, :P], cache, lengths=lengths.to(DEVICE) if ragged else None)]
        at = P
        for n in steps:
            outs.append(layer(x[:, at:at + n], cache))
            at += n
        got = torch.cat(outs, 1)
        for b in range(B):
            L = int(lengths[b])
            seq = torch.cat([x[b:b + 1, :L], x[b:b + 1, P:]], 1)
            want = layer(seq)
            assert_close(f"y (sequence {b})", torch.cat([got[b:b + 1, :L], got[b:b + 1, P:]], 1), want,
                         torch.float32)


@given(window=st.sampled_from(["block", "sliding"]), summaries=st.sampled_from(["mean", "weighted"]),
       C=st.sampled_from([1, 2, 3]), Wc=st.sampled_from([1, 2]), P=st.integers(0, 9),
       steps=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=5), ragged=st.booleans(),
       summary_bias=st.sampled_from([None, "log_count", "learned"]))
def test_generation_matches_full_forward(window, summaries, C, Wc, P, steps, ragged, summary_bias):
    """Prefill + steps through the layer == the layer's full-sequence forward (reference backend)."""
    check_generation("reference", window, summaries, C, Wc, P, steps, ragged, summary_bias)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("window", ["block", "sliding"])
def test_generation_matches_full_forward_on_kernels(backend, window):
    """The same through the kernels (the cache tests fuzz them; here one case per window)."""
    check_generation(backend, window, "weighted", 2, 2, 5, [1, 2, 1], True, "learned")


def banded_attention(layer, x, window):
    """The layer's q/k/v/o with exact softmax over keys [start(t), t] only (fp64, autograd)."""
    from flashswitch.cache import window_start
    B, N = x.shape[:2]
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    xd = x.double()
    q = (xd @ layer.q_proj.weight.double().T).view(B, N, H, D).transpose(1, 2)
    k = (xd @ layer.k_proj.weight.double().T).view(B, N, Hkv, D).transpose(1, 2)
    v = (xd @ layer.v_proj.weight.double().T).view(B, N, Hkv, D).transpose(1, 2)
    cos, sin = layer.rotary.cos_sin(torch.arange(N, device=x.device))
    q, k = apply_rotary(q, cos.double(), sin.double()), apply_rotary(k, cos.double(), sin.double())
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    t = torch.arange(N, device=x.device)
    start = window_start(t, layer.chunk_size, layer.window_size, window)
    see = (t[None, :] <= t[:, None]) & (t[None, :] >= start[:, None])
    p = torch.softmax((q @ k.transpose(-1, -2) * D ** -0.5).masked_fill(~see, float("-inf")), -1)
    return (p @ v).transpose(1, 2).reshape(B, N, H * D) @ layer.o_proj.weight.double().T


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", ["block", "sliding"])
def test_summaries_off_is_windowed_exact_attention(backend, window):
    """summary_bias="off": exact attention over the window's keys alone, forward and gradients, and
    generation through the cache gives the same outputs."""
    layer = make_layer(window=window, chunk_size=2, window_size=4, summary_bias="off", backend=backend)
    x = torch.randn(2, 13, 24, device=DEVICE, requires_grad=True)
    got = layer(x)
    want = banded_attention(layer, x, window)
    assert_close("y", got, want, torch.float32)
    g = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, [x, layer.q_proj.weight, layer.k_proj.weight], g)
    want_grads = torch.autograd.grad(want, [x, layer.q_proj.weight, layer.k_proj.weight], g.double())
    for name, a, b in zip(("dx", "dWq", "dWk"), got_grads, want_grads):
        assert_close(name, a, b, torch.float32)
    with torch.no_grad():
        cache = layer.new_cache(2, 13)
        gen = torch.cat([layer(x[:, :6], cache)] + [layer(x[:, i:i + 1], cache) for i in range(6, 13)], 1)
    assert_close("y (generation)", gen, want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", ["block", "sliding"])
def test_learned_summary_bias(backend, window):
    """summary_bias="learned" adds summary_logit_bias [Hkv] (fp32 zeros): at the start the layer is the
    "log_count" one; with bias b_h it is op 2 with the summary bias tensor log C + b_h."""
    layer = make_layer(window=window, summary_bias="learned", backend=backend)
    assert layer.summary_logit_bias.dtype == torch.float32 and layer.summary_logit_bias.shape == (2,)
    assert not EvaAttention(24, 4, chunk_size=2, window_size=4, summary_bias="learned").summary_logit_bias.any()
    x = torch.randn(2, 13, 24, device=DEVICE)
    with torch.no_grad():
        b = layer.summary_logit_bias.clone()
        zero = torch.zeros_like(b)
        layer.summary_logit_bias.zero_()
        assert_close("y (zero bias)", layer(x), _forward_with_bias(layer, x, zero + math.log(2)).double(),
                     torch.float32)
        layer.summary_logit_bias.copy_(b)
        got = layer(x)
        want = _forward_with_bias(layer, x, b + math.log(2))
        assert (want - _forward_with_bias(layer, x, zero + math.log(2))).abs().max() > 1e-3  # in use
    assert_close("y (learned bias)", got, want.double(), torch.float32)


def _forward_with_bias(layer, x, per_head):
    """The layer's forward spelled out, op 2's summary bias the tensor per_head[h] on every chunk."""
    from flashswitch.nn._projections import qkv_projection
    B, N = x.shape[:2]
    q, k, v = qkv_projection(layer, x)
    q, k = layer.rotary.rotate_qk(q, k, None)
    k_sum, v_sum = chunk_summaries(k, v, layer.chunk_size, backend=layer.backend)
    bias = per_head.float()[None, :, None].expand(B, layer.num_kv_heads, k_sum.shape[2])
    o = eva_attention(q, k, v, k_sum, v_sum, chunk_size=layer.chunk_size, window_size=layer.window_size,
                      window=layer.window, summary_bias=bias, backend=layer.backend)
    return layer.o_proj(o.transpose(1, 2).reshape(B, N, layer.num_heads * layer.head_dim))


def test_gradients_reach_every_parameter():
    layer = make_layer(summaries="weighted", summary_bias="learned", window_size=2, chunk_size=2, backend="reference")
    x = torch.randn(2, 11, 24, device=DEVICE, requires_grad=True)
    layer(x).square().sum().backward()
    for name, p in list(layer.named_parameters()) + [("x", x)]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_bad_arguments():
    kw = dict(hidden_size=8, num_heads=2, chunk_size=2, window_size=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        EvaAttention(**{**kw, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="window_size"):
        EvaAttention(**{**kw, "window_size": 3})
    with pytest.raises(ValueError, match="summaries"):
        EvaAttention(**kw, summaries="max")
    with pytest.raises(ValueError, match="summary_bias"):
        EvaAttention(**kw, summary_bias="on")
    with pytest.raises(ValueError, match="rotary"):
        EvaAttention(**kw, head_dim=3)
    layer = EvaAttention(**kw)
    with pytest.raises(ValueError, match="hidden_size"):
        layer(torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match="lengths"):
        layer(torch.randn(1, 3, 8), lengths=torch.tensor([2]))


def test_nn_is_reached_from_the_package():
    """`import flashswitch as fs; fs.nn.EvaAttention` works without `import flashswitch.nn`, and the plain
    import does not load the layers (a fresh process: this one has imported them already)."""
    code = ("import sys, flashswitch as fs\n"
            "assert 'flashswitch.nn' not in sys.modules, 'import flashswitch loaded flashswitch.nn'\n"
            "assert fs.nn.EvaAttention.__name__ == 'EvaAttention'\n"
            "assert not hasattr(fs, 'no_such_name')\n")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- transformers (optional)
def test_from_llama_matches_llama_attention():
    """With the window covering the sequence, the copied layer equals transformers' own Llama layer."""
    tf = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as ml
    cfg = tf.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=1, vocab_size=50, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = ml.LlamaAttention(cfg, layer_idx=0).to(DEVICE)
    rope = ml.LlamaRotaryEmbedding(cfg).to(DEVICE)
    x = torch.randn(2, 17, 32, device=DEVICE)
    pos = torch.arange(17, device=DEVICE)[None].expand(2, -1)
    mask = torch.full((17, 17), float("-inf"), device=DEVICE).triu(1)[None, None]
    with torch.no_grad():
        want = attn(x, position_embeddings=rope(x, pos), attention_mask=mask)[0]
        layer = EvaAttention.from_llama(attn, chunk_size=4, window_size=32, inv_freq=rope.inv_freq,
                                        backend="reference")
        assert_close("y", layer(x), want, torch.float32)
        narrow = EvaAttention.from_llama(attn, chunk_size=4, window_size=8, backend="reference")
        assert not torch.allclose(narrow(x), want, atol=1e-3)  # a real EVA layer, not a copy of softmax


def _tiny_llama(tf):
    cfg = tf.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=2, vocab_size=61, max_position_embeddings=128)
    torch.manual_seed(1)
    return tf.LlamaForCausalLM(cfg).to(DEVICE).eval()


def test_transformers_llama_runs_and_generates_with_eva():
    """use_eva + EvaHFCache: generate()'s cached decoding gives the logits of the full-sequence EVA
    forward at every new position, and with a window covering everything both equal softmax Llama."""
    tf = pytest.importorskip("transformers")
    from flashswitch.nn import hf
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)  # 0 is padding
    gen = dict(max_new_tokens=7, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    with torch.no_grad():
        model = _tiny_llama(tf)
        exact = model(ids).logits
        exact_gen = model.generate(ids, **gen)
        for window, C, W in (("block", 2, 4), ("sliding", 2, 4), ("block", 4, 32)):
            hf.use_eva(model, chunk_size=C, window_size=W, window=window, summaries="weighted", backend="reference")
            for m in model.modules():
                if hasattr(m, "eva_key_weight"):
                    m.eva_key_weight.normal_(0, 0.3), m.eva_omega.normal_(0, 0.3)
            cache = hf.EvaHFCache(model.config, max_cache_len=16)
            out = model.generate(ids, **{hf.cache_kwarg(model): cache}, **gen)
            assert cache.nbytes > 0
            full = model(out.sequences[:, :-1]).logits[:, ids.shape[1] - 1:]
            assert_close(f"logits ({window}, W={W})", torch.stack(out.logits, 1), full, torch.float32)
            if W >= 16:
                assert_close("prompt logits", model(ids).logits, exact, torch.float32)
                assert torch.equal(out.sequences, exact_gen.sequences)
            for m in model.modules():  # the next round adds fresh ones
                if hasattr(m, "eva_key_weight"):
                    del m.eva_key_weight, m.eva_omega


def test_transformers_beam_search_reorders_the_cache():
    """Beam search with EvaHFCache (reorder every step) picks the beams of cache-free EVA decoding."""
    tf = pytest.importorskip("transformers")
    from flashswitch.nn import hf
    ids = torch.randint(1, 61, (2, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    gen = dict(max_new_tokens=6, do_sample=False, num_beams=3, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model = hf.use_eva(_tiny_llama(tf), chunk_size=2, window_size=4, window="sliding", backend="reference")
        want = model.generate(ids, use_cache=False, **gen)
        cache = hf.EvaHFCache(model.config, max_cache_len=13)
        got = model.generate(ids, **{hf.cache_kwarg(model): cache}, **gen)
    assert torch.equal(got, want)
