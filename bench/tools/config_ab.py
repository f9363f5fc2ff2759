"""A/B of explicit configs on one tuning shape, to decide a kernel knob before it goes into the tuner's
space: per-call `do_bench` median (L2 flushed by zeroing), per-call median after a read flush
(bench/common.py `read_flush_ms`) and CUDA-graph replay (kernel time only), in rounds so that drift
hits every variant alike; each cell is the median over rounds.

    python3 bench/tools/config_ab.py eva_attention 3 '{}' '{"EVICT": true}' '{"LAZY": true}' [--rounds 5]

(op, index into autotune/space.py TUNE_SHAPES, then variants: JSON updates of the tuned config, '{}'
being the tuned config itself; bf16, triton unless --backend; --set Nk=4096 changes fields of the
shape, whose config is then the one the store gives that bucket.) A JSON string names a baseline of the
op's bench suite (bench/ops/bench_<op>.py BUILDERS), timed in the same rounds: '"flex"' for eva_attention
pairs the kernel with FlexAttention under the same clocks and temperature. For expert_matmul the
variant '"route"' times route() alone (keys, sort, offsets), the rest of a call being the kernels.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR / "ops")]  # `import common`, the bench_<op> files' BUILDERS

import torch  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from common import read_flush_ms  # noqa: E402
from flashswitch import registry  # noqa: E402
from flashswitch.autotune import space, store  # noqa: E402


def _route_only(problem: dict):
    from flashswitch.ops.expert_matmul import route
    return lambda: route(problem["expert_idx"], problem["num_experts"], check=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op")
    ap.add_argument("index", type=int)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=INT", help="change integer fields of the shape")
    args = ap.parse_args(argv)

    spec = registry.get(args.op)
    shape = dict(space.TUNE_SHAPES[args.op][args.index])
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in shape:
            ap.error(f"--set {item}: the shape has no field {key!r} (fields: {', '.join(shape)})")
        shape[key] = int(value)
    problem = spec.random_problem(**shape, dtype="bf16", device="cuda", seed=0)
    tuned = store.lookup(args.op, args.backend, spec.features(problem))
    print(f"{args.op} {registry.describe(shape)} bf16, tuned {args.backend} config: {json.dumps(tuned)}")

    fns, names = [], []
    for v in args.variants:
        upd = json.loads(v)
        if upd == "route" and args.op == "expert_matmul":
            fns.append(_route_only(problem))
        elif isinstance(upd, str):
            fns.append(importlib.import_module(f"bench_{args.op.replace('.', '_')}").BUILDERS[upd](problem))
        else:
            fns.append(spec.kernel_callable(args.backend, {**tuned, **upd}, problem))
        names.append(v)
    for fn in fns:  # compile, warm up
        fn()
    torch.cuda.synchronize()

    per_call = {n: [] for n in names}
    read_flush = {n: [] for n in names}
    graph = {n: [] for n in names}
    for _ in range(args.rounds):
        for n, fn in zip(names, fns):
            per_call[n].append(do_bench(fn, warmup=10, rep=60, return_mode="median"))
            read_flush[n].append(read_flush_ms(fn, reps=60))
            try:
                graph[n].append(do_bench_cudagraph(fn, rep=40, return_mode="median"))
            except Exception as exc:  # not capturable: say so once
                graph[n].append(float("nan"))
                print(f"  {n}: no graph ({type(exc).__name__})")
    print(f"{'variant':48s} {'per call ms':>12s} {'read flush':>11s} {'graph ms':>10s}  "
          f"(median of {args.rounds} rounds)")
    for n in names:
        print(f"{n:48s} {statistics.median(per_call[n]):12.4f} {statistics.median(read_flush[n]):11.4f} "
              f"{statistics.median(graph[n]):10.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
