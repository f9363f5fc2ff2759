"""End-to-end data-parallel training: correctness, then throughput of a paper model under DDP and FSDP2
against one GPU at the same per-GPU batch.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 bench/e2e/e2e_distributed.py      # two GPUs, NCCL
    python bench/e2e/e2e_distributed.py --cpu-smoke [--out DIR]     # CPU, gloo, tiny model (also under torchrun)
    python bench/e2e/e2e_distributed.py                             # one GPU: the same at world size 1

1. Parity (bench/e2e/distributed_parity.py): a tiny LM of EvaAttention, SwitchHeadAttention and SigmaMoE
   trained 5 fp32 AdamW steps under DDP and under FSDP2 gives the per-step losses and first-step
   gradients of one process on the whole batches (rank 0 runs that one too); experts without local
   tokens get zero gradients; DDP runs with find_unused_parameters=False.
2. Throughput: `build_model(--size, --variant)` (default the 262M SwitchHead model), bf16 autocast
   with fp32 master weights, AdamW, random tokens of the config's context, `--batch` sequences per
   GPU. Modes: "single" (no wrapper; every rank trains its own copy at once, no communication),
   "ddp", "fsdp2" (fp32 parameters gathered, autocast inside) and "fsdp2_bf16" (FSDP2's
   MixedPrecisionPolicy: bf16 parameters gathered, fp32 gradient reduction). Each step (forward,
   backward, optimizer) is timed with CUDA events after `--warmup` steps; the table gives the median.
Results (rank 0): <out>/e2e_distributed.json and .md, <out> = bench/results/<device>/ by default (a
fresh temporary folder with --cpu-smoke).
The exit status is 1 when a parity check fails (the throughput still runs and is written).
NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set here before NCCL starts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before any NCCL communicator exists
E2E_DIR = Path(__file__).resolve().parent
BENCH_DIR = E2E_DIR.parent
ROOT = BENCH_DIR.parent
for p in (str(ROOT), str(BENCH_DIR), str(E2E_DIR)):
    if p not in sys.path:  # a checkout used without installing the package
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distributed_parity as P  # noqa: E402
from common import provenance, provenance_line  # noqa: E402
from flashswitch.autotune import store  # noqa: E402
from flashswitch.nn.models import build_model  # noqa: E402
from flashswitch.nn.parallel import TrainingLoss, fully_shard_model  # noqa: E402

MODES = ("single", "ddp", "fsdp2", "fsdp2_bf16")
# fp32 parity bound: CPU runs differ only in summation order; on GPUs the per-rank GEMMs have half
# the rows, so cuBLAS and the kernels may tile and sum differently, and Adam carries that on
PARITY_RTOL = {"cpu": 1e-5, "cuda": 1e-4}
# --cpu-smoke: a tiny SwitchHead LM of the same code paths
SMOKE_MODEL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=8, att_experts=4, att_k=2, d_ff=32,
                   context=16, dropout=0.0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="262M", help="paper size of build_model (47M, 262M)")
    ap.add_argument("--variant", default="switchhead", help="dense, switchhead or switchall")
    ap.add_argument("--attention", default=None, help="sdpa or eva (default: the config's)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per GPU and step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps per mode (JIT compiles, allocator)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--no-autocast", action="store_true", help="fp32 compute instead of bf16 autocast")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/<device>/)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU, gloo, a tiny model, 2 timed steps (torchrun or a single process)")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; expected a subset of {MODES}")
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--batch and --steps must be >= 1, --warmup >= 0")
    if args.cpu_smoke:
        args.steps, args.warmup, args.batch = min(args.steps, 2), min(args.warmup, 1), min(args.batch, 2)
    return args


# ---------------------------------------------------------------- process group
def init(cpu: bool):
    """(rank, world, local_rank, device): from torchrun's environment, else one process with a file store."""
    backend = "gloo" if cpu else "nccl"
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if not cpu:
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
    else:
        local = 0
        if not cpu:
            torch.cuda.set_device(0)
        store_file = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group(backend, init_method=f"file://{store_file}", rank=0, world_size=1)
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    return dist.get_rank(), dist.get_world_size(), local, device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- 1. parity
def parity(device, rank: int) -> dict:
    """{mode: the comparison on rank 0}. A failed comparison is recorded; a failure inside a run (a
    missing or nonzero empty-expert gradient) raises."""
    cfg = P.ParityConfig()
    world = dist.get_world_size()
    rtol = PARITY_RTOL[device.type]
    single = P.single_run(cfg, device, world) if rank == 0 else None
    out = {}
    for mode in P.MODES:
        res = P.parallel_run(mode, cfg, device)
        if rank != 0:
            continue
        try:
            out[mode] = {"ok": True, **P.compare(single, res, rtol)}
        except AssertionError as e:
            out[mode] = {"ok": False, "error": str(e)}
        out[mode].update(rtol=rtol, world=world, empty_experts=res["empty_experts"])
        print(f"parity {mode}: {out[mode]}", flush=True)
    return out


# ---------------------------------------------------------------- 2. throughput
def make_model(args, device):
    torch.manual_seed(0)
    overrides = dict(SMOKE_MODEL) if args.cpu_smoke else {}
    if args.attention:
        overrides["attention"] = args.attention
    return build_model(args.size, args.variant, device=device, **overrides)


def wrap(mode: str, lm, device, world: int):
    loss_fn = TrainingLoss(lm)
    if mode == "single":
        return loss_fn
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [device] if device.type == "cuda" else None
        return DDP(loss_fn, device_ids=ids, find_unused_parameters=False, gradient_as_bucket_view=True)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world,))
    policy = None
    if mode == "fsdp2_bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fully_shard_model(loss_fn, mesh, mp_policy=policy)


def throughput(mode: str, args, device, rank: int, world: int) -> dict:
    lm = make_model(args, device)
    n_params = lm.num_parameters()
    context, vocab = lm.config.context, lm.config.vocab_size
    model = wrap(mode, lm, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)  # fused takes FSDP2's DTensors too
    g = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own data
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_autocast)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        tokens = torch.randint(0, vocab, (args.batch, context + 1), device=device, generator=g)
        with autocast:
            loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    sync(device)
    losses, times = [], []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
        for start, end in events:
            start.record()
            losses.append(step())
            end.record()
        sync(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(1e3 * (time.perf_counter() - t0))
    ms = statistics.median(times)
    gpus = 1 if mode == "single" else world
    tokens_per_step = gpus * args.batch * context
    row = {"mode": mode, "gpus": gpus, "batch_per_gpu": args.batch, "context": context, "params": n_params,
           "ms_per_step": ms, "ms_mean": statistics.fmean(times), "ms_min": min(times),
           "tokens_per_s": tokens_per_step / (ms / 1e3), "tokens_per_s_per_gpu": args.batch * context / (ms / 1e3),
           "final_loss": float(losses[-1]), "finite": all(math.isfinite(float(v)) for v in losses)}
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    del model, lm, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- results
def markdown(result: dict) -> str:
    env, cfg = result["env"], result["config"]
    rows = result["throughput"]
    single = next((r for r in rows if r["mode"] == "single"), None)
    lines = [f"# Data-parallel training: {cfg['size']} {cfg['variant']} on {env['world']} x {env['device']}", "",
             f"Per-GPU batch {cfg['batch']} x context {rows[0]['context'] if rows else '?'} tokens, "
             f"{'fp32' if cfg['no_autocast'] else 'bf16 autocast (fp32 master weights)'}, AdamW; "
             f"median of {cfg['steps']} steps after {cfg['warmup']} warm-up steps (forward + backward + "
             f"optimizer, {'CUDA events' if env['device'] != 'cpu' else 'wall clock'}); 'single' runs on "
             f"every GPU at once, each its own copy. torch {env['torch']}, triton {env['triton']}, NCCL_NVLS_ENABLE="
             f"{env['NCCL_NVLS_ENABLE']}; {provenance_line(result)}. 'vs one GPU': tokens/s over GPUs x the "
             "single-GPU tokens/s.", "",
             "| mode | GPUs | ms/step | tokens/s | tokens/s per GPU | vs one GPU | peak GiB | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eff = f"{r['tokens_per_s'] / (r['gpus'] * single['tokens_per_s']):.1%}" if single else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
        lines.append(f"| {r['mode']} | {r['gpus']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {eff} | {mem} | {r['final_loss']:.3f} |")
    lines += ["", "Parity (tiny EVA + SwitchHead + sigma-MoE LM, fp32, 5 AdamW steps vs one process on the "
              "whole batches):", "", "| mode | ok | max loss rel | max grad rel (param) | bound |",
              "|---|---|---|---|---|"]
    for mode, p in result["parity"].items():
        if p.get("ok"):
            lines.append(f"| {mode} | yes | {p['loss_rel']:.2e} | {p['grad_rel']:.2e} ({p['worst_grad']}) | "
                         f"{p['rtol']:g} |")
        else:
            lines.append(f"| {mode} | **no** | {p.get('error', '')[:200]} | | {p['rtol']:g} |")
    return "\n".join(lines) + "\n"


def environment(device, world: int) -> dict:
    import triton
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "world": world,
           "torch": torch.__version__, "triton": triton.__version__,
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    if device.type == "cuda":
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["cuda"] = torch.version.cuda
    return env


def results_dir(args, device_name: str) -> Path:
    if args.out:
        return Path(args.out)
    if args.cpu_smoke:
        return Path(tempfile.mkdtemp(prefix="e2e_distributed_"))
    return BENCH_DIR / "results" / store.device_slug(device_name)


def save(result: dict, out: Path) -> None:
    """Written after every stage, so a run cut short keeps what it finished."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e_distributed.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "e2e_distributed.md").write_text(markdown(result))


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, local, device = init(cpu=args.cpu_smoke)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 parity check compares fp32 math
        torch.backends.cudnn.allow_tf32 = False
    result = {**provenance(), "env": environment(device, world),
              "config": {k: getattr(args, k) for k in ("size", "variant", "attention", "batch", "steps", "warmup",
                                                         "lr", "no_autocast", "cpu_smoke")},
              "parity": {}, "throughput": []}
    if args.cpu_smoke:
        result["config"]["model_overrides"] = SMOKE_MODEL
    out = results_dir(args, result["env"]["device"]) if rank == 0 else None
    try:
        if not args.skip_parity:
            result["parity"] = parity(device, rank)
            if rank == 0:
                save(result, out)
        for mode in args.modes:
            dist.barrier(device_ids=[local]) if device.type == "cuda" else dist.barrier()
            row = throughput(mode, args, device, rank, world)
            if rank == 0:
                print(f"throughput {mode}: {row}", flush=True)
                result["throughput"].append(row)
                save(result, out)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the other ranks may wait in a collective: torchrun ends them when one rank fails
    if rank == 0:
        print(markdown(result))
        print(f"results: {out}/e2e_distributed.{{json,md}}", flush=True)
    dist.destroy_process_group()
    failed = rank == 0 and not all(p["ok"] for p in result["parity"].values())
    failed = failed or (rank == 0 and not all(r["finite"] for r in result["throughput"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
