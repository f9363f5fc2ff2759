"""Where a FlashEVA model's time goes: the shipped Llama shapes with EVA and with exact attention, side
by side in one run.

    python bench/e2e/model_speed.py                                   # every model, mode and attention
    python bench/e2e/model_speed.py --models smollm2-135m --modes train --impls compiled
    python bench/e2e/model_speed.py --smoke                           # a tiny model on the CPU

Writes bench/results/<device>/model_speed.{json,md,png} (or --out DIR), merging its rows into the JSON
already there (a run split by flags adds up). Modes:

prefill    batch 1, prompts of --prefill-lens tokens into empty caches (LlamaLM.new_cache), the last
           position's logits, bf16 weights, no gradient.
attention  the attention op alone at each --train-shapes B x T and the model's head layout, forward
         + backward (fwd_ms: forward alone): EVA is op 1 + op 2 (chunk_summaries, eva_attention), exact
         is SDPA (is_causal, enable_gqa); q, k, v after rotary, bf16. Also the same EVA attention through
         FlexAttention ("flex-sliding", "flex-block": op 1, then compiled flex_attention over [k; k_sum]
         with EVA's block mask and the log-count bias as score_mod; bench/baselines.py), the library a
         user would otherwise write EVA with.
train      one fine-tuning step (forward + backward + fused AdamW, bf16 autocast over fp32 master weights)
           at each --train-shapes B x T, random tokens.

Attentions: "sdpa" (exact causal attention, SDPA with enable_gqa), "eva-sliding" and "eva-block"
(EvaAttention, C 32, W 256, the log-count summary bias). Impls of the train step: "eager" (the model as
written), "compiled" (LlamaLM.compile_regions: each block and the loss head through torch.compile) and
"graphed" (compiled, and the whole step replayed from a CUDA graph as a fine-tune runs it:
e2e_common.trainer; CUDA only). Prefill and attention rows run eager.
Each row has the median per-call time (CUDA events, host included), the time of the same call
replayed from a CUDA graph (the kernels alone; None where it cannot be captured), the MAC-ideal
speedup (exact attention's multiply-accumulates per token over the row's, flashswitch.nn.llama.
macs_per_token) and the split of one call's GPU time by kernel family (torch profiler). A case that
fails (out of memory, say) is recorded with its error and the run goes on.
"""
from __future__ import annotations

import argparse
import re
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/: baselines.py

import torch  # noqa: E402

import e2e_common as E  # noqa: E402
from flashswitch.nn.llama import LLAMA_SHAPES, LlamaConfig, LlamaLM, macs_per_token  # noqa: E402

NAME = "model_speed"
KEYS = {"rows": ("model", "mode", "batch", "seq_len", "attention", "impl")}
ATTENTIONS = {"sdpa": {"attention": "sdpa"},
              "eva-sliding": {"attention": "eva", "chunk_size": 32, "window_size": 256, "window": "sliding"},
              "eva-block": {"attention": "eva", "chunk_size": 32, "window_size": 256, "window": "block"}}
IMPLS = ("eager", "compiled", "graphed")
# EVA attention through FlexAttention (attention mode only): the EVA attention each one computes
FLEX = {"flex-sliding": "eva-sliding", "flex-block": "eva-block"}
MODES = ("attention", "prefill", "train")
PREFILL_LENS = (2048, 4096, 8192, 16384, 32768)
TRAIN_SHAPES = ("8x2048", "2x8192")
# the smoke run: a 2-layer toy with SmolLM2's head layout, EVA at toy chunk and window sizes
SMOKE_CFG = LlamaConfig(vocab_size=256, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                        intermediate_size=128)
SMOKE_EVA = {"chunk_size": 4, "window_size": 16}
GiB = float(1 << 30)

# the profile split's columns (e2e_common.KERNEL_FAMILIES; op 3 runs in no Llama model)
SPLIT = ("op1", "op2_fwd", "op2_bwd", "exact_attention", "gemm", "loss", "optimizer", "elementwise", "host")


# ---------------------------------------------------------------- measuring
def call_ms(fn, reset, *, reps: int, warmup: int, device) -> list[float]:
    """Milliseconds of each of `reps` calls of fn after `warmup` ones: back to back (E.time_calls), or,
    where a reset() comes before each call, that reset run and waited for outside the timing."""
    if reset is None or torch.device(device).type != "cuda":
        def call():
            if reset is not None:
                reset()
            fn()
        return E.time_calls(call, warmup=warmup, reps=reps, device=device)
    for _ in range(warmup):
        reset()
        fn()
    out = []
    for _ in range(reps):
        reset()
        torch.cuda.synchronize()
        out += E.time_calls(fn, warmup=0, reps=1, device=device)
    return out


def graph_ms(fn, reset, reps: int) -> float | None:
    """Median ms of fn replayed from a CUDA graph (reset() before each replay, outside the graph and
    the timing), or None where fn cannot be captured."""
    try:
        graph = E.capture(fn, reset=reset)
    except Exception as err:  # noqa: BLE001 (a step that cannot be captured only costs the column)
        print(f"  no CUDA graph: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200])
        torch.cuda.synchronize()
        return None
    return E.median(call_ms(graph.replay, reset, reps=reps, warmup=0, device="cuda"))


def timed(fn, reset, *, reps: int, warmup: int, device, graph: bool) -> dict:
    """Per-call ms (host included), CUDA-graph ms and one call's profile; reset() (outside the timing)
    before each call."""
    out = {"ms": E.median(call_ms(fn, reset, reps=reps, warmup=warmup, device=device))}
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        if reset is not None:
            reset()
        out.update(E.profile_split(fn, SPLIT[:-1]))
        out["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
        out["split"]["host"] = max(out["ms"] - sum(out["split"].values()), 0.0)
        out["graph_ms"] = graph_ms(fn, reset, reps) if graph else None
    return out


# ---------------------------------------------------------------- cases
def attention_kw(attention: str, smoke: bool) -> dict:
    kw = dict(ATTENTIONS[FLEX.get(attention, attention)])
    if smoke and kw["attention"] == "eva":
        kw.update(SMOKE_EVA)
    return kw


def ideal_speedup(cfg: LlamaConfig, seq_len: int, attention: str, *, logits: bool, smoke: bool,
                  alone: bool = False) -> float:
    """Exact attention's MACs per token over the row's: the whole model's, or with `alone` the
    attention's (op 2's pairs and op 1's summaries)."""
    kw = attention_kw(attention, smoke)
    part = ("attention", "summaries") if alone else ("total",)
    exact, own = macs_per_token(cfg, seq_len, logits=logits), macs_per_token(cfg, seq_len, **kw, logits=logits)
    return sum(exact[p] for p in part) / sum(own[p] for p in part)


def build(cfg: LlamaConfig, attention: str, impl: str, device, dtype, smoke: bool) -> LlamaLM:
    model = LlamaLM(cfg, device=device, dtype=dtype, **attention_kw(attention, smoke))
    return model.compile_regions() if impl in ("compiled", "graphed") else model


def prefill_case(model: LlamaLM, seq_len: int, args, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, seq_len), device=device, generator=g)
    caches = model.new_cache(1, seq_len)

    def reset():
        for c in caches:
            c.reset()

    with torch.no_grad():
        return timed(lambda: model(prompt, caches, last_only=True), reset, reps=args.reps, warmup=args.warmup,
                     device=device, graph=args.graph)


def train_case(model: LlamaLM, batch: int, seq_len: int, args, device, impl: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq_len + 1), device=device, generator=g)
    amp = E.amp_dtype(device)
    if impl == "graphed":  # the step a fine-tune takes: copy the batch in, replay (graph ms: the same thing)
        step, _ = E.trainer(model, lr=1e-5, batch_shape=tokens.shape, amp=amp, graphed=True)
        return timed(lambda: step(tokens), None, reps=args.reps, warmup=args.warmup, device=device, graph=False)
    opt = E.make_optimizer(model, lr=1e-5, capturable=args.graph)
    out = timed(lambda: E.train_step(model, opt, tokens, amp=amp), None, reps=args.reps, warmup=args.warmup,
                device=device, graph=False)
    if args.graph:
        def step():
            E._loss_backward(model, tokens, amp)
            opt.step()
        out["graph_ms"] = graph_ms(step, lambda: opt.zero_grad(set_to_none=True), args.reps)
    return out


def attention_case(cfg: LlamaConfig, attention: str, batch: int, seq_len: int, args, device) -> dict:
    import torch.nn.functional as F
    from flashswitch.ops.chunk_summaries import chunk_summaries
    from flashswitch.ops.eva_attention import eva_attention
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def rnd(h):
        return torch.randn(batch, h, seq_len, D, device=device, dtype=dtype, generator=g).requires_grad_()
    q, k, v = rnd(H), rnd(Hkv), rnd(Hkv)
    do = torch.randn(batch, H, seq_len, D, device=device, dtype=dtype, generator=g)
    kw = attention_kw(attention, args.smoke)
    flex = None
    if attention in FLEX:  # block mask and score_mod built here, outside the timing
        from baselines import FlexEva
        Nc = -(-seq_len // kw["chunk_size"])
        flex = FlexEva(q, k, k.new_empty(batch, Hkv, Nc, D), chunk_size=kw["chunk_size"],
                       window_size=kw["window_size"], window=kw["window"], summary_bias="log_count",
                       compiled=device.type == "cuda")

    def forward():
        if kw["attention"] == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
        k_sum, v_sum = chunk_summaries(k, v, kw["chunk_size"])
        if flex is not None:
            return flex(q, k, v, k_sum, v_sum)
        return eva_attention(q, k, v, k_sum, v_sum, chunk_size=kw["chunk_size"], window_size=kw["window_size"],
                             window=kw["window"], summary_bias="log_count")

    def reset():
        q.grad = k.grad = v.grad = None

    out = timed(lambda: forward().backward(do), reset, reps=args.reps, warmup=args.warmup, device=device,
                graph=args.graph)
    with torch.no_grad():
        out["fwd_ms"] = E.median(E.time_calls(forward, warmup=args.warmup, reps=args.reps, device=device))
    return out


def cases(args):
    """(model, mode, batch, seq_len, attention, impl) in run order: a model's rows together."""
    for name in args.models:
        for mode in args.modes:
            shapes = ([(1, n) for n in args.prefill_lens] if mode == "prefill"
                      else [tuple(int(v) for v in s.split("x")) for s in args.train_shapes])
            impls = args.impls if mode == "train" else ["eager"]
            for impl in impls:
                for attention in (a for a in args.attentions if mode == "attention" or a not in FLEX):
                    for batch, seq_len in shapes:
                        yield name, mode, batch, seq_len, attention, impl


def run(args, device, commit=None) -> list[dict]:
    rows, built = [], {}
    for name, mode, batch, seq_len, attention, impl in cases(args):
        cfg = SMOKE_CFG if args.smoke else LLAMA_SHAPES[name]
        row = {"model": name, "mode": mode, "batch": batch, "seq_len": seq_len, "attention": attention,
               "impl": impl, "commit": commit, "ideal_speedup": ideal_speedup(cfg, seq_len, attention, logits=mode == "train",
                                                 smoke=args.smoke, alone=mode == "attention")}
        print(f"{name} {mode} {batch}x{seq_len} {attention} {impl}", flush=True)
        key = (name, mode, attention, impl)
        try:
            if mode == "attention":
                row.update(attention_case(cfg, attention, batch, seq_len, args, device))
                row["tokens_per_s"] = batch * seq_len / row["ms"] * 1e3
                print(f"  {row['ms']:.3f} ms, graph {row.get('graph_ms')}", flush=True)
                rows.append(row)
                continue
            if key not in built:  # one model per (name, mode, attention, impl): compiled once
                built.clear()
                E.free_memory(device)
                dtype = torch.bfloat16 if mode == "prefill" and device.type == "cuda" else None
                built[key] = build(cfg, attention, impl, device, dtype, args.smoke)
            model = built[key]
            case = prefill_case if mode == "prefill" else train_case
            row.update(case(model, seq_len, args, device) if mode == "prefill"
                       else case(model, batch, seq_len, args, device, impl))
            row["tokens_per_s"] = batch * seq_len / row["ms"] * 1e3
            print(f"  {row['ms']:.3f} ms, graph {row.get('graph_ms')}", flush=True)
        except Exception as err:  # noqa: BLE001 (recorded in the row; the run goes on)
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
            built.clear()
        rows.append(row)
    built.clear()
    return rows


# ---------------------------------------------------------------- tables and plot
def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each row with `speedup`: the exact row's time of the same (model, mode, shape, impl) and commit (the
    same run) over its own."""
    def key(r):
        return r["model"], r["mode"], r["batch"], r["seq_len"], r["impl"], r.get("commit")
    exact = {key(r): r for r in rows if r["attention"] == "sdpa" and r.get("ms")}
    out = []
    for r in rows:
        e = exact.get(key(r))
        out.append({**r, "speedup": e["ms"] / r["ms"] if e and r.get("ms") else None,
                    "graph_speedup": e["graph_ms"] / r["graph_ms"] if e and r.get("graph_ms")
                    and e.get("graph_ms") else None})
    return out


def markdown(data: dict) -> str:
    rows = with_speedups(data["rows"])
    out = [f"# Model speed: EVA against exact attention ({data.get('device')})", "",
           f"Latest run: {E.provenance_line(data)}; torch {data.get('torch')}, triton {data.get('triton')}; each row "
           "names the commit it ran. "
           "`python bench/e2e/model_speed.py`. ms: median per call (CUDA events, host included); graph: the "
           "same call replayed from a CUDA graph; fwd ms: the attention op's forward alone; speedup: exact's ms over the row's (same impl), graph "
           "speedup likewise; ideal: exact's MACs per token over the row's; of ideal: speedup / ideal. "
           "Split: one call's GPU time by kernel family (torch profiler), host: ms minus the kernels' sum.", ""]
    head = ("| model | mode | B x T | attention | impl | ms | fwd ms | graph ms | speedup | graph speedup | ideal | "
            "of ideal | " + " | ".join(SPLIT) + " | commit |")
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    order = {a: i for i, a in enumerate([*ATTENTIONS, *FLEX])}
    modes = {m: i for i, m in enumerate(MODES)}
    for r in sorted(rows, key=lambda r: (r["model"], modes.get(r["mode"], 9), r["impl"], r["batch"] * r["seq_len"], r["seq_len"],
                                         order.get(r["attention"], 9))):
        shape = f"{r['batch']} x {r['seq_len']}"
        if r.get("error"):
            out.append(f"| {r['model']} | {r['mode']} | {shape} | {r['attention']} | {r['impl']} | "
                       f"{r['error']} |" + " |" * (head.count("|") - 7))
            continue
        frac = r["speedup"] / r["ideal_speedup"] if r.get("speedup") else None
        split = r.get("split") or {}
        out.append(f"| {r['model']} | {r['mode']} | {shape} | {r['attention']} | {r['impl']} | {r['ms']:.2f} | "
                   f"{_f(r.get('fwd_ms'), '.2f')} | {_f(r.get('graph_ms'), '.2f')} | {_f(r.get('speedup'), '.2f')} | "
                   f"{_f(r.get('graph_speedup'), '.2f')} | {r['ideal_speedup']:.2f} | {_f(frac, '.2f')} | "
                   + " | ".join(_f(split.get(f), ".1f") for f in SPLIT) + f" | {r.get('commit') or '-'} |")
    return "\n".join(out)


def plot(data: dict, path: Path) -> bool:
    try:
        plt = E.pyplot()
    except ImportError:
        return False
    rows = [r for r in with_speedups(data["rows"]) if r.get("speedup") and r["attention"] != "sdpa"]
    groups = sorted({(r["model"], r["mode"]) for r in rows})
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (model, mode) in zip(axes[0], groups):
        sel = [r for r in rows if (r["model"], r["mode"]) == (model, mode)]
        for (attention, impl) in sorted({(r["attention"], r["impl"]) for r in sel}):
            pts = sorted((r["batch"] * r["seq_len"] if mode == "train" else r["seq_len"], r["seq_len"], r["speedup"],
                          r["ideal_speedup"]) for r in sel if (r["attention"], r["impl"]) == (attention, impl))
            xs = [p[1] for p in pts]
            line, = ax.plot(xs, [p[2] for p in pts], "o-", label=f"{attention} {impl}")
            ax.plot(xs, [p[3] for p in pts], ":", color=line.get_color())
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("speedup over exact (dotted: MAC-ideal)")
        ax.set_title(f"{model} {mode}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{data.get('device')}, {E.provenance_line(data)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(data: dict, folder: Path) -> list[Path]:
    return E.write_outputs(NAME, data, folder, markdown, plot)


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(LLAMA_SHAPES), choices=list(LLAMA_SHAPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--attentions", nargs="+", choices=[*ATTENTIONS, *FLEX],
                   help="default: all; flex-*: attention mode only, CUDA only (FlexAttention has no CPU backward)")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="train steps' impls")
    p.add_argument("--prefill-lens", nargs="+", type=int, default=list(PREFILL_LENS))
    p.add_argument("--train-shapes", nargs="+", default=list(TRAIN_SHAPES), help="B x T, as 8x2048")
    p.add_argument("--reps", type=int, default=10, help="timed calls per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (compile, allocator)")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph timing")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, tiny sizes (tests)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<device>/)")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.prefill_lens, args.train_shapes = args.models[:1], [48, 96], ["2x48"]
        args.reps, args.warmup = min(args.reps, 2), min(args.warmup, 1)
    for s in args.train_shapes:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", s):
            p.error(f"--train-shapes takes B x T as 8x2048, got {s!r}")
    if min(args.prefill_lens) < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--prefill-lens and --reps must be >= 1, --warmup >= 0")
    args.device = torch.device(args.device)
    args.graph = args.graph and args.device.type == "cuda"
    if args.device.type != "cuda":  # a CUDA graph needs CUDA
        args.impls = [i for i in args.impls if i != "graphed"]
    if args.attentions is None:
        args.attentions = [*ATTENTIONS, *(FLEX if args.device.type == "cuda" else ())]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    header = {**E.env_info(args.device), **E.provenance()}
    rows = run(args, args.device, header["commit"])  # each row its commit: runs split by flags merge
    folder = args.out or E.default_out_dir(args.device)
    if folder is None:
        print(markdown({**header, "rows": rows}))
        print("a CPU run: not written (--out DIR keeps it)")
    else:
        data = E.merge_json(folder / f"{NAME}.json", {"rows": rows}, KEYS, header)
        for path in write_outputs(data, folder):
            print(f"wrote {path}")
        print(markdown(data))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
