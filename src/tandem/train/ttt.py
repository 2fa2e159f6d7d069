"""Training-time test (TTT): the head is unrolled for several draft steps, as inference runs it.

Draft position t of a sequence x pairs input token x[t+1] with the target's aux state at t (what
`speculative/drafter.py` feeds). At TTT step j (1-based), position t:
- input token x[t+j] (ground truth);
- g = fc(aux_t) for j = 1, else the head's own pre-norm output of step j-1 at t (fc skipped);
- rope position t + j - 1 (inference: base + depth - 1);
- attention: step-1 keys at positions <= t, and steps 2..j at t only (see train/attention.py);
- it predicts x[t+j+1]; the label is the target's distribution at position t+j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.llama import StepContext
from tandem.train.attention import DenseTTTAttention, GridMetadata, new_caches


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, t + n] at column t; the last n columns get `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_forward(head, input_ids: torch.Tensor, aux: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
    """Pre-norm hidden states [B, T, H] of every step (index j-1 for step j)."""
    b, t = input_ids.shape
    k_caches, v_caches = new_caches(head.num_kv_layers)
    ctx = StepContext(DenseTTTAttention(), GridMetadata(b, t), k_caches, v_caches)
    base = torch.arange(t, device=input_ids.device).repeat(b)
    g = aux.reshape(b * t, -1)
    outs = []
    for j in range(1, num_steps + 1):
        tokens = shift_left(input_ids, j, 0).reshape(-1)
        g = head(tokens, base + (j - 1), g, ctx, hidden_is_target=(j == 1))
        outs.append(g.view(b, t, -1))
    return outs


@dataclass
class TTTLoss:
    loss: torch.Tensor  # scalar, weighted sum over steps
    step_losses: list[float]  # per step, unweighted
    step_correct: list[int]  # positions where the head's argmax is the target's argmax
    step_count: list[int]  # positions scored


def ttt_loss(head, hiddens: list[torch.Tensor], valid: torch.Tensor, target_probs: torch.Tensor,
             target_argmax: torch.Tensor, step_loss_decay: float) -> TTTLoss:
    """Soft cross-entropy against the target's (draft-vocab-restricted) distribution, per step.

    valid [B, T]: real tokens. Step j at t is scored when x[t+j] is real (its label, the target's
    distribution at t+j, then exists)."""
    total = 0.0
    losses, correct, count = [], [], []
    seq_len = valid.shape[1]
    for j, h in enumerate(hiddens, start=1):
        if j >= seq_len:  # no position has a label this far ahead
            losses.append(0.0)
            correct.append(0)
            count.append(0)
            continue
        # position t of step j is labelled by the target at t + j
        mask, labels = valid[:, j:], target_probs[:, j:]  # [B, T-j], [B, T-j, V_draft]
        logp = torch.log_softmax(head.compute_logits(h[:, :seq_len - j]), dim=-1)
        ce = -(labels * logp).sum(-1)  # [B, T-j]
        n = mask.sum()
        step_loss = (ce * mask).sum() / n.clamp_min(1)
        total = total + step_loss_decay ** (j - 1) * step_loss
        with torch.no_grad():
            hit = (head.to_target_ids(logp.argmax(-1)) == target_argmax[:, j:]) & mask
        losses.append(float(step_loss.detach()))
        correct.append(int(hit.sum()))
        count.append(int(n))
    return TTTLoss(total, losses, correct, count)


def estimated_accept_length(step_accuracy: list[float]) -> float:
    """Chain acceptance length if step j's draft is accepted with probability acc_j given the
    earlier ones were: 1 + a1 + a1*a2 + ..."""
    tau, run = 1.0, 1.0
    for a in step_accuracy:
        run *= a
        tau += run
    return tau
