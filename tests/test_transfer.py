"""flashswitch.nn.convert (nn/transfer.py): an exact LlamaLM turned into a FlashEVA model, and the
attention-transfer stage that fits EVA's own parameters (and optionally q / k) to the exact layers'
outputs."""
import pytest
import torch

from conftest import DEVICE
from flashswitch.nn import attention_transfer, convert
from flashswitch.nn.transfer import exact_teacher, transfer_parameters
from flashswitch.nn.llama import LlamaConfig, LlamaLM

CFG = LlamaConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=40)
EVA = dict(chunk_size=4, window_size=8, window="sliding")
N = 48  # past the window: summaries matter


def _model(qk_scale: float = 1.0):
    """qk_scale: q / k weights scaled up for peaked attention, which mean summaries approximate poorly
    (N(0, 0.02) weights give nearly uniform attention, which they approximate to 3e-5)."""
    model = LlamaLM(CFG, seed=5, device=DEVICE)
    with torch.no_grad():
        for block in model.layers:
            block.attn.q_proj.weight.mul_(qk_scale)
            block.attn.k_proj.weight.mul_(qk_scale)
    return model


def _batches(count=3, seed=0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (2, N), device=DEVICE, generator=g) for _ in range(count)]


def _layer_error(model, teacher, tokens):
    """The transfer's loss, evaluated without a step."""
    from flashswitch.nn.transfer import _teacher_io
    inputs, targets = _teacher_io(model, teacher, tokens, None)
    with torch.no_grad():
        errs = [((b.attn(x) - y).pow(2).sum() / y.pow(2).sum()).item()
                for b, x, y in zip(model.layers, inputs, targets)]
    return sum(errs) / len(errs)


def test_convert_without_transfer_is_set_attention():
    tokens = _batches(1)[0]
    ref = _model().set_attention("eva", summaries="weighted", summary_bias="learned", **EVA)
    got = convert(_model(), summaries="weighted", summary_bias="learned", **EVA)
    assert got.attention == "eva" and got.transfer_losses == []
    with torch.no_grad():
        assert torch.equal(got(tokens), ref(tokens))


@pytest.mark.parametrize("train_qk", [False, True])
def test_transfer_fits_the_exact_layers_and_nothing_else(train_qk):
    """The layer-wise error falls; only the transfer parameters move (q / k only with train_qk); the
    teacher (frozen copies of the exact attention) and every other weight keep their values, and
    every parameter its requires_grad."""
    model = _model(qk_scale=20.0)
    exact = {n: p.detach().clone() for n, p in model.named_parameters()}
    teacher = exact_teacher(model)
    model.set_attention("eva", summaries="weighted", summary_bias="learned", **EVA)
    batches = _batches()
    before = _layer_error(model, teacher, batches[0])
    losses = attention_transfer(model, teacher, batches, steps=30, lr=1e-2, train_qk=train_qk)
    after = _layer_error(model, teacher, batches[0])
    assert len(losses) == 30 and losses[-1] < 0.9 * losses[0], losses
    assert after < 0.95 * before, (before, after)  # EVA's own parameters alone: 0.669 -> 0.607
    fitted = {id(p) for p in transfer_parameters(model, train_qk)}
    for name, p in model.named_parameters():
        assert p.requires_grad
        if name in exact:
            moved = not torch.equal(p, exact[name])
            assert moved == (id(p) in fitted), name
            assert moved == (train_qk and name.endswith(("q_proj.weight", "k_proj.weight"))), name
        else:  # EVA's own parameters: created at zero, fitted
            assert name.endswith(("key_weight", "omega", "summary_logit_bias")) and p.abs().sum() > 0, name
    for t, name in zip(teacher, ("layers.0.attn", "layers.1.attn")):
        for n, p in t.named_parameters():
            assert torch.equal(p, exact[f"{name}.{n}"]) and not p.requires_grad


def test_convert_with_transfer_keeps_its_losses():
    model = convert(_model(), summaries="weighted", summary_bias="learned", transfer=_batches(), steps=4, lr=1e-2,
                    **EVA)
    assert model.attention == "eva" and len(model.transfer_losses) == 4
    assert all(loss > 0 for loss in model.transfer_losses)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nothing to fit"):  # mean summaries under a fixed bias: no parameters
        convert(_model(), summaries="mean", summary_bias="log_count", transfer=_batches(), steps=2, **EVA)
    with pytest.raises(ValueError, match="needs transfer"):
        convert(_model(), steps=2, **EVA)
    with pytest.raises(ValueError, match="steps"):
        convert(_model(), steps=-1, **EVA)
    with pytest.raises(ValueError, match="model.attention must be 'sdpa'"):
        exact_teacher(_model().set_attention("eva", **EVA))
    model = _model()
    teacher = exact_teacher(model)
    model.set_attention("eva", summaries="weighted", **EVA)
    with pytest.raises(ValueError, match="teacher has 1 layers"):
        attention_transfer(model, teacher[:1], _batches(), steps=1)
    with pytest.raises(ValueError, match="steps"):
        attention_transfer(model, teacher, _batches(), steps=0)
