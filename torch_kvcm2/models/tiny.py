"""Tiny random DeepSeek-V3.2 / GLM-MoE-DSA models, built from an embedded config (no download).

Four layers, hidden 256, 8 heads, a 64 + 16 latent, MoE from layer 1, top-64 token selection.
The indexer has 16 heads: with few indexer heads random weights give exact score ties (many
scores are exactly 0 after the ReLU), and ``topk`` breaks ties differently for different
shapes, so two correct runs of different shapes could select different tokens.
"""
from __future__ import annotations

from .support import import_transformers

ARCHES = ("v32", "glm", "v4")

TINY = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=64,
    q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, index_topk=64,
    index_head_dim=32, index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=4096,
    bos_token_id=0, eos_token_id=1, pad_token_id=None)


#: DeepSeek-V4: one layer of each attention type and a second CSA layer (compressed sparse at
#: rate 4, heavily compressed at rate 16 instead of 128 so that short runs close its windows, and
#: sliding), a 16-token window, top-8 entries, 16 indexer heads (fewer make exact score ties)
TINY_V4 = dict(
    vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, head_dim=64, q_lora_rank=96, n_routed_experts=8,
    num_experts_per_tok=2, num_hash_layers=1, hc_mult=2, o_groups=2, o_lora_rank=32,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention", "sliding_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=16, index_n_heads=16, index_head_dim=32, index_topk=8,
    max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=None)

#: the real models' latent row (512 + 64) and indexer key (128): the shape the Triton sparse MLA
#: decode kernel reads (``sparse_mla``), for a tiny model that runs it
REAL_LATENT = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)

#: transformers' MoE computation a captured decode step needs: "grouped_mm" reads its expert
#: offsets on the host in fp32 on an H100 with torch 2.11 (a copy the capture refuses), while
#: "batched_mm" gathers each token's expert weights on the device
CAPTURABLE_EXPERTS = "batched_mm"


def tiny_config(arch: str = "v32", **overrides):
    """The tiny config of ``arch`` ("v32": DeepSeek-V3.2; "glm": GLM-MoE-DSA, whose odd layers
    share the previous layer's indexer; "v4": DeepSeek-V4), with ``overrides`` applied."""
    transformers = import_transformers()
    if arch not in ARCHES:
        raise ValueError(f"tiny_config: arch must be one of {ARCHES}, got {arch!r}")
    if arch == "v4":
        return transformers.DeepseekV4Config(**dict(TINY_V4, **overrides))
    fields = dict(TINY, **overrides)
    if arch == "v32":
        return transformers.DeepseekV32Config(**fields)
    layers = fields["num_hidden_layers"]
    fields.setdefault("indexer_types", ["full" if i % 2 == 0 else "shared"
                                        for i in range(layers)])
    return transformers.GlmMoeDsaConfig(**fields)


def model_class(config):
    """The ``...ForCausalLM`` class of a DeepSeek-V3.2 or GLM-MoE-DSA config."""
    transformers = import_transformers()
    classes = {"deepseek_v32": transformers.DeepseekV32ForCausalLM,
               "glm_moe_dsa": transformers.GlmMoeDsaForCausalLM,
               "deepseek_v4": transformers.DeepseekV4ForCausalLM}
    try:
        return classes[config.model_type]
    except KeyError:
        raise TypeError(f"torch_kvcm2.models supports model types {sorted(classes)}, not "
                        f"{config.model_type!r}") from None


def tiny_model(arch: str = "v32", dtype=None, seed: int = 0, attn_implementation: str = "sdpa",
               device="cpu", experts_implementation=None, **overrides):
    """A tiny random model of ``arch`` with weights from ``seed``, in eval mode (DeepSeek-V4
    always with eager attention, the only one it declares);
    ``experts_implementation`` names transformers' MoE computation (None: its default;
    ``CAPTURABLE_EXPERTS`` for a decode step captured as a CUDA graph)."""
    import torch

    config = tiny_config(arch, **overrides)
    config._attn_implementation = "eager" if arch == "v4" else attn_implementation
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()
