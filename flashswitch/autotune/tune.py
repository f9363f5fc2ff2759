"""The autotune sweep: time every config of every kernel backend on each tuning bucket, keep the
fastest config whose output is right, and record per bucket which backend `backend="auto"` uses.

For each op (flashswitch.registry), shape (space.TUNE_SHAPES) and dtype:
  1. build a random problem on the GPU and its bucket (`problem_features`);
  2. for each kernel backend that can run here, time each config of `space.config_space` with
     `triton.testing.do_bench` (median of CUDA-event timings); a config that fails to compile or run
     is skipped and its error recorded; the fastest few are timed again in interleaved rounds and
     ranked by their median (FINAL_ROUNDS);
  3. run the fastest config again on NaN-poisoned outputs and compare it with an fp64 reference
     (SPEC tolerance rule); a wrong config is recorded and the next fastest is tried, so a wrong
     config is never saved;
  4. time the PyTorch reference too: "best" is the fastest of the kernels and the reference, so
     "auto" never picks something slower than the reference.
The results are merged into `<out_dir>/<device>.json` (other ops and buckets are kept) and written
atomically after every bucket, so a run stopped by the budget or Ctrl-C keeps what it finished.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from flashswitch import backends as BK
from flashswitch import registry
from flashswitch.autotune import space, store

KERNEL_BACKENDS = BK.KERNELS
DEFAULT_BUDGET_S = 480.0
MAX_RECORDED_FAILURES = 10
RUNNERS_UP = 4  # the next-fastest configs kept beside the winner: how close the race was
# The sweep's fastest configs are timed again in this many interleaved rounds and ranked by their
# median: one timing per config, taken between compiles on a card whose clock follows its power,
# picks the luckiest draw (the minimum over dozens of configs 4-7% apart, measured on the H200)
FINAL_ROUNDS = 5

# time_fn(fn, *, backend, config) -> milliseconds (median); the default is `bench_ms`
TimeFn = Callable[..., float]


# ---------------------------------------------------------------- timing
def bench_ms(fn: Callable[[], object], *, warmup: int = 10, rep: int = 40, **_label) -> float:
    """Median time of `fn()` in ms from CUDA events (`triton.testing.do_bench`, L2 flushed between runs)."""
    from triton.testing import do_bench
    try:
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except TypeError:  # a triton without return_mode: the 0.5 quantile is the median
        out = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])
        return float(out[0] if isinstance(out, (list, tuple)) else out)


def _short(err: BaseException, limit: int = 300) -> str:
    msg = f"{type(err).__name__}: {err}".strip().replace("\n", " ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


@contextlib.contextmanager
def poisoned():
    """FLASHSWITCH_POISON=1 inside the block: kernel outputs start as NaN, unwritten elements show."""
    old = os.environ.get("FLASHSWITCH_POISON")
    os.environ["FLASHSWITCH_POISON"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASHSWITCH_POISON", None)
        else:
            os.environ["FLASHSWITCH_POISON"] = old


# ---------------------------------------------------------------- the sweep of one backend
def sweep_configs(configs: Iterable[dict], make_fn: Callable[[dict], Callable[[], object]],
                  time_fn: Callable[[Callable[[], object], dict], float], *,
                  verify: Optional[Callable[[dict], None]] = None, deadline: Optional[float] = None,
                  on_config: Optional[Callable[[dict], None]] = None, final_rounds: int = FINAL_ROUNDS) -> dict:
    """Time each config, then return the fastest one that passes `verify`.

    `make_fn(config)` gives the callable to time; `time_fn(fn, config)` its median ms; `verify(config)`
    raises when the config's output is wrong. Configs whose build, run or timing raises, or whose
    time is not a positive finite number, are skipped. Stops timing at `deadline`
    (time.monotonic()). The 1 + RUNNERS_UP fastest are then timed `final_rounds` more times, round by
    round (each config once per round, so that drift hits them alike), and ranked by the median of
    those rounds, which is the "ms" they report (a config failing there drops out of the final).
    Returns {"config", "ms", "timed", "runners_up", "failed", "complete"} with
    "config" None when no config was both timed and verified; "runners_up" lists {"config", "ms"} of the
    next RUNNERS_UP fastest timed configs; "failed" lists {"config", "error"}.
    """
    timed: list[tuple[float, int, dict]] = []
    failed: list[dict] = []
    complete = True
    for i, cfg in enumerate(configs):
        if deadline is not None and time.monotonic() > deadline:
            complete = False
            break
        try:
            timed.append((_timed_ms(time_fn, make_fn(cfg), cfg), i, cfg))
        except KeyboardInterrupt:
            raise
        except Exception as err:  # a config that does not compile / launch / fit is just skipped
            failed.append({"config": cfg, "error": _short(err)})
        if on_config is not None:
            on_config(cfg)
    timed.sort(key=lambda t: (t[0], t[1]))
    if final_rounds > 0 and len(timed) > 1:
        timed = _final(timed, make_fn, time_fn, final_rounds, failed)
    best = {"config": None, "ms": None, "timed": len(timed), "runners_up": [], "failed": failed,
            "complete": complete}
    for rank, (ms, _, cfg) in enumerate(timed):
        if verify is not None:
            try:
                verify(cfg)
            except KeyboardInterrupt:
                raise
            except Exception as err:
                failed.append({"config": cfg, "error": "wrong result: " + _short(err)})
                continue
        best.update(config=cfg, ms=ms,
                    runners_up=[{"config": c, "ms": m} for m, _, c in timed[rank + 1:rank + 1 + RUNNERS_UP]])
        break
    return best


def _timed_ms(time_fn, fn, cfg: dict) -> float:
    """time_fn(fn, cfg), which must be a positive finite number of ms."""
    ms = float(time_fn(fn, cfg))
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"timing gave {ms}")
    return ms


def _final(timed: list, make_fn, time_fn, rounds: int, failed: list) -> list:
    """`timed` (sorted (ms, index, config)) with its first 1 + RUNNERS_UP entries re-timed in `rounds`
    interleaved rounds and re-ranked by their median; the rest keep their sweep times behind them."""
    head, tail = timed[:1 + RUNNERS_UP], timed[1 + RUNNERS_UP:]
    fns = [make_fn(cfg) for _, _, cfg in head]
    times: list[list[float]] = [[] for _ in head]
    dropped: set[int] = set()
    for _ in range(rounds):
        for j, (fn, (_, _, cfg)) in enumerate(zip(fns, head)):
            if j in dropped:
                continue
            try:
                times[j].append(_timed_ms(time_fn, fn, cfg))
            except KeyboardInterrupt:
                raise
            except Exception as err:
                dropped.add(j)
                failed.append({"config": cfg, "error": "final round: " + _short(err)})
    final = sorted((statistics.median(times[j]), i, cfg)
                   for j, (_, i, cfg) in enumerate(head) if j not in dropped)
    return final + tail


def choose_best(times: dict) -> Optional[str]:
    """The backend with the smallest time; on a tie the reference, then the order of `times`.

    `times` maps backend -> ms (None / missing for a backend that has no valid config)."""
    valid = [(ms, 0 if b == "reference" else 1, i, b) for i, (b, ms) in enumerate(times.items())
             if ms is not None and math.isfinite(ms)]
    return min(valid)[3] if valid else None


# ---------------------------------------------------------------- headers and files
def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    try:
        import flashswitch
        out["flashswitch"] = flashswitch.__version__
    except Exception:
        pass
    return out


def device_header(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, cap, sms = props.name, list(torch.cuda.get_device_capability(device)), props.multi_processor_count
    else:
        name, cap, sms = "cpu", None, None
    return {"device": name, "capability": cap, "sm_count": sms, "versions": versions()}


def _read_existing(path: Path) -> dict:
    """The file's current table to merge into ({"ops": {}} when missing or unreadable)."""
    if not path.exists():
        return {"ops": {}}
    import copy
    data = store.load(path)  # warns and gives {"ops": {}} on a corrupt file
    return copy.deepcopy(data)


def _problem_str(shape: dict, dtype: str) -> str:
    return f"{registry.describe(shape)} {dtype}"


# ---------------------------------------------------------------- the tuner
def _kernel_backends(device: torch.device, backends: Optional[Sequence[str]]) -> list[str]:
    names = KERNEL_BACKENDS if backends is None else [b for b in backends if b != "reference"]
    for b in names:
        if b not in KERNEL_BACKENDS:
            raise ValueError(f"backend must be one of {KERNEL_BACKENDS}, got {b!r}")
    return BK.usable(device, names)


def _verify_fn(spec: registry.OpSpec, backend: str, problem: dict, dtype: torch.dtype, expected: tuple,
               baseline: tuple) -> Callable[[dict], None]:
    from flashswitch.testing import assert_close, rule_dtype

    def verify(cfg: dict) -> None:
        with poisoned():
            outs = spec.kernel_outputs(backend, cfg, problem)
        if len(outs) != len(expected):
            raise AssertionError(f"{len(outs)} outputs, expected {len(expected)}")
        names = spec.output_names(len(outs), problem)
        for name, out, ref, base in zip(names, outs, expected, baseline):
            assert_close(name, out, ref, rule_dtype(name, dtype), baseline=base)
    return verify


class _Progress:
    """A rich progress bar (or nothing): one line for buckets, one for the configs of a backend."""

    def __init__(self, enabled: bool, n_buckets: int):
        self.bar = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), transient=False)
        self.bar.start()
        self.buckets = self.bar.add_task("buckets", total=n_buckets)
        self.configs = self.bar.add_task("configs", total=1)

    def backend(self, label: str, n: int):
        if self.bar:
            self.bar.reset(self.configs, total=max(n, 1), description=label)

    def config(self):
        if self.bar:
            self.bar.advance(self.configs)

    def bucket(self, label: str):
        if self.bar:
            self.bar.update(self.buckets, description=label)

    def bucket_done(self):
        if self.bar:
            self.bar.advance(self.buckets)

    def log(self, msg: str):
        if self.bar:
            from rich.markup import escape
            self.bar.console.print(escape(msg))

    def stop(self):
        if self.bar:
            self.bar.stop()


def tune(ops: Optional[Sequence[str]] = None, backends: Optional[Sequence[str]] = None, shapes=None,
         dtypes: Sequence[str] = ("bf16", "fp16"), budget_s: float = DEFAULT_BUDGET_S,
         out_dir: Optional[os.PathLike] = None, *, device=None, time_fn: Optional[TimeFn] = None,
         progress: bool = True, seed: int = 0, resume: bool = False,
         log: Optional[Callable[[str], None]] = None) -> dict:
    """Sweep, pick, verify and save; returns {"path": Path, "data": the whole file, "buckets": n tuned}.

    `ops`: registry names (default all). `backends`: kernel backends to sweep (default all that can
    run here). `shapes`: a list of `random_problem` shape dicts used for every op, or {op: list}
    (default `space.TUNE_SHAPES`). `dtypes`: "bf16" / "fp16" / "fp32". `budget_s`: wall-clock budget;
    when spent, the tuner stops timing and keeps the buckets it finished (a bucket cut short is kept
    only when one of its backends has a verified config, and is marked "complete": false).
    `out_dir`: folder of `<device>.json` (default `store.config_dir()`). `device`: default "cuda".
    `time_fn(fn, backend=, config=) -> ms`: default `bench_ms` (CUDA events). `resume`: skip buckets
    the file already holds complete (to continue a run that its budget cut short).
    """
    device = torch.device(device if device is not None else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("autotuning needs a CUDA GPU (torch.cuda.is_available() is False)")
    time_fn = time_fn or bench_ms
    header = device_header(device)
    folder = Path(out_dir) if out_dir is not None else store.config_dir()
    path = store.device_file(header["device"], folder=folder)
    data = _read_existing(path)
    data.setdefault("ops", {})
    specs = registry.select(ops)
    kernels = _kernel_backends(device, backends)
    dtypes = [d for d in dtypes]
    for d in dtypes:
        if d not in registry.DTYPES:
            raise ValueError(f"dtype must be one of {list(registry.DTYPES)}, got {d!r}")

    def shapes_of(op: str) -> list[dict]:
        if shapes is None:
            return list(space.TUNE_SHAPES.get(op, []))
        if isinstance(shapes, dict):
            return list(shapes.get(op, []))
        return list(shapes)

    plan = [(spec, shape, dt) for spec in specs for shape in shapes_of(spec.name) for dt in dtypes]
    t0 = time.monotonic()
    deadline = t0 + float(budget_s)
    bar = _Progress(progress, len(plan))
    say = log or (bar.log if bar.bar else (lambda m: print(m, file=sys.stderr)))
    tuned = 0
    stopped = None
    try:
        for spec, shape, dt in plan:
            if time.monotonic() > deadline:
                stopped = "budget"
                break
            label = f"{spec.name} {_problem_str(shape, dt)}"
            bar.bucket(label)
            problem = spec.random_problem(**shape, dtype=dt, device=device, seed=seed)
            old = data["ops"].get(spec.name, {}).get(store.bucket_key(spec.features(problem)))
            if resume and old is not None and old.get("complete") and _same_spaces(spec, problem, kernels, old):
                bar.bucket_done()
                say(f"[kept] {label}: already tuned (best {old.get('best')})")
                continue
            record = _tune_bucket(spec, problem, shape, dt, kernels, time_fn, deadline, bar)
            del problem
            bar.bucket_done()
            if record is None:
                say(f"[skip] {label}: no backend produced a verified result")
                continue
            _keep_unswept(record, old)
            tuned += 1
            data = _save({spec.name: {store.bucket_key(record["features"]): record}}, header, budget_s, path)
            b = record["best"]
            say(f"[ok] {label}: best {b} {record['backends'][b]['ms']:.4f} ms"
                + ("" if record["complete"] else " (budget spent mid-bucket)"))
            if not record["complete"]:
                stopped = "budget"
                break
    except KeyboardInterrupt:
        stopped = "interrupted"
        say("interrupted: keeping the buckets finished so far")
    finally:
        bar.stop()
    if stopped == "budget":
        say(f"time budget of {budget_s:.0f} s spent: kept {tuned} of {len(plan)} buckets")
    if tuned:
        data = _save({}, header, budget_s, path)
    return {"path": path, "data": data, "buckets": tuned, "planned": len(plan), "stopped": stopped}


def space_digest(configs: list) -> str:
    """A short digest of a config space, recorded with each swept backend's result: `--resume` tunes a
    bucket again when its space has changed since (a new config option, other tiles)."""
    return hashlib.sha1(json.dumps(configs, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _same_spaces(spec, problem: dict, kernels, old: dict) -> bool:
    """Whether no kernel backend that `old` holds a result of, among those swept now, was swept over
    another space than it has now (entries recorded before digests were kept count as the same)."""
    feats = spec.features(problem)
    for backend in [b for b in kernels if b in spec.kernel_backends]:
        rec = old.get("backends", {}).get(backend)
        if isinstance(rec, dict) and "space" in rec and \
                rec["space"] != space_digest(space.config_space(spec.name, backend, feats)):
            return False
    return True


def _keep_unswept(record: dict, old: Optional[dict]) -> None:
    """Backends this run did not sweep (e.g. `--backends triton`) keep their entries from the file;
    "best" is then chosen over all of them."""
    if not old or not isinstance(old.get("backends"), dict):
        return
    kept = {b: e for b, e in old["backends"].items() if b not in record["backends"]}
    if kept:
        record["backends"].update(kept)
        record["best"] = choose_best({b: e["ms"] for b, e in record["backends"].items()})


def _save(tables: dict, header: dict, budget_s: float, path: Path) -> dict:
    """Merge the buckets just tuned into the file (store.update: other writers' buckets are kept)."""
    stamp = {**header, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
             "budget_s": float(budget_s)}
    return store.update(path, tables, stamp)


def _tune_bucket(spec: registry.OpSpec, problem: dict, shape: dict, dt: str, kernels: list[str],
                 time_fn: TimeFn, deadline: float, bar: _Progress) -> Optional[dict]:
    """One bucket: sweep each kernel backend, time the reference, verify, choose. None if nothing valid."""
    dtype = registry.DTYPES[dt]
    feats = spec.features(problem)
    expected = spec.accurate_outputs(problem)
    baseline = spec.torch_outputs(problem)
    per_backend: dict = {}
    failures: dict = {}
    complete = True
    for backend in [b for b in kernels if b in spec.kernel_backends]:
        configs = space.config_space(spec.name, backend, feats)
        bar.backend(f"{backend} ({len(configs)} configs)", len(configs))
        result = sweep_configs(
            configs,
            make_fn=lambda cfg, b=backend: spec.kernel_callable(b, cfg, problem),
            time_fn=lambda fn, cfg, b=backend: time_fn(fn, backend=b, config=cfg),
            verify=_verify_fn(spec, backend, problem, dtype, expected, baseline),
            deadline=deadline, on_config=lambda cfg: bar.config())
        complete = complete and result["complete"]
        if result["failed"]:
            failures[backend] = {"count": len(result["failed"]),
                                 "first": result["failed"][:MAX_RECORDED_FAILURES]}
        if result["config"] is not None:
            per_backend[backend] = {"config": result["config"], "ms": result["ms"], "timed": result["timed"],
                                    **spec.throughput(problem, result["ms"]), "runners_up": result["runners_up"],
                                    "space": space_digest(configs)}
        if not result["complete"]:
            break
    if not per_backend:  # no kernel gave a verified config: record nothing for this bucket
        return None
    try:
        ref_ms = float(time_fn(spec.torch_callable(problem), backend="reference", config={}))
        per_backend["reference"] = {"config": {}, "ms": ref_ms, **spec.throughput(problem, ref_ms)}
    except KeyboardInterrupt:
        raise
    except Exception as err:
        failures["reference"] = {"count": 1, "first": [{"config": {}, "error": _short(err)}]}
    best = choose_best({b: e["ms"] for b, e in per_backend.items()})
    return {"features": feats, "shape": _json_shape(shape), "dtype": dt, "best": best, "backends": per_backend,
            "failures": failures, "complete": complete}


def _json_shape(shape: dict) -> dict:
    """The tune shape as the config file records it: torch dtypes (fp32 master weights) by name."""
    return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for k, v in shape.items()}


__all__ = ["tune", "sweep_configs", "choose_best", "bench_ms", "device_header", "versions"]
