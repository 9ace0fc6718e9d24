"""P-SERVE's attention with DeepSeek-V3.2's own modules (``serve.py --attention mla``): per layer
transformers' ``DeepseekV32Attention`` with random bf16 weights at the run's shapes (real ones by
default: hidden 7168, 128 heads, q LoRA 1536, latent 512 + rope 64, nope 128, v 128; the DSA
indexer's 64 heads of 128), its indexer, and the absorbed decode a FlashMLA-style kernel
computes, over each row's K selected FP8 rows (656 B: the 512 latent values in FP8 with four
fp32 scales and the 64-value rope in bf16) with the project's sparse MLA kernel
(``torch_kvcm2.models.sparse_mla``: Triton on CUDA, torch on CPU):

    r = norm(q_a(x))
    indexer:   wq_b(r) [64 x 128], weights_proj(x)  ->  logits over every key of the row's
               pages (``torch_kvcm2.models.indexer_logits``: 132-byte FP8 keys, paged)
               ->  the top-K (serve.py --topk);      k_norm(wk(x)) for the new token's key
    attention: q_b(r)  ->  q_nope W_UK (absorbed), q_rope  ->  kernel over the K rows
               ->  W_UV  ->  o_proj;   kv_a(x) for the new token

Both sides run the same modules on the same inputs; both indexers read the keys in the dense
GPU pool through its page table; torch_kvcm2's attention kernel reads the cells through
resolve's index table, the baseline's the dense pool through its page table (entries
``page * P + token``). Random weights select no tokens of their own: the locality model's
selection (benchmarks/locality.py) overwrites its positions of the logits with the largest
finite float before the top-K, so the top-K is that selection while the indexer's work is all
done. The new token's latent and key are the stand-in's pattern made a valid FP8 row and key
(``fp8_rows``, ``fp8_keys``), so every check of the bytes stays; ``kv_a``, ``wk`` and
``k_norm`` run for their cost. The rotary embeddings of the queries are left out (elementwise,
a few µs). Needs transformers (``pip install -e .[models]``).
"""
from __future__ import annotations

import torch

from torch_kvcm2.models.indexer_logits import INDEX_DIM, KEY_BYTES, indexer_logits
from torch_kvcm2.models.sparse_mla import sparse_mla_decode

LATENT, ROPE = 512, 64  # the kernel's row: 512 latent values and 64 rope values


def fp8_rows(words: torch.Tensor) -> torch.Tensor:
    """int32[..., 164] of any bits -> the same shape as valid FP8 rows of the kernel: every
    latent byte an FP8 value of at most 240 (sign and top exponent bit cleared: never NaN), the
    four scales 1/64, every rope value a finite bf16 below 2 (in place; returns ``words``)."""
    words[..., :LATENT // 4] &= 0x77777777
    words[..., LATENT // 4:LATENT // 4 + 4] = 0x3C800000  # fp32 1/64
    words[..., LATENT // 4 + 4:] &= 0x3F7F3F7F
    return words


def fp8_keys(words: torch.Tensor) -> torch.Tensor:
    """int32[..., 33] of any bits -> valid FP8 indexer keys (132 B: 128 FP8 values of at most
    240, then the fp32 scale 1/64), in place; returns ``words``."""
    words[..., :INDEX_DIM // 4] &= 0x77777777
    words[..., INDEX_DIM // 4] = 0x3C800000  # fp32 1/64
    return words


def mla_param_bytes(shape) -> int:
    """Bytes of one layer's attention weights in bf16 at ``shape``'s sizes (q_a, q_b, kv_a,
    kv_b, o and the two norms; the indexer's wq_b, wk, its norm and weights_proj), as ``MLA``
    builds them."""
    qk = shape.nope + ROPE
    params = (shape.model_hidden * shape.q_lora + shape.q_lora * shape.heads * qk
              + shape.model_hidden * (LATENT + ROPE) + LATENT * shape.heads * (shape.nope + shape.v_dim)
              + shape.heads * shape.v_dim * shape.model_hidden + shape.q_lora + LATENT)
    indexer = (shape.q_lora * shape.index_heads * INDEX_DIM + shape.model_hidden * INDEX_DIM
               + 2 * INDEX_DIM + shape.model_hidden * shape.index_heads)
    return 2 * (params + indexer)


class MLA:
    """The layers' attention modules (built once per side) and their absorbed decode."""

    def __init__(self, shape, layers: int, device: str, seed: int = 0):
        if shape.key_bytes != KEY_BYTES:
            raise ValueError(f"--attention mla keeps the indexer's keys in FP8: --key-bytes must "
                             f"be {KEY_BYTES}, got {shape.key_bytes}")
        from torch_kvcm2.models.support import import_transformers
        transformers = import_transformers()
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention
        self.config = transformers.DeepseekV32Config(
            hidden_size=shape.model_hidden, num_attention_heads=shape.heads,
            num_key_value_heads=shape.heads, q_lora_rank=shape.q_lora, kv_lora_rank=LATENT,
            qk_rope_head_dim=ROPE, qk_nope_head_dim=shape.nope, v_head_dim=shape.v_dim,
            index_n_heads=shape.index_heads, index_head_dim=INDEX_DIM, index_topk=shape.top_k)
        torch.manual_seed(seed)
        with torch.device(device):
            self.modules = [DeepseekV32Attention(self.config, i).to(torch.bfloat16).eval()
                            .requires_grad_(False) for i in range(layers)]  # decode: no autograd
        first = self.modules[0]
        self.H, self.nope, self.v = first.num_heads, first.qk_nope_head_dim, first.v_head_dim
        self.param_bytes = sum(p.numel() * p.element_size() for p in first.parameters())
        assert self.param_bytes == mla_param_bytes(shape), "the modules' weights are not as sized"

    def hidden(self, rows: int, device: str) -> torch.Tensor:
        """The step's hidden states of ``rows`` rows (fixed: a decode step's input)."""
        g = torch.Generator(device="cpu").manual_seed(rows)
        return (torch.randn(rows, self.config.hidden_size, generator=g) * 0.5).to(
            device=device, dtype=torch.bfloat16)

    def indexer_inputs(self, layer: int, x: torch.Tensor) -> tuple:
        """Layer ``layer``'s indexer query bf16[R, IH, 128] and weights fp32[R, IH] (the softmax
        scale and IH^-0.5 folded in) for hidden states ``x``, and the query LoRA's output
        ``norm(q_a(x))`` the attention's query starts from."""
        m = self.modules[layer]
        ix = m.indexer
        resid = m.q_a_layernorm(m.q_a_proj(x))
        q = ix.wq_b(resid).view(x.shape[0], ix.n_heads, INDEX_DIM)
        weights = ix.weights_proj(x).float() * (ix.n_heads ** -0.5 * ix.softmax_scale)
        return q, weights, resid

    def index(self, layer: int, x: torch.Tensor, keys: torch.Tensor, pages: torch.Tensor,
              lengths: torch.Tensor, out: torch.Tensor, layout: str) -> torch.Tensor:
        """Layer ``layer``'s indexer: its logits over every key of the rows' pages written to
        ``out`` (``indexer_logits``: keys uint8[pages, P, 132] in ``layout``, the rows' page
        table, their history lengths), the new token's key projected; returns
        ``norm(q_a(x))`` for ``attend``."""
        q, weights, resid = self.indexer_inputs(layer, x)
        ix = self.modules[layer].indexer
        ix.k_norm(ix.wk(x))  # the new token's key (its bytes: the pattern)
        indexer_logits(q, weights, keys, pages, lengths, out=out, layout=layout)
        return resid

    def query(self, layer: int, resid: torch.Tensor) -> torch.Tensor:
        """bf16[R, H, 576]: the absorbed query of layer ``layer`` from ``norm(q_a(x))``."""
        m = self.modules[layer]
        q = m.q_b_proj(resid).view(resid.shape[0], self.H, -1)
        w_uk = m.kv_b_proj.weight.view(self.H, self.nope + self.v, LATENT)[:, :self.nope]
        q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), w_uk).transpose(0, 1)
        return torch.cat([q_latent, q[..., self.nope:]], dim=-1)

    def attend(self, layer: int, x: torch.Tensor, resid: torch.Tensor, rows: torch.Tensor,
               index: torch.Tensor) -> tuple:
        """Layer ``layer``'s decode over ``rows`` (uint8[N, 656] FP8 rows) at ``index``
        (int32[R, K], negative entries select nothing), from hidden states ``x`` and the
        ``resid`` its ``index`` returned: returns (the absorbed query, the kernel's output
        latents bf16[R, H, 512], the layer's output bf16[R, hidden])."""
        m = self.modules[layer]
        q = self.query(layer, resid)
        latent = sparse_mla_decode(q, rows, index, m.scaling)
        w_uv = m.kv_b_proj.weight.view(self.H, self.nope + self.v, LATENT)[:, self.nope:]
        o = torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        m.kv_a_proj_with_mqa(x)  # the new token's latent projection (its bytes: the pattern)
        return q, latent, m.o_proj(o.reshape(x.shape[0], -1))

    def flops(self, rows: int, k: int, span: int) -> float:
        """FLOPs of one layer's decode for ``rows`` rows over ``k`` selected rows of ``span``
        keys scored: the projections' products, the indexer's 2 IH 128 per key and the
        kernel's 2 H K (576 + 512) per row."""
        ih = self.config.index_n_heads
        return 2.0 * rows * (self.param_bytes / 2 + ih * INDEX_DIM * span
                             + self.H * k * (LATENT + ROPE + LATENT))
