"""`flashswitch <command>` (in a checkout `./fs <command>`; also `python -m flashswitch <command>`):
demo | info | check | bench | autotune | generate | test.

  demo      run each op on a small problem on this machine; the default command
  info      versions, GPU, which backends can run (and why not), tuned-config files, environment
  check     every op x backend x dtype on random problems, NaN-poisoned outputs, vs the fp64 oracle
  bench     the pytest-benchmark suite in bench/ops/ (JSON + plot + table in bench/results/<device>/),
            or --quick: a timing table printed here
  autotune  sweep the kernels' configs on this GPU and write the tuned-config file
  generate  greedy text from a pretrained model (flashswitch.nn.pretrained) with EVA or exact attention,
            streamed as it decodes (CUDA-graph steps on a GPU)
  test      the checkout's test suite: pytest tests/, every argument after `test` passed to pytest

Every op comes from `flashswitch.registry`; nothing here names a particular op.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ENV_VARS = ("FLASHSWITCH_BACKEND", "FLASHSWITCH_CONFIG_DIR", "FLASHSWITCH_POISON", "FLASHSWITCH_SKIP_CUDA_BUILD",
            "TRITON_INTERPRET", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS",
            "HYPOTHESIS_PROFILE")
REPO_ROOT = Path(__file__).resolve().parent.parent


def _prog() -> str:
    """How the user runs this command, for the usage line and the hints we print: `./fs` sets
    FLASHSWITCH_PROG to the path it was run by; else the console script's name."""
    return os.environ.get("FLASHSWITCH_PROG") or "flashswitch"


# ---------------------------------------------------------------- output
def _console():
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else 140, highlight=False)


def _table(title: str, columns: Sequence[str]):
    from rich.table import Table
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def _e(text) -> str:
    """`text` with rich markup escaped (messages and shapes may contain [brackets])."""
    from rich.markup import escape
    return escape(str(text))


def _fmt_err(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "nan/inf" if x != x or x == float("inf") else f"{x:.2e}"


# ---------------------------------------------------------------- environment facts
def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def backend_status(backend: str, device) -> tuple[bool, str]:
    """(usable for tensors on `device`, a one-line reason); (False, ...) for an unknown name."""
    from flashswitch import backends
    try:
        return backends.status(backend, device)
    except ValueError:
        return False, "unknown backend"


def usable_kernel_backends(device) -> list[str]:
    from flashswitch import backends
    return backends.usable(device, backends.KERNELS)


# ---------------------------------------------------------------- info
def cmd_info(args) -> int:
    import torch
    import flashswitch
    from flashswitch.autotune import store
    from flashswitch import backends, registry

    con = _console()
    con.print(f"[bold]flashswitch {flashswitch.__version__}[/bold]  ({Path(flashswitch.__file__).parent})")
    con.print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
              f"triton {backends.triton_version() or 'not installed'}  cupy {backends.cupy_version() or 'not installed'}")
    device = _device()
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            con.print(f"GPU {i}: {p.name}, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
                      f"{p.total_memory / 2**30:.0f} GiB")
    else:
        con.print("GPU: none visible (torch.cuda.is_available() is False): kernels run only under "
                  "TRITON_INTERPRET=1; the references always run")
    t = _table(f"backends for tensors on {device.type}", ["backend", "usable", "why"])
    for b in backends.NAMES:
        ok, why = backend_status(b, device)
        t.add_row(b, "yes" if ok else "no", _e(why))
    con.print(t)
    con.print(f"ops: {', '.join(registry.OPS)}")
    folder = store.config_dir()
    src = "FLASHSWITCH_CONFIG_DIR" if os.environ.get("FLASHSWITCH_CONFIG_DIR") else "package default"
    con.print(f"config folder: {folder} ({src})")
    files = store.config_files(folder)
    mine = store.device_file()
    for f in files:
        try:
            data = store.load(f)
            ops = ", ".join(f"{op} ({len(tab)} buckets)" for op, tab in data.get("ops", {}).items()) or "empty"
        except Exception as err:
            ops = f"unreadable: {err}"
        mark = "  <- this device" if mine is not None and f == mine else ""
        con.print(_e(f"  {f.name}: {ops}{mark}"))
    if not files:
        con.print(f"  no tuned-config files (heuristic defaults are used; `{_prog()} autotune` makes one)")
    elif mine is not None and not mine.exists():
        con.print(f"  none for this device ({mine.name}): heuristic defaults are used")
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("FLASHSWITCH_") and k not in env})
    con.print(_e("environment: " + (", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none of "
                                    + ", ".join(ENV_VARS[:5]) + " set")))
    return 0


# ---------------------------------------------------------------- check
def _compare(spec, outs, oracle, baseline, dtype, *, use_baseline: bool, problem=None):
    """(max relative error, failure message or None) of `outs` (of a problem with `dtype` inputs)
    against the oracle."""
    from flashswitch.testing import assert_close, rel_error, rule_dtype
    if len(outs) != len(oracle):
        return None, f"{len(outs)} outputs, expected {len(oracle)}"
    worst, msg = 0.0, None
    for name, out, ref, base in zip(spec.output_names(len(outs), problem), outs, oracle, baseline):
        err = rel_error(out, ref)
        worst = max(worst, err) if err == err else float("inf")
        try:
            assert_close(name, out, ref, rule_dtype(name, dtype), baseline=base if use_baseline else None)
        except AssertionError as e:
            msg = msg or str(e)
    return worst, msg


def cmd_check(args) -> int:
    import torch
    from flashswitch import registry
    from flashswitch.backends import NAMES
    from flashswitch.autotune.tune import poisoned

    con = _console()
    device = _device()
    specs = registry.select(args.ops)
    kernels = usable_kernel_backends(device)
    backends = ["reference"] + kernels
    if args.backends:
        unknown = set(args.backends) - set(NAMES)
        if unknown:
            con.print(f"unknown backend(s): {', '.join(sorted(unknown))}")
            return 2
        backends = [b for b in backends if b in args.backends]
    dtypes = args.dtypes or (["bf16", "fp16", "fp32"] if device.type == "cuda" else ["fp32", "fp16", "bf16"])
    con.print(f"checking {', '.join(s.name for s in specs)} on {device.type}: backends {', '.join(backends)}; "
              f"dtypes {', '.join(dtypes)}; outputs NaN-poisoned; oracle: fp64 NumPy")
    if device.type == "cpu" and not kernels:
        con.print("(no kernel backend runs here: set TRITON_INTERPRET=1 to check the Triton kernels on CPU)")
    t = _table("flashswitch check", ["op", "backend", "dtype", "problem", "max rel err", "result"])
    failures = []
    n_pass = n_skip = 0
    with poisoned():
        for spec in specs:
            for case in spec.check_cases:
                for trial in range(args.trials):
                    seed = args.seed + trial
                    for dt in dtypes:
                        problem = spec.random_problem(**case, dtype=dt, device=device, seed=seed)
                        label = registry.describe(case) + (f" seed={seed}" if args.trials > 1 else "")
                        oracle = spec.oracle_outputs(problem)
                        baseline = spec.torch_outputs(problem)
                        for b in [b for b in backends if b == "reference" or b in spec.kernel_backends]:
                            if b == "triton" and device.type == "cpu" and dt == "bf16":
                                n_skip += 1
                                continue  # bf16 arithmetic is missing in the Triton interpreter
                            try:
                                outs = baseline if b == "reference" else spec.kernel_outputs(b, None, problem)
                                err, msg = _compare(spec, outs, oracle, baseline, registry.DTYPES[dt],
                                                    use_baseline=b != "reference", problem=problem)
                            except Exception as e:  # a crash is a failure of that row, not of the run
                                err, msg = None, f"{type(e).__name__}: {e}"
                            ok = msg is None
                            n_pass += ok
                            if not ok:
                                failures.append(f"{spec.name} {b} {dt} [{label}]: {msg}")
                            t.add_row(spec.name, b, dt, _e(label), _fmt_err(err),
                                      "[green]pass[/green]" if ok else "[red]FAIL[/red]")
    con.print(t)
    if n_skip:
        con.print(f"{n_skip} triton bf16 rows skipped (bf16 is not supported by the Triton interpreter)")
    for f in failures:
        con.print(f"[red]FAIL[/red] {_e(f)}")
    con.print(f"{n_pass} passed, {len(failures)} failed")
    return 1 if failures else 0


# ---------------------------------------------------------------- demo
def _time_ms(fn, device, repeat: int) -> float:
    import torch
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _shapes(problem: dict) -> str:
    import torch
    return ", ".join(f"{k} {list(v.shape)}" for k, v in problem.items() if isinstance(v, torch.Tensor))


def cmd_demo(args) -> int:
    import torch
    from flashswitch import registry
    from flashswitch.ops import call_plan
    from flashswitch.testing import assert_close, rel_error, rule_dtype

    con = _console()
    device = _device()
    dt = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    kernels = usable_kernel_backends(device)
    con.print(f"flashswitch demo on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} "
              f"({dt}); backends here: reference{''.join(', ' + b for b in kernels)}")
    if device.type == "cpu" and not kernels:
        con.print("(kernels need a GPU; set TRITON_INTERPRET=1 to also run the Triton kernels on CPU)")
    bad = 0
    for spec in registry.select(args.ops):
        problem = spec.random_problem(**spec.demo_case, dtype=dt, device=device, seed=args.seed)
        bucket = spec.features(problem) if device.type == "cuda" else None
        try:
            auto = call_plan.resolve_backend(spec.name, "auto", device, bucket, spec.kernel_backends)
        except Exception as err:
            auto = f"? ({err})"
        con.print(f"\n[bold]{spec.name}[/bold]  {registry.describe(spec.demo_case)}")
        con.print(_e(f"  inputs: {_shapes(problem)}"))
        con.print(_e(f"  backend='auto' picks: {auto}"))
        oracle = spec.oracle_outputs(problem)
        baseline = spec.torch_outputs(problem)
        t = _table("", ["backend", "outputs", "max rel err vs fp64", "ok", "ms"])
        for b in ["reference"] + [k for k in kernels if k in spec.kernel_backends]:
            fn = spec.torch_callable(problem) if b == "reference" else spec.kernel_callable(b, None, problem)
            try:
                outs = registry.as_tuple(fn())
                err = max(rel_error(o, r) for o, r in zip(outs, oracle)) if outs else 0.0
                for name, o, r, base in zip(spec.output_names(len(outs), problem), outs, oracle, baseline):
                    assert_close(name, o, r, rule_dtype(name, registry.DTYPES[dt]),
                                 baseline=None if b == "reference" else base)
                ok = "yes"
                ms = _time_ms(fn, device, 5 if device.type == "cuda" or b == "reference" else 2)
                shapes = "  ".join(f"{n} {list(o.shape)}" for n, o in zip(spec.output_names(len(outs), problem), outs))
            except Exception as e:
                bad += 1
                t.add_row(b + (" (auto)" if b == auto else ""), "-", "-",
                          f"[red]{_e(type(e).__name__)}: {_e(e)}[/red]", "-")
                continue
            t.add_row(b + (" (auto)" if b == auto else ""), _e(shapes), _fmt_err(err), ok, f"{ms:.3f}")
        con.print(t)
    prog = _prog()
    con.print(f"\nmore: {prog} info | check | bench | autotune | generate   ({prog} <command> --help)")
    return 1 if bad else 0


# ---------------------------------------------------------------- test, bench
def _checkout_dir(name: str) -> Optional[Path]:
    """The checkout's `name` folder (tests, bench/ops), under the working directory or this package's tree."""
    for root in (Path.cwd(), REPO_ROOT):
        if (root / name / "conftest.py").exists():
            return root / name
    return None


def cmd_test(pytest_args: Sequence[str]) -> int:
    tests = _checkout_dir("tests")
    if tests is None:
        print("tests/ not found: run from the repository root (the suite is not part of the installed package)",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "pytest", str(tests), *pytest_args], cwd=str(tests.parent))


def _device_slug() -> str:
    from flashswitch.autotune import store
    name = store.device_name()
    return store.device_slug(name) if name else "cpu"


def cmd_bench(args) -> int:
    import torch
    from flashswitch import registry

    con = _console()
    if args.quick:
        return _quick_bench(con, registry.select(args.ops), args)
    ops_dir = _checkout_dir("bench/ops")  # the pytest-benchmark files; bench/tools has plot.py and ceilings.py
    if ops_dir is None:
        con.print("bench/ops/ not found: run from the repository root (the suite is not part of the installed package)")
        return 2
    if not torch.cuda.is_available():  # every case would skip: write no result files either
        con.print("the benchmark suite times CUDA kernels and needs a GPU; none is visible")
        return 2
    bench, tools = ops_dir.parent, ops_dir.parent / "tools"
    out = Path(args.out) if args.out else bench / "results" / _device_slug()
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    if args.ceilings:
        rc |= subprocess.call([sys.executable, str(tools / "ceilings.py"), "--out", str(out)])
    for spec in registry.select(args.ops):
        file = ops_dir / f"bench_{spec.slug}.py"
        if not file.exists():
            con.print(f"{file} missing: no benchmark for {spec.name}")
            continue
        js = out / f"{spec.slug}.json"
        cases = out / f"{spec.slug}.cases.jsonl"  # every finished case, also when the run is cut short
        cases.write_text("")
        js.unlink(missing_ok=True)  # a table of an earlier run must not stand in for this one
        cmd = [sys.executable, "-m", "pytest", str(file), "-q", "-p", "no:cacheprovider",
               f"--benchmark-json={js}", *args.pytest_args]
        con.print("$ " + " ".join(cmd))
        r = subprocess.call(cmd, cwd=str(bench.parent), env={**os.environ, "FLASHSWITCH_BENCH_CASES": str(cases)})
        rc |= r
        if js.exists() and js.stat().st_size:
            rc |= subprocess.call([sys.executable, str(tools / "plot.py"), str(js)])
        elif cases.stat().st_size:
            rc |= subprocess.call([sys.executable, str(tools / "plot.py"), str(cases)])
    return 1 if rc else 0


def _quick_bench(con, specs, args) -> int:
    import torch
    from flashswitch import registry
    from flashswitch.autotune.tune import bench_ms

    if not torch.cuda.is_available():
        con.print("bench --quick times CUDA kernels and needs a GPU; none is visible")
        return 2
    device = torch.device("cuda")
    kernels = usable_kernel_backends(device)
    t = _table(f"flashswitch bench --quick on {torch.cuda.get_device_name()} (do_bench median)",
               ["op", "problem", "dtype", "backend", "ms", "throughput", "vs reference"])
    for spec in specs:
        for shape in spec.bench_shapes:
            problem = spec.random_problem(**shape, dtype=args.dtype or "bf16", device=device)
            ref_ms = None
            for b in ["reference"] + [k for k in kernels if k in spec.kernel_backends]:
                fn = spec.torch_callable(problem) if b == "reference" else spec.kernel_callable(b, None, problem)
                try:
                    ms = bench_ms(fn)
                except Exception as e:
                    t.add_row(spec.name, registry.describe(shape), problem_dtype(problem), b,
                              f"{type(e).__name__}", "-", "-")
                    continue
                ref_ms = ms if b == "reference" else ref_ms
                thr = spec.throughput(problem, ms)
                thr_s = "  ".join(f"{v:.1f} {k}" for k, v in thr.items())
                t.add_row(spec.name, registry.describe(shape), problem_dtype(problem), b, f"{ms:.4f}", thr_s,
                          f"{ref_ms / ms:.2f}x" if ref_ms else "-")
            del problem
    con.print(t)
    return 0


def problem_dtype(problem: dict) -> str:
    import torch
    from flashswitch._common import DTYPE_NAMES
    for v in problem.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return DTYPE_NAMES.get(v.dtype, str(v.dtype))
    return "-"


# ---------------------------------------------------------------- autotune
def cmd_autotune(args) -> int:
    import torch
    from flashswitch.nn.llama import LLAMA_SHAPES
    con = _console()
    if args.model is not None and args.model not in LLAMA_SHAPES:
        con.print(f"autotune --model takes one of {', '.join(sorted(LLAMA_SHAPES))}, not {args.model!r}")
        return 2
    if not torch.cuda.is_available():
        con.print("autotune times kernels on a CUDA GPU, and none is visible (torch.cuda.is_available() is "
                  "False). Run it on the GPU machine; without a tuned file the heuristic defaults are used.")
        return 2
    from flashswitch.autotune import space
    from flashswitch.autotune.tune import tune
    shapes, ops = None, args.ops  # None: the tuner's TUNE_SHAPES
    if args.model is not None:  # the calls that model makes, derived from its config
        shapes = _model_shapes(args)
        ops = [op for op in (ops or shapes) if op in shapes]
    if args.first is not None:  # the first N shapes of each op (issue shapes come first in TUNE_SHAPES)
        shapes = {op: list(lst[:args.first]) for op, lst in (shapes or space.TUNE_SHAPES).items()}
    if args.shape is not None:  # chosen shapes of each op, by index
        shapes = {op: [lst[i] for i in args.shape if i < len(lst)] for op, lst in (shapes or space.TUNE_SHAPES).items()}
    res = tune(ops=ops, backends=args.backends, shapes=shapes, dtypes=args.dtypes, budget_s=args.budget,
               out_dir=args.out, seed=args.seed, progress=not args.no_progress, resume=args.resume)
    con.print(f"tuned {res['buckets']} of {res['planned']} buckets -> {res['path']}"
              + (f" (stopped: {res['stopped']})" if res["stopped"] else ""))
    return 0 if res["buckets"] else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _batch_by_len(text: str) -> tuple:
    """B x T written as 8x2048."""
    try:
        b, t = (_positive(v) for v in text.split("x"))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"B x T is written as 8x2048, got {text!r}") from None
    return b, t


def _model_shapes(args) -> dict:
    """autotune --model: the op calls of a shipped Llama shape (prefill at --seq-lens, training at
    --train-shapes, EVA with --chunk-size, --window-size and each of --windows)."""
    from flashswitch.autotune.model_shapes import model_shapes
    from flashswitch.nn.llama import LLAMA_SHAPES
    return model_shapes(LLAMA_SHAPES[args.model], seq_lens=args.seq_lens, train=args.train_shapes,
                        chunk_size=args.chunk_size, window_size=args.window_size, windows=args.windows,
                        dtype=args.dtypes[0])


# ---------------------------------------------------------------- generate
CHATML = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's chat format, one user turn


def cmd_generate(args) -> int:
    import torch
    from flashswitch.nn import pretrained
    from flashswitch.nn.generate import greedy

    device = torch.device(args.device) if args.device else _device()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    attention = dict(attention="sdpa")
    if args.attention == "eva":
        attention = dict(attention="eva", chunk_size=args.chunk_size, window_size=args.window_size,
                         window=args.window, summary_bias=None if args.summary_bias == "none" else args.summary_bias)
    t0 = time.perf_counter()
    model, tok = pretrained.load(args.model, device=device, dtype=dtype, **attention)
    prompt = args.prompt
    if args.chat:
        if "<|im_start|>" not in (tok.chat_template or ""):
            print("flashswitch generate: --chat writes ChatML turns, which this model's chat template does not use",
                  file=sys.stderr)
            return 2
        prompt = CHATML.format(prompt=prompt)
    ids = tok.encode(prompt)
    print(f"[{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {args.attention} "
          f"attention, {device.type} {dtype}, loaded in {time.perf_counter() - t0:.1f} s; prompt {len(ids)} tokens]",
          file=sys.stderr, flush=True)
    new, shown = [], [""]

    def show(token) -> bool:  # print the text decoded so far past what is shown (a split character waits)
        new.append(int(token[0]))
        text = tok.decode(new, skip_special=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text
        return not args.ignore_eos and new[-1] == tok.eos_id

    sys.stdout.write(args.prompt if not args.chat else "")
    out = greedy(model, [ids], args.max_new_tokens, graph=False if args.no_graph else None, on_token=show)
    sys.stdout.write("\n")
    n = out.tokens.shape[1]
    print(f"[{n} tokens; prefill {1e3 * out.prefill_s:.1f} ms; first step {1e3 * out.first_step_s:.1f} ms; then "
          f"{out.tokens_per_s:.1f} tokens/s over {out.steady_steps} {'CUDA-graph' if out.graph else 'eager'} steps]",
          file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------- argument parsing
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_prog(), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="With no command, runs `demo`.")
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="<command>")

    def ops_arg(sp):
        sp.add_argument("--ops", nargs="+", metavar="OP", help="ops to include (default: all)")

    d = sub.add_parser("demo", help="run each op on a small problem here (CPU works)")
    ops_arg(d)
    d.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 on a GPU, fp32 on CPU")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("info", help="versions, GPU, usable backends, config files, environment")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("check", help="every op/backend/dtype vs the fp64 oracle; exit 1 on any mismatch")
    ops_arg(c)
    c.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16", "fp32"))
    c.add_argument("--backends", nargs="+", metavar="B", help="reference, triton, cuda, cupy (default: all usable)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--trials", type=int, default=1, help="random problems per case (seeds seed..seed+N-1)")
    c.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="benchmark suite -> bench/results/<device>/ (or --quick table)")
    ops_arg(b)
    b.add_argument("--quick", action="store_true", help="print a do_bench table instead of the pytest suite")
    b.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="--quick only (default bf16)")
    b.add_argument("--out", help="results folder (default bench/results/<device>)")
    b.add_argument("--ceilings", action="store_true", help="measure copy/matmul ceilings first (bench/tools/ceilings.py)")
    b.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    b.set_defaults(func=cmd_bench)

    a = sub.add_parser("autotune", help="tune the kernel configs on this GPU and save them")
    ops_arg(a)
    a.add_argument("--backends", nargs="+", metavar="B", help="kernel backends (default: all usable)")
    a.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=("bf16", "fp16", "fp32"))
    a.add_argument("--budget", type=float, default=480.0, help="wall-clock seconds (default 480)")
    a.add_argument("--out", help="folder of <device>.json (default: the package's config folder)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--first", type=int, metavar="N",
                   help="tune only the first N shapes of each op (autotune/space.py TUNE_SHAPES, issue shapes first)")
    a.add_argument("--shape", type=int, nargs="+", metavar="I",
                   help="tune only these shapes of each op (indices into autotune/space.py TUNE_SHAPES)")
    a.add_argument("--resume", action="store_true",
                   help="skip buckets the file already holds complete over today's config spaces (continue a "
                        "run the budget cut short; a bucket whose space changed since is tuned again)")
    a.add_argument("--no-progress", action="store_true")
    m = a.add_argument_group("a model's calls (instead of autotune/space.py TUNE_SHAPES)")
    m.add_argument("--model", metavar="NAME", help="a shipped Llama shape (smollm2-135m, llama-1b): tune the buckets "
                   "its EVA attention hits, op 1 and op 2 forward at prefill (batch 1) and training shapes, their "
                   "backward at training ones")
    m.add_argument("--seq-lens", nargs="+", type=_positive, default=[2048, 4096, 8192, 16384, 32768],
                   help="prefill lengths (batch 1)")
    m.add_argument("--train-shapes", nargs="+", type=_batch_by_len, default=["8x2048", "2x8192"],
                   help="training steps' B x T")
    m.add_argument("--chunk-size", type=_positive, default=32)
    m.add_argument("--window-size", type=_positive, default=256)
    m.add_argument("--windows", nargs="+", choices=("sliding", "block"), default=["sliding", "block"])
    a.set_defaults(func=cmd_autotune)

    from flashswitch.nn.eva_attention import SUMMARY_BIASES  # torch is loaded already (flashswitch/__init__)
    g = sub.add_parser("generate", help="greedy text from a pretrained model, EVA or exact attention")
    g.add_argument("--model", default="smollm2-135m", help="a known model name (flashswitch.nn.pretrained) or a "
                   ".gguf path (default smollm2-135m)")
    g.add_argument("--attention", choices=("eva", "sdpa"), default="eva")
    g.add_argument("--chunk-size", type=int, default=32, help="EVA chunk size C (default 32)")
    g.add_argument("--window-size", type=int, default=256, help="EVA exact window W (default 256)")
    g.add_argument("--window", choices=("sliding", "block"), default="sliding")
    g.add_argument("--summary-bias", choices=[b or "none" for b in SUMMARY_BIASES], default="log_count",
                   help="EVA's bias on the summaries' logits (EvaAttention summary_bias): none (0); log_count (log C, "
                        "the default); off (summaries switched off: sliding-window attention with --window "
                        "sliding); learned (log C plus a learnable per-head bias, which a GGUF file does not "
                        "hold: it starts at zero, so it generates as log_count)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user turn of the chat format")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    g.add_argument("--device", help="default: cuda when a GPU is visible, else cpu")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 on a GPU, fp32 on the CPU")
    g.add_argument("--no-graph", action="store_true", help="eager decode steps on a GPU too")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("test", help="the test suite: pytest tests/ [pytest args]")
    t.set_defaults(func=lambda args: cmd_test([]))  # main() hands any arguments to pytest before parsing
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["test"]:  # the rest is pytest's, options included
        return cmd_test(argv[1:])
    args = parser.parse_args(argv)
    if args.cmd is None:
        args = parser.parse_args(["demo"] + argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # e.g. an unknown op name
        print(f"flashswitch {args.cmd}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
