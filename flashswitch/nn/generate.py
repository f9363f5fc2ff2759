"""Greedy generation with a `LlamaLM` through its caches (EvaCache or StaticKVCache): the prompts are
prefilled in one batch (right-padded, lengths on the device), then every step feeds each sequence its
last token. On CUDA the steps after the first replay one CUDA graph of a step (its shapes are fixed
and the positions live on the device), so a step costs no host work per kernel.

    from flashswitch.nn import pretrained
    from flashswitch.nn.generate import greedy
    model, tok = pretrained.load("smollm2-135m", device="cuda", dtype=torch.bfloat16)
    out = greedy(model, [tok.encode("The capital of France is")], max_new_tokens=32)
    print(tok.decode(out.tokens[0].tolist()), out.tokens_per_s)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass
class Generation:
    tokens: torch.Tensor   # [B, n] the generated ids (n <= max_new_tokens: fewer when on_token stopped it)
    prompt_lengths: list
    prefill_s: float       # the prompts' forward pass, which also gives the first new token
    first_step_s: float    # the first step (compiles; on CUDA also the graph capture)
    steady_s: float        # the steps after it
    graph: bool            # whether those steps replayed a CUDA graph

    @property
    def steady_steps(self) -> int:
        return max(0, self.tokens.shape[1] - 2)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput after the first step: new tokens of every sequence per second."""
        n = self.steady_steps
        return self.tokens.shape[0] * n / self.steady_s if n and self.steady_s > 0 else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, graph: Optional[bool] = None,
           on_token: Optional[Callable[[torch.Tensor], bool]] = None) -> Generation:
    """Greedy continuation of each prompt (a list of token ids; one batch, right-padded) by up to
    `max_new_tokens` tokens. graph: replay a CUDA graph of the step (default: on CUDA). on_token(tok)
    is called with each new token of every sequence ([B] on the device) and stops the generation by
    returning True (e.g. at an end-of-sequence token; reading tok synchronises)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = model.embed.weight.device
    graph = device.type == "cuda" if graph is None else graph
    lengths = [len(p) for p in prompts]
    B, P = len(prompts), max(lengths)
    ids = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    ids = ids.to(device)
    # one position more than the tokens fed: a graph capture advances the caches' host-side count once
    caches = model.new_cache(B, P + max_new_tokens + 1)
    out = []

    def emit(tok) -> bool:
        out.append(tok[:, 0].clone())
        return bool(on_token(out[-1])) if on_token is not None else False

    def step():
        tok.copy_(model(tok, caches)[:, -1:].argmax(-1))

    _sync(device)
    times = [time.perf_counter()]
    tok = model(ids, caches, lengths=torch.tensor(lengths, device=device), last_only=True).argmax(-1)   # [B, 1]
    stop = emit(tok)
    replay = None
    while not stop and len(out) < max_new_tokens:
        if len(out) <= 2:  # prefill, then first step done: mark the times
            _sync(device)
            times.append(time.perf_counter())
        if replay is not None:
            replay()
        elif graph:  # the first step eagerly (on a side stream, as capture asks), then capture it
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream(device).wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                step()
            replay = cuda_graph.replay
        else:
            step()
        stop = emit(tok)
    _sync(device)
    times += [time.perf_counter()] * (4 - len(times))
    return Generation(torch.stack(out, 1), lengths, times[1] - times[0], times[2] - times[1], times[3] - times[2],
                      replay is not None)


__all__ = ["Generation", "greedy"]
