"""The MLP GEMMs of a SwitchHead-paper model's training step at the paper's widths and at aligned ones: do
rows that are not a multiple of 16 bytes keep cuBLAS off its Hopper kernels?

    python bench/tools/gemm_align.py [--size 262M] [--tokens 16384] [--d-ff 4096 4110 ...] [--out DIR]
    python bench/tools/gemm_align.py --smoke --out DIR     # tiny shapes on the CPU: the code path, no timing

Per hidden width d_ff, the six GEMMs of one MLP layer's training step as autograd runs them for F.linear
under bf16 autocast (bf16 operands; the fp32 master weights cast once, outside the timing): forward
h = x W_up^T and y = h W_down^T, the input gradients dx = dh W_up and dh = dy W_down, the weight gradients
dW_up = dh^T x and dW_down = dy^T h; x, dy [T, d_model], h, dh [T, d_ff], W_up [d_ff, d_model],
W_down [d_model, d_ff]. Widths (default): the dense and SwitchHead models' d_ff (262M: 4110, 4188), each
rounded up to a multiple of 8 (4112, 4192), and the power of two below them (4096).
Layouts: "contiguous" (rows of d_ff elements) and, for widths not a multiple of 8, "padded": every
[.., d_ff] operand and output a view of a [.., d_pad] allocation (d_pad: d_ff rounded up to 8), so the
values and the MACs are the paper's but every row starts 16-byte aligned.
What the model options (flashswitch.nn.models) run: d_ff_multiple_of=8 a wider model whose GEMMs are the
d_pad rows'; d_ff_pad_multiple=8 the paper's model on zero-padded weights, also the d_pad rows' GEMMs.

Times: `triton.testing.do_bench` medians (CUDA events, L2 flushed), TFLOP/s on 2·T·d_model·d_ff flops
per GEMM, against the bf16 roof measured in the same run (an 8192^3 matmul). Kernels: the names of the
CUDA kernels one call launches (torch.profiler), classed "hopper" (nvjet*, sm90*), "ampere" (cutlass_80*,
ampere*, *s16816*) or "other". Also recorded: the padded layout's outputs against the contiguous one's.
Writes gemm_align.{json,md} under bench/results/<device>/ (or --out; a CPU run only with --out).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: `import common`
from common import device_name, env_info, provenance, provenance_line, results_dir, time_ms  # noqa: E402
from flashswitch.nn import models  # noqa: E402

NAME = "gemm_align"
TOKENS = 16384
ROOF_N = 8192
ALIGN = models.ALIGN_ELEMENTS
GEMMS = ("up fwd", "up dX", "up dW", "down fwd", "down dX", "down dW")
SMOKE = dict(d_model=24, n_layers=2, tokens=40, widths=[32, 37, 40], roof_n=64)  # 37: rows of 74 bytes
# the same products in another layout may round differently (other kernels, other split of K)
MAX_REL_DIFF = 1e-2
_HOPPER = re.compile(r"nvjet|sm9\d", re.I)
_AMPERE = re.compile(r"cutlass_80|sm80|ampere|s16816", re.I)


def kernel_class(name: str) -> str:
    return "hopper" if _HOPPER.search(name) else "ampere" if _AMPERE.search(name) else "other"


def default_widths(size: str) -> list[int]:
    paper = sorted({models.paper_config(size, v).d_ff for v in ("dense", "switchhead")})
    below = 1 << (paper[0].bit_length() - 1)
    return sorted({below, *paper, *(models.round_up(w, ALIGN) for w in paper)})


def place(t: torch.Tensor, ld: int) -> torch.Tensor:
    """t [r, c] as a view of a zero [r, ld] allocation: the same values with row stride ld."""
    if ld == t.shape[1]:
        return t.contiguous()
    store = t.new_zeros(t.shape[0], ld)
    store[:, : t.shape[1]] = t
    return store[:, : t.shape[1]]


def gemm_calls(T: int, d: int, F: int, ld: int, device) -> dict:
    """{gemm: (call, its output)} at width F, every [.., F] tensor with row stride ld; the values depend
    on F only, so both layouts of a width multiply the same numbers."""
    g = torch.Generator(device=device).manual_seed(F)
    bf16 = torch.bfloat16

    def rand(rows, cols, scale=1.0):
        return torch.randn(rows, cols, generator=g, device=device) * scale

    x, dy = rand(T, d).to(bf16), rand(T, d).to(bf16)
    h, dh = place(rand(T, F).to(bf16), ld), place(rand(T, F).to(bf16), ld)
    up = rand(F, d, d ** -0.5).to(bf16)  # fp32 master weights, cast once
    down = place(rand(d, F, F ** -0.5).to(bf16), ld)

    def empty(rows, cols):
        return place(torch.empty(rows, cols, dtype=bf16, device=device), ld if cols == F else cols)

    out = {"up fwd": empty(T, F), "up dX": empty(T, d), "up dW": empty(F, d), "down fwd": empty(T, d),
           "down dX": empty(T, F), "down dW": empty(d, F)}
    calls = {"up fwd": lambda: torch.mm(x, up.t(), out=out["up fwd"]),
             "up dX": lambda: torch.mm(dh, up, out=out["up dX"]),
             "up dW": lambda: torch.mm(dh.t(), x, out=out["up dW"]),
             "down fwd": lambda: torch.mm(h, down.t(), out=out["down fwd"]),
             "down dX": lambda: torch.mm(dy, down, out=out["down dX"]),
             "down dW": lambda: torch.mm(dy.t(), h, out=out["down dW"])}
    return {k: (calls[k], out[k]) for k in GEMMS}


def mnk(gemm: str, T: int, d: int, F: int) -> list[int]:
    return {"up fwd": [T, F, d], "up dX": [T, d, F], "up dW": [F, d, T], "down fwd": [T, d, F],
            "down dX": [T, F, d], "down dW": [d, F, T]}[gemm]


def kernels(fn, gpu: bool) -> list[str]:
    """Names of what one call of fn runs: CUDA kernels on a GPU, the ops on the CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        fn()
        if gpu:
            torch.cuda.synchronize()
    if gpu:
        return list(dict.fromkeys(e.name for e in prof.events() if e.device_type == DeviceType.CUDA))
    return list(dict.fromkeys(e.name for e in prof.events() if e.name == "aten::mm"))


def measure_roof(n: int, gpu: bool, device) -> dict:
    a, b = (torch.randn(n, n, device=device).to(torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: torch.mm(a, b), gpu)
    return {"n": n, "ms": ms, "TFLOPs": 2 * n ** 3 / (ms * 1e-3) / 1e12}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure_width(F: int, T: int, d: int, roof: dict, gpu: bool, device) -> list[dict]:
    """The six GEMMs at width F in each of its layouts; the padded layout's outputs against the
    contiguous layout's."""
    layouts = [("contiguous", F)] + ([("padded", models.round_up(F, ALIGN))] if F % ALIGN else [])
    rows, reference = [], {}
    for layout, ld in layouts:
        for gemm, (fn, out) in gemm_calls(T, d, F, ld, device).items():
            fn()  # warm-up: cuBLAS picks and loads its kernel
            names = kernels(fn, gpu)
            ms = time_ms(fn, gpu)
            flops = 2 * T * d * F
            classes = sorted({kernel_class(n) for n in names})
            row = {"d_ff": F, "layout": layout, "ld": ld, "gemm": gemm, "mnk": mnk(gemm, T, d, F), "flops": flops,
                   "ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12, "kernels": names,
                   "kernel_class": "hopper" if "hopper" in classes else "ampere" if "ampere" in classes else "other"}
            row["pct_roof"] = 100 * row["TFLOPs"] / roof["TFLOPs"]
            fn()
            if layout == "contiguous":
                reference[gemm] = out.clone()
            else:
                row["rel_diff_vs_contiguous"] = rel_diff(out, reference[gemm])
            rows.append(row)
            print(f"d_ff {F:>5} {layout:>10} (ld {ld}) {gemm:>8}: {ms:8.4f} ms {row['TFLOPs']:7.1f} TFLOP/s "
                  f"{row['pct_roof']:5.1f} % of roof  {row['kernel_class']:>6}  {names[0] if names else '-'}",
                  flush=True)
        del fn, out
        if gpu:
            torch.cuda.empty_cache()
    return rows


def width_summary(rows: list[dict], roof: dict, n_layers: int) -> list[dict]:
    """Per (d_ff, layout): the six GEMMs' time, their rate, and their time in a step of n_layers layers."""
    out = {}
    for r in rows:
        s = out.setdefault((r["d_ff"], r["layout"]), {"d_ff": r["d_ff"], "layout": r["layout"], "ld": r["ld"],
                                                      "row_bytes": 2 * r["ld"], "ms": 0.0, "flops": 0,
                                                      "classes": []})
        s["ms"] += r["ms"]
        s["flops"] += r["flops"]
        s["classes"] = sorted(set(s["classes"]) | {r["kernel_class"]})
    for s in out.values():
        s["TFLOPs"] = s["flops"] / (s["ms"] * 1e-3) / 1e12
        s["pct_roof"] = 100 * s["TFLOPs"] / roof["TFLOPs"]
        s["step_ms"] = n_layers * s["ms"]
    return list(out.values())


def mac_rows(size: str) -> list[dict]:
    """MACs per token (forward, at the config's context) of each variant with paper and rounded widths."""
    rows = []
    for v in ("dense", "switchhead"):
        per = {mode: models.build_model(size, v, device="meta", **models.mlp_align(mode)) for mode in ("none", "round")}
        none, rnd = (per[m].macs_per_token() for m in ("none", "round"))
        rows.append({"size": size, "variant": v, "d_ff": per["none"].config.mlp_width,
                     "d_ff_round": per["round"].config.mlp_width, "macs_per_token": none,
                     "macs_per_token_round": rnd, "change_pct": 100 * (rnd / none - 1)})
    return rows


def markdown(data: dict) -> str:
    roof = data["roof"]
    out = [f"# MLP GEMMs at the paper's widths and at aligned ones ({data['device']})", "",
           f"Run: {provenance_line(data)}. `{data['command']}`"
           + (" (smoke run: tiny shapes on the CPU, numbers mean nothing)" if data["smoke"] else ""), "",
           f"torch {data.get('torch')}, CUDA {data.get('cuda')}, BLAS {data.get('blas')}. {data['size']}: "
           f"T = {data['tokens']} tokens, d_model {data['d_model']}, {data['n_layers']} layers; bf16 operands. "
           f"Roof: {roof['TFLOPs']:.0f} TFLOP/s (bf16 {roof['n']}^3 matmul, this run). Layout \"padded\": every "
           f"[.., d_ff] tensor a view of a [.., d_pad] allocation (d_pad = d_ff rounded up to {ALIGN}): the paper's "
           "values and MACs, 16-byte-aligned rows. Kernel class: hopper = nvjet / sm90 kernels, ampere = "
           "cutlass_80 / ampere / s16816.", "",
           "## The six GEMMs of one layer's step, per width", "",
           "| d_ff | layout | row bytes | ms (6 GEMMs) | TFLOP/s | % of roof | ms per step (all layers) | kernels |",
           "|---:|---|---:|---:|---:|---:|---:|---|"]
    for s in data["widths"]:
        out.append(f"| {s['d_ff']} | {s['layout']} | {s['row_bytes']} | {s['ms']:.3f} | {s['TFLOPs']:.1f} | "
                   f"{s['pct_roof']:.0f}% | {s['step_ms']:.2f} | {', '.join(s['classes'])} |")
    out += ["", "## Per GEMM", "",
            "| d_ff | layout | GEMM | M x N x K | ms | TFLOP/s | % of roof | class | kernel | padded vs contiguous |",
            "|---:|---|---|---|---:|---:|---:|---|---|---:|"]
    for r in data["rows"]:
        diff = r.get("rel_diff_vs_contiguous")
        out.append(f"| {r['d_ff']} | {r['layout']} | {r['gemm']} | {' x '.join(map(str, r['mnk']))} | {r['ms']:.4f} | "
                   f"{r['TFLOPs']:.1f} | {r['pct_roof']:.0f}% | {r['kernel_class']} | "
                   f"`{'`, `'.join(r['kernels']) or '-'}` | {'-' if diff is None else format(diff, '.1e')} |")
    out += ["", "## The model options (flashswitch.nn.models)", "",
            "`d_ff_pad_multiple=8` (`--mlp-align pad`): the paper's model, its MLP weights stored with zero hidden "
            "units up to d_pad: its GEMMs are the d_pad rows' (contiguous), its MACs and outputs the paper's. "
            "`d_ff_multiple_of=8` (`--mlp-align round`): d_ff rounded up, the same GEMMs, a few more MACs:", "",
            "| size | variant | d_ff | rounded | MMAC/token | rounded MMAC/token | change |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for m in data["macs"]:
        out.append(f"| {m['size']} | {m['variant']} | {m['d_ff']} | {m['d_ff_round']} | "
                   f"{m['macs_per_token'] / 1e6:.4f} | {m['macs_per_token_round'] / 1e6:.4f} | "
                   f"{m['change_pct']:+.3f}% |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="262M", choices=models.SIZES, help="the model whose d_model and widths to use")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="rows of x (tokens per step)")
    ap.add_argument("--d-ff", nargs="+", type=int, help="widths (default: the size's, rounded, and 2^k below)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the code path")
    ap.add_argument("--out", type=Path, help="folder (default bench/results/<device>/)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or (args.d_ff and min(args.d_ff) < 1):
        ap.error("--tokens and --d-ff must be >= 1")
    gpu = torch.cuda.is_available() and not args.smoke
    if not gpu and not args.smoke:
        print("gemm_align.py times cuBLAS GEMMs and no GPU is visible; --smoke runs tiny shapes on the CPU",
              file=sys.stderr)
        return 2
    device = "cuda" if gpu else "cpu"
    cfg = models.paper_config(args.size, "dense")
    if args.smoke:
        d, n_layers, T, widths, roof_n = (SMOKE[k] for k in ("d_model", "n_layers", "tokens", "widths", "roof_n"))
    else:
        d, n_layers, T, roof_n = cfg.d_model, cfg.n_layers, args.tokens, ROOF_N
        widths = args.d_ff or default_widths(args.size)
    roof = measure_roof(roof_n, gpu, device)
    print(f"bf16 roof: {roof['TFLOPs']:.1f} TFLOP/s ({roof_n}^3)", flush=True)
    rows = [r for F in widths for r in measure_width(F, T, d, roof, gpu, device)]
    blas = getattr(torch.backends.cuda, "preferred_blas_library", None)
    data = {"name": NAME, **provenance(), **env_info(), **({"device": "cpu"} if not gpu else {}),
            "command": shlex.join(["python", "bench/tools/gemm_align.py", *(sys.argv[1:] if argv is None else argv)]),
            "smoke": args.smoke, "size": args.size, "tokens": T, "d_model": d, "n_layers": n_layers,
            "blas": str(blas()).replace("_BlasBackend.", "") if blas and gpu else None, "roof": roof,
            "widths": width_summary(rows, roof, n_layers), "rows": rows, "macs": mac_rows(args.size)}
    bad = [r for r in rows if r.get("rel_diff_vs_contiguous", 0) > MAX_REL_DIFF]
    for r in bad:
        print(f"d_ff {r['d_ff']} {r['gemm']}: the padded layout's output differs from the contiguous one's "
              f"(relative {r['rel_diff_vs_contiguous']:.2e})", file=sys.stderr)
    md = markdown(data)
    if args.out is None and not gpu:
        print(md)
        print("a CPU run: not written (--out DIR keeps it)")
        return 1 if bad else 0
    folder = args.out or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{NAME}.json").write_text(json.dumps(data, indent=1) + "\n")
    (folder / f"{NAME}.md").write_text(md)
    print(md)
    print(f"wrote {folder / (NAME + '.json')} and {NAME}.md ({device_name() if gpu else 'cpu'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
