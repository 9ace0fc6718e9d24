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

#: the largest logit difference ``compare`` accepts, per dtype, in the modes that are not exact:
#: fp32 sums in another order (absorption, other batch shapes) move logits by ~1e-6; bf16 rounds
#: every product to 8 bits of mantissa, so a logit of magnitude ~4 moves by up to a few 1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}


def _dynamic_cache(model):
    return import_transformers().DynamicCache(config=model.config)


def _chunks(tokens: Sequence[int], chunk: int):
    for start in range(0, len(tokens), chunk):
        yield list(tokens[start:start + chunk])


def stock_request_logits(model, prompt: Sequence[int], generated: Sequence[int],
                         prefill_chunk: int) -> torch.Tensor:
    """float32[len(generated), V]: the stock model's logits at each point where a run sampled
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
    return torch.cat(rows).float()


def stock_batch_logits(model, prompts: torch.Tensor, generated: torch.Tensor,
                       prefill_chunk: int) -> torch.Tensor:
    """float-typed [steps, R, V]: the stock model over a batch of equal-length ``prompts``
    [R, L] prefilled in chunks, then teacher-forced on ``generated`` [R, steps] (a run's
    sampled tokens), the logits at each sampling point, in the model's dtype."""
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
    return torch.stack(steps)


@dataclass
class Comparison:
    """Where a run's logits and tokens differ from the reference's.

    ``max_diff``: the largest absolute logit difference; ``exact``: every logit bit-identical;
    ``token_mismatches``: (request, step, ours, reference's) where a greedy token differs from
    the reference's argmax by more than a near tie (the two logits within ``tolerance``);
    ``near_ties``: differing tokens within that margin."""

    max_diff: float = 0.0
    exact: bool = True
    compared: int = 0
    token_mismatches: list = field(default_factory=list)
    near_ties: list = field(default_factory=list)

    def ok(self, tolerance: float, need_exact: bool = False) -> bool:
        if need_exact:
            return self.exact
        return self.max_diff <= tolerance and not self.token_mismatches


def compare(requests, reference: dict, tolerance: float, greedy: bool = True,
            into: Optional[Comparison] = None) -> Comparison:
    """Compare each request's recorded logits (``Request.logits``) and, when ``greedy``, its
    tokens with ``reference[request_id]`` (float32[steps, V])."""
    result = into or Comparison()
    for req in requests:
        ours = torch.stack(req.logits).float()
        ref = reference[req.request_id].float()
        if ours.shape != ref.shape:
            raise ValueError(f"compare: request {req.request_id} has logits {tuple(ours.shape)}, "
                             f"the reference {tuple(ref.shape)}")
        diff = (ours - ref).abs().max().item() if ours.numel() else 0.0
        result.max_diff = max(result.max_diff, diff)
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
            (result.near_ties if gap <= tolerance else result.token_mismatches).append(where)
    return result
