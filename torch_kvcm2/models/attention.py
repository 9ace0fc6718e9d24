"""The replacement attention forward of DeepSeek-V3.2 and GLM-MoE-DSA layers (MOD-1).

``install(model)`` gives each attention module of the model a forward that, when the cache it
is handed is a ``SparseMLACache``, computes the projections as the stock forward does, runs the
indexer first (the stock indexer module, whose key cache is the dense pool), and leaves the
cache work and the attention over the selected latents to the cache object. Given any other
cache (transformers' ``DynamicCache``, or none) it runs the stock forward unchanged, so one
model instance serves both a torch_kvcm2 run and its stock reference.

Registering an attention function with transformers' ``AttentionInterface`` is not enough:
by the time it is called every cached latent has been expanded through ``kv_b_proj``, and the
indexer has already run against the stock cache.
"""
from __future__ import annotations

import sys
import types

from .layout import group_id, layer_name
from .support import describe

_MARK = "_torch_kvcm2_sparse_forward"


def install(model, allow_untested: bool = False):
    """Give every attention module of ``model`` (a ``DeepseekV32ForCausalLM`` or
    ``GlmMoeDsaForCausalLM``) the sparse forward. Idempotent; only this instance changes (the
    class keeps its forward). Returns the model's ``ModelSpec``; raises what ``describe``
    raises for an unsupported model or transformers version."""
    spec = describe(model, allow_untested)
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        # constants the cache reads per layer (dsa_cache.module_layer)
        attention._torch_kvcm2_layer = (layer_name(i), group_id(spec.leader[i]),
                                        spec.leader[i] == i)
        if getattr(attention, _MARK, False):
            continue
        attention.forward = types.MethodType(_sparse_forward, attention)
        setattr(attention, _MARK, True)
    return spec


def _sparse_forward(self, hidden_states, position_embeddings, attention_mask,
                    past_key_values=None, position_ids=None, prev_topk_indices=None, **kwargs):
    from .dsa_cache import SparseMLACache

    shares_topk = hasattr(self, "skip_topk")  # GLM: takes and returns the previous top-k
    if not isinstance(past_key_values, SparseMLACache):
        extra = {"prev_topk_indices": prev_topk_indices} if shares_topk else {}
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  past_key_values=past_key_values, position_ids=position_ids,
                                  **extra, **kwargs)
    modeling = sys.modules[type(self).__module__]
    batch_size, seq_length = hidden_states.shape[:-1]
    query_shape = (batch_size, seq_length, -1, self.qk_head_dim)

    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(query_shape).transpose(1, 2)
    q_pass, q_rot = q_states.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = compressed_kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(batch_size, 1, seq_length, self.kv_lora_rank)
    k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)

    if self.indexer is not None:  # the stock indexer; its keys live in the dense pool
        past_key_values.indexing = self._torch_kvcm2_layer[0]
        topk = self.indexer(hidden_states, q_resid, position_embeddings, attention_mask[:, 0],
                            position_ids, past_key_values=past_key_values)
    elif prev_topk_indices is None:
        raise ValueError("a shared DSA layer needs the top-k of a previous full indexer layer")
    else:
        topk = prev_topk_indices
    out = past_key_values.attend(self, q_pass, q_rot, k_pass, k_rot, topk, attention_mask, kwargs)
    out = self.o_proj(out.reshape(batch_size, seq_length, -1).contiguous())
    return (out, None, topk) if shares_topk else (out, None)


def installed(model) -> bool:
    """Whether ``install`` has given this model the sparse forward."""
    return all(getattr(layer.self_attn, _MARK, False) for layer in model.model.layers)


__all__ = ["install", "installed", "describe"]
