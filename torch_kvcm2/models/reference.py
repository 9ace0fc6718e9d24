"""The stock model as the reference (MOD-2): transformers' own forward with its own dense cache.

``stock_request_logits`` decodes one request alone, teacher-forced on the tokens a torch_kvcm2
run generated (so one differing token does not derail the rest of the comparison);
``stock_batch_logits`` runs a batch of equal-length prompts in lockstep, the same shapes a
``Generator`` run of the same batch multiplies, which is what makes bit-for-bit comparison
possible (matrix products of other shapes differ in the last bits: docs/MODELS.md).
``compare`` says where a run and its reference differ.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .generation import last_logits
from .support import import_transformers


@dataclass(frozen=True)
class Tolerance:
    """What ``Comparison.ok`` accepts where a run is not bit-identical to its reference:
    ``max_diff`` the largest |logit difference|, ``mean_diff`` (when set) the mean over every
    logit, ``tokens`` whether greedy tokens must be the reference's argmax (beyond near ties:
    the two logits within ``max_diff``)."""

    max_diff: float
    mean_diff: Optional[float] = None
    tokens: bool = True


#: per dtype (docs/MODELS.md). fp32: sums in another order (weight absorption, matrix products
#: of other batch shapes) move logits by ~1e-6, so 1e-4 is a wide margin and tokens must match.
#: bf16: every product is rounded to 8 mantissa bits at different points, which moves a logit
#: of magnitude ~1 by ~0.01 typically; where a MoE router's top experts are nearly tied, that
#: flips an expert and moves the step's logits by up to ~0.6, and random bf16 logits have
#: exact top-1 ties, so bf16 is checked on the mean difference, with a loose bound on the
#: largest, and not token by token.
TOLERANCE = {torch.float32: Tolerance(max_diff=1e-4),
             torch.bfloat16: Tolerance(max_diff=1.0, mean_diff=0.025, tokens=False)}


def _dynamic_cache(model):
    return import_transformers().DynamicCache(config=model.config)


def _chunks(tokens: Sequence[int], chunk: int):
    for start in range(0, len(tokens), chunk):
        yield list(tokens[start:start + chunk])


def stock_request_logits(model, prompt: Sequence[int], generated: Sequence[int],
                         prefill_chunk: int) -> torch.Tensor:
    """float32[len(generated), V] on the CPU: the stock model's logits at each point where a run sampled
    ``generated`` from ``prompt`` -- the prompt's last token (prefilled in chunks of
    ``prefill_chunk``), then each generated token but the last, fed one at a time."""
    device = next(model.parameters()).device
    cache, rows = _dynamic_cache(model), []
    with torch.no_grad():
        for ids in _chunks(prompt, prefill_chunk):
            hidden = model.model(input_ids=torch.tensor([ids], device=device),
                                 past_key_values=cache, use_cache=True).last_hidden_state
        rows.append(last_logits(model, hidden, [len(ids)]))
        for token in generated[:-1]:
            hidden = model.model(input_ids=torch.tensor([[token]], device=device),
                                 past_key_values=cache, use_cache=True).last_hidden_state
            rows.append(last_logits(model, hidden, [1]))
    return torch.cat(rows).float().cpu()


def stock_batch_logits(model, prompts: torch.Tensor, generated: torch.Tensor,
                       prefill_chunk: int) -> torch.Tensor:
    """[steps, R, V] in the model's dtype, on the CPU (where a run records its logits): the stock model over a batch of equal-length ``prompts``
    [R, L] prefilled in chunks, then teacher-forced on ``generated`` [R, steps] (a run's
    sampled tokens), the logits at each sampling point."""
    device = next(model.parameters()).device
    cache, steps = _dynamic_cache(model), []
    prompts, generated = prompts.to(device), generated.to(device)
    R = prompts.shape[0]
    with torch.no_grad():
        for start in range(0, prompts.shape[1], prefill_chunk):
            ids = prompts[:, start:start + prefill_chunk]
            hidden = model.model(input_ids=ids, past_key_values=cache,
                                 use_cache=True).last_hidden_state
        steps.append(last_logits(model, hidden, [ids.shape[1]] * R))
        for i in range(generated.shape[1] - 1):
            hidden = model.model(input_ids=generated[:, i:i + 1], past_key_values=cache,
                                 use_cache=True).last_hidden_state
            steps.append(last_logits(model, hidden, [1] * R))
    return torch.stack(steps).cpu()


@dataclass
class Comparison:
    """Where a run's logits and tokens differ from the reference's.

    ``max_diff`` / ``mean_diff``: the largest and the mean absolute logit difference;
    ``exact``: every logit bit-identical; ``token_mismatches``: (request, step, ours,
    reference's) where a greedy token is not the reference's argmax and the reference's two
    logits differ by more than ``near`` (``near_ties`` lists those within it)."""

    max_diff: float = 0.0
    mean_diff: float = 0.0
    exact: bool = True
    compared: int = 0
    token_mismatches: list = field(default_factory=list)
    near_ties: list = field(default_factory=list)

    def ok(self, tolerance: Tolerance) -> bool:
        """Whether the differences are within ``tolerance`` (always, when exact)."""
        if self.exact:
            return True
        if self.max_diff > tolerance.max_diff:
            return False
        if tolerance.mean_diff is not None and self.mean_diff > tolerance.mean_diff:
            return False
        return not (tolerance.tokens and self.token_mismatches)


def compare(requests, reference: dict, near: float = 0.0, greedy: bool = True) -> Comparison:
    """Compare each request's recorded logits (``Request.logits``) and, when ``greedy``, its
    tokens with ``reference[request_id]`` (float32[steps, V])."""
    result, total, count = Comparison(), 0.0, 0
    for req in requests:
        ours = torch.stack(req.logits).float()
        ref = reference[req.request_id].float()
        if ours.shape != ref.shape:
            raise ValueError(f"compare: request {req.request_id} has logits {tuple(ours.shape)}, "
                             f"the reference {tuple(ref.shape)}")
        diff = (ours - ref).abs()
        result.max_diff = max(result.max_diff, diff.max().item())
        total, count = total + diff.sum().item(), count + diff.numel()
        result.exact = result.exact and torch.equal(ours, ref)
        result.compared += ours.shape[0]
        if not greedy:
            continue
        best = ref.argmax(-1)
        for step, token in enumerate(req.generated):
            if token == int(best[step]):
                continue
            gap = (ref[step, best[step]] - ref[step, token]).item()
            where = (req.request_id, step, token, int(best[step]))
            (result.near_ties if gap <= near else result.token_mismatches).append(where)
    result.mean_diff = total / count if count else 0.0
    return result
