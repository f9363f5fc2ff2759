"""One checkout's side of bench/tools/regress.py: a persistent process that builds and times the cases the
driver sends, one JSON object per line on stdin, one answer per line on stdout.

The driver starts it with PYTHONPATH=<checkout root>, so `import flashswitch` is that checkout's. It
uses only the public API every compared tree has (chunk_summaries, eva_attention, route,
expert_matmul, each with backend=) and builds inputs from fixed seeds, so both sides time identical
problems. A case whose call raises (an argument or a backward pass the tree lacks) is answered
"unsupported" with the error, not a crash.

Requests: {"cmd": "prepare", "case": {...}} builds the case and runs it once (compiles);
{"cmd": "time"} times the prepared case once (one round); {"cmd": "quit"}.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(op: str, shape: dict, dtype: str, device: str, seed: int = 0) -> dict:
    """The public call's inputs (as keyword arguments; op 3: expert_idx and num_experts in place of
    its route) from `seed`, on `device`; device "meta" gives shapes only (the driver's cost counts)."""
    dt = DTYPES[dtype]
    g = None if device == "meta" else torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * scale).to(dt)

    if op == "chunk_summaries":
        s = shape
        return dict(k=randn(s["B"], s["H"], s["N"], s["D"]), v=randn(s["B"], s["H"], s["N"], s["D"]),
                    chunk_size=s["C"])
    if op == "eva_attention":
        s = shape
        nq, nc = s.get("Nq", s["Nk"]), -(-s["Nk"] // s["C"])
        # summaries as random as the keys: attention's cost does not depend on their values
        return dict(q=randn(s["B"], s["H"], nq, s["D"]), k=randn(s["B"], s["Hkv"], s["Nk"], s["D"]),
                    v=randn(s["B"], s["Hkv"], s["Nk"], s["D"]), k_sum=randn(s["B"], s["Hkv"], nc, s["D"]),
                    v_sum=randn(s["B"], s["Hkv"], nc, s["D"]), chunk_size=s["C"], window_size=s["W"],
                    window=s["window"])
    if op in ("expert_matmul", "route"):
        s = shape
        T, S, E = s["T"], s["S"], s["E"]
        g_in = s.get("G_in")
        x = randn(T, s["d_in"]) if g_in is None else randn(T, g_in, s["d_in"])
        weight = randn(E, s["d_in"], s["d_out"], scale=s["d_in"] ** -0.5)
        # S distinct experts per token
        idx = torch.rand(T, E, generator=g, device=device).argsort(-1)[:, :S]
        gates = torch.sigmoid(randn(T, S).float()).to(dt) if s.get("gated", True) else None
        return dict(x=x, expert_idx=idx, num_experts=E, weight=weight, gates=gates, out_groups=s.get("G_out"))
    raise ValueError(f"unknown op {op!r}")


def _bare_triton(device: str):
    """A launch of a kernel that stores one element: Triton's own cost per call (the host rows' reference)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _store_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)

    x = torch.empty(16, device=device)
    return lambda: _store_one[(1,)](x, 1, BLOCK=16)


def build(case: dict, device: str, backend: str):
    """The no-argument call to time for `case`."""
    import flashswitch
    op, pass_ = case["op"], case["pass"]
    if op == "bare_triton":
        return _bare_triton(device)
    p = make_inputs(op, case["shape"], case["dtype"], device, case.get("seed", 0))
    if op == "route":
        idx, E = p["expert_idx"], p["num_experts"]
        return lambda: flashswitch.route(idx, E, check=False)
    if op == "expert_matmul":
        rt = flashswitch.route(p.pop("expert_idx"), p.pop("num_experts"))  # outside the timed call
        fn = lambda x, weight, gates: flashswitch.expert_matmul(  # noqa: E731
            x, rt, weight, gates=gates, out_groups=p["out_groups"], backend=backend)
        tensors = {n: p[n] for n in ("x", "weight", "gates")}
    else:
        tensors = {n: t for n, t in p.items() if isinstance(t, torch.Tensor)}
        scalars = {n: v for n, v in p.items() if not isinstance(v, torch.Tensor)}
        public = getattr(flashswitch, op)
        fn = lambda **t: public(**t, **scalars, backend=backend)  # noqa: E731
    if pass_ == "fwd":
        return lambda: fn(**tensors)
    # forward + backward: every floating-point input a leaf, fixed random cotangents
    leaves = {n: t.detach().requires_grad_() for n, t in tensors.items() if t is not None}
    kw = {**tensors, **leaves}

    def outputs():
        out = fn(**kw)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    with torch.enable_grad():
        g = torch.Generator(device=device).manual_seed(case.get("seed", 0) + 7919)
        ups = [torch.randn(o.shape, generator=g, device=device, dtype=torch.float32).to(o.dtype) for o in outputs()]

    def step():
        with torch.enable_grad():
            return torch.autograd.grad(outputs(), list(leaves.values()), ups)
    return step


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_ms(fn, timing: dict) -> float:
    """One round's time per call in ms: do_bench's median of CUDA-event timings (L2 flushed) on a GPU,
    else the median wall time of a few synchronous calls (--smoke on the CPU)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=timing["warmup"], rep=timing["rep"], return_mode="median"))
    times = []
    for _ in range(timing["reps"]):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def host_us(fn, timing: dict) -> float:
    """One round's host time per call in us: CPU time of this process over back-to-back calls with no
    synchronisation in between (the GPU queue absorbs the tiny kernels), median over batches."""
    with torch.no_grad():  # a fwd+bwd call turns gradients on itself
        for _ in range(timing["warmup"]):
            fn()
        batches = []
        for _ in range(timing["batches"]):
            sync()
            t0 = time.process_time()
            for _ in range(timing["calls"]):
                fn()
            batches.append((time.process_time() - t0) / timing["calls"] * 1e6)
        sync()
    return sorted(batches)[len(batches) // 2]


def main() -> None:
    # answers go to the original stdout; anything else printed (warnings, Triton, C code) to stderr
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")

    import triton
    import flashswitch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    answer({"ready": True, "flashswitch": os.path.abspath(flashswitch.__file__), "torch": torch.__version__,
            "triton": triton.__version__, "device": device})
    fn, case = None, None
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "quit":
            break
        try:
            if req["cmd"] == "prepare":
                fn, case = None, req["case"]
                if device == "cuda":
                    torch.cuda.empty_cache()
                try:
                    fn = build(case, device, req["backend"])
                    fn()  # compiles; a call this tree cannot make raises here
                    sync()
                except Exception as err:  # noqa: BLE001 - the tree lacks this call: reported, not fatal
                    fn = None
                    msg = " ".join(str(err).split())
                    answer({"unsupported": f"{type(err).__name__}: {msg}"[:300]})
                    continue
                answer({"ok": True})
            elif req["cmd"] == "time":
                timing = case["timing"]
                value = host_us(fn, timing) if case["timer"] == "host" else device_ms(fn, timing)
                answer({"value": value})
            else:
                answer({"error": f"unknown command {req['cmd']!r}"})
        except Exception:  # noqa: BLE001 - the driver shows it and stops
            answer({"error": traceback.format_exc()[-2000:]})


if __name__ == "__main__":
    main()
