"""Data-parallel parity of the flashswitch layers: a tiny LM made of EvaAttention, SwitchHeadAttention
(EVA attention inside) and SigmaMoE, trained a few AdamW steps with each of `world` ranks on its slice
of every global batch, under DDP or FSDP2, must give the per-step losses (and first-step gradients) of
one process trained on the whole batches.

Also checked on every rank, before any wrapping: the sigma-MoE layer has experts that no local token
picked (the tiny config makes it certain: more experts than local tokens), their gradients are exactly
zero tensors (not None), and every parameter has a gradient, so DDP runs with
find_unused_parameters=False.

Used by tests/test_distributed.py (CPU, gloo, spawned ranks) and bench/e2e/e2e_distributed.py (GPUs, NCCL).
fp32 throughout; with entropy_reg = 0 and no dropout, the only difference between the runs is the
order of floating-point sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashswitch.nn import EvaAttention, SigmaMoE, SwitchHeadAttention
from flashswitch.nn._routing import sigmoid_top_k
from flashswitch.nn.parallel import fully_shard_model
from flashswitch.testing import rel_error

MODES = ("ddp", "fsdp2")


@dataclass(frozen=True)
class ParityConfig:
    vocab: int = 32
    d: int = 16
    heads: int = 2
    head_dim: int = 8
    att_experts: int = 4
    att_k: int = 2
    moe_experts: int = 40  # > local tokens * moe_k: every rank leaves some expert without tokens
    moe_dim: int = 4
    moe_k: int = 1
    chunk: int = 2
    window: int = 4
    seq: int = 8           # tokens per sequence fed to the model (each batch row holds seq + 1)
    local_batch: int = 2   # sequences per rank
    steps: int = 5
    lr: float = 1e-2
    seed: int = 0


class MixedLM(nn.Module):
    """Embedding, then pre-norm residual EvaAttention (weighted summaries), SwitchHeadAttention (EVA
    attention) and SigmaMoE, a final norm and an output layer. forward(tokens [B, seq + 1]) returns
    the mean next-token cross-entropy (DDP and FSDP2 hook forward, so forward is the loss)."""

    def __init__(self, cfg: ParityConfig, *, backend: str = "auto", device=None):
        super().__init__()
        d, kw = cfg.d, dict(device=device)
        self.embed = nn.Embedding(cfg.vocab, d, **kw)
        self.norms = nn.ModuleList(nn.LayerNorm(d, **kw) for _ in range(4))
        self.eva = EvaAttention(d, cfg.heads, head_dim=cfg.head_dim, chunk_size=cfg.chunk, window_size=cfg.window,
                                summaries="weighted", backend=backend, **kw)
        self.switch = SwitchHeadAttention(d, cfg.heads, cfg.head_dim, cfg.att_experts, cfg.att_k, attention="eva",
                                          eva_chunk_size=cfg.chunk, eva_window_size=cfg.window, backend=backend, **kw)
        self.moe = SigmaMoE(d, cfg.moe_experts, cfg.moe_dim, cfg.moe_k, backend=backend, **kw)
        self.head = nn.Linear(d, cfg.vocab, bias=False, **kw)
        with torch.no_grad():  # the weighted summaries start at 0; nonzero values exercise their gradients
            self.eva.key_weight.normal_(0.0, 0.3)
            self.eva.omega.normal_(0.0, 0.3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for norm, layer in zip(self.norms, (self.eva, self.switch, self.moe)):
            x = x + layer(norm(x))
        logits = self.head(self.norms[3](x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def make_model(cfg: ParityConfig, device, backend: str = "auto") -> MixedLM:
    torch.manual_seed(cfg.seed)  # every run starts from the same weights
    return MixedLM(cfg, backend=backend, device=device)


def global_batches(cfg: ParityConfig, world: int) -> list[torch.Tensor]:
    """The steps' global batches [world * local_batch, seq + 1] (CPU, int64); rank r trains on rows
    [r * local_batch, (r + 1) * local_batch)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [torch.randint(0, cfg.vocab, (world * cfg.local_batch, cfg.seq + 1), generator=g) for _ in range(cfg.steps)]


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one plain tensor (FSDP2 keeps sharded DTensor gradients: gathered, a collective)."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def train(model: nn.Module, params: dict, batches, device, *, lr: float, world: int = 1) -> dict:
    """AdamW steps of `model` (forward = loss) on `batches`; params: the named parameters whose
    gradients are read. Returns {"losses": the global mean loss per step, "grads": the first step's
    gradients (CPU)}. Every parameter must have a gradient after every backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step, tokens in enumerate(batches):
        loss = model(tokens.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        missing = [n for n, p in params.items() if p.grad is None]
        if missing:
            raise AssertionError(f"step {step}: no gradient for {missing}")
        if step == 0:
            grads = {n: _full(p.grad).detach().cpu().clone() for n, p in params.items()}
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)  # every rank's mean over the same number of tokens: the global mean
            total /= world
        losses.append(total)
    return {"losses": torch.stack(losses).cpu().tolist(), "grads": grads}


def single_run(cfg: ParityConfig, device, world: int, backend: str = "auto") -> dict:
    """One process on the whole global batches."""
    model = make_model(cfg, device, backend)
    return train(model, dict(model.named_parameters()), global_batches(cfg, world), device, lr=cfg.lr)


def check_local_gradients(model: MixedLM, tokens: torch.Tensor) -> int:
    """One local forward + backward (no wrapper): every parameter gets a gradient, and the sigma-MoE
    experts that no local token picked get exactly-zero ones. Returns how many experts were empty
    (raises when none: the check would prove nothing)."""
    seen = {}

    def keep_input(module, args):  # returns None: the input goes on unchanged
        seen["x"] = args[0].detach()

    hook = model.moe.register_forward_pre_hook(keep_input)
    try:
        model.zero_grad(set_to_none=True)
        model(tokens).backward()
    finally:
        hook.remove()
    moe = model.moe
    x2 = seen["x"].reshape(-1, moe.embed_dim)
    idx, _ = sigmoid_top_k(F.linear(x2, moe.router), moe.experts_per_token)
    counts = torch.bincount(idx.reshape(-1), minlength=moe.num_experts).cpu()
    empty = (counts == 0).nonzero().flatten().tolist()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if missing:
        raise AssertionError(f"no gradient for {missing}")
    if not empty:
        raise AssertionError("every sigma-MoE expert got a local token: the empty-expert check would be vacuous")
    used = (counts > 0).nonzero().flatten().tolist()
    for name in ("up", "down"):
        g = getattr(moe, name).grad
        if bool(g[empty].ne(0).any()):
            raise AssertionError(f"moe.{name}: experts without tokens {empty} have nonzero gradients")
        if not bool(g[used].ne(0).any()):
            raise AssertionError(f"moe.{name}: the used experts {used} have no gradient")
    model.zero_grad(set_to_none=True)
    return len(empty)


def parallel_run(mode: str, cfg: ParityConfig, device, backend: str = "auto") -> dict:
    """This rank's part of a `mode` ("ddp" | "fsdp2") run over the default process group. Returns
    {"losses", "grads", "empty_experts"} (the losses and gradients are global: equal on every rank)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * cfg.local_batch, (rank + 1) * cfg.local_batch)
    batches = [b[rows] for b in global_batches(cfg, world)]
    model = make_model(cfg, device, backend)
    empty = check_local_gradients(model, batches[0].to(device))
    params = dict(model.named_parameters())
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [device] if torch.device(device).type == "cuda" else None
        wrapped = DDP(model, device_ids=ids, find_unused_parameters=False)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(torch.device(device).type, (world,))
        wrapped = fully_shard_model(model, mesh)
        params = dict(model.named_parameters())  # FSDP2 swapped in sharded (DTensor) parameters
    out = train(wrapped, params, batches, device, lr=cfg.lr, world=world)
    return {**out, "empty_experts": empty}


def _spawned_rank(rank: int, world: int, workdir: str, device_type: str, cfg: ParityConfig) -> None:
    torch.set_num_threads(1)  # the ranks share the host's cores
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{workdir}/store",
                            rank=rank, world_size=world)
    try:
        results = {mode: parallel_run(mode, cfg, device) for mode in MODES}
        if rank == 0:
            torch.save(results, f"{workdir}/results.pt")
        # both ranks done before either tears gloo down: a rank that exited while the other still held
        # its connections aborted once in CI ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_parallel_runs(world: int, device_type: str, workdir, cfg: ParityConfig = ParityConfig()) -> dict:
    """{mode: parallel_run's result} of `world` spawned ranks (gloo on "cpu", NCCL on "cuda": rank r on
    GPU r); workdir: an empty folder for the rendezvous file and the results."""
    import torch.multiprocessing as mp
    mp.spawn(_spawned_rank, args=(world, str(workdir), device_type, cfg), nprocs=world, join=True)
    return torch.load(f"{workdir}/results.pt")


def compare(single: dict, parallel: dict, rtol: float) -> dict:
    """{"loss_rel": largest relative loss difference over the steps, "grad_rel": largest relative
    (L2) first-step gradient error over the parameters}; raises AssertionError beyond rtol."""
    a, b = parallel["losses"], single["losses"]
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} parallel steps vs {len(b)} single-process steps")
    loss_rel = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))
    if set(parallel["grads"]) != set(single["grads"]):
        raise AssertionError(f"parameters differ: {sorted(set(parallel['grads']) ^ set(single['grads']))}")
    errs = {n: rel_error(parallel["grads"][n], g) for n, g in single["grads"].items()}
    worst = max(errs, key=errs.get)
    if not (loss_rel <= rtol and all(math.isfinite(x) for x in a)):
        raise AssertionError(f"per-step losses differ by {loss_rel:.3g} relative (> {rtol:g}): {a} vs {b}")
    if not errs[worst] <= rtol:
        raise AssertionError(f"first-step gradient of {worst} differs by {errs[worst]:.3g} relative (> {rtol:g})")
    return {"loss_rel": loss_rel, "grad_rel": errs[worst], "worst_grad": worst}


__all__ = ["MODES", "ParityConfig", "MixedLM", "make_model", "global_batches", "train", "single_run",
           "check_local_gradients", "parallel_run", "spawn_parallel_runs", "compare"]
