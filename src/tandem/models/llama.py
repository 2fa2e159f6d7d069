"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) as plain `nn.Module`s.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are stored merged
(`qkv_proj`, `gate_up_proj`); `PACKED_MODULES` tells the loader where each checkpoint tensor goes.

Tensor parallelism (`tp`, a `TPGroup` of size > 1): each rank holds num_heads / tp query heads and
their KV heads (replicated when there are fewer KV heads than ranks), and intermediate / tp MLP
columns; q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel (one all-reduce
each), the embedding and lm_head vocabulary-parallel. Without `tp` (drafts) everything is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tandem.layers.attention.base import AttentionBackend
from tandem.distributed.parallel_state import TPGroup, kv_heads_layout, split_evenly
from tandem.layers.fused import kernels, use_fused
from tandem.layers.linear import Linear, MergedLinear, RowParallelLinear, default_weight_loader
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from tandem.models.hf_config import ModelArchConfig

# checkpoint name fragment -> (our parameter's name fragment, shard id)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


@dataclass
class StepContext:
    """Everything a forward pass needs besides the tokens; passed explicitly, never global."""

    backend: AttentionBackend
    metadata: object  # from backend.plan()
    k_caches: list[torch.Tensor]  # per layer [num_slots, kv_heads, D]
    v_caches: list[torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int, rotary: RotaryEmbedding, in_features: int | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.layer_id = layer_id
        self.num_heads = split_evenly(cfg.num_heads, tp.size, "num_attention_heads")  # on this rank
        self.num_kv_heads, kv_block = kv_heads_layout(cfg.num_kv_heads, tp)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        num_kv_blocks = cfg.num_kv_heads // self.num_kv_heads
        blocks = {"q": (tp.rank, tp.size), "k": (kv_block, num_kv_blocks), "v": (kv_block, num_kv_blocks)}
        # in_features differs from hidden_size only in EAGLE-3's draft layer (embedding and hidden side by side).
        self.qkv_proj = MergedLinear(in_features or cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size},
                                     cfg.qkv_bias, shard_blocks=blocks if tp.size > 1 else None)
        if tp.size > 1:
            self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        else:
            self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:  # Qwen3 normalises each head's q and k before the rotation
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary  # shared by all layers; not a parameter

    def project(self, positions: torch.Tensor, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """q, k, v of x [N, heads or kv_heads, D], rotated. Given `slot_mapping` (a backend that reads k/v
        from the cache only), k and v are also written to those cache slots where the fused kernel
        applies; the last value says whether they were (else the backend's forward stores them)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        stored = slot_mapping is not None and self.rotary.rotate_and_store_(
            positions, q, k, v, k_cache, v_cache, slot_mapping)
        if not stored:
            q, k = self.rotary(positions, q, k)
        return q, k, v, stored

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        k_cache, v_cache = ctx.k_caches[self.layer_id], ctx.v_caches[self.layer_id]
        q, k, v, stored = self.project(positions, x, k_cache, v_cache, store_slots(ctx))
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.metadata, self.scale, kv_stored=stored)
        return self.o_proj(out.reshape(x.shape[0], -1))


def store_slots(ctx: StepContext) -> torch.Tensor | None:
    """The slots a layer writes its k/v to itself, or None where the backend's forward stores them."""
    return ctx.metadata.slot_mapping if ctx.backend.accepts_stored_kv else None


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        local = split_evenly(intermediate, tp.size, "intermediate_size")
        blocks = {"gate": (tp.rank, tp.size), "up": (tp.rank, tp.size)} if tp.size > 1 else None
        self.gate_up_proj = MergedLinear(hidden, {"gate": local, "up": local}, bias, shard_blocks=blocks)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp) if tp.size > 1 else \
            Linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_fused(gate_up) and gate_up.stride(-1) == 1:
            return self.down_proj(kernels().silu_mul(gate_up))  # gate and up halves, as stored
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary, tp=tp)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx, residual: torch.Tensor | None = None):
        """Returns (out, residual); the residual stream after this layer is out + residual. The add
        is left to the next norm, which fuses it (one kernel on a GPU instead of two): pass the
        previous layer's pair as (x, residual), or the stream itself as x with residual None."""
        attn = self.self_attn
        k_cache, v_cache = ctx.k_caches[attn.layer_id], ctx.v_caches[attn.layer_id]
        q, k, v, stored, residual = self.attention_input(positions, x, residual, k_cache, v_cache, store_slots(ctx))
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.metadata, attn.scale, kv_stored=stored)
        return self.attention_output(out, residual)

    # The two halves around attention, also run on their own (piecewise CUDA graphs: runtime/piecewise_graphs.py).
    def attention_input(self, positions, x, residual, k_cache, v_cache, slot_mapping):
        """The input norm (with the residual add) and q/k/v: returns (q, k, v, stored, residual)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        return (*self.self_attn.project(positions, h, k_cache, v_cache, slot_mapping), residual)

    def attention_output(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """o_proj, the post-attention norm (with the residual add) and the MLP: returns (out, residual)."""
        h = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        h, residual = self.post_attention_layernorm(h, residual=residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        if tp is not None and tp.size > 1:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens.weight.weight_loader = default_weight_loader
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup.single()
        self.model = LlamaModel(cfg, max_positions, self.tp)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        elif self.tp.size > 1:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        ctx: StepContext,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final hidden states [N, H] (after the last norm) and, for each id in
        `aux_layer_ids`, the residual stream entering that layer (EAGLE-3's auxiliary states)."""
        x, residual = self.model.embed_tokens(input_ids), None
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layer_ids:
                captured[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, ctx, residual)
        x, captured[len(self.model.layers)] = self.model.norm(x, residual=residual)  # "entering layer L"
        return x, [captured[i] for i in aux_layer_ids]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:  # every rank gets the full-vocabulary logits (all-gather)
            return self.model.embed_tokens.logits(hidden, None if self.lm_head is None else self.lm_head.weight)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)
