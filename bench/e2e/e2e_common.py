"""What the end-to-end scripts (e2e_training.py, e2e_text.py) share: model building per size and
implementation, the optimizer, one training step, step timing and merging partial runs into a JSON.

Sizes: the papers' "47M" and "262M" (flashswitch.nn.models), and "tiny", a 2-layer toy of each
variant for smoke runs on the CPU. Implementations ("impls") of the same model:
  flashswitch  the library's layers (SDPA causal flash path, op-3 kernels; the reference on the CPU)
  paper        attention as the SwitchHead paper's code writes it (bench/e2e/paper_attention.py), experts
               still through op 3
  paper_torch  paper-style attention and every op on the PyTorch reference (one GEMM per expert in
               fp32): no flashswitch kernel at all
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
BENCH_DIR = E2E_DIR.parent
ROOT = BENCH_DIR.parent
for p in (str(ROOT), str(BENCH_DIR), str(E2E_DIR)):
    if p not in sys.path:  # a checkout used without installing the package
        sys.path.insert(0, p)

import torch  # noqa: E402

from common import provenance, provenance_line  # noqa: E402,F401  (the scripts use E.provenance)
from flashswitch.nn import models  # noqa: E402
from paper_attention import to_paper_style  # noqa: E402

SIZES = ("tiny",) + models.SIZES
IMPLS = ("flashswitch", "paper", "paper_torch")
# the tiny toy: every variant keeps its kind of layers (heads x experts, sigma-MoE), at toy widths
_TINY = dict(common=dict(vocab_size=64, d_model=32, n_layers=2, context=32, dropout=0.0),
             dense=dict(n_heads=4, head_dim=8, d_ff=64),
             switchhead=dict(n_heads=2, head_dim=8, att_experts=3, att_k=2, d_ff=64),
             switchall=dict(n_heads=2, head_dim=8, att_experts=3, att_k=2, moe_experts=4, moe_expert_dim=16,
                            moe_k=2, moe_entropy_reg=1e-4))


def model_config(size: str, variant: str, **overrides) -> models.ModelConfig:
    if size == "tiny":
        if variant not in models.VARIANTS:
            raise ValueError(f"variant must be one of {models.VARIANTS}, got {variant!r}")
        return models.ModelConfig(**{**_TINY["common"], **_TINY[variant], **overrides})
    return models.paper_config(size, variant, **overrides)


def build(size: str, variant: str, impl: str = "flashswitch", *, device="cpu", **overrides) -> models.DecoderLM:
    """The model of (size, variant) run the way `impl` says, fp32 parameters on `device`."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "paper_torch":
        overrides.setdefault("backend", "reference")
    model = models.DecoderLM(model_config(size, variant, **overrides), device=device)
    return to_paper_style(model) if impl != "flashswitch" else model


def make_optimizer(model: torch.nn.Module, lr: float = 3e-4, weight_decay: float = 0.0, *,
                   capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW over fp32 master weights; the fused implementation where this torch has it for the device
    (`capturable`: its step count on the device, as a CUDA-graph-captured step needs)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=lr, weight_decay=weight_decay, **({"capturable": True} if capturable else {}))
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, **kw)


def amp_dtype(device) -> torch.dtype | None:
    """bf16 autocast on CUDA; none on the CPU (the Triton interpreter and the CPU tests run fp32)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


def train_step(model, opt, tokens: torch.Tensor, *, amp: torch.dtype | None = None, clip: float | None = None,
               scheduler=None, loss=None) -> torch.Tensor:
    """One step: forward (autocast to `amp` when given), backward, optional gradient clipping, AdamW.
    Returns the loss as a detached device tensor (no host sync). `loss(tokens)`: the objective (default
    model.loss)."""
    loss = _loss_backward(model, tokens, amp, loss)
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    if scheduler is not None:
        scheduler.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _loss_backward(model, tokens: torch.Tensor, amp: torch.dtype | None, loss=None) -> torch.Tensor:
    """The loss of tokens (`loss(tokens)`, default model.loss) under autocast to `amp`, back-propagated."""
    with torch.autocast(tokens.device.type, dtype=amp or torch.float32, enabled=amp is not None):
        loss = (loss or model.loss)(tokens)
    loss.backward()
    return loss


def capture(fn, *, reset=None, warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA graph, after `warmup` calls on a side stream (as torch.cuda.graph asks);
    reset() runs before each warmup call and before the capture (e.g. gradients set to None, so the
    captured backward writes them instead of accumulating). replay() then re-runs fn's kernels with
    no host work: the time a graph-captured training loop pays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            if reset is not None:
                reset()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def captured_train_step(model, opt, tokens: torch.Tensor, *, amp: torch.dtype | None = None):
    """train_step (without clipping) captured in a CUDA graph on the static batch `tokens` (copy the
    next batch into it before each replay); `opt` must be capturable (make_optimizer)."""
    def step():
        _loss_backward(model, tokens, amp)
        opt.step()

    return capture(step, reset=lambda: opt.zero_grad(set_to_none=True))


def graphed_train_step(model, opt, tokens: torch.Tensor, *, amp: torch.dtype | None = None,
                       clip: float | None = None, loss=None):
    """A training step (forward, backward, optional gradient clipping, AdamW) captured in a CUDA graph
    on the static batch `tokens`: returns run(batch) -> the loss tensor, which copies batch into
    tokens and replays. `opt` must be capturable (make_optimizer), its learning rate a tensor to change
    between replays. The warmup steps of the capture are undone: the weights are restored and AdamW's
    state zeroed (its initial state), so the first replay is the run's first step."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    out = {}

    def step():
        out["loss"] = _loss_backward(model, tokens, amp, loss).detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()

    graph = capture(step, reset=lambda: opt.zero_grad(set_to_none=True))
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    v.zero_()

    def run(batch: torch.Tensor) -> torch.Tensor:
        tokens.copy_(batch)
        graph.replay()
        return out["loss"]
    return run


def trainer(model, *, lr: float, weight_decay: float = 0.0, schedule=None, batch_shape: tuple,
            amp: torch.dtype | None = None, clip: float | None = None, graphed: bool = False, loss=None):
    """(step, opt): step(batch) runs one training step (train_step: forward, backward, clipping at
    `clip`, AdamW) and returns its loss as a detached device tensor; its i-th call (from 0) uses the
    learning rate lr * schedule(i) (schedule None: constant). `graphed` (CUDA): the step is captured
    once in a CUDA graph on a static batch of `batch_shape` (graphed_train_step) and each call copies
    the batch in and replays it: no host work per kernel, so a small model is no longer paced by its
    host; the learning rate then lives in a device tensor the schedule fills. `loss(tokens)`: the
    objective (default model.loss)."""
    schedule = schedule or (lambda i: 1.0)
    calls = iter(range(1 << 62))
    if not graphed:
        opt = make_optimizer(model, lr=lr, weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return (lambda batch: train_step(model, opt, batch, amp=amp, clip=clip, scheduler=sched, loss=loss)), opt
    device = next(model.parameters()).device
    lr_now = torch.tensor(lr * schedule(0), dtype=torch.float32, device=device)
    opt = make_optimizer(model, lr=lr_now, weight_decay=weight_decay, capturable=True)
    static = torch.zeros(batch_shape, dtype=torch.long, device=device)
    run = graphed_train_step(model, opt, static, amp=amp, clip=clip, loss=loss)

    def step(batch: torch.Tensor) -> torch.Tensor:
        lr_now.fill_(lr * schedule(next(calls)))
        return run(batch)
    return step, opt


# kernel families of a profile split: the first pattern that a kernel's name matches (lower case)
KERNEL_FAMILIES = (
    ("op1", r"chunk_summ"),
    ("op2_fwd", r"_eva_fwd|_eva_combine"),
    ("op2_bwd", r"_eva_bwd"),
    ("op3", r"expert_matmul|_group_sum|_pair_experts|_dense_z|_dx_kernel|_dw_kernel|_dense_dg|_dense_dx|"
            r"_sum_leading|_forward_kernel|_forward_rows|_da_dw|_dweight|_gate_table|_gate_grad|route|top_k_rows"),
    ("exact_attention", r"flash|fmha|cudnn|attention"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|s16816|wgmma|splitk"),
    ("loss", r"cross_entropy|log_softmax|nll_loss"),
    ("optimizer", r"adam|multi_tensor"),
    ("elementwise", r"."))  # norms, rotary, activations, casts, copies, fills


def kernel_family(kernel: str) -> str:
    """The KERNEL_FAMILIES name of a GPU kernel."""
    name = kernel.lower()
    return next(f for f, pattern in KERNEL_FAMILIES if re.search(pattern, name))


def profile_split(fn, families=tuple(f for f, _ in KERNEL_FAMILIES)) -> dict:
    """One call of fn under the torch profiler: {"split": GPU ms per kernel family (of `families`; a
    kernel of another family counts as elementwise), "kernels": the kernel count}."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    split, count = dict.fromkeys(families, 0.0), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            f = kernel_family(e.name)
            split[f if f in split else "elementwise"] += e.time_range.elapsed_us() / 1e3
            count += 1
    return {"split": split, "kernels": count}


def time_calls(fn, *, warmup: int, reps: int, device) -> list[float]:
    """Milliseconds of each of `reps` calls of fn after `warmup` calls: CUDA events around each call on
    a GPU (back to back, one synchronisation at the end), perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def env_info(device) -> dict:
    info = {"device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def device_slug(name: str) -> str:
    from flashswitch.autotune import store
    return store.device_slug(name)


def default_out_dir(device):
    """bench/results/<device>/ for a GPU run; None for a CPU run, which is no device's result (its
    callers write only with --out)."""
    if torch.device(device).type != "cuda":
        return None
    return BENCH_DIR / "results" / device_slug(env_info(device)["device"])


def merge_json(path: Path, sections: dict[str, list[dict]], keys: dict[str, tuple], header: dict,
               defaults: dict[str, dict] | None = None) -> dict:
    """Merge `sections` ({name: rows}) into the JSON at `path`: a new row replaces the stored row with the
    same values of keys[name], other stored rows stay (so a run split by flags adds up). defaults[name]
    fills the fields a stored row lacks (rows written before a key field existed). Returns the merged
    data, also written to `path`."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    for name, rows in sections.items():
        key = keys[name]
        fill = (defaults or {}).get(name, {})
        kept = {tuple(r.get(k) for k in key): r for r in ({**fill, **r} for r in data.get(name, []))}
        for r in rows:
            kept[tuple(r.get(k) for k in key)] = r
        data[name] = list(kept.values())
    data.update(header)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def write_outputs(name: str, data: dict, folder: Path, markdown, plot) -> list[Path]:
    """<name>.md from markdown(data) and <name>.png from plot(data, path) (where it draws one) beside the
    JSON in `folder`: the paths written."""
    md = folder / f"{name}.md"
    md.write_text(markdown(data) + "\n")
    written = [folder / f"{name}.json", md]
    png = folder / f"{name}.png"
    if plot(data, png):
        written.append(png)
    return written


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def free_memory(device) -> None:
    """Before a new case on a GPU: the last case's memory back to the device, peak statistics reset
    (a CPU run skips it: the collection costs more than its toy cases)."""
    if torch.device(device).type == "cuda":
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

