"""Pre-norm decoder language models of the SwitchHead paper in three variants.

- "dense": multi-head attention (SDPA's causal flash path) + dense ReLU MLP (the paper's
  parameter-matched baseline: more, narrower heads).
- "switchhead": SwitchHead attention + dense MLP.
- "switchall": SwitchHead attention + sigma-MoE MLP.

`paper_config(size, variant)` gives the paper's 47M and 262M configurations; `build_model(size,
variant, **overrides)` the model. Every variant of a size has the same width, depth and vocabulary.

Sizes and their sources (the SwitchHead paper's tables and the sweep files of its public code,
RoPE models; where the two differ the code's values are used):
  47M:  d_model 412, 16 layers, context 256, dropout 0.1.
        dense: 10 heads x 41, d_ff 2053.  switchhead: 2 heads x 76, E 5, k 3, d_ff 2080.
        switchall: 2 heads x 76, E 5, k 2; sigma-MoE 16 experts x 128, k 4, entropy reg 1e-4.
  262M: d_model 1024, 18 layers, context 512, dropout 0.2.
        dense: 16 heads x 64, d_ff 4110.  switchhead: 4 heads x 112, E 4, k 2, d_ff 4188.
        switchall: 4 heads x 112, E 4, k 2; sigma-MoE 32 experts x 128, k 4, expert dropout 0.1,
        entropy reg 1e-3.
Assumptions: vocabulary 8000 (the papers' SentencePiece model for C4 / Wikitext-103 / peS2o);
rotary embeddings on half of each head's dims (the paper's RoPE models) instead of Transformer-XL
relative positions, so the models have no positional projection and count 44.5M / 243M parameters
(the paper's 47M / 262M include Transformer-XL's per-layer positional projection); no biases;
LayerNorm; untied output layer.
Init: embeddings N(0, 1); every dense projection N(0, 1/fan_in) (the SwitchHead code's rule), expert
layers as their modules document.

MLP widths and Hopper: the paper's d_ff (4110, 4188, 2053) make bf16 rows that are not 16-byte aligned, which
cuBLAS's TMA-based Hopper GEMMs need (bench/tools/gemm_align.py measures it; the 47M models' d_model 412 is
unaligned too, which these options leave). Two ModelConfig options, both off by default so the paper's
widths stay as published (`mlp_align(mode)` gives each one's overrides):
  d_ff_multiple_of   d_ff rounded up, as Llama's configs round theirs: another model, a few more MACs
                     (262M: 4110 -> 4112, +0.05 % of dense's MLP MACs; 4188 -> 4192, +0.1 %).
  d_ff_pad_multiple  the paper's model itself, its MLP weights stored with zero hidden units up to the
                     multiple (DenseMLP): same outputs and gradients, the state_dict in the paper's shapes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashswitch.nn._routing import check_positive
from flashswitch.nn.sigma_moe import SigmaMoE
from flashswitch.nn.switchhead import (ATTENTIONS, SwitchHeadAttention, attention_macs_per_token, causal_attention,
                                       rotary_dims, rotate_packed)

VARIANTS = ("dense", "switchhead", "switchall")
SIZES = ("47M", "262M")
# 16 bytes of bf16: the row alignment of Hopper's TMA-based GEMM kernels
ALIGN_ELEMENTS = 8
MLP_ALIGN = ("none", "pad", "round")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ModelConfig:
    """One decoder LM. att_experts 0: dense attention; moe_experts 0: dense MLP of d_ff units."""
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_ff: int = 0
    att_experts: int = 0
    att_k: int = 0
    moe_experts: int = 0
    moe_expert_dim: int = 0
    moe_k: int = 0
    moe_expert_dropout: float = 0.0
    moe_entropy_reg: float = 0.0
    dropout: float = 0.0
    context: int = 256
    rope_fraction: float = 0.5
    attention: str = "sdpa"
    eva_chunk_size: int = 64
    eva_window_size: int = 256
    backend: str = "auto"
    d_ff_multiple_of: int = 1
    d_ff_pad_multiple: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "d_ff_multiple_of",
                     "d_ff_pad_multiple"):
            check_positive(name, getattr(self, name))
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if not self.moe_experts and not self.d_ff:
            raise ValueError("d_ff must be >= 1 for a dense MLP (moe_experts = 0)")

    @property
    def mlp_width(self) -> int:
        """The dense MLP's hidden units: d_ff rounded up to a multiple of d_ff_multiple_of."""
        return round_up(self.d_ff, self.d_ff_multiple_of)


def mlp_align(mode: str, multiple: int = ALIGN_ELEMENTS) -> dict:
    """The ModelConfig overrides of an MLP alignment `mode`: "none" (d_ff as given), "pad" (d_ff as given,
    the weights stored with zero units up to `multiple`), "round" (d_ff rounded up to `multiple`)."""
    if mode not in MLP_ALIGN:
        raise ValueError(f"mode must be one of {MLP_ALIGN}, got {mode!r}")
    check_positive("multiple", multiple)
    return {"none": {"d_ff_pad_multiple": 1}, "pad": {"d_ff_pad_multiple": multiple},
            "round": {"d_ff_multiple_of": multiple, "d_ff_pad_multiple": 1}}[mode]


_PAPER = {
    "47M": dict(common=dict(vocab_size=8000, d_model=412, n_layers=16, context=256, dropout=0.1),
                dense=dict(n_heads=10, head_dim=41, d_ff=2053),
                switchhead=dict(n_heads=2, head_dim=76, att_experts=5, att_k=3, d_ff=2080),
                switchall=dict(n_heads=2, head_dim=76, att_experts=5, att_k=2, moe_experts=16, moe_expert_dim=128,
                               moe_k=4, moe_entropy_reg=1e-4)),
    "262M": dict(common=dict(vocab_size=8000, d_model=1024, n_layers=18, context=512, dropout=0.2),
                 dense=dict(n_heads=16, head_dim=64, d_ff=4110),
                 switchhead=dict(n_heads=4, head_dim=112, att_experts=4, att_k=2, d_ff=4188),
                 switchall=dict(n_heads=4, head_dim=112, att_experts=4, att_k=2, moe_experts=32, moe_expert_dim=128,
                                moe_k=4, moe_expert_dropout=0.1, moe_entropy_reg=1e-3)),
}


def paper_config(size: str = "47M", variant: str = "switchhead", **overrides) -> ModelConfig:
    """The paper's configuration of `size` ("47M", "262M") and `variant` ("dense", "switchhead",
    "switchall"), with any ModelConfig field overridden. Its MLP weights are stored padded to whole
    16-byte rows (d_ff_pad_multiple): the paper's model and MACs, on Hopper's GEMM kernels (cuBLAS runs
    the paper's 4110 / 4188 on its Ampere ones at a third of the rate, bench/tools/gemm_align.py)."""
    if size not in _PAPER:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    fields = {**_PAPER[size]["common"], **_PAPER[size][variant]}
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise TypeError(f"unknown ModelConfig fields: {sorted(unknown)}")
    return ModelConfig(**{"d_ff_pad_multiple": ALIGN_ELEMENTS, **fields, **overrides})


def build_model(size: str = "47M", variant: str = "switchhead", *, device=None, dtype=None,
                **overrides) -> "DecoderLM":
    return DecoderLM(paper_config(size, variant, **overrides), device=device, dtype=dtype)


def paper_macs(size: str = "47M", seq_len=None, **overrides) -> dict:
    """{variant: multiply-accumulates per token of one forward pass} for one paper size (built on the
    meta device: no memory, no compute); dense / other is a variant's ideal speedup."""
    return {v: build_model(size, v, device="meta", **overrides).macs_per_token(seq_len) for v in VARIANTS}


# ---------------------------------------------------------------- dense baseline layers
class DenseAttention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings (the dense baseline)."""

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, *, attention: str = "sdpa",
                 rope_fraction: float = 0.5, rope_base: float = 10000.0, eva_chunk_size: int = 64,
                 eva_window_size: int = 256, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.attention, self.backend = attention, backend
        self.eva = dict(eva_chunk_size=eva_chunk_size, eva_window_size=eva_window_size)
        self.n_rot, self.rope_base = rotary_dims(head_dim, rope_fraction), rope_base
        kw = dict(device=device, dtype=dtype)
        self.qkv = nn.Parameter(torch.empty(3 * num_heads * head_dim, embed_dim, **kw))
        self.out = nn.Parameter(torch.empty(embed_dim, num_heads * head_dim, **kw))
        with torch.no_grad():
            self.qkv.normal_(0.0, embed_dim ** -0.5)
            self.out.normal_(0.0, (num_heads * head_dim) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        H, D = self.num_heads, self.head_dim
        qkv = F.linear(x, self.qkv).view(B, N, 3, H, D)
        qk, v = qkv.split([2, 1], dim=2)
        q, k = (t.transpose(1, 2) for t in rotate_packed(qk, self.n_rot, self.rope_base).unbind(2))
        v = v.squeeze(2).transpose(1, 2)
        a = causal_attention(q, k, v, attention=self.attention, backend=self.backend, **self.eva)
        return F.linear(a.transpose(1, 2).reshape(B, N, H * D), self.out)

    def macs_per_token(self, seq_len: int) -> float:
        d, HD = self.embed_dim, self.num_heads * self.head_dim
        return 4 * d * HD + attention_macs_per_token(self.num_heads, self.head_dim, seq_len, attention=self.attention,
                                                     **self.eva)


class DenseMLP(nn.Module):
    """ReLU MLP d -> d_ff -> d without biases (the dense baseline).

    pad_multiple: up [d_pad, d] and down [d, d_pad] with d_pad = d_ff rounded up to this multiple, the
    d_pad - d_ff extra hidden units zero in both. The outputs and the real weights' gradients are the
    unpadded layer's (zero products add nothing), the padding's gradients are exactly zero, so AdamW, SGD
    and weight decay keep it zero (an optimizer that moves weights without a gradient would not: call
    zero_padding_()). state_dict() and load_state_dict() use the logical [d_ff, d] and [d, d_ff] shapes,
    so checkpoints move between padded and unpadded layers; macs_per_token counts d_ff.
    """
    # Whole zero-padded weights rather than a view of the logical shape: a view down[:, :d_ff] has aligned
    # rows, but the hidden activations relu(x up^T) [T, d_ff] and their gradient (operands or outputs of
    # four of the six GEMMs) would still be rows of d_ff elements, and autograd returns a strided view's
    # weight gradient in another layout. With zero units every operand of every GEMM has aligned rows, for
    # d_pad / d_ff - 1 extra MACs (262M: 0.05 % at 4110, 0.1 % at 4188).

    def __init__(self, embed_dim: int, d_ff: int, *, pad_multiple: int = 1, device=None, dtype=None):
        super().__init__()
        self.embed_dim = check_positive("embed_dim", embed_dim)
        self.d_ff = check_positive("d_ff", d_ff)
        pad = round_up(d_ff, check_positive("pad_multiple", pad_multiple)) - d_ff
        kw = dict(device=device, dtype=dtype)
        # drawn at the logical shapes, then padded: a seed gives the unpadded layer's weights
        up = torch.empty(d_ff, embed_dim, **kw).normal_(0.0, embed_dim ** -0.5)
        down = torch.empty(embed_dim, d_ff, **kw).normal_(0.0, d_ff ** -0.5)
        self.up = nn.Parameter(F.pad(up, (0, 0, 0, pad)) if pad else up)
        self.down = nn.Parameter(F.pad(down, (0, pad)) if pad else down)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, d_ff={self.d_ff}, stored_d_ff={self.up.shape[0]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.up)), self.down)

    def macs_per_token(self, seq_len: int = 0) -> float:
        return 2 * self.d_ff * self.embed_dim

    def padding_numel(self) -> int:
        """Stored elements beyond the logical weights (zeros)."""
        return 2 * (self.up.shape[0] - self.d_ff) * self.embed_dim

    def zero_padding_(self) -> None:
        with torch.no_grad():
            self.up[self.d_ff:].zero_()
            self.down[:, self.d_ff:].zero_()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.padding_numel():  # views, no copy
            destination[prefix + "up"] = destination[prefix + "up"][: self.d_ff]
            destination[prefix + "down"] = destination[prefix + "down"][:, : self.d_ff]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        pad = self.up.shape[0] - self.d_ff
        for name, dim in (("up", 0), ("down", 1)):
            w = state_dict.get(prefix + name)
            if pad and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[dim] == self.d_ff:
                state_dict[prefix + name] = F.pad(w, (0, pad) if dim else (0, 0, 0, pad))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if pad:  # a tensor loaded in the stored shape may carry nonzero padding
            self.zero_padding_()


# ---------------------------------------------------------------- the model
class Block(nn.Module):
    """Pre-norm residual block: x + drop(att(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        d = cfg.d_model
        self.norm1 = nn.LayerNorm(d, **kw)
        self.norm2 = nn.LayerNorm(d, **kw)
        if cfg.att_experts:
            self.att = SwitchHeadAttention(d, cfg.n_heads, cfg.head_dim, cfg.att_experts, cfg.att_k,
                                           attention=cfg.attention, rope_fraction=cfg.rope_fraction,
                                           eva_chunk_size=cfg.eva_chunk_size, eva_window_size=cfg.eva_window_size,
                                           backend=cfg.backend, **kw)
        else:
            self.att = DenseAttention(d, cfg.n_heads, cfg.head_dim, attention=cfg.attention,
                                      rope_fraction=cfg.rope_fraction, eva_chunk_size=cfg.eva_chunk_size,
                                      eva_window_size=cfg.eva_window_size, backend=cfg.backend, **kw)
        if cfg.moe_experts:
            self.mlp = SigmaMoE(d, cfg.moe_experts, cfg.moe_expert_dim, cfg.moe_k,
                                expert_dropout=cfg.moe_expert_dropout, entropy_reg=cfg.moe_entropy_reg,
                                backend=cfg.backend, **kw)
        else:
            self.mlp = DenseMLP(d, cfg.mlp_width, pad_multiple=cfg.d_ff_pad_multiple, **kw)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor):
        """(x, auxiliary loss of this block: the sigma-MoE regulariser, or None)."""
        x = x + self.drop(self.att(self.norm1(x)))
        if isinstance(self.mlp, SigmaMoE):
            m, aux = self.mlp(self.norm2(x), return_aux_loss=True)
        else:
            m, aux = self.mlp(self.norm2(x)), None
        return x + self.drop(m), aux

    def macs_per_token(self, seq_len: int) -> float:
        return self.att.macs_per_token(seq_len) + self.mlp.macs_per_token(seq_len)


class DecoderLM(nn.Module):
    """Token embedding, cfg.n_layers pre-norm blocks, final LayerNorm, output layer.

    forward(tokens [B, N] int) -> logits [B, N, vocab] in the compute dtype (autocast's inside autocast).
    loss(tokens, targets=None): mean next-token cross-entropy in fp32 (targets default: tokens shifted
    by one) plus the sigma-MoE regularisers in training.
    """

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = cfg
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, **kw)
        self.blocks = nn.ModuleList(Block(cfg, **kw) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model, **kw)
        self.head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model, **kw))
        with torch.no_grad():
            self.embed.weight.normal_(0.0, 1.0)
            self.head.normal_(0.0, cfg.d_model ** -0.5)

    def _trunk(self, tokens: torch.Tensor):
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError("tokens must be an int32/int64 torch.Tensor")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, N], got shape {tuple(tokens.shape)}")
        x = self.embed(tokens)
        aux = None
        for block in self.blocks:
            x, a = block(x)
            if a is not None:
                aux = a if aux is None else aux + a
        return F.linear(self.norm(x), self.head), aux

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._trunk(tokens)[0]

    def loss(self, tokens: torch.Tensor, targets=None) -> torch.Tensor:
        if targets is None:
            tokens, targets = tokens[:, :-1], tokens[:, 1:]
        logits, aux = self._trunk(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss if aux is None else loss + aux

    def macs_per_token(self, seq_len=None) -> float:
        """Multiply-accumulates per token of one forward pass at seq_len (default: the config's context),
        attention's length-dependent part averaged over positions; embedding lookups and norms not counted."""
        seq_len = self.config.context if seq_len is None else seq_len
        return sum(b.macs_per_token(seq_len) for b in self.blocks) + self.config.vocab_size * self.config.d_model

    def num_parameters(self) -> int:
        """Parameters of the model's math: the zero units of padded MLP weights not counted."""
        padding = sum(m.padding_numel() for m in self.modules() if isinstance(m, DenseMLP))
        return sum(p.numel() for p in self.parameters()) - padding
