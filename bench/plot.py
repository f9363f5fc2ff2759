"""Plot and tabulate a benchmark JSON (pytest-benchmark --benchmark-json).

    python bench/plot.py bench/results/<device>/<op>.json [more.json ...]

writes, next to each JSON:
  <op>.png  throughput vs the sweep axis (sequence length N for op 1), one line per backend
  <op>.md   shape, backend, median ms (do_bench), throughput, % of the measured ceiling (ceilings.json
            in the same folder, from bench/ceilings.py; else the nominal copy bandwidth) and speedup
            vs the eager PyTorch reference
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BACKEND_ORDER, load_ceilings  # noqa: E402

UNITS = ("GB/s", "TFLOP/s")


def load_rows(path: Path) -> tuple[list[dict], dict]:
    """One row per benchmark that recorded a do_bench time; plus the file's header facts."""
    data = json.loads(Path(path).read_text())
    rows = []
    for b in data.get("benchmarks", []):
        ei = b.get("extra_info") or {}
        if ei.get("ms") is None:
            continue
        stats = b.get("stats") or {}
        rows.append({**ei, "pedantic_ms": stats.get("median", float("nan")) * 1e3})
    head = rows[0] if rows else {}
    meta = {k: head.get(k) for k in ("device", "capability", "torch", "triton", "cuda", "python")}
    meta["datetime"] = data.get("datetime")
    return rows, meta


def shape_str(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _key(shape: dict) -> str:
    return json.dumps(shape, sort_keys=True)


def _unit(rows: list[dict]) -> str:
    for u in UNITS:
        if any(r.get(u) is not None for r in rows):
            return u
    return "GB/s"


def _ceiling(unit: str, ceilings: dict):
    return ceilings["copy_GBps"] if unit == "GB/s" else ceilings.get("matmul_TFLOPs")


def markdown(rows: list[dict], meta: dict, ceilings: dict, op: str) -> str:
    unit = _unit(rows)
    ceil = _ceiling(unit, ceilings)
    ref = {(_key(r["shape"]), r.get("dtype")): r["ms"] for r in rows if r["backend"] == "reference"}
    order = OrderedDict()
    for r in rows:
        order.setdefault(_key(r["shape"]), len(order))
    rows = sorted(rows, key=lambda r: (order[_key(r["shape"])], r.get("dtype") or "",
                                       BACKEND_ORDER.get(r["backend"], 99), r["backend"]))
    ceil_label = f"% of {ceil:.0f} {unit}" if ceil else "% of ceiling"
    lines = [
        f"# {op} on {meta.get('device')}",
        "",
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}, "
        f"capability {meta.get('capability')}; run {meta.get('datetime')}.",
        f"Times: `triton.testing.do_bench` median (CUDA events, L2 flushed); pedantic: wall clock per "
        f"synchronized call. Ceiling: {ceilings['source']}.",
        "",
        f"| shape | dtype | backend | median ms | pedantic ms | {unit} | {ceil_label} | speedup vs reference |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        thr = r.get(unit)
        pct = f"{100 * thr / ceil:.1f}%" if thr is not None and ceil else "-"
        base = ref.get((_key(r["shape"]), r.get("dtype")))
        speed = f"{base / r['ms']:.2f}x" if base else "-"
        lines.append(f"| {shape_str(r['shape'])} | {r.get('dtype', '-')} | {r['backend']} | {r['ms']:.4f} | "
                     f"{r['pedantic_ms']:.4f} | {'-' if thr is None else f'{thr:.1f}'} | {pct} | {speed} |")
    return "\n".join(lines) + "\n"


def sweep_rows(rows: list[dict]) -> tuple[str, list[dict]]:
    """The x key and the rows of the largest family of shapes that differ only in x."""
    x = next((r.get("x") for r in rows if r.get("x")), "N")
    families: dict = {}
    for r in rows:
        if x not in r["shape"]:
            continue
        rest = {k: v for k, v in r["shape"].items() if k != x}
        families.setdefault((_key(rest), r.get("dtype")), []).append(r)
    if not families:
        return x, []
    best = max(families.values(), key=lambda rs: len({r["shape"][x] for r in rs}))
    return x, best


def plot(rows: list[dict], meta: dict, ceilings: dict, op: str, out: Path) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = _unit(rows)
    x, fam = sweep_rows(rows)
    if not fam:
        return False
    fig, ax = plt.subplots(figsize=(8.5, 4.5), dpi=120)
    by_backend: dict = {}
    for r in fam:
        if r.get(unit) is not None:
            by_backend.setdefault(r["backend"], []).append((r["shape"][x], r[unit]))
    for b in sorted(by_backend, key=lambda b: BACKEND_ORDER.get(b, 99)):
        pts = sorted(by_backend[b])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
    ceil = _ceiling(unit, ceilings)
    if ceil:
        ax.axhline(ceil, color="gray", linestyle="--", linewidth=1,
                   label=f"ceiling {ceil:.0f} {unit}")
    ax.set_xscale("log", base=2)
    xs = sorted({r["shape"][x] for r in fam})
    ax.set_xticks(xs)
    ax.set_xticklabels([str(v) for v in xs])
    ax.minorticks_off()
    ax.set_xlabel(x)
    ax.set_ylabel(unit)
    fixed = {k: v for k, v in fam[0]["shape"].items() if k != x}
    ax.set_title(f"{op} on {meta.get('device')}: {shape_str(fixed)} {fam[0].get('dtype', '')}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylim(bottom=0)
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
    written = []
    md = path.with_suffix(".md")
    md.write_text(markdown(rows, meta, ceilings, op))
    written.append(md)
    png = path.with_suffix(".png")
    if plot(rows, meta, ceilings, op, png):
        written.append(png)
    for w in written:
        print(f"wrote {w}")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path, help="pytest-benchmark JSON file(s)")
    p.add_argument("--ceilings", type=Path, help="ceilings.json (default: the one beside each JSON)")
    args = p.parse_args(argv)
    for path in args.json:
        process(path, args.ceilings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
