"""Plot and tabulate a benchmark JSON (pytest-benchmark --benchmark-json).

    python bench/tools/plot.py bench/results/<device>/<op>.json [more.json ...]

writes, next to each JSON (what each op gets comes from its registry entry, `bench_plot`,
`bench_compare`, `bench_roof`):
  <op>.png  "throughput": throughput vs the sweep axis (sequence length N for op 1), one line per
            backend; "speedup": speedup over one baseline (sdpa_causal for op 2) vs the sweep axis,
            plus <op>_throughput.png; "bars": throughput per shape, one bar per backend (op 3)
  <op>.md   shape, backend, median ms (do_bench), throughput (TFLOP/s and/or GB/s), % of the measured
            ceilings (ceilings.json in the same folder, from bench/tools/ceilings.py; else the nominal copy
            bandwidth), speedup vs each baseline of the op (the eager PyTorch reference for op 1, flex
            and sdpa_causal for op 2, grouped_mm_pipeline for op 3) and % of the roof backend
            (dense_equal_macs for op 3); baselines that cannot run a shape show as "unsupported"
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: `import common`

from common import BACKEND_ORDER, load_ceilings, provenance_line  # noqa: E402

UNITS = ("GB/s", "TFLOP/s")


def op_settings(op: str) -> dict:
    """{"unit", "compare", "roof", "plot"} of an op from its registry entry (defaults otherwise)."""
    out = {"unit": None, "compare": ("reference",), "roof": None, "plot": {"kind": "throughput"}}
    try:
        from flashswitch import registry
        spec = registry.OPS.get(op)
    except Exception:
        spec = None
    if spec is not None:
        out.update(unit=spec.unit, compare=tuple(spec.bench_compare), roof=spec.bench_roof, plot=dict(spec.bench_plot))
    return out


def load_rows(path: Path) -> tuple[list[dict], dict]:
    """One row per benchmark that recorded a do_bench time; plus the file's header facts."""
    text = Path(path).read_text()
    if Path(path).suffix == ".jsonl":  # the per-case log of a run cut short (bench/common.py, log_case)
        data = {"benchmarks": [json.loads(line) for line in text.splitlines() if line.strip()],
                "datetime": _dt.datetime.fromtimestamp(Path(path).stat().st_mtime, _dt.timezone.utc).isoformat()}
    else:
        data = json.loads(text)
    rows = []
    for b in data.get("benchmarks", []):
        ei = b.get("extra_info") or {}
        if ei.get("unsupported"):
            rows.append({**ei, "ms": None, "pedantic_ms": None})
            continue
        if ei.get("ms") is None:
            continue
        stats = b.get("stats") or {}
        median = stats.get("median")
        rows.append({**ei, "pedantic_ms": float("nan") if median is None else median * 1e3})
    head = rows[0] if rows else {}
    meta = {k: head.get(k) for k in ("device", "capability", "torch", "triton", "cuda", "python")}
    # the run's commit and date (bench/ops/conftest.py adds them to the file; its cases carry them too)
    info = data.get("commit_info") or {}  # pytest-benchmark's own record, where git was there
    meta["commit"] = data.get("commit") or head.get("commit") or (
        info.get("id") and info["id"][:12] + ("-dirty" if info.get("dirty") else ""))
    meta["date"] = data.get("date") or data.get("datetime") or head.get("date")
    return rows, meta


def shape_str(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _key(shape: dict) -> str:
    return json.dumps(shape, sort_keys=True)


def _units(rows: list[dict], primary: str | None = None) -> list[str]:
    """The throughput units the rows carry, the op's own unit first."""
    have = [u for u in UNITS if any(r.get(u) is not None for r in rows)]
    if primary in have:
        have.remove(primary)
        have.insert(0, primary)
    return have or [primary or "GB/s"]


def _unit(rows: list[dict], primary: str | None = None) -> str:
    if primary is None:
        primary = next((r["unit"] for r in rows if r.get("unit")), None)
    return _units(rows, primary)[0]


def _ceiling(unit: str, ceilings: dict):
    return ceilings["copy_GBps"] if unit == "GB/s" else ceilings.get("matmul_TFLOPs")


def _label(r: dict) -> str:
    return f"{r['label']}: {shape_str(r['shape'])}" if r.get("label") else shape_str(r["shape"])


def _ms_of(rows: list[dict], backend: str) -> dict:
    """(shape key, dtype) -> median ms of `backend` (timed rows only)."""
    return {(_key(r["shape"]), r.get("dtype")): r["ms"] for r in rows
            if r["backend"] == backend and r.get("ms")}


def markdown(rows: list[dict], meta: dict, ceilings: dict, op: str) -> str:
    st = op_settings(op)
    timed = [r for r in rows if r.get("ms")]
    units = _units(timed, st["unit"] or _unit(timed))
    compare = [b for b in st["compare"] if any(r["backend"] == b for r in timed)] or list(st["compare"][:1])
    base = {b: _ms_of(rows, b) for b in compare}
    roof = _ms_of(rows, st["roof"]) if st["roof"] else None
    order = OrderedDict()
    for r in rows:
        order.setdefault(_key(r["shape"]), len(order))
    rows = sorted(rows, key=lambda r: (order[_key(r["shape"])], r.get("dtype") or "",
                                       BACKEND_ORDER.get(r["backend"], 99), r["backend"]))
    head = ["shape", "dtype", "backend", "median ms", "pedantic ms"]
    for u in units:
        head.append(u)
        c = _ceiling(u, ceilings)
        if c:
            head.append(f"% of {c:.0f} {u}")
    head += [f"speedup vs {b}" for b in compare]
    if roof is not None:
        head.append(f"% of roof ({st['roof']})")
    rotating = any(r.get("ms_rotating") for r in rows)
    if rotating:
        head += ["rotating ms"] + [f"{u} rotating" for u in units] + ["graph ms"] + [f"{u} graph" for u in units]
    read_flush = any(r.get("ms_read_flush") for r in rows)
    if read_flush:
        head += ["read-flush ms"] + [f"{u} read flush" for u in units]
    ceil_src = ceilings["source"]
    lines = [
        f"# {op} on {meta.get('device')}",
        "",
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}, "
        f"capability {meta.get('capability')}; {provenance_line(meta)}.",
        f"Times: `triton.testing.do_bench` median (CUDA events, L2 flushed); pedantic: wall clock per "
        f"synchronized call. Ceilings: {ceil_src}. Every row's throughput counts the work of the op "
        f"itself ({', '.join(units)}), whatever the backend computes.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|",
    ]
    for r in rows:
        cells = [_label(r), r.get("dtype", "-"), r["backend"]]
        if r.get("unsupported"):
            cells += ["unsupported"] + ["-"] * (len(head) - 4)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells += [f"{r['ms']:.4f}", "-" if r.get("pedantic_ms") is None else f"{r['pedantic_ms']:.4f}"]
        for u in units:
            thr = r.get(u)
            cells.append("-" if thr is None else f"{thr:.1f}")
            c = _ceiling(u, ceilings)
            if c:
                cells.append(f"{100 * thr / c:.1f}%" if thr is not None else "-")
        k = (_key(r["shape"]), r.get("dtype"))
        for b in compare:
            ms = base[b].get(k)
            cells.append(f"{ms / r['ms']:.2f}x" if ms else "-")
        if roof is not None:
            ms = roof.get(k)
            cells.append(f"{100 * ms / r['ms']:.1f}%" if ms else "-")
        if rotating:
            rms = r.get("ms_rotating")
            cells.append("-" if not rms else f"{rms:.4f}")
            cells += ["-" if r.get(f"{u} rotating") is None else f"{r[f'{u} rotating']:.1f}" for u in units]
            gms = r.get("ms_graph")
            cells.append("-" if not gms else f"{gms:.4f}")
            cells += ["-" if r.get(f"{u} graph") is None else f"{r[f'{u} graph']:.1f}" for u in units]
        if read_flush:
            fms = r.get("ms_read_flush")
            cells.append("-" if not fms else f"{fms:.4f}")
            cells += ["-" if r.get(f"{u} read flush") is None else f"{r[f'{u} read flush']:.1f}" for u in units]
        lines.append("| " + " | ".join(cells) + " |")
    if rotating:
        lines += ["", "rotating: median CUDA-event time per call cycling through distinct input sets (together "
                  ">= 4x the L2) with no flush; do_bench's flush zeroes 256 MB before each call and leaves up to "
                  "one L2 of dirty lines that the timed call must write back. graph: median of CUDA-graph replays of "
                  "the same rotation (triton.testing.do_bench_cudagraph): kernel time without per-call host work."]
    if read_flush:
        lines += ["", "read flush: median CUDA-event time per call after flushing the L2 by reading 512 MB (inputs "
                  "as cold as under do_bench, but no dirty lines of the flush left to write back, and ~125 us of "
                  "GPU work to hide the host's work per call)."]
    notes = sorted({f"{r['backend']}: {r['unsupported']}" for r in rows if r.get("unsupported")})
    if notes:
        lines += ["", "Unsupported:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def sweep_rows(rows: list[dict]) -> tuple[str, list[dict]]:
    """The x key and the timed rows of the largest family of shapes that differ only in x."""
    x = next((r.get("x") for r in rows if r.get("x")), "N")
    families: dict = {}
    for r in rows:
        if x not in r["shape"] or not r.get("ms"):
            continue
        rest = {k: v for k, v in r["shape"].items() if k != x}
        families.setdefault((_key(rest), r.get("dtype")), []).append(r)
    if not families:
        return x, []
    best = max(families.values(), key=lambda rs: len({r["shape"][x] for r in rs}))
    return x, best


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _x_axis(ax, x: str, fam: list[dict]) -> None:
    ax.set_xscale("log", base=2)
    xs = sorted({r["shape"][x] for r in fam})
    ax.set_xticks(xs)
    ax.set_xticklabels([str(v) for v in xs])
    ax.minorticks_off()
    ax.set_xlabel(x)


def _save(fig, ax, out: Path, plt) -> None:
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot(rows: list[dict], meta: dict, ceilings: dict, op: str, out: Path) -> bool:
    """Throughput vs the sweep axis, one line per backend."""
    unit = _unit([r for r in rows if r.get("ms")], op_settings(op)["unit"])
    x, fam = sweep_rows(rows)
    if not fam:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5), dpi=120)
    by_backend: dict = {}
    by_backend_graph: dict = {}  # kernel-only throughput (CUDA-graph replay), where the bench recorded it
    for r in fam:
        if r.get(unit) is not None:
            by_backend.setdefault(r["backend"], []).append((r["shape"][x], r[unit]))
        if r.get(f"{unit} graph") is not None:
            by_backend_graph.setdefault(r["backend"], []).append((r["shape"][x], r[f"{unit} graph"]))
    for b in sorted(by_backend, key=lambda b: BACKEND_ORDER.get(b, 99)):
        pts = sorted(by_backend[b])
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{b} (per call)"
                        if by_backend_graph else b)
        if b in by_backend_graph:
            pts = sorted(by_backend_graph[b])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                    label=f"{b} (kernel: graph replay)")
    ceil = _ceiling(unit, ceilings)
    if ceil:
        ax.axhline(ceil, color="gray", linestyle="--", linewidth=1,
                   label=f"ceiling {ceil:.0f} {unit}")
    _x_axis(ax, x, fam)
    ax.set_ylabel(unit)
    fixed = {k: v for k, v in fam[0]["shape"].items() if k != x}
    ax.set_title(f"{op} on {meta.get('device')}\n{shape_str(fixed)} {fam[0].get('dtype', '')}", fontsize=10)
    ax.set_ylim(bottom=0)
    _save(fig, ax, out, plt)
    return True


def plot_speedup(rows: list[dict], meta: dict, op: str, over: str, out: Path) -> bool:
    """Speedup over backend `over` (its ms / each backend's ms, same shape) vs the sweep axis."""
    x, fam = sweep_rows(rows)
    base = {r["shape"][x]: r["ms"] for r in fam if r["backend"] == over}
    if not base:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5), dpi=120)
    by_backend: dict = {}
    for r in fam:
        if r["backend"] != over and r["shape"][x] in base:
            by_backend.setdefault(r["backend"], []).append((r["shape"][x], base[r["shape"][x]] / r["ms"]))
    for b in sorted(by_backend, key=lambda b: BACKEND_ORDER.get(b, 99)):
        pts = sorted(by_backend[b])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label=f"{over} (1x)")
    _x_axis(ax, x, fam)
    ax.set_yscale("log", base=2)
    from matplotlib.ticker import FuncFormatter
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_ylabel(f"speedup over {over}")
    fixed = {k: v for k, v in fam[0]["shape"].items() if k != x}
    ax.set_title(f"{op} on {meta.get('device')}: speedup over {over}\n{shape_str(fixed)} "
                 f"{fam[0].get('dtype', '')}", fontsize=10)
    _save(fig, ax, out, plt)
    return True


def plot_bars(rows: list[dict], meta: dict, op: str, out: Path) -> bool:
    """Throughput per shape, one bar per backend; backends that cannot run a shape are marked n/a."""
    timed = [r for r in rows if r.get("ms")]
    if not timed:
        return False
    unit = _unit(timed, op_settings(op)["unit"])
    shapes = OrderedDict()
    for r in rows:
        shapes.setdefault(_key(r["shape"]), r.get("label") or shape_str(r["shape"]))
    backends = sorted({r["backend"] for r in rows}, key=lambda b: (BACKEND_ORDER.get(b, 99), b))
    val = {(_key(r["shape"]), r["backend"]): r.get(unit) for r in timed}
    unsupported = {(_key(r["shape"]), r["backend"]) for r in rows if r.get("unsupported")}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(8.5, 1.6 * len(shapes) + 3), 4.8), dpi=120)
    width = 0.8 / max(1, len(backends))
    top = max((v for v in val.values() if v is not None), default=1.0)
    for i, b in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(shapes))]
        hs = [val.get((k, b)) or 0.0 for k in shapes]
        ax.bar(xs, hs, width=width, label=b)
        for xx, k in zip(xs, shapes):
            if (k, b) in unsupported:
                ax.text(xx, top * 0.01, "n/a", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(list(shapes.values()), rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    dt = timed[0].get("dtype", "")
    ax.set_title(f"{op} on {meta.get('device')} ({dt})", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def process(path: Path, ceilings_path: Path | None = None) -> list[Path]:
    path = Path(path)
    rows, meta = load_rows(path)
    op = rows[0]["op"] if rows and rows[0].get("op") else path.stem
    if not rows:
        print(f"{path}: no benchmark results with timings (was the suite skipped?)")
        return []
    ceilings = load_ceilings(ceilings_path.parent if ceilings_path else path.parent)
    if path.suffix == ".jsonl":  # <op>.cases.jsonl: the tables and plots keep the op's own names
        path = path.with_name(f"{op.replace('.', '_')}.json")
    written = []
    md = path.with_suffix(".md")
    md.write_text(markdown(rows, meta, ceilings, op))
    written.append(md)
    png = path.with_suffix(".png")
    kind = op_settings(op)["plot"]
    if kind.get("kind") == "speedup":
        if plot_speedup(rows, meta, op, kind["over"], png):
            written.append(png)
        extra = path.with_name(f"{path.stem}_throughput.png")
        if plot(rows, meta, ceilings, op, extra):
            written.append(extra)
    elif kind.get("kind") == "bars":
        if plot_bars(rows, meta, op, png):
            written.append(png)
    elif plot(rows, meta, ceilings, op, png):
        written.append(png)
    for w in written:
        print(f"wrote {w}")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path,
                   help="pytest-benchmark JSON file(s), or <op>.cases.jsonl of a run cut short")
    p.add_argument("--ceilings", type=Path, help="ceilings.json (default: the one beside each JSON)")
    args = p.parse_args(argv)
    for path in args.json:
        process(path, args.ceilings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
