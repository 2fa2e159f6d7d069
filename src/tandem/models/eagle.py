"""EAGLE-1/2 draft head (public `EAGLE-LLaMA3-Instruct-8B` format).

h = fc(cat[embed(x[t+1]), f_t]); one decoder layer with no input norm; no final norm; logits come
from the target's lm_head. f_t is the target's final hidden state on the first step, then the
head's own output.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.distributed.parallel_state import TPGroup
from tandem.layers.linear import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.draft_base import DraftModel
from tandem.models.hf_config import ModelArchConfig
from tandem.models.llama import LlamaAttention, LlamaMLP


class EagleDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, 0, rotary, tp=tp)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx):
        # EAGLE drops layer 0's input norm; the residual add is fused into the post-attention norm.
        normed, x = self.post_attention_layernorm(self.self_attn(positions, x, ctx), residual=x)
        return x + self.mlp(normed)


class EagleDraft(DraftModel):
    token_offset = 1
    target_hidden = "final"

    def __init__(self, cfg: ModelArchConfig, target, max_positions: int, tp: TPGroup | None = None):
        """`tp`: split the decoder layer like the target's (fc stays whole on every rank)."""
        super().__init__()
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=bool(cfg.raw.get("bias", True)))
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList([EagleDecoderLayer(cfg, rotary, tp)])
        # Shared with the target, not owned: plain callables so they are not registered as submodules.
        self._embed = target.embed
        self._logits = target.compute_logits

    def forward(self, input_ids, positions, hidden, ctx, hidden_is_target):
        x = self.fc(torch.cat([self._embed(input_ids), hidden], dim=-1))
        return self.layers[0](positions, x, ctx)

    def compute_logits(self, hidden):
        return self._logits(hidden)

    @property
    def num_kv_layers(self) -> int:
        return 1
