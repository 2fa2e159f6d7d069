"""What the speculative worker needs from any draft model."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.llama import StepContext


class DraftModel(nn.Module):
    """A draft model maps (token, hidden) pairs to a new hidden state and draft logits.

    `token_offset` says where a token's KV lives in the draft cache: EAGLE-style heads pair token
    x[t+1] with the target's hidden state at t, so token i sits at draft position i - 1 (offset 1);
    a standalone model sits at position i (offset 0).
    `target_hidden` says what the target must hand over: "final" (after its last norm), "aux"
    (EAGLE-3: residual streams entering `aux_layer_ids`, concatenated) or None.
    """

    token_offset: int = 1
    target_hidden: str | None = "final"
    aux_layer_ids: tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
                ctx: StepContext, hidden_is_target: bool) -> torch.Tensor:
        """Returns the hidden state [N, H] to feed back at the next draft step (and to get logits from).
        `hidden_is_target` tells whether `hidden` came from the target or from this draft's last step."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [N, V_draft] in float32."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target vocabulary ids (identity unless the draft vocab is reduced)."""
        return draft_ids

    @property
    def num_kv_layers(self) -> int:
        raise NotImplementedError
