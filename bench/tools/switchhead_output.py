"""SwitchHead's output projection three ways, forward and forward + backward, at the papers' shapes:
the fused dense-over-experts op (ops/switchhead_output.py, both forms of its kernels), op 3
as the layer calls it otherwise (route + expert_matmul, backend "auto": the tuned kernel), and a dense bf16
matmul with the routed multiply-adds (x [T, H·k·D] @ W [H·k·D, d], the roof). Every rate is counted on the
routed MACs (2·T·H·k·D·d flops forward, 3x that forward + backward), so the columns compare times directly.

    python bench/tools/switchhead_output.py [--shapes 262M 47M] [--out DIR]
    python bench/tools/switchhead_output.py --smoke --out DIR      # tiny shapes; the CPU under the interpreter

Shapes: T = 16384 tokens (the 262M model's batch; the 47M one at the same T), a in bf16, the output experts
as fp32 master weights (what the layer passes under autocast). Rows: "fused" (the per-column Z tile forward,
fp32 weights cast per tile in the kernel: the layer's path), "fused, W cast once" (the weights cast to bf16
per call before the kernels, autograd through the cast: a variant to weigh, its weight gradient is rounded
to bf16), "fused, row scale" and "fused, row scale, W cast once" (the same with the row-scale forward and
weight gradient, the kernels' form "rows"), "op 3", "dense (routed MACs)". Times: `triton.testing.do_bench`
medians (L2 flushed; bench/common.py bench_ms) after a warm-up call that makes the call plans. Also
recorded: each fused form's relative error against op 3's outputs and the configs the calls ran (the tuned
store's or the defaults).
Writes switchhead_output.{json,md} under bench/results/<device>/ (or --out; without a GPU only with --out).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: `import common`
from common import device_name, env_info, provenance, provenance_line, results_dir, time_ms  # noqa: E402
from flashswitch.kernels_triton import switchhead_output as K, switchhead_output_bwd as KB  # noqa: E402
from flashswitch.nn._routing import matmul_weight  # noqa: E402
from flashswitch.nn.models import paper_config  # noqa: E402
from flashswitch.ops import call_plan, switchhead_output as op  # noqa: E402
from flashswitch.ops.expert_matmul import expert_matmul, route  # noqa: E402
from flashswitch.testing import rel_error  # noqa: E402

TOKENS = 16384


def paper_shape(size: str, T: int = TOKENS) -> dict:
    cfg = paper_config(size, "switchhead")
    return dict(T=T, H=cfg.n_heads, E=cfg.att_experts, k=cfg.att_k, D=cfg.head_dim, d=cfg.d_model)


SMOKE_SHAPES = {"tiny": dict(T=64, H=2, E=4, k=2, D=12, d=32), "tiny odd": dict(T=50, H=2, E=5, k=3, D=20, d=24)}
IMPLS = ("fused", "fused, W cast once", "fused, row scale", "fused, row scale, W cast once", "op 3",
         "dense (routed MACs)")
FUSED = ("fused", "fused, row scale")  # the rows whose outputs are compared with op 3's


def make_inputs(s: dict, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """The layer's output-projection inputs: a [T, H, D], routing of k of E experts per head (global ids
    h·E + e in slot h·k + j), sigmoid gates, fp32 master weights [H·E, D, d] (weights in a's dtype when a is
    fp32), the cotangent dy; and the dense roof's operands x [T, H·k·D], w [H·k·D, d] in a's dtype."""
    T, H, E, k, D, d = (s[n] for n in ("T", "H", "E", "k", "D", "d"))
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, H, E, generator=g, device=device)
    ids = (scores.topk(k, -1).indices + torch.arange(H, device=device)[:, None] * E).reshape(T, H * k)
    return dict(
        a=torch.randn(T, H, D, generator=g, device=device).to(dtype), ids=ids,
        gates=torch.sigmoid(torch.randn(T, H * k, generator=g, device=device)),
        weight=torch.randn(H * E, D, d, generator=g, device=device) * (H * D) ** -0.5,
        dy=torch.randn(T, d, generator=g, device=device).to(dtype),
        x=torch.randn(T, H * k * D, generator=g, device=device).to(dtype),
        w=(torch.randn(H * k * D, d, generator=g, device=device) * (H * k * D) ** -0.5).to(dtype))


def kernel_form(form: str) -> None:
    """The fused forward and weight gradient in `form` (K.FORMS) from here on (a config without FORM / DW_FORM
    runs the modules' default form); the plans, prepared in the other form, start over where it changes."""
    if (K.FORWARD_FORM, KB.DWEIGHT_FORM) != (form, form):
        K.FORWARD_FORM = KB.DWEIGHT_FORM = form
        call_plan.clear_all()


def callables(p: dict, s: dict) -> dict:
    """{impl: (forward, forward + backward)}, each a no-argument call as a training step makes it."""
    E, HE = s["E"], s["H"] * s["E"]
    dtype = p["a"].dtype
    leaves = [p["a"].detach().requires_grad_(), p["gates"].detach().requires_grad_(),
              p["weight"].detach().requires_grad_()]

    def fused(a, gates, weight):
        return op.switchhead_output(a, p["ids"], gates, weight, E, check=False, backend="triton")

    def fused_cast(a, gates, weight):
        return fused(a, gates, weight.to(dtype))

    def op3(a, gates, weight):
        rt = route(p["ids"], HE, check=False)  # the layer routes in every step
        return expert_matmul(a, rt, matmul_weight(weight, dtype), gates=gates, out_groups=1)[:, 0]

    def step(fn, form="columns"):
        def fwd():
            kernel_form(form)
            return fn(p["a"], p["gates"], p["weight"])

        def train():
            kernel_form(form)
            return torch.autograd.grad(fn(*leaves), leaves, p["dy"])
        return fwd, train

    wx = [p["x"].detach().requires_grad_(), p["w"].detach().requires_grad_()]
    dense = (lambda: p["x"] @ p["w"], lambda: torch.autograd.grad(wx[0] @ wx[1], wx, p["dy"]))
    return {"fused": step(fused), "fused, W cast once": step(fused_cast), "fused, row scale": step(fused, "rows"),
            "fused, row scale, W cast once": step(fused_cast, "rows"), "op 3": step(op3), "dense (routed MACs)": dense}


def run_configs(p: dict) -> dict:
    """The configs the fused calls run on these inputs (tuned store or default), forward and backward."""
    args = (p["a"], p["ids"], p["gates"], p["weight"])
    return {"forward": dict(call_plan.config(op.OP, "triton", op.OPDEF.features(op.OP, *args))),
            "backward": dict(call_plan.config(op.OP_BWD, "triton", op.OPDEF.features(op.OP_BWD, *args)))}


def measure(label: str, s: dict, dtype: torch.dtype, device: str, gpu: bool) -> list[dict]:
    p = make_inputs(s, dtype, device)
    fns = callables(p, s)
    routed_flops = 2 * s["T"] * s["H"] * s["k"] * s["D"] * s["d"]
    # each fused form vs op 3 on the same inputs: output and gradients
    got = {impl: (fns[impl][0](), *fns[impl][1]()) for impl in (*FUSED, "op 3")}
    errors = {impl: {name: rel_error(f, o) for name, f, o in zip(("y", "da", "dgates", "dweight"), got[impl],
                                                                  got["op 3"])} for impl in FUSED}
    del got
    rows = []
    for pass_, flops in (("fwd", routed_flops), ("fwd+bwd", 3 * routed_flops)):
        for impl in IMPLS:
            fn = fns[impl][0 if pass_ == "fwd" else 1]
            fn()  # compiles and makes the call plans
            if gpu:
                torch.cuda.synchronize()
            ms = time_ms(fn, gpu)
            rows.append({"shape": label, **s, "pass": pass_, "impl": impl, "ms": ms,
                         "routed_TFLOPs": flops / (ms * 1e-3) / 1e12})
        by = {r["impl"]: r for r in rows if r["pass"] == pass_}
        for r in by.values():
            r["rate_vs_dense"] = by["dense (routed MACs)"]["ms"] / r["ms"]
            r["speedup_vs_op3"] = by["op 3"]["ms"] / r["ms"]
        by["fused"]["configs"] = run_configs(p)
        for impl in FUSED:
            by[impl]["rel_error_vs_op3"] = errors[impl]
        print(f"{label} {pass_}: " + ", ".join(f"{i} {by[i]['ms']:.3f} ms" for i in IMPLS), flush=True)
    return rows


def markdown(data: dict) -> str:
    lines = [f"# SwitchHead output projection: fused kernel vs op 3 vs dense ({data['device']}, {data['dtype']})", "",
             f"Run: {provenance_line(data)}. `{data['command']}`"
             + (" (smoke run: tiny shapes, interpreter wall clock, numbers mean nothing)" if data["smoke"] else ""), "",
             "Median `do_bench` time; TFLOP/s counted on the routed MACs (2·T·H·k·D·d forward, 3x that forward + "
             "backward) for every row; `vs dense` = the time of the dense matmul of the routed MACs (in a's "
             "dtype) / the row's: the share of that rate the row reaches, `vs op 3` = op 3's time / the row's. "
             "The fused kernel multiplies all E experts per head: E / k times the routed MACs.", "",
             "| shape | T, H, E, k, D, d | pass | impl | ms | routed TFLOP/s | vs dense | vs op 3 |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        dims = ", ".join(str(r[n]) for n in ("T", "H", "E", "k", "D", "d"))
        lines.append(f"| {r['shape']} | {dims} | {r['pass']} | {r['impl']} | {r['ms']:.3f} | "
                     f"{r['routed_TFLOPs']:.1f} | {r['rate_vs_dense']:.2f} | {r['speedup_vs_op3']:.2f} |")
    lines += ["", "Fused (each forward form) against op 3 on the same inputs (relative L2 error) and the configs the "
              "calls ran (tuned store or defaults):", ""]
    for r in data["rows"]:
        if r["impl"] in FUSED and r["pass"] == "fwd+bwd":
            errs = ", ".join(f"{k} {v:.2e}" for k, v in r["rel_error_vs_op3"].items())
            cfgs = f"; configs {json.dumps(r['configs'])}" if "configs" in r else ""
            lines.append(f"- {r['shape']}, {r['impl']}: {errs}{cfgs}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["262M", "47M"], choices=("262M", "47M"))
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU: Triton interpreter, fp32)")
    ap.add_argument("--out", type=Path, help="folder (default bench/results/<device>/)")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu and not args.smoke:
        print("switchhead_output.py times CUDA kernels and no GPU is visible; --smoke runs tiny shapes on the CPU",
              file=sys.stderr)
        return 2
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32  # the interpreter's bf16 dot is not right
    shapes = SMOKE_SHAPES if args.smoke else {s: paper_shape(s, args.tokens) for s in args.shapes}
    rows = []
    for label, s in shapes.items():
        rows += measure(label, s, dtype, device, gpu)
    data = {"name": "switchhead_output", **provenance(), **env_info(),
            "command": shlex.join(["python", "bench/tools/switchhead_output.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
            "smoke": args.smoke, "dtype": str(dtype).replace("torch.", ""), "weight_dtype": "float32", "rows": rows}
    if args.out is None and not gpu:
        print("no GPU: nothing written (--out DIR keeps the tables)")
        return 0
    folder = args.out or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "switchhead_output.json").write_text(json.dumps(data, indent=1) + "\n")
    (folder / "switchhead_output.md").write_text(markdown(data))
    print(f"wrote {folder / 'switchhead_output.json'} and switchhead_output.md ({device_name()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
