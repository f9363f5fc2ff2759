"""End-to-end generation: a Llama-style decoder with random weights (bf16, flashswitch.nn.llama) decoding
with EVA attention on a compressed cache (EvaAttention + EvaCache) against the same model with exact
attention (SDPA) on a preallocated standard KV cache (StaticKVCache). Both decode with one
CUDA-graph-captured step per (method, batch), replayed for every token; positions and lengths live on
device tensors.

    python bench/e2e/e2e_generation.py [--sizes smollm2-135m llama-1b] [--contexts 4096 16384 32768]
        [--methods sdpa eva-sliding eva-block] [--batches 1 16 max] [--steps 32] [--budget-gb 120]
    python bench/e2e/e2e_generation.py --macs-only      # the ideal prefill speedups from MACs (no GPU needed)
    python bench/e2e/e2e_generation.py --plot-only      # tables and plots from the JSON (no GPU needed)

Per (size, method, context):
  prefill  batch 1: median CUDA-event time of the prompt's forward pass into a fresh cache (last
           position's logits only), after one untimed call; peak memory of the timed calls.
  decode   per batch (1, 16 and "max", the largest batch within the memory budget): the batch-1 prefilled
           cache is copied into every sequence of a batch-B cache (the decode cost does not depend on the
           values, and B prompts of 32k tokens would cost B prefills); one eager step (compiles), one
           captured step (embedding, every layer's cache step, final norm, logits, greedy argmax fed back
           as the next input), WARM_REPLAYS replays, then --steps replays timed between CUDA events:
           ms per step and tokens/s = B * steps / time. KV bytes per sequence: the per-layer caches'
           allocation (EvaCache.nbytes; k, v and lengths of the StaticKVCache, sized prompt + decoded
           tokens) divided by B. Peak memory: torch.cuda.max_memory_allocated() over the case (weights,
           the batch-1 cache it copies from, the batch-B cache, the graph's pool). KV read GB/s: the
           keys and values a step must read (every layer, every sequence; exact attention: each key up
           to the new token's position, EVA: the exact keys and summaries its query sees), averaged
           over the timed steps, per ms / step; % of copy: of the copy bandwidth in ceilings.json of
           the results folder (bench/tools/ceilings.py; else a nominal one).
  max batch the budget (set as the process's memory fraction, so exceeding it is an OOM) minus what is
           allocated, divided by the KV bytes plus an activation estimate per sequence; then allocated
           and run, backing off by 15% on OOM.
Methods: sdpa (exact; prefill: SDPA flash backend; decode: the first of EXACT_DECODE that runs here,
each reading every kv head once per step: "gqa", SDPA with enable_gqa and a key bias per sequence on
cuDNN's attention, else "flash", the flash kernel's variable-length entry with seqused_k, else
"masked" SDPA), eva-sliding (W=256, C=32), eva-block (W=2048, C=16).

Results merge into <out>/e2e_generation.json (a rerun replaces the rows of the cases it ran and keeps
the others), then e2e_generation.md, e2e_generation_throughput.png (tokens/s vs batch) and
e2e_generation_memory.png (KV bytes per sequence and peak memory vs context) are rewritten from it.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
for p in (E2E_DIR, E2E_DIR.parent):  # bench/e2e, bench/ (`import common`)
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from common import provenance, provenance_line  # noqa: E402
from flashswitch.nn.llama import LLAMA_SHAPES, LlamaLM, StaticKVCache, keys_seen, macs_per_token  # noqa: E402

NAME = "e2e_generation"
DEVICE = "cuda"
DTYPE = torch.bfloat16
# the exact baseline's decode kernels, fastest first on the H200 (cuDNN's "gqa" about twice flash's rate
# at large batch, level at batch 16): the first that runs here decodes the sdpa method
EXACT_DECODE = ("gqa", "flash")
METHODS = {
    "sdpa": dict(attention="sdpa"),
    "eva-sliding": dict(attention="eva", chunk_size=32, window_size=256, window="sliding"),
    "eva-block": dict(attention="eva", chunk_size=16, window_size=2048, window="block"),
}
CONTEXTS = (4096, 16384, 32768)
BATCHES = ("1", "16", "max")
WARM_REPLAYS = 3
RESERVE = 2 << 30          # kept free under the budget: cuBLAS workspaces, allocator rounding
BACKOFF = (0.85, 0.85, 0.85, 0.5, 0.5, 0.5, 0.5)  # batch factor after each OOM: near the estimate, then halving
GiB, MiB = float(1 << 30), float(1 << 20)


# ---------------------------------------------------------------- cost model (no GPU)
def macs_rows(sizes, contexts, methods) -> list[dict]:
    """MACs per token of a prefill, the attention's share, and the ideal speedup over exact attention."""
    rows = []
    for size in sizes:
        cfg = LLAMA_SHAPES[size]
        for n in contexts:
            exact = macs_per_token(cfg, n)
            for m in methods:
                kw = {k: v for k, v in METHODS[m].items() if k != "attention"}
                macs = macs_per_token(cfg, n, attention=METHODS[m]["attention"], **kw)
                rows.append({"size": size, "context": n, "method": m, "macs_per_token": macs["total"],
                             "attention_share": (macs["attention"] + macs["summaries"]) / macs["total"],
                             "ideal_speedup": exact["total"] / macs["total"]})
    return rows


def print_macs(rows: list[dict]) -> None:
    print(f"{'size':14s} {'context':>8s} {'method':12s} {'GMAC/token':>10s} {'attention %':>11s} "
          f"{'ideal prefill speedup':>22s}")
    for r in rows:
        print(f"{r['size']:14s} {r['context']:8d} {r['method']:12s} {r['macs_per_token'] / 1e9:10.3f} "
              f"{100 * r['attention_share']:10.1f}% {r['ideal_speedup']:21.2f}x")


def activation_bytes_per_seq(cfg, attention: str, cache) -> int:
    """Rough upper estimate of one sequence's share of a decode step's temporaries (logits and argmax,
    one layer's activations, the attention step's masks and biases), doubled for the graph pool."""
    d, H, Hkv, D, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 2
    logits = cfg.vocab_size * (e + 8)
    layer = e * (8 * d + 3 * cfg.intermediate_size + 2 * D * (H + 2 * Hkv)) + 4 * 4 * D * (H + Hkv)
    if attention == "eva":
        attn = 4 * 4 * Hkv * (cache.num_summaries + cache.ring_size)
    elif cache.decode == "masked":
        attn = (1 + 4) * (H // Hkv) * cache.max_seq_len
    elif cache.decode == "gqa":
        attn = (1 + 4 + e) * cache.max_seq_len  # key mask, fp32 bias, its 16-bit copy
    else:
        attn = 0
    return 2 * (logits + layer + attn)


def max_batch_estimate(free_bytes: int, kv_per_seq: float, act_per_seq: float) -> int:
    return max(1, int(free_bytes // (kv_per_seq + act_per_seq)))


def kv_read_bytes(cfg, settings: dict, positions, batch: int, itemsize: int) -> float:
    """Bytes of keys and values one decode step must read, every layer and sequence, averaged over steps
    whose new token sits at `positions`: exact attention each key up to and including that position,
    EVA the exact keys and summaries its query sees (llama.keys_seen)."""
    keys = keys_seen(positions, **settings).mean()
    return cfg.num_layers * batch * cfg.num_kv_heads * 2 * cfg.head_dim * itemsize * float(keys)


def timed_positions(P: int, steps: int) -> range:
    """The new token's position in each timed replay: the prompt, the eager step, the warm replays."""
    return range(P + 1 + WARM_REPLAYS, P + 1 + WARM_REPLAYS + steps)


# ---------------------------------------------------------------- results file
def row_key(r: dict) -> tuple:
    return (r["size"], r["method"], r["context"], r["kind"], str(r.get("batch_label", "")))


def merge(path: Path, rows: list[dict], macs: list[dict]) -> dict:
    """The results file with `rows` and `macs` replacing the entries of the same case (others kept)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        data = {}
    old = {row_key(r): r for r in data.get("rows", [])}
    old.update({row_key(r): r for r in rows})
    old_macs = {(r["size"], r["context"], r["method"]): r for r in data.get("macs", [])}
    old_macs.update({(r["size"], r["context"], r["method"]): r for r in macs})
    data.update(name=NAME, rows=sorted(old.values(), key=_sort_key),
                macs=[old_macs[k] for k in sorted(old_macs)], **provenance())
    return data


def _sort_key(r: dict) -> tuple:
    label = str(r.get("batch_label", ""))
    return (r["size"], r["context"], list(METHODS).index(r["method"]) if r["method"] in METHODS else 99,
            r["kind"] != "prefill", (1, 0) if label == "max" else (0, int(label) if label.isdigit() else 0))


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def write_tables(data: dict, folder: Path) -> Path:
    rows = data.get("rows", [])
    ideal = {(r["size"], r["context"], r["method"]): r["ideal_speedup"] for r in data.get("macs", [])}
    ran = [r for r in rows if not r.get("error")]
    pre = {(r["size"], r["context"], r["method"]): r for r in ran if r["kind"] == "prefill"}
    dec = {(r["size"], r["context"], r["method"], r["batch_label"]): r for r in ran if r["kind"] == "decode"}
    env = next((r for r in rows if r.get("device")), {})
    commits = sorted({r.get("commit") or "unknown" for r in rows})
    lines = [f"# End-to-end generation on {env.get('device', '?')}", "",
             f"Last written: {provenance_line(data)}" +
             (f"; the rows come from commits {', '.join(commits)}" if len(commits) > 1 else "") + ".", "",
             f"`bench/e2e/e2e_generation.py`: Llama-style decoders with random weights (bf16), torch "
             f"{env.get('torch', '?')}, triton {env.get('triton', '?')}. Methods: " +
             ", ".join(f"`{m}` ({', '.join(f'{k}={v}' for k, v in kw.items() if k != 'attention') or 'exact'})"
                       for m, kw in METHODS.items()) + ".", "",
             "## Prefill (batch 1)", "",
             "| size | context | method | prefill ms | tokens/s | speedup vs sdpa | ideal (MACs) | peak GiB |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for (size, n, m), r in pre.items():
        base = pre.get((size, n, "sdpa"))
        sp = base["ms"] / r["ms"] if base and r.get("ms") and base.get("ms") else None
        lines.append(f"| {size} | {n} | {m} | {_fmt(r.get('ms'), '.1f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_fmt(sp, '.2f')}x | {_fmt(ideal.get((size, n, m)), '.2f')}x | "
                     f"{_fmt(r.get('peak_bytes') and r['peak_bytes'] / GiB, '.1f')} |")
    ceil = data.get("ceilings") or {}
    lines += ["", "## Decode (one CUDA-graph-captured step per token)", "",
              "GPU ops / step: the kernels, copies and fills one step issues (torch profiler over its first, "
              "eager run), which each replay runs back to back. KV read GB/s: the keys and values a step must "
              "read (every layer and sequence; exact: each key up to the new token, EVA: the exact keys and "
              "summaries its query sees) per step time; % of copy: of "
              f"{_fmt(ceil.get('copy_GBps'), '.0f', '?')} GB/s ({ceil.get('source', 'not recorded')}).", "",
              "| size | context | method | decode kernel | batch | ms / step | tokens/s | vs sdpa (same batch label) | "
              "KV read GB/s | % of copy | KV MiB / sequence | peak GiB | GPU ops / step |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (size, n, m, label), r in dec.items():
        base = dec.get((size, n, "sdpa", label))
        sp = r["tokens_per_s"] / base["tokens_per_s"] if base and r.get("tokens_per_s") and base.get(
            "tokens_per_s") else None
        batch = f"{r['batch']} (max)" if label == "max" else str(r["batch"])
        lines.append(f"| {size} | {n} | {m} | {r.get('decode_kernel', '?')} | {batch} | {_fmt(r.get('ms'), '.2f')} | "
                     f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(sp, '.2f')}x | "
                     f"{_fmt(r.get('kv_read_GBps'), ',.0f')} | {_fmt(r.get('kv_read_pct_of_copy'), '.1f')} | "
                     f"{_fmt(r.get('kv_bytes_per_seq') and r['kv_bytes_per_seq'] / MiB, ',.1f')} | "
                     f"{_fmt(r.get('peak_bytes') and r['peak_bytes'] / GiB, '.1f')} | "
                     f"{_fmt(r.get('kernels_per_step'), 'd')} |")
    weak = sorted({r.get("decode_kernel", "?") for r in dec.values()
                   if r.get("method") == "sdpa" and r.get("decode_kernel") != EXACT_DECODE[0]})
    if weak:
        lines += ["", f"Some `sdpa` rows decoded with {' / '.join(f'`{k}`' for k in weak)}, not with "
                  f"`{EXACT_DECODE[0]}` (SDPA with enable_gqa on cuDNN's attention, the fastest exact decode "
                  "measured here): their 'vs sdpa' ratios are against a weaker baseline."]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "Cases that did not run: " + "; ".join(
            f"{r['size']} {r['method']} {r['context']} {r['kind']} {r.get('batch_label', '')}: {r['error']}"
            for r in failed)]
    if data.get("macs"):
        lines += ["", "## Ideal prefill speedup from MACs per token", "",
                  "| size | context | method | GMAC / token | attention share | ideal speedup |",
                  "|---|---:|---|---:|---:|---:|"]
        for r in data["macs"]:
            lines.append(f"| {r['size']} | {r['context']} | {r['method']} | {r['macs_per_token'] / 1e9:.3f} | "
                         f"{100 * r['attention_share']:.1f}% | {r['ideal_speedup']:.2f}x |")
    out = Path(folder) / f"{NAME}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plain():
    from matplotlib.ticker import FuncFormatter
    return FuncFormatter(lambda v, _: f"{v:g}")


def plot_throughput(data: dict, folder: Path) -> Path | None:
    """Decode tokens/s vs batch: one panel per (size, context), one line per method."""
    dec = [r for r in data.get("rows", []) if r["kind"] == "decode" and r.get("tokens_per_s")]
    panels = sorted({(r["size"], r["context"]) for r in dec})
    if not panels:
        return None
    sizes = sorted({p[0] for p in panels})
    contexts = sorted({p[1] for p in panels})
    plt = _pyplot()
    fig, axes = plt.subplots(len(sizes), len(contexts), figsize=(4.2 * len(contexts), 3.4 * len(sizes)), dpi=120,
                             squeeze=False)
    for i, size in enumerate(sizes):
        for j, n in enumerate(contexts):
            ax = axes[i][j]
            for m in METHODS:
                pts = sorted((r["batch"], r["tokens_per_s"]) for r in dec
                             if (r["size"], r["context"], r["method"]) == (size, n, m))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
            ax.set_title(f"{size}, context {n}", fontsize=9)
            if not ax.get_lines():
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
                continue
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(_plain())
            ax.set_xlabel("batch")
            ax.set_ylabel("decode tokens/s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"Decode throughput (CUDA-graph step), {dec[0].get('device', '')}", fontsize=10)
    fig.tight_layout()
    out = Path(folder) / f"{NAME}_throughput.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_memory(data: dict, folder: Path) -> Path | None:
    """KV bytes per sequence and peak memory at batch 16 vs context, one column per size."""
    dec = [r for r in data.get("rows", []) if r["kind"] == "decode" and r.get("kv_bytes_per_seq")]
    sizes = sorted({r["size"] for r in dec})
    if not sizes:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.0 * len(sizes), 6.4), dpi=120, squeeze=False)
    for j, size in enumerate(sizes):
        for m in METHODS:
            rs = [r for r in dec if (r["size"], r["method"]) == (size, m)]
            kv = sorted({r["context"]: r["kv_bytes_per_seq"] / MiB for r in rs}.items())
            peak = sorted((r["context"], r["peak_bytes"] / GiB) for r in rs if r["batch_label"] == "16"
                          and r.get("peak_bytes"))
            if kv:
                axes[0][j].plot([p[0] for p in kv], [p[1] for p in kv], marker="o", label=m)
            if peak:
                axes[1][j].plot([p[0] for p in peak], [p[1] for p in peak], marker="o", label=m)
        for ax, what in ((axes[0][j], "KV cache MiB / sequence"), (axes[1][j], "peak GiB, decode at batch 16")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["context"] for r in dec if r["size"] == size}))
            ax.xaxis.set_major_formatter(_plain())
            ax.minorticks_off()
            ax.set_xlabel("context (prompt tokens)")
            ax.set_ylabel(what)
            ax.set_title(size, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=7)
        axes[0][j].set_yscale("log")
        axes[1][j].set_ylim(bottom=0)
    fig.tight_layout()
    out = Path(folder) / f"{NAME}_memory.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def render(data: dict, folder: Path) -> list[Path]:
    return [p for p in (write_tables(data, folder), plot_throughput(data, folder), plot_memory(data, folder)) if p]


# ---------------------------------------------------------------- GPU measurements
def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def decode_context(cache):
    """SDPA held to cuDNN's attention for a "gqa" step: where cuDNN cannot take it, the step fails
    instead of falling back to the math backend, which copies every kv head G times."""
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gqa = isinstance(cache, StaticKVCache) and cache.decode == "gqa"
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if gqa else nullcontext()


def exact_decode_kernel(num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64) -> str:
    """The first of EXACT_DECODE that runs here and equals the masked SDPA decode on a small problem with
    the model's heads and ragged lengths (cuDNN's attention rejects some head dims at run time);
    "masked" when none does."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(3, h, 70, head_dim, device=DEVICE, dtype=DTYPE, generator=g)
               for h in (num_heads, num_kv_heads, num_kv_heads))

    def decode(kernel):
        cache = StaticKVCache(3, num_kv_heads, head_dim, max_seq_len=78, dtype=DTYPE, device=DEVICE, decode=kernel)
        cache.prefill(q[:, :, :69], k[:, :, :69], v[:, :, :69], lengths=torch.tensor([69, 40, 1], device=DEVICE))
        with decode_context(cache):
            return cache.step(q[:, :, 69:], k[:, :, 69:], v[:, :, 69:]).float()

    want = decode("masked")
    for kernel in EXACT_DECODE:
        try:
            if (decode(kernel) - want).abs().max() < 2e-2:
                return kernel
            print(f"{kernel} decode differs from masked SDPA; not used")
        except Exception as err:  # no cuDNN attention, an older torch without seqused_k, ...
            print(f"{kernel} decode unavailable ({(str(err).splitlines() or [type(err).__name__])[0]})")
    return "masked"


def copy_state(dst, src) -> None:
    """Every sequence of the batch-B cache `dst` takes the state of the batch-1 cache `src`."""
    for name in ("k", "v", "lengths"):
        getattr(dst, name).copy_(getattr(src, name).expand_as(getattr(dst, name)))
    dst._max_len = src._max_len  # the caches' host-side bound on the lengths (known without a sync)


def timed_ms(fn, reset, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        reset()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def sdpa_context(method: str):
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if METHODS[method]["attention"] == "sdpa" else nullcontext()


def run_prefill(model, method: str, P: int, max_len: int, reps: int, seed: int):
    """(row, batch-1 caches holding the prompt, the first decoded token [1, 1])."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, P), device=DEVICE, generator=g)
    caches = model.new_cache(1, max_len)
    out = {}

    def reset():
        for c in caches:
            c.reset()

    def fn():
        out["logits"] = model(prompt, caches, last_only=True)

    with torch.no_grad(), sdpa_context(method):
        timed_ms(fn, reset, 1)  # compiles
        free_memory()
        torch.cuda.reset_peak_memory_stats()
        ms = statistics.median(timed_ms(fn, reset, reps))
    row = {"kind": "prefill", "batch": 1, "batch_label": "1", "ms": ms, "tokens_per_s": P / ms * 1e3,
           "peak_bytes": torch.cuda.max_memory_allocated(), "reps": reps}
    return row, caches, out["logits"][:, -1].argmax(-1, keepdim=True)


def count_kernels(fn) -> int | None:
    """fn() run once under the torch profiler: how many GPU operations (kernels, copies, fills) it
    issued, the count a captured step replays (None where the profiler cannot record them). fn's own
    errors (out of memory) propagate."""
    try:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    except Exception:  # noqa: BLE001 (a profiler that cannot start only costs the column)
        prof = None
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        if prof is not None:
            try:
                prof.__exit__(None, None, None)
            except Exception:  # noqa: BLE001
                prof = None
    if prof is None:
        return None
    try:
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) or None
    except Exception:  # noqa: BLE001
        return None


def run_decode(model, src_caches, first_token, B: int, P: int, max_len: int, steps: int) -> dict:
    """One captured decode step for batch B from the state of `src_caches` (batch 1), timed over `steps` replays."""
    torch.cuda.reset_peak_memory_stats()
    caches = model.new_cache(B, max_len)
    for dst, src in zip(caches, src_caches):
        copy_state(dst, src)
    tok = first_token.expand(B, 1).clone()
    kv = sum(c.nbytes for c in caches) / B

    def step():
        logits = model(tok, caches)
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        return logits

    with torch.no_grad(), decode_context(caches[0]):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            kernels = count_kernels(step)  # eager: compiles, and is the first decoded token
        torch.cuda.current_stream().wait_stream(side)
        free_memory()  # the eager step's temporaries go back, so the graph's own pool can take that memory
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        for _ in range(WARM_REPLAYS):
            graph.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
    ms = a.elapsed_time(b) / steps
    want = P + 1 + WARM_REPLAYS + steps
    row = {"kind": "decode", "batch": B, "ms": ms, "tokens_per_s": B / ms * 1e3, "kv_bytes_per_seq": kv,
           "kernels_per_step": kernels,
           "peak_bytes": torch.cuda.max_memory_allocated(), "steps": steps,
           "finite": bool(torch.isfinite(logits).all()),
           "lengths_ok": bool((caches[0].lengths == want).all())}
    del graph, caches, logits
    return row


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err)


def run_max_batch(model, src_caches, first_token, P, max_len, steps, budget, attention, max_batch=None) -> dict:
    """The decode row at the largest batch that fits in `budget` (at most max_batch where given)."""
    kv = sum(c.nbytes for c in src_caches)
    act = activation_bytes_per_seq(model.cfg, attention, src_caches[0])
    free = budget - torch.cuda.memory_allocated() - RESERVE
    B = estimate = min(max_batch_estimate(free, kv, act), max_batch or float("inf"))
    tries = []
    while True:
        failed = False
        try:
            row = run_decode(model, src_caches, first_token, B, P, max_len, steps)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
            if not is_oom(err) or B == 1 or len(tries) == len(BACKOFF):
                raise
            failed = True
        if not failed:
            return {**row, "batch_estimate": estimate, "oom_batches": tries}
        tries.append(B)
        free_memory()
        print(f"    batch {B}: out of memory, backing off", flush=True)
        B = max(1, int(B * BACKOFF[len(tries) - 1]))


def attempt(fn):
    """(fn(), None), or (None, the error's first line) when it runs out of memory or fails on the
    device; memory is freed once the exception (and the frames it holds) is gone."""
    try:
        return fn(), None
    except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
        text = (str(err).splitlines() or [type(err).__name__])[0]
    free_memory()
    return None, text


def kv_read(cfg, method: str, P: int, steps: int, row: dict, copy_GBps: float) -> dict:
    """A decode row's KV read bytes per step, GB/s and % of the copy bandwidth."""
    nbytes = kv_read_bytes(cfg, METHODS[method], timed_positions(P, steps), row["batch"], DTYPE.itemsize)
    gbps = nbytes / (row["ms"] * 1e-3) / 1e9
    return {"kv_read_bytes_per_step": nbytes, "kv_read_GBps": gbps, "kv_read_pct_of_copy": 100 * gbps / copy_GBps}


def run_context(model, method, attention, P, args, budget, base, t_start, copy_GBps) -> list[dict]:
    """The prefill and every decode batch of one (size, method, context)."""
    max_len = P + 1 + WARM_REPLAYS + args.steps
    out, err = attempt(lambda: run_prefill(model, method, P, max_len, args.reps, args.seed))
    if err:
        print(f"{base['size']} {method} P={P}: prefill failed: {err}", flush=True)
        return [{**base, "kind": "prefill", "batch_label": "1", "error": err}]
    row, src, first = out
    rows = [{**base, **row}]
    print(f"{base['size']:13s} {method:12s} P={P:6d} prefill {row['ms']:9.2f} ms  peak "
          f"{row['peak_bytes'] / GiB:6.1f} GiB   [{time.time() - t_start:5.0f} s]", flush=True)
    for label in args.batches:
        if label == "max":
            r, err = attempt(lambda: run_max_batch(model, src, first, P, max_len, args.steps, budget, attention))
        else:
            r, err = attempt(lambda: run_decode(model, src, first, int(label), P, max_len, args.steps))
        if err:
            print(f"{base['size']} {method} P={P} batch {label}: failed: {err}", flush=True)
            rows.append({**base, "kind": "decode", "batch_label": label, "error": err})
            continue
        r.update(kv_read(model.cfg, method, P, args.steps, r, copy_GBps))
        rows.append({**base, **r, "batch_label": label})
        ok = r["finite"] and r["lengths_ok"]
        print(f"{'':36s} decode B={r['batch']:5d} {r['ms']:7.2f} ms/step {r['tokens_per_s']:10.0f} tok/s  KV "
              f"{r['kv_bytes_per_seq'] / MiB:8.1f} MiB/seq  read {r['kv_read_GBps']:6.0f} GB/s "
              f"({r['kv_read_pct_of_copy']:.0f}% of copy)  peak {r['peak_bytes'] / GiB:6.1f} GiB"
              f"{'' if ok else '  CHECK FAILED'}   [{time.time() - t_start:5.0f} s]", flush=True)
        free_memory()
    del src, first
    free_memory()
    return rows


def run(args, save, copy_GBps: float) -> list[dict]:
    """Every case of `args`; `save(rows)` is called with the rows so far after each (size, method,
    context), so a run cut short keeps what it finished."""
    from common import env_info
    total = torch.cuda.get_device_properties(0).total_memory
    budget = min(int(args.budget_gb * 1e9), total)
    torch.cuda.set_per_process_memory_fraction(budget / total)
    env = env_info()
    rows = []
    t_start = time.time()
    for size in args.sizes:
        cfg = LLAMA_SHAPES[size]
        model = LlamaLM(cfg, device=DEVICE, dtype=DTYPE, seed=args.seed)
        exact = exact_decode_kernel(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) if "sdpa" in args.methods else None
        for method in args.methods:
            kw = dict(METHODS[method])
            attention = kw.pop("attention")
            if attention == "sdpa":
                kw["decode"] = exact
            model.set_attention(attention, **kw)
            for P in args.contexts:
                base = {"size": size, "method": method, "context": P, "settings": METHODS[method],
                        "decode_kernel": kw.get("decode", "eva"), **env, **provenance()}
                rows += run_context(model, method, attention, P, args, budget, base, t_start, copy_GBps)
                save(rows)
        del model
        free_memory()
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(LLAMA_SHAPES), choices=list(LLAMA_SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS), help="prompt lengths")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--batches", nargs="+", default=list(BATCHES), help="decode batch sizes; 'max': the largest "
                    "that fits the budget")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (replays) per case")
    ap.add_argument("--reps", type=int, default=3, help="timed prefills per case (median)")
    ap.add_argument("--budget-gb", type=float, default=120.0, help="memory budget in GB (1e9 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<device>)")
    ap.add_argument("--macs-only", action="store_true", help="print the ideal prefill speedups and exit")
    ap.add_argument("--plot-only", action="store_true", help="rewrite the tables and plots from the JSON and exit")
    args = ap.parse_args(argv)
    for b in args.batches:
        if b != "max" and not (b.isdigit() and int(b) > 0):
            ap.error(f"--batches takes positive integers or 'max', got {b!r}")
    if args.steps < 1 or args.reps < 1 or min(args.contexts) < 1:
        ap.error("--steps, --reps and every context must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    macs = macs_rows(args.sizes, args.contexts, args.methods)
    print_macs(macs)
    if args.macs_only:
        return 0
    from common import RESULTS, load_ceilings, results_dir
    if args.plot_only:  # the given folder, else every results folder that has this benchmark's JSON
        paths = [args.out / f"{NAME}.json"] if args.out else sorted(RESULTS.glob(f"*/{NAME}.json"))
        for path in paths:
            for p in render(json.loads(path.read_text()), path.parent):
                print(f"wrote {p}")
        return 0
    if not torch.cuda.is_available():
        print("the generation benchmark needs a CUDA GPU (--macs-only and --plot-only run without one)")
        return 2
    folder = args.out or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{NAME}.json"
    ceilings = load_ceilings(folder)

    def save(rows):
        data = merge(path, rows, macs)
        data["ceilings"] = {k: ceilings[k] for k in ("copy_GBps", "source")}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
        return data

    rows = run(args, save, ceilings["copy_GBps"])
    data = save(rows)
    print(f"wrote {path}")
    for p in render(data, folder):
        print(f"wrote {p}")
    bad = [r for r in rows if r.get("error") or r.get("finite") is False or r.get("lengths_ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
