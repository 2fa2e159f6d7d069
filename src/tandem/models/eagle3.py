"""EAGLE-3 draft head (public `EAGLE3-LLaMA3.1-Instruct-8B` format).

g = fc(cat[h_low, h_mid, h_high]) from three target layers (first step only; later steps feed the
head's own pre-norm output as g); a = attn(cat[input_ln(embed(x)), hidden_norm(g)]); h = g + a;
h = h + mlp(post_ln(h)); logits = lm_head(norm(h)) over a reduced draft vocabulary, draft id i
meaning target id i + d2t[i].
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


def eagle3_aux_layer_ids(draft_raw_config: dict, num_target_layers: int) -> tuple[int, ...]:
    ids = (draft_raw_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        n = num_target_layers
        return (2, n // 2, n - 3) if n >= 4 else (0, n // 2, n - 1)
    # Checkpoints name the layer whose *output* is taken (HF hidden_states[i + 1]); that is the
    # residual stream entering layer i + 1.
    return tuple(int(i) + 1 for i in ids)


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, tp: TPGroup | None = None):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = LlamaAttention(cfg, 0, rotary, in_features=2 * h, tp=tp)
        self.mlp = LlamaMLP(h, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, positions, embeds, g, ctx):
        a = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1), ctx)
        normed, h = self.post_attention_layernorm(a, residual=g)  # h = g + a, the add fused into the norm
        return h + self.mlp(normed)


class Eagle3Draft(DraftModel):
    token_offset = 1
    target_hidden = "aux"

    def __init__(self, cfg: ModelArchConfig, target, max_positions: int, aux_layer_ids: tuple[int, ...],
                 tp: TPGroup | None = None):
        """`tp`: split the decoder layer like the target's; fc and the (small) lm_head stay whole on
        every rank, so the draft's logits need no gather."""
        super().__init__()
        h = cfg.hidden_size
        target_h = int(cfg.raw.get("target_hidden_size") or target.config.hidden_size)
        self.aux_layer_ids = aux_layer_ids
        self.draft_vocab_size = int(cfg.raw.get("draft_vocab_size") or cfg.vocab_size)
        self.fc = Linear(len(aux_layer_ids) * target_h, h, bias=False)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.midlayer = Eagle3MidLayer(cfg, rotary, tp)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, self.draft_vocab_size, bias=False)
        # d2t[i] = target id - draft id; stored as a frozen integer parameter so it loads like a weight.
        self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.long), requires_grad=False)
        self._embed = target.embed  # the target's embedding, shared (EAGLE-3 trains with it frozen)

    def forward(self, input_ids, positions, hidden, ctx, hidden_is_target):
        g = self.fc(hidden) if hidden_is_target else hidden
        return self.midlayer(positions, self._embed(input_ids), g, ctx)

    def compute_logits(self, hidden):
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    @property
    def num_kv_layers(self) -> int:
        return 1
