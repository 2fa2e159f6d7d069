"""Plain decoding under the overlap scheduler: step N+1 is launched before the host has read step
N's tokens, so a decode's input token ("future" chunk) comes from the device. This pool keeps each
running request's last sampled token there; the handle carries one step's results to the host
through pinned memory and one event."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.runtime.state_rows import StateRows


class PlainStatePool(StateRows):
    def __init__(self, max_requests: int, device: torch.device):
        super().__init__(max_requests, "plain decoding")
        self.last_token = torch.zeros(max_requests, dtype=torch.long, device=device)


@dataclass
class PlainStepHandle:
    """One launched plain step: where its sampled tokens (and logprobs) will be on the host."""

    iteration: int
    request_ids: list[str] = field(default_factory=list)  # the sampled rows, in order
    logprobs_wanted: dict[str, int] = field(default_factory=dict)  # request id -> top logprobs asked
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: torch.cuda.Event | None = None  # None on a CPU (the copies were synchronous)
    keep_alive: list = field(default_factory=list)  # device tensors the copies read
    prompt_logprob_rows: object | None = None  # runtime/prompt_logprobs.PromptLogprobRows of this step
    result: object | None = None  # its StepResult once collected
