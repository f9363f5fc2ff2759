"""Compile an op's Triton (and Gluon) kernels for a GPU that is not here (default sm_90, the H200)
with the installed Triton, for every config of its tuning spaces: catches the configs the compiler
rejects (Triton 3.6's software pipeliner failing on a loop, as seen on the H200) and reports per kernel the
registers, register spills (the stack frame), shared memory and whether ptxas serializes its wgmma,
before any device time is spent. No GPU needed.

    python3 bench/tools/compile_check.py --ops eva_attention [--shape 0 1] [--first 8] [--arch 90]
    python3 bench/tools/compile_check.py --ops eva_cache          # EvaCache's decode-step kernels
    python3 bench/tools/compile_check.py --ops layer_ops          # the decoder layers' fused kernels
    python3 bench/tools/compile_check.py --ops switchhead_output  # SwitchHead's fused output projection
    python3 bench/tools/compile_check.py --tuned flashswitch/autotune/configs/NVIDIA_H200.json

--shape: indices into autotune/space.py TUNE_SHAPES (default all); --first: the first N configs of
each space; --tuned: instead of the spaces, the config that file gives each shape, and the default.
Exit status 1 when a config fails to compile. Each config runs the real launcher on CPU tensors with
the kernels' launches recorded instead of run; the recorded arguments are specialized and compiled as
Triton's JIT would on the device. TRITON_INTERPRET must be unset (it replaces the kernels).

A refactor that claims to leave the generated code alone is checked by the SASS it produces:

    python3 bench/tools/compile_check.py --json /tmp/before.json          # on the old tree
    python3 bench/tools/compile_check.py --compare /tmp/before.json       # on the new one

--compare reports every config whose kernels' SASS (instructions only, no addresses) differs from the
file's, and exits 1 if any does.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # this tree's package, installed or not: --compare sets one tree against another
    sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def _recording(modules):
    """The Triton (and Gluon) kernels of `modules` record (kernel, args, kwargs) into the yielded list
    instead of launching, and CPU tensors pass the ops layer's backend check."""
    import triton
    from flashswitch import backends

    calls: list = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.fn, args, kwargs))

        def __getattr__(self, name):  # the launchers read the kernel's parameter names
            return getattr(self.fn, name)

    saved = [(m, n, getattr(m, n)) for m in modules for n in dir(m)
             if isinstance(getattr(m, n), triton.runtime.JITFunction)]
    old_available = backends.available
    try:
        for m, n, fn in saved:
            setattr(m, n, Recorder(fn))
        backends.available = lambda backend, device: True
        yield calls
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)
        backends.available = old_available


def _kernel_modules(op: str) -> list:
    """The op's Triton kernel modules: forward, Gluon where there is one, and for a backward entry
    (`<op>.bwd`, whose call runs the forward too) the backward's."""
    base = op.split(".")[0]
    out = [importlib.import_module(f"flashswitch.kernels_triton.{base}")]
    for suffix in ("_gluon",) + (("_bwd",) if op.endswith(".bwd") else ()):
        try:
            out.append(importlib.import_module(f"flashswitch.kernels_triton.{base}{suffix}"))
        except ImportError:
            pass
    return out


def compile_call(fn, args, kwargs, arch: int):
    """Specialize (fn, args, kwargs) as Triton's JIT does and compile it for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    except ImportError:  # a Triton without Gluon
        GluonASTSource = GluonJITFunction = None

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    source = GluonASTSource if GluonJITFunction is not None and isinstance(fn, GluonJITFunction) else ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _sass_digest(cuobjdump: Path, cubin: Path) -> str:
    """sha256 of a cubin's SASS instructions (addresses, encodings and comments dropped)."""
    text = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
    lines = (re.sub(r"/\*[0-9a-f]+\*/", "", line).split(";")[0].strip() for line in text.splitlines())
    body = "\n".join(line for line in lines if line and not line.startswith(("code for", "Function", ".", "-", "/*")))
    return hashlib.sha256(body.encode()).hexdigest()


def resource_usage(kernel, arch: int = 90) -> dict:
    """{"regs", "local", "stack", "shared", "sass", "wgmma_serialized"} of a compiled kernel: cuobjdump on
    its cubin (stack: the frame that holds ptxas' register spills; sass: the digest of its instructions),
    and whether ptxas serializes its wgmma (warnings
    C7514-C7515: an accumulator register touched while its wgmma runs, so every wgmma waits for the
    previous one)."""
    import triton
    from triton.backends.nvidia import compiler as nv

    ptxas = Path(nv.get_ptxas(arch).path)
    # Triton's own lookup: torch may point TRITON_PTXAS_PATH at a ptxas with no cuobjdump beside it
    cuobjdump = Path(triton.knobs.nvidia.cuobjdump.path)
    out = {"shared": kernel.metadata.shared}
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)],
                              capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", text)
        if m:
            out.update(regs=int(m.group(1)), local=int(m.group(2)))
        m = re.search(r"STACK:(\d+)", text)
        if m:
            out["stack"] = int(m.group(1))
        out["sass"] = _sass_digest(cuobjdump, cubin)
        if "wgmma" in kernel.asm.get("ptx", ""):
            ptx.write_text(kernel.asm["ptx"])
            log = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", str(ptx), "-o", str(Path(tmp) / "v.cubin")],
                                 capture_output=True, text=True)
            out["wgmma_serialized"] = bool(re.search(r"C751[0-9]", log.stdout + log.stderr))
    return out


def shape_problem(op: str, index: int, dtype: str) -> dict:
    """Tuning shape `index` of op on CPU tensors, at batch 1: the specialization is the same (strides
    stay multiples of 16) in a fraction of the memory."""
    from flashswitch import registry
    from flashswitch.autotune import space

    shape = space.TUNE_SHAPES[op][index]
    return registry.get(op).random_problem(**({**shape, "B": 1} if "B" in shape else shape), dtype=dtype,
                                           device="cpu", seed=0)


def compile_row(row: dict, modules, run, arch: int, label: str) -> dict:
    """Record the launches `run()` makes of the kernels of `modules`, compile each for sm_<arch> and fill
    row["kernels"] ({"name", "regs", "local", "shared", ...}), row["ok"] (False with row["error"] where
    the compiler or the launcher refused, or nothing launched) and row["s"]; print one line."""
    row["kernels"] = []
    t0 = time.monotonic()
    try:
        with _recording(modules) as calls:
            run()
        for fn, args, kwargs in calls:
            k = compile_call(fn, args, kwargs, arch)
            row["kernels"].append({"name": fn.__name__, **resource_usage(k, arch)})
        row["ok"] = bool(calls)
        if not calls:
            row["error"] = "no launch recorded"
    except Exception as err:  # what the device would have hit
        lines = str(err).strip().splitlines()
        row.update(ok=False, error=f"{type(err).__name__}: {lines[-1] if lines else ''}")
    row["s"] = round(time.monotonic() - t0, 1)
    res = ", ".join(f"{k['name']} {k.get('regs', '?')} regs {k.get('stack', '?')} B stack "
                    f"{k.get('local', '?')} B local "
                    f"{k.get('shared', 0) // 1024} KB smem{' wgmma serialized' if k.get('wgmma_serialized') else ''}"
                    for k in row["kernels"])
    print(f"  {'ok  ' if row['ok'] else 'FAIL'} {label}  {res or row.get('error', '')}", flush=True)
    return row


def check_configs(op: str, index: int, configs, arch: int, problem: dict) -> list[dict]:
    """Compile op's kernels as launched on `problem` (tuning shape `index`) with each config: rows of
    {"op", "shape", "config", "ok", "kernels": [{"name", "regs", "local", "shared"}], "error"?, "s"}."""
    from flashswitch import registry

    spec = registry.get(op)
    modules = _kernel_modules(op)
    return [compile_row({"op": op, "shape": index, "config": cfg}, modules,
                        lambda cfg=cfg: spec.kernel_callable("triton", cfg, problem)(), arch, json.dumps(cfg))
            for cfg in configs]


def check_op(op: str, shapes, first, arch: int, dtype: str, tuned=None) -> list[dict]:
    """check_configs over the shapes: the first `first` configs of each space, or (tuned: a config
    file) the config that file gives each shape and the default."""
    from flashswitch import registry
    from flashswitch.autotune import space, store

    spec = registry.get(op)
    rows = []
    for index in shapes:
        shape = space.TUNE_SHAPES[op][index]
        problem = shape_problem(op, index, dtype)
        feats = spec.features(problem)
        if tuned is None:
            configs = space.config_space(op, "triton", feats)[:first]
        else:
            # the file's entry tuned on this very shape, else the one nearest to its batch-1 bucket
            entries = store.load(tuned)["ops"].get(op, {}).values()
            own = [e["backends"]["triton"]["config"] for e in entries
                   if e.get("shape") == shape and e.get("dtype", dtype) == dtype
                   and isinstance(e.get("backends", {}).get("triton", {}).get("config"), dict)]
            configs = [c for c in (own[0] if own else store.tuned_config(tuned, op, "triton", feats),
                                   space.default_config(op, "triton", feats)) if c is not None]
        print(f"{op} [{index}] {registry.describe(shape)} {dtype}: {len(configs)} configs", flush=True)
        rows += check_configs(op, index, configs, arch, problem)
    return rows


def check_eva_cache(arch: int, dtype: str) -> list[dict]:
    """Compile the launches of an EvaCache (kernels_triton/eva_cache.py) as a cache of the e2e generation's
    shape launches them: each window, with and without a summary-bias tensor; the prefill's (prompts of
    1 and 37 tokens), and a decode step's: the two around op 1, and the one-launch step (mean summaries
    with the log-count bias, weighted ones with the tensor)."""
    from flashswitch import EvaCache, registry
    from flashswitch.kernels_triton import eva_cache as kernels

    B, Hkv, D, C, W, N = 16, 8, 64, 16, 64, 32768
    dt = registry.DTYPES[dtype]
    rows = []
    for index, (window, bias) in enumerate((w, b) for w in ("block", "sliding") for b in ("log_count", "tensor")):
        def run(window=window, bias=bias):
            user = torch.zeros(B, Hkv, -(-N // C)) if bias == "tensor" else None
            cache = EvaCache(B, Hkv, D, chunk_size=C, window_size=W, window=window, max_seq_len=N, dtype=dt,
                             summary_bias=user if bias == "tensor" else bias, backend="reference")
            x = torch.zeros(B, Hkv, 1, D, dtype=dt)
            shape = dict(chunk_size=C, num_summaries=cache.num_summaries, ring_size=cache.ring_size)
            kernels.gather_chunk(cache.k, cache.v, cache.lengths, **shape)
            kernels.append(cache.k, cache.v, cache.bias, cache.lengths, cache.lengths.clone(), x, x, x, x, user,
                           window_size=W, window=window, on_bias=0.0, **shape)
            centre = torch.zeros(Hkv, D, dtype=dt) if bias == "tensor" else None
            kernels.step(cache.k, cache.v, cache.bias, cache.lengths, cache._done_programs, x, x, centre, centre,
                         user, window_size=W, window=window, on_bias=0.0, scale=D ** -0.5, **shape)
            for P in (1, 37):  # prompts of one token (an int argument of 1 is a constexpr to Triton) and more
                kv = torch.zeros(B, Hkv, P, D, dtype=dt)
                summ = torch.zeros(B, Hkv, -(-P // C), D, dtype=dt)
                given = torch.full((B,), P) if P > 1 else None  # ragged prompts, and all of length P
                kernels.prefill(cache.k, cache.v, cache.lengths, kv, kv, summ, summ, given,
                                num_summaries=cache.num_summaries, ring_size=cache.ring_size)

        config = {"window": window, "summary_bias": bias}
        rows.append(compile_row({"op": "eva_cache", "shape": index, "config": config}, [kernels], run, arch,
                                json.dumps(config)))
    return rows


def check_layer_ops(arch: int, dtype: str) -> list[dict]:
    """Compile the decoder layers' fused kernels (kernels_triton/layer_ops.py) at the e2e models' widths:
    rotary of q/k (shared and per-sequence positions), RMSNorm with and without the residual add,
    silu * up, the packed rotary's forward and backward (SwitchHead-262M's heads) and the routers' top-k."""
    from flashswitch import registry
    from flashswitch.kernels_triton import layer_ops as ops

    dt = registry.DTYPES[dtype]
    freq = torch.zeros(32)
    cases = {
        "rotary_qk": lambda: ops.rotary_qk(torch.zeros(16, 32, 1, 64, dtype=dt), torch.zeros(16, 8, 1, 64, dtype=dt),
                                           freq, None),
        "rotary_qk offsets": lambda: ops.rotary_qk(torch.zeros(16, 9, 1, 64, dtype=dt),
                                                   torch.zeros(16, 3, 1, 64, dtype=dt), freq,
                                                   torch.zeros(16, dtype=torch.int64)),
        "rms_norm 2048": lambda: ops.rms_norm(torch.zeros(16, 1, 2048, dtype=dt), torch.zeros(2048, dtype=dt), 1e-5),
        "add_rms_norm 576": lambda: ops.add_rms_norm(torch.zeros(16, 1, 576, dtype=dt), torch.zeros(16, 1, 576, dtype=dt),
                                                     torch.zeros(576, dtype=dt), 1e-5),
        "silu_mul 8192": lambda: ops.silu_mul(torch.zeros(16, 1, 8192, dtype=dt), torch.zeros(16, 1, 8192, dtype=dt)),
        "rotary_packed fwd+bwd": lambda: ops.rotary_packed(torch.zeros(2, 8, 2, 4, 112, dtype=dt, requires_grad=True),
                                                           torch.zeros(28), 56).sum().backward(),
        "top_k_gates 4 of 2 fwd+bwd": lambda: ops.top_k_gates(torch.zeros(64, 2, 4, 4, requires_grad=True), 2,
                                                               True)[1].sum().backward(),
        "top_k_gates 32 of 4": lambda: ops.top_k_gates(torch.zeros(64, 1, 1, 32), 4),
    }
    return [compile_row({"op": "layer_ops", "shape": index, "config": {"case": name}}, [ops], run, arch, name)
            for index, (name, run) in enumerate(cases.items())]


def check_switchhead_output(arch: int, dtype: str) -> list[dict]:
    """Compile the fused output projection's kernels (kernels_triton/switchhead_output(_bwd).py) with every
    config of their lists in autotune/space.py at SwitchHead-262M's and 47M's output shapes (a in `dtype`, fp32
    master weights for 16-bit a, as the layer passes them): the forward and the dweight kernel in both forms
    (columns, rows), and the backward's da/dw kernel (dweight with a split of the token sum, as on the GPU)."""
    from flashswitch import registry
    from flashswitch.autotune import space
    from flashswitch.kernels_triton import switchhead_output as ops, switchhead_output_bwd as bwd

    dt = registry.DTYPES[dtype]
    shapes = {"262M": dict(H=4, E=4, k=2, D=112, d=1024), "47M": dict(H=2, E=5, k=3, D=76, d=412)}
    rows = []
    for label, s in shapes.items():
        T, H, E, D, d = 512, s["H"], s["E"], s["D"], s["d"]
        a = torch.zeros(T, H, D, dtype=dt)
        weight = torch.zeros(H * E, D, d)
        ids = torch.zeros(T, H * s["k"], dtype=torch.int64)
        gates = torch.zeros(T, H * s["k"])
        w = torch.zeros(T, H * E)
        dy = torch.zeros(T, d, dtype=dt)

        def grads(need, config, **kw):
            return bwd.backward(dy, a, ids, gates, weight, *need, config=config, **kw)
        da0, dw0 = space.SHO_DA_DW[0], space.SHO_DWEIGHT_COLUMNS[0]
        runs = [(f"forward {cfg}", lambda cfg=cfg: ops.forward(a, w, weight, config=cfg))
                for cfg in space.SHO_FORWARD_COLUMNS]
        runs += [(f"forward rows {cfg}", lambda cfg=cfg: ops.forward(a, w, weight, config=cfg, form="rows"))
                 for cfg in space.SHO_FORWARD_ROWS]
        runs += [(f"da_dw {cfg}", lambda cfg=cfg: grads((True, True, False), space.sho_backward_config(cfg, dw0)))
                 for cfg in space.SHO_DA_DW]
        runs += [(f"dweight {cfg}", lambda cfg=cfg: grads((False, False, True), space.sho_backward_config(da0, cfg),
                                                          splits=2))
                 for cfg in space.SHO_DWEIGHT_COLUMNS]
        runs += [(f"dweight rows {cfg}", lambda cfg=cfg: grads((False, False, True),
                                                               space.sho_backward_config(da0, cfg), splits=2,
                                                               form="rows"))
                 for cfg in space.SHO_DWEIGHT_ROWS]
        print(f"switchhead_output {label} {dtype}: {len(runs)} configs", flush=True)
        rows += [compile_row({"op": "switchhead_output", "shape": label, "config": {"case": name}}, [ops, bwd], run,
                             arch, name) for name, run in runs]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=["eva_attention"])
    ap.add_argument("--shape", type=int, nargs="+", help="indices into TUNE_SHAPES (default: all)")
    ap.add_argument("--first", type=int, default=None, help="only the first N configs of each space")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tuned", type=Path, help="a config file: its configs (and the defaults), not the spaces")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--compare", type=Path, help="rows of an earlier --json: report SASS that differs")
    args = ap.parse_args(argv)
    from flashswitch._common import triton_interpret
    if triton_interpret():
        ap.error("unset TRITON_INTERPRET: the interpreter replaces the kernels this compiles")
    import flashswitch
    from flashswitch.autotune import space
    import triton

    print(f"flashswitch from {Path(flashswitch.__file__).parent}, triton {triton.__version__}, "
          f"torch {torch.__version__}, target sm_{args.arch}")
    rows = []
    for op in args.ops:
        if op == "eva_cache":  # no op of its own: the cache's step bookkeeping
            rows += check_eva_cache(args.arch, args.dtype)
            continue
        if op == "layer_ops":
            rows += check_layer_ops(args.arch, args.dtype)
            continue
        if op == "switchhead_output":
            rows += check_switchhead_output(args.arch, args.dtype)
            continue
        shapes = args.shape if args.shape is not None else range(len(space.TUNE_SHAPES[op]))
        rows += check_op(op, shapes, args.first, args.arch, args.dtype, args.tuned)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} configs compile for sm_{args.arch}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.compare:
        changed = compare_sass(json.loads(args.compare.read_text()), rows)
        print(f"{len(changed)} of {len(rows)} configs changed their SASS against {args.compare}")
        bad += changed
    return 1 if bad else 0


def compare_sass(before: list[dict], after: list[dict]) -> list[dict]:
    """The rows of `after` whose kernels' SASS digests differ from (or are missing in) `before`."""
    def key(row):
        return row["op"], row["shape"], json.dumps(row["config"], sort_keys=True)

    old = {key(r): [k.get("sass") for k in r["kernels"]] for r in before}
    changed = []
    for row in after:
        new = [k.get("sass") for k in row["kernels"]]
        if old.get(key(row)) != new:
            changed.append(row)
            print(f"  SASS {'changed' if key(row) in old else 'new'}: [{row['shape']}] {json.dumps(row['config'])}")
    return changed


if __name__ == "__main__":
    sys.exit(main())
