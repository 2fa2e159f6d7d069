"""A whole smaller model of the same tokenizer as the draft (e.g. a 1B model for an 8B target)."""

from __future__ import annotations

from tandem.models.draft_base import DraftModel


class StandaloneDraft(DraftModel):
    token_offset = 0  # an ordinary language model: token i at position i
    target_hidden = None

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, hidden, ctx, hidden_is_target):
        out, _ = self.model(input_ids, positions, ctx)
        return out

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)

    @property
    def num_kv_layers(self) -> int:
        return self.model.config.num_layers
