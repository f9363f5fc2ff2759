"""Training speed of the SwitchHead paper's models end to end, and of one attention layer alone.

    python bench/e2e/e2e_training.py                       # the default run (<= 8 min on one H200)
    python bench/e2e/e2e_training.py --sizes 262M --seq-lens 4096 --parts models   # a part: merged into the JSON

Writes bench/results/<device>/e2e_training.{json,md,png} (or --out DIR). Each run merges its rows into
the JSON already there, so a run split by --sizes / --variants / --impls / --seq-lens adds up; the
table and the plot are rebuilt from the merged JSON.

models  one training step (forward + backward + fused AdamW, bf16 autocast over fp32 master weights,
        random tokens) of each variant (dense, switchhead, switchall) of each size, the same number of
        tokens per step at every sequence length (B = tokens / T): median of CUDA-event step times
        after warmup, tokens/s, peak memory (weights, AdamW state and activations), set against the
        MACs per token (flashswitch.nn.models): dense MACs / variant MACs is the speedup that
        kernels with time proportional to MACs would reach.
layers  the attention layer alone at a size's width, forward + backward: SwitchHead against the dense
        layer (q/k/v/o projections + SDPA flash).
On CUDA both parts also time the step (or layer call) captured in a CUDA graph ("graph ms": the GPU's
time without the host's per-op work, what a graph-captured training loop pays; --no-graph skips it)
next to the eager time a plain loop pays.
Both parts run every --impls: "flashswitch" (the library's layers), "paper" (attention as the paper's
code writes it: a boolean causal mask given to SDPA, torch.cat for rotary and heads;
bench/e2e/paper_attention.py), "paper_torch" (paper-style attention, every op on the PyTorch reference).
--mlp-align: the dense MLP's width as the paper gives it ("none"), the paper's width with its weights stored
padded with zero units to a multiple of --mlp-multiple ("pad": the same model, every GEMM row 16-byte aligned
for Hopper's kernels at multiple 8), or d_ff rounded up to that multiple ("round": a few more MACs); rows of
each choice are kept apart (flashswitch.nn.models, bench/tools/gemm_align.py).
A case that fails (out of memory, an op that cannot run) is recorded with its error and the run goes on.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import e2e_common as E  # noqa: E402
from flashswitch.nn import models  # noqa: E402
from flashswitch.nn.switchhead import SwitchHeadAttention  # noqa: E402
from paper_attention import to_paper_style  # noqa: E402

NAME = "e2e_training"
KEYS = {"models": ("size", "variant", "impl", "mlp_align", "seq_len", "tokens"),
        "layers": ("size", "layer", "impl", "seq_len", "tokens"),
        "macs": ("size", "variant", "mlp_align", "seq_len")}
# rows written before --mlp-align existed ran the paper's widths
DEFAULTS = {"models": {"mlp_align": "none"}, "macs": {"mlp_align": "none"}}
GiB = float(1 << 30)
# the profile split of a step's GPU time (e2e_common.KERNEL_FAMILIES), then the host's share
SPLIT = ("op3", "exact_attention", "gemm", "loss", "optimizer", "elementwise")


# ---------------------------------------------------------------- MACs
def mac_rows(sizes, seq_lens, mlp_align: str = "none", multiple: int = models.ALIGN_ELEMENTS) -> list[dict]:
    """MACs per token of one forward pass per (size, variant, T), whole model and attention layers alone
    (models built on the meta device), and the ideal speedup over dense."""
    rows = []
    for size in sizes:
        for T in seq_lens:
            per = {}
            for v in models.VARIANTS:
                m = E.build(size, v, device="meta", **models.mlp_align(mlp_align, multiple))
                per[v] = (m.macs_per_token(T), sum(b.att.macs_per_token(T) for b in m.blocks))
            for v in models.VARIANTS:
                rows.append({"size": size, "variant": v, "mlp_align": mlp_align, "seq_len": T,
                             "macs_per_token": per[v][0],
                             "attention_macs_per_token": per[v][1],
                             "ideal_speedup": per["dense"][0] / per[v][0],
                             "attention_ideal_speedup": per["dense"][1] / per[v][1]})
    return rows


# ---------------------------------------------------------------- whole-model training steps
def _error_text(err: BaseException) -> str:
    traceback.print_exc()
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def _failure(row: dict, err: BaseException) -> dict:
    return {**row, "error": _error_text(err)}


def model_rows(args, device) -> list[dict]:
    rows = []
    env = E.env_info(device)
    amp = E.amp_dtype(device)
    for size in args.sizes:
        for variant in args.variants:
            for impl in args.impls:
                E.free_memory(device)
                base = {"size": size, "variant": variant, "impl": impl, "mlp_align": args.mlp_align, **env}
                try:
                    torch.manual_seed(0)
                    model = E.build(size, variant, impl, device=device,
                                    **models.mlp_align(args.mlp_align, args.mlp_multiple))
                    opt = E.make_optimizer(model)
                except Exception as err:  # noqa: BLE001 (recorded, the run goes on)
                    rows += [_failure({**base, "seq_len": T, "tokens": args.tokens}, err) for T in args.seq_lens]
                    continue
                params = model.num_parameters()
                for T in args.seq_lens:
                    B = max(1, args.tokens // T)
                    row = {**base, "seq_len": T, "batch": B, "tokens": args.tokens, "params": params,
                           "d_ff_stored": _stored_width(model),
                           "macs_per_token": model.macs_per_token(T), "fused_adamw": bool(opt.defaults.get("fused"))}
                    try:
                        E.free_memory(device)
                        batches = [torch.randint(0, model.config.vocab_size, (B, T + 1), device=device)
                                   for _ in range(2)]
                        turn = [0]

                        def step():
                            turn[0] += 1
                            E.train_step(model, opt, batches[turn[0] % 2], amp=amp)

                        ms = E.time_calls(step, warmup=args.warmup, reps=args.steps, device=device)
                        med = E.median(ms)
                        row.update(ms=med, ms_min=min(ms), ms_steps=ms, tokens_per_s=B * T / (med * 1e-3),
                                   model_TFLOPs=6 * row["macs_per_token"] * B * T / (med * 1e-3) / 1e12)
                        if torch.device(device).type == "cuda":
                            row["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
                            row.update(E.profile_split(step, SPLIT))
                            row["split"]["host"] = max(med - sum(row["split"].values()), 0.0)
                        print(f"{size:>5} {variant:>10} {impl:>11} MLP {args.mlp_align:<5} T={T:<5} B={B:<3} "
                              f"{med:9.2f} ms/step "
                              f"{row['tokens_per_s'] / 1e3:9.1f} k tok/s  peak {row.get('peak_GiB', 0):6.2f} GiB",
                              flush=True)
                        if args.graph:
                            row.update(_graphed_model_step(model, batches, amp, args, device))
                    except Exception as err:  # noqa: BLE001
                        row = _failure(row, err)
                        opt.zero_grad(set_to_none=True)
                    rows.append(row)
                del model, opt
    E.free_memory(device)
    return rows


def _stored_width(model) -> int | None:
    """The hidden width of the dense MLP's weights as stored (padding included); None for sigma-MoE."""
    mlp = model.blocks[0].mlp
    return mlp.up.shape[0] if isinstance(mlp, models.DenseMLP) else None


def _graphed_model_step(model, batches, amp, args, device) -> dict:
    """The same step captured in a CUDA graph (a capturable AdamW of its own): graph_ms, the step's
    GPU time without the host's per-op work, or graph_error."""
    try:
        torch.cuda.empty_cache()  # the eager steps' cached blocks back: the graph allocates from its own pool
        opt = E.make_optimizer(model, capturable=True)
        static = batches[0].clone()
        graph = E.captured_train_step(model, opt, static, amp=amp)
        turn = [0]

        def replay():
            turn[0] += 1
            static.copy_(batches[turn[0] % 2])
            graph.replay()

        ms = E.median(E.time_calls(replay, warmup=1, reps=args.steps, device=device))
        print(f"{'':>30} graph-captured {ms:9.2f} ms/step", flush=True)
        return {"graph_ms": ms}
    except Exception as err:  # noqa: BLE001 (the eager row stands)
        return {"graph_error": _error_text(err)}
    finally:
        for p in model.parameters():
            p.grad = None


def _graphed_layer(m, x, dy, amp, args, device) -> dict:
    """The layer's forward + backward captured in a CUDA graph: graph_ms or graph_error."""
    params = [x] + list(m.parameters())

    def fwd_bwd():
        with torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            y = m(x)
        y.backward(dy)

    def reset():
        for p in params:
            p.grad = None

    try:
        torch.cuda.empty_cache()
        graph = E.capture(fwd_bwd, reset=reset)
        ms = E.median(E.time_calls(graph.replay, warmup=1, reps=args.steps, device=device))
        return {"graph_ms": ms}
    except Exception as err:  # noqa: BLE001
        return {"graph_error": _error_text(err)}
    finally:
        reset()


# ---------------------------------------------------------------- the attention layer alone
def attention_layer(size: str, layer: str, impl: str, device):
    """The attention layer of `size`'s "dense" or "switchhead" variant, fp32 parameters."""
    c = E.model_config(size, layer, backend="reference" if impl == "paper_torch" else "auto")
    if layer == "dense":
        m = models.DenseAttention(c.d_model, c.n_heads, c.head_dim, rope_fraction=c.rope_fraction,
                                  backend=c.backend, device=device)
    else:
        m = SwitchHeadAttention(c.d_model, c.n_heads, c.head_dim, c.att_experts, c.att_k,
                                rope_fraction=c.rope_fraction, backend=c.backend, device=device)
    return to_paper_style(m) if impl != "flashswitch" else m


def layer_rows(args, device) -> list[dict]:
    rows = []
    env = E.env_info(device)
    amp = E.amp_dtype(device)
    for impl in args.impls:
        for layer in ("dense", "switchhead"):
            for T in args.layer_seq_lens:
                E.free_memory(device)
                B = max(1, args.tokens // T)
                row = {"size": args.layer_size, "layer": layer, "impl": impl, "seq_len": T, "batch": B,
                       "tokens": args.tokens, **env}
                try:
                    torch.manual_seed(0)
                    m = attention_layer(args.layer_size, layer, impl, device)
                    row["macs_per_token"] = m.macs_per_token(T)
                    x = torch.randn(B, T, m.embed_dim, device=device, requires_grad=True)
                    dy = torch.randn(B, T, m.embed_dim, device=device)
                    params = [x] + list(m.parameters())

                    def fwd_bwd():
                        with torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
                            y = m(x)
                        y.backward(dy)
                        for p in params:
                            p.grad = None

                    ms = E.time_calls(fwd_bwd, warmup=args.warmup, reps=args.steps, device=device)
                    row.update(ms=E.median(ms), ms_min=min(ms), ms_steps=ms)
                    if torch.device(device).type == "cuda":
                        row["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
                    if args.graph:
                        row.update(_graphed_layer(m, x, dy, amp, args, device))
                    print(f"layer {args.layer_size} {layer:>10} {impl:>11} T={T:<5} B={B:<3} {row['ms']:9.3f} ms "
                          f"fwd+bwd, graph-captured {_f(row.get('graph_ms'), '.3f', ' ms')}", flush=True)
                    del m, x, dy, params
                except Exception as err:  # noqa: BLE001
                    row = _failure(row, err)
                rows.append(row)
    E.free_memory(device)
    return rows


# ---------------------------------------------------------------- tables and plot
def _f(v, fmt: str, unit: str = "") -> str:
    return "-" if v is None else format(v, fmt) + unit


def _size(name: str) -> int:
    return E.SIZES.index(name) if name in E.SIZES else len(E.SIZES)


def _index(rows, *keys):
    return {tuple(r.get(k) for k in keys): r for r in rows if r.get("ms") is not None}


def _filled(data: dict, name: str) -> list[dict]:
    return [{**DEFAULTS.get(name, {}), **r} for r in data.get(name, [])]


def _mlp(r: dict) -> int:
    return models.MLP_ALIGN.index(r["mlp_align"]) if r["mlp_align"] in models.MLP_ALIGN else 9


def _graph_cells(r: dict, dense) -> str:
    """The graph-captured time and its speedup over dense's ("-" where not measured)."""
    g = r.get("graph_ms")
    if g is None:
        return f"{'failed' if r.get('graph_error') else '-'} | -"
    dg = dense.get("graph_ms") if dense else None
    return f"{g:.3f} | {_f(dg / g if dg else None, '.2f', 'x')}"


def markdown(data: dict) -> str:
    macs, mrows, lrows = _filled(data, "macs"), _filled(data, "models"), data.get("layers", [])
    out = [f"# End-to-end training speed ({data.get('device', '?')})", "",
           f"torch {data.get('torch')}, triton {data.get('triton')}, CUDA {data.get('cuda')}; last run: "
           f"{E.provenance_line(data)}. Command and what each column means: `bench/e2e/e2e_training.py --help`.", ""]
    if macs:
        out += ["## MACs per token (forward) and the speedup over dense that MAC-proportional kernels reach", "",
                "| size | T | variant | MLP | MMAC/token | attention MMAC/token | ideal speedup | attention ideal "
                "speedup |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(macs, key=lambda r: (_size(r["size"]), r["seq_len"], _mlp(r),
                                             models.VARIANTS.index(r["variant"]))):
            out.append(f"| {r['size']} | {r['seq_len']} | {r['variant']} | {r['mlp_align']} | "
                       f"{r['macs_per_token'] / 1e6:.4g} | "
                       f"{r['attention_macs_per_token'] / 1e6:.4g} | {r['ideal_speedup']:.2f}x | "
                       f"{r['attention_ideal_speedup']:.2f}x |")
        out += ["", "ideal speedup: dense MACs / variant MACs per token (whole model, output layer included; "
                "attention: the attention layers alone). A training step costs about 3x the forward MACs.", ""]
    if mrows:
        idx = _index(mrows, "size", "variant", "impl", "mlp_align", "seq_len", "tokens")
        ideal = {(r["size"], r["variant"], r["seq_len"], r["mlp_align"]): r["ideal_speedup"] for r in macs}
        out += [f"## Training step (forward + backward + AdamW), autocast {data.get('amp')}", "",
                "speedup vs dense: dense step time / this step time, same size, T and impl; % of ideal: that "
                "speedup over the MAC ratio; vs paper: the paper-style step time of the same variant / this one. "
                "model TFLOP/s: 6 x forward MACs per token x tokens / step time.", "",
                "graph: the same step captured in a CUDA graph (no host work per op), and its speedup over "
                "dense's graph-captured step.", "",
                "MLP: the dense MLP's width (--mlp-align): none = the paper's d_ff; pad = the paper's d_ff, weights "
                "stored with zero units to an aligned width (the same model); round = d_ff rounded up. Each row is "
                "compared with dense of the same MLP choice.", "",
                "| size | T | B | variant | impl | MLP | step ms | k tokens/s | peak GiB | model TFLOP/s "
                "| ideal speedup | speedup vs dense | % of ideal | vs paper | graph step ms | graph speedup vs dense |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        order = {v: i for i, v in enumerate(models.VARIANTS)}
        for r in sorted(mrows, key=lambda r: (_size(r["size"]), r["seq_len"], _mlp(r),
                                              order.get(r["variant"], 9),
                                              E.IMPLS.index(r["impl"]) if r["impl"] in E.IMPLS else 9)):
            head = (f"| {r['size']} | {r['seq_len']} | {r.get('batch', '-')} | {r['variant']} | {r['impl']} | "
                    f"{r['mlp_align']} |")
            if r.get("ms") is None:
                out.append(f"{head} {r.get('error', 'not run')} | | | | | | | | | |")
                continue
            dense = idx.get((r["size"], "dense", r["impl"], r["mlp_align"], r["seq_len"], r["tokens"]))
            paper = idx.get((r["size"], r["variant"], "paper", r["mlp_align"], r["seq_len"], r["tokens"]))
            sp = dense["ms"] / r["ms"] if dense else None
            ide = ideal.get((r["size"], r["variant"], r["seq_len"], r["mlp_align"]))
            vs_paper = paper["ms"] / r["ms"] if paper and r["impl"] != "paper" else None
            out.append(f"{head} {r['ms']:.2f} | {r['tokens_per_s'] / 1e3:.1f} | {_f(r.get('peak_GiB'), '.2f')} | "
                       f"{r['model_TFLOPs']:.1f} | {_f(ide, '.2f', 'x')} | {_f(sp, '.2f', 'x')} | "
                       f"{_f(sp / ide * 100 if sp and ide and r['variant'] != 'dense' else None, '.0f', '%')} | "
                       f"{_f(vs_paper, '.2f', 'x')} | {_graph_cells(r, dense)} |")
        out.append("")
        split = [r for r in mrows if r.get("split")]
        if split:
            cols = SPLIT + ("host",)
            out += ["## Where a step's time goes", "",
                    "One eager step's GPU time by kernel family (torch profiler, ms): op3 the routed expert "
                    "kernels (expert matmuls, routing), exact_attention SDPA, gemm cuBLAS (dense projections, MLP, "
                    "output layer, op 3's dense-Z GEMMs), elementwise the rest (norms, rotary, activations, casts, "
                    "copies); host: step ms minus the kernels' sum (time the GPU waits for the host).", "",
                    "| size | T | variant | impl | MLP | step ms | " + " | ".join(cols) + " | kernels |",
                    "|---|---|---|---|---|---|" + "---|" * (len(cols) + 1)]
            for r in sorted(split, key=lambda r: (_size(r["size"]), r["seq_len"], _mlp(r),
                                                  order.get(r["variant"], 9), r["impl"])):
                out.append(f"| {r['size']} | {r['seq_len']} | {r['variant']} | {r['impl']} | {r['mlp_align']} | "
                           f"{r['ms']:.2f} | " + " | ".join(_f(r["split"].get(c), ".1f") for c in cols)
                           + f" | {r.get('kernels', '-')} |")
            out.append("")
    if lrows:
        idx = _index(lrows, "size", "layer", "impl", "seq_len", "tokens")
        out += [f"## Attention layer alone, forward + backward, autocast {data.get('amp')}", "",
                "| width | layer | impl | T | B | ms | MMAC/token | ideal speedup | speedup vs dense | vs paper "
                "| graph ms | graph speedup vs dense |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(lrows, key=lambda r: (_size(r["size"]), r["seq_len"], r["layer"], r["impl"])):
            head = f"| {r['size']} | {r['layer']} | {r['impl']} | {r['seq_len']} | {r.get('batch', '-')} |"
            if r.get("ms") is None:
                out.append(f"{head} {r.get('error', 'not run')} | | | | | | |")
                continue
            dense = idx.get((r["size"], "dense", r["impl"], r["seq_len"], r["tokens"]))
            paper = idx.get((r["size"], r["layer"], "paper", r["seq_len"], r["tokens"]))
            ide = dense["macs_per_token"] / r["macs_per_token"] if dense else None
            vs_paper = paper["ms"] / r["ms"] if paper and r["impl"] != "paper" else None
            out.append(f"{head} {r['ms']:.3f} | {r['macs_per_token'] / 1e6:.4g} | {_f(ide, '.2f', 'x')} | "
                       f"{_f(dense['ms'] / r['ms'] if dense else None, '.2f', 'x')} | {_f(vs_paper, '.2f', 'x')} | "
                       f"{_graph_cells(r, dense)} |")
        out.append("")
    return "\n".join(out)


def plot(data: dict, out: Path) -> bool:
    """Per size: tokens/s against T (top) and the speedup over dense against the MAC ratio (bottom)."""
    rows = [r for r in _filled(data, "models") if r.get("ms") is not None]
    sizes = [s for s in E.SIZES if any(r["size"] == s for r in rows)]
    if not sizes:
        return False
    plt = E.pyplot()
    fig, axes = plt.subplots(2, len(sizes), figsize=(6.5 * len(sizes), 8), squeeze=False)
    colors = {"dense": "tab:gray", "switchhead": "tab:blue", "switchall": "tab:orange"}
    styles = {"flashswitch": "-", "paper": "--", "paper_torch": ":"}
    ideal = {(r["size"], r["variant"], r["seq_len"]): r["ideal_speedup"] for r in _filled(data, "macs")
             if r["mlp_align"] == "none"}  # the MLP choices move it by < 0.1 %
    idx = _index(rows, "size", "variant", "impl", "mlp_align", "seq_len", "tokens")
    markers = {"none": "o", "pad": "s", "round": "^"}
    for col, size in enumerate(sizes):
        top, bottom = axes[0][col], axes[1][col]
        for (variant, impl, mlp) in sorted({(r["variant"], r["impl"], r["mlp_align"]) for r in rows
                                            if r["size"] == size}):
            rs = sorted((r for r in rows if (r["size"], r["variant"], r["impl"], r["mlp_align"]) ==
                         (size, variant, impl, mlp)), key=lambda r: r["seq_len"])
            xs = [r["seq_len"] for r in rs]
            kw = dict(color=colors.get(variant), linestyle=styles.get(impl, "-"), marker=markers.get(mlp, "x"))
            label = f"{variant} {impl}" + ("" if mlp == "none" else f" MLP {mlp}")
            top.plot(xs, [r["tokens_per_s"] / 1e3 for r in rs], label=label, **kw)
            if variant == "dense":
                continue
            keys = [(size, "dense", impl, mlp, r["seq_len"], r["tokens"]) for r in rs]
            pts = [(r["seq_len"], idx[k]["ms"] / r["ms"]) for r, k in zip(rs, keys) if k in idx]
            if pts:
                bottom.plot(*zip(*pts), label=label, **kw)
        for variant in ("switchhead", "switchall"):
            pts = sorted((T, v) for (s, var, T), v in ideal.items() if s == size and var == variant)
            if pts:
                bottom.plot(*zip(*pts), color=colors[variant], linestyle="-.", alpha=0.5, label=f"{variant} MAC ratio")
        bottom.axhline(1.0, color="black", linewidth=0.8)
        top.set_title(f"{size}: training throughput")
        top.set_ylabel("k tokens / s")
        bottom.set_title(f"{size}: speedup over dense (same impl) vs MAC ratio")
        bottom.set_ylabel("x dense")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            xs = sorted({r["seq_len"] for r in rows if r["size"] == size})
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            ax.minorticks_off()
            ax.set_xlabel("sequence length T (same tokens per step)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{data.get('device', '?')}: training step (autocast {data.get('amp')}), AdamW")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def write_outputs(data: dict, folder: Path) -> list[Path]:
    return E.write_outputs(NAME, data, folder, markdown, plot)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(models.SIZES), choices=E.SIZES)
    p.add_argument("--variants", nargs="+", default=list(models.VARIANTS), choices=models.VARIANTS)
    p.add_argument("--impls", nargs="+", default=["flashswitch", "paper"], choices=E.IMPLS)
    p.add_argument("--seq-lens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (B = tokens / T)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (or layer calls) per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, allocator)")
    p.add_argument("--parts", nargs="+", default=["models", "layers"], choices=["models", "layers"])
    p.add_argument("--layer-size", default="262M", choices=E.SIZES, help="width of the attention-layer part")
    p.add_argument("--layer-seq-lens", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="skip the CUDA-graph-captured timing of each step and layer (CUDA only)")
    p.add_argument("--mlp-align", default="pad", choices=models.MLP_ALIGN,
                   help="the dense MLP's width: the paper's, padded storage, or rounded up (see above)")
    p.add_argument("--mlp-multiple", type=int, default=models.ALIGN_ELEMENTS,
                   help="the multiple --mlp-align pads or rounds d_ff to (8 bf16 = 16 bytes)")
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<device>/)")
    args = p.parse_args(argv)
    for name in ("tokens", "steps", "mlp_multiple"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.seq_lens + args.layer_seq_lens) < 1 or args.warmup < 0:
        p.error("sequence lengths must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    args.graph = args.graph and device.type == "cuda"
    folder = args.out or E.default_out_dir(device)
    sections = {"macs": mac_rows(args.sizes, args.seq_lens, args.mlp_align, args.mlp_multiple)}
    if "models" in args.parts:
        sections["models"] = model_rows(args, device)
    if "layers" in args.parts:
        sections["layers"] = layer_rows(args, device)
        sections["macs"] += [r for r in mac_rows([args.layer_size], args.layer_seq_lens, args.mlp_align,
                                                 args.mlp_multiple)
                             if r["size"] not in args.sizes or r["seq_len"] not in args.seq_lens]
    header = {**E.env_info(device), "amp": str(E.amp_dtype(device) or "none (fp32)").replace("torch.", ""),
              **E.provenance()}
    if folder is None:
        print(markdown({**header, **sections}))
        print("a CPU run: not written (--out DIR keeps it)")
        return 1 if any(r.get("error") for part in ("models", "layers") for r in sections.get(part, [])) else 0
    data = E.merge_json(folder / f"{NAME}.json", sections, KEYS, header, DEFAULTS)
    for path in write_outputs(data, folder):
        print(f"wrote {path}")
    print(markdown(data))
    failed = [r for part in ("models", "layers") for r in sections.get(part, []) if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
