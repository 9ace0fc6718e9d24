"""What the model integration supports, checked before anything is built (MOD-1).

transformers is imported here and only here, on first use, so ``import torch_kvcm2`` and
``import torch_kvcm2.models`` never need it. ``describe(model)`` reads everything the cache
layout and the attention forward need from a model instance and refuses, naming the reason, a
model class, attention implementation or transformers version the integration was not written
and tested for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

#: transformers versions the integration is tested with (the ``[models]`` extra's range).
TESTED_TRANSFORMERS = ("5.17.0", "5.23.0")
OLDEST, NEWEST = (5, 17), (5, 23)

#: model class name -> short architecture name
SUPPORTED_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": "v32",
    "GlmMoeDsaForCausalLM": "glm",
}

#: attention implementations whose masks the integration builds (bool for sdpa, float for eager)
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def _version_tuple(text: str) -> tuple:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def import_transformers(allow_untested: bool = False):
    """The transformers module, after checking its version is one the integration is tested
    with (5.17 to 5.23). Raises ImportError naming the extra when it is missing, RuntimeError
    for a version outside the range (``allow_untested=True`` skips the version check)."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "torch_kvcm2.models needs transformers (tested with "
            f"{' and '.join(TESTED_TRANSFORMERS)}): pip install 'torch_kvcm2[models]'") from error
    version = _version_tuple(transformers.__version__)
    if not allow_untested and not OLDEST <= version <= NEWEST:
        raise RuntimeError(
            f"torch_kvcm2.models: transformers {transformers.__version__} is untested; the "
            f"integration replaces the attention forward of DeepSeek-V3.2 and GLM-MoE-DSA and is "
            f"tested with transformers {' and '.join(TESTED_TRANSFORMERS)} (install "
            f"'torch_kvcm2[models]', or pass allow_untested=True at your own risk)")
    return transformers


@dataclass(frozen=True)
class ModelSpec:
    """What the cache and the attention forward need to know about a model.

    ``leader[i]`` is the layer whose indexer selects for layer ``i`` (``i`` itself for a layer
    with its own indexer; GLM's "shared" layers name the previous "full" layer), so the layers
    with one leader are one selection group."""

    arch: str
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    index_topk: int
    index_head_dim: int
    leader: tuple
    dtype: object
    attn_implementation: str

    @property
    def latent_dim(self) -> int:
        """Elements of one cached token: the normalised latent, then the rotated rope part."""
        return self.kv_lora_rank + self.rope_dim

    def has_indexer(self, layer: int) -> bool:
        return self.leader[layer] == layer

    @property
    def leaders(self) -> tuple:
        return tuple(i for i in range(self.num_layers) if self.has_indexer(i))

    def group_layers(self, leader: int) -> tuple:
        return tuple(i for i in range(self.num_layers) if self.leader[i] == leader)


def _leaders(config, arch: str, num_layers: int) -> tuple:
    if arch == "v32":
        return tuple(range(num_layers))
    types = list(getattr(config, "indexer_types", None) or ["full"] * num_layers)
    if len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise ValueError(f"torch_kvcm2.models: indexer_types must name 'full' or 'shared' for "
                         f"each of the {num_layers} layers, got {types!r}")
    leader, last = [], None
    for i, kind in enumerate(types):
        if kind == "full":
            last = i
        elif last is None:
            raise ValueError(f"torch_kvcm2.models: layer {i} is a 'shared' indexer layer with no "
                             f"'full' layer before it to share with")
        leader.append(last)
    return tuple(leader)


def describe(model, allow_untested: bool = False) -> ModelSpec:
    """The ``ModelSpec`` of a ``DeepseekV32ForCausalLM`` or ``GlmMoeDsaForCausalLM`` instance.

    Raises TypeError for another model class, ValueError for a configuration the forward does
    not handle (no ``q_lora_rank``, an attention implementation other than sdpa or eager,
    layers without the expected modules), and what ``import_transformers`` raises."""
    import_transformers(allow_untested)
    name = type(model).__name__
    arch = SUPPORTED_ARCHITECTURES.get(name)
    if arch is None:
        raise TypeError(
            f"torch_kvcm2.models supports {', '.join(SUPPORTED_ARCHITECTURES)} (transformers' own "
            f"definitions), not {name}")
    config = model.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"torch_kvcm2.models: attention implementation {implementation!r} is not supported "
            f"(use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}: attn_implementation='sdpa')")
    if getattr(config, "q_lora_rank", None) is None:
        raise ValueError("torch_kvcm2.models: the indexer needs q_lora_rank (the query's "
                         "low-rank residual); this config has none")
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        missing = [a for a in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                               "kv_a_layernorm", "kv_b_proj", "o_proj", "expand_kv", "scaling")
                   if not hasattr(attention, a)]
        if missing:
            raise ValueError(f"torch_kvcm2.models: layer {i}'s attention lacks {missing} "
                             f"(a transformers version whose {name} differs from the tested ones)")
    num_layers = len(layers)
    leader = _leaders(config, arch, num_layers)
    for i in range(num_layers):
        if (layers[i].self_attn.indexer is not None) != (leader[i] == i):
            raise ValueError(f"torch_kvcm2.models: layer {i} has "
                             f"{'an' if leader[i] != i else 'no'} indexer, which its "
                             f"indexer_types entry contradicts")
    return ModelSpec(
        arch=arch, num_layers=num_layers, num_heads=config.num_attention_heads,
        kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim,
        nope_dim=config.qk_nope_head_dim, v_dim=config.v_head_dim,
        index_topk=config.index_topk, index_head_dim=config.index_head_dim, leader=leader,
        dtype=next(model.parameters()).dtype, attn_implementation=implementation)


def stock_caches_latents(model) -> Optional[bool]:
    """Whether transformers' own attention forward of this model stores the compressed latents
    in its cache (5.23: ``update(k_pass, k_rot)``) rather than the expanded keys and values
    (5.17: ``update(key_states, value_states)`` after ``kv_b_proj``). Only with latents does the
    stock dense cache compute exactly what the scatter-back mode computes: expanded keys of old
    tokens are results of matrix products of other shapes, which differ in the last bits
    (docs/MODELS.md). Probed by running layer 0's stock attention forward on one token with a
    cache that records what it is given."""
    import torch

    attention = model.model.layers[0].self_attn
    kv_lora_rank = model.config.kv_lora_rank
    seen = {}

    class Probe:
        def update(self, first, second, layer_idx, *args, **kwargs):
            seen["latent"] = first.shape[1] == 1 and first.shape[-1] == kv_lora_rank
            raise _ProbeDone

        def update_indexer(self, keys, layer_idx, *args, **kwargs):
            return keys

    hidden = torch.zeros(1, 1, model.config.hidden_size, dtype=next(model.parameters()).dtype,
                         device=next(model.parameters()).device)
    positions = torch.zeros(1, 1, dtype=torch.long, device=hidden.device)
    cos_sin = model.model.rotary_emb(hidden, positions)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=hidden.device)
    try:
        with torch.no_grad():
            type(attention).forward(attention, hidden_states=hidden, position_embeddings=cos_sin,
                                    attention_mask=mask, past_key_values=Probe(),
                                    position_ids=positions)
    except _ProbeDone:
        pass
    return seen.get("latent")


class _ProbeDone(Exception):
    pass
