"""Each running request's sampling parameters as device tensors, indexed by its state row.

Written once when a request is admitted (its first prefill chunk, or its recompute after preemption),
read by every step through `metadata(rows, positions)`: a few gathers on the device, nothing built per
step on the host, so a step's sampling inputs need no host value and fit in a CUDA graph.

Penalties need each request's output-token counts and the set of its prompt tokens ([rows, vocab] each).
They are allocated when the first penalised request arrives, or at start-up when CUDA graphs are
captured (the graph of penalised steps reads them: 10 bytes per row and vocabulary entry, 92 MB for a
128k vocabulary and 72 rows), and from then on updated on the device by the tokens every step produces
(`add_outputs`), so a penalised request never waits for the host.
"""

from __future__ import annotations

import torch

from tandem.layers.sampler import SamplingMetadata
from tandem.request import SamplingParams

_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "frequency_penalty",
           "presence_penalty")


class SamplingState:
    def __init__(self, num_rows: int, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        f32 = dict(dtype=torch.float32, device=device)
        self.temperature = torch.zeros(num_rows, **f32)
        self.top_k = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.top_p = torch.ones(num_rows, **f32)
        self.min_p = torch.zeros(num_rows, **f32)
        self.seed = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.repetition_penalty = torch.ones(num_rows, **f32)
        self.frequency_penalty = torch.zeros(num_rows, **f32)
        self.presence_penalty = torch.zeros(num_rows, **f32)
        self.output_counts: torch.Tensor | None = None  # [rows, V] float32
        self.prompt_mask: torch.Tensor | None = None  # [rows, V] bool
        # logit_bias and min_tokens, allocated with the penalty tables (the same stage applies them).
        self.logit_bias: torch.Tensor | None = None  # [rows, V] float32
        self.suppress: torch.Tensor | None = None  # [rows, V] bool: not drawable before min_tokens
        self.min_tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.num_prompt = torch.zeros(num_rows, dtype=torch.int64, device=device)
        # Per row, the tokens (prompt + outputs) its request had when admitted: a recompute after
        # preemption re-feeds earlier outputs, which count as outputs; later ones were counted when sampled.
        self.admitted_len = [0] * num_rows

    def admit_chunk(self, row: int, chunk) -> None:
        """For a chunk of known tokens (a ScheduledChunk): its first chunk (re)writes the row's parameters;
        every chunk adds its tokens to the penalty state (a first chunk after a prefix-cache hit, the
        cached tokens before it too: the penalties see the whole prompt)."""
        if chunk.first_chunk:
            self.admitted_len[row] = chunk.request_len
            self.admit(row, chunk.sampling_params, chunk.seed, chunk.num_prompt_tokens, chunk.suppress_ids)
        # Only a penalised row reads its counts and prompt set (a neutral row's weights ignore them).
        if self.output_counts is not None and chunk.sampling_params.needs_penalties:
            if chunk.first_chunk and chunk.cached_token_ids:
                self.record_known_tokens(row, chunk.cached_token_ids, 0, chunk.num_prompt_tokens,
                                         self.admitted_len[row])
            self.record_known_tokens(row, chunk.token_ids, chunk.start_pos, chunk.num_prompt_tokens,
                                     self.admitted_len[row])

    def admit(self, row: int, params: SamplingParams, seed: int, num_prompt: int = 0,
              suppress_ids: tuple[int, ...] = ()) -> None:
        """Writes a request's parameters into its row and clears its counts. Each value is a fill kernel's
        argument: `t[row] = value` copies it from pageable host memory, which waits for the device's queue
        (measured: ten such waits per admission, so a new request stalled the host behind the step in flight)."""
        # float(): a Python int such as 10**30 is a valid temperature but no int64 holds it.
        values = dict(temperature=float(params.temperature), top_k=params.top_k, top_p=float(params.top_p),
                      min_p=float(params.min_p), seed=seed, repetition_penalty=float(params.repetition_penalty),
                      frequency_penalty=float(params.frequency_penalty),
                      presence_penalty=float(params.presence_penalty))
        for name in _FIELDS:
            getattr(self, name)[row].fill_(values[name])
        if params.needs_penalties:
            self.allocate_penalty_tables()
        self.min_tokens[row].fill_(params.min_tokens)
        self.num_prompt[row].fill_(num_prompt)
        if self.output_counts is not None:
            self.output_counts[row].zero_()
            self.prompt_mask[row].zero_()
            self.logit_bias[row].zero_()
            self.suppress[row].zero_()
            if params.logit_bias:
                ids = [t for t in params.logit_bias if t < self.vocab]  # ids past the vocabulary: no token
                self.logit_bias[row, self._upload(ids)] = self._upload(
                    [float(params.logit_bias[t]) for t in ids], torch.float32)
            self._add(self.suppress, row, [t for t in suppress_ids if t < self.vocab])

    def allocate_penalty_tables(self) -> None:
        if self.output_counts is not None:
            return
        rows = self.temperature.shape[0]
        self.output_counts = torch.zeros(rows, self.vocab, dtype=torch.float32, device=self.device)
        self.prompt_mask = torch.zeros(rows, self.vocab, dtype=torch.bool, device=self.device)
        self.logit_bias = torch.zeros(rows, self.vocab, dtype=torch.float32, device=self.device)
        self.suppress = torch.zeros(rows, self.vocab, dtype=torch.bool, device=self.device)

    def record_known_tokens(self, row: int, token_ids, start_pos: int, num_prompt: int, admitted_len: int) -> None:
        """Penalty state for a chunk of known tokens at [start_pos, ...): prompt tokens into the prompt set,
        outputs produced before admission (a recompute re-feeds them) into the counts. Outputs sampled
        since admission were counted on the device when sampled."""
        positions = range(start_pos, start_pos + len(token_ids))
        prompt = [t for p, t in zip(positions, token_ids) if p < num_prompt]
        earlier_outputs = [t for p, t in zip(positions, token_ids) if num_prompt <= p < admitted_len]
        self._add(self.prompt_mask, row, prompt)
        self._add(self.output_counts, row, earlier_outputs)

    def _upload(self, values: list, dtype=torch.int64) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _add(self, table: torch.Tensor, row: int, tokens: list[int]) -> None:
        if not tokens:
            return
        ids = self._upload(tokens)
        if table.dtype == torch.bool:
            table[row, ids] = True
        else:
            table[row].index_add_(0, ids, torch.ones(ids.shape[0], dtype=table.dtype, device=self.device))

    def add_outputs(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts produced tokens on the device. rows: [B]; tokens: [B, Q] with -1 where no token."""
        if self.output_counts is None:
            return
        valid = tokens >= 0
        # One accumulate per token (no [B, V] delta: every graphed step runs this once the tables exist);
        # an invalid entry adds 0 to column 0.
        flat = rows[:, None] * self.vocab + tokens.clamp(min=0)
        self.output_counts.view(-1).index_add_(0, flat.reshape(-1), valid.float().reshape(-1))

    def metadata(self, rows: torch.Tensor, positions: torch.Tensor, penalties: bool = False,
                 extra_counts: torch.Tensor | None = None) -> SamplingMetadata:
        """Sampling rows for state rows `rows` [R] drawing the tokens at `positions` [R]. With penalties,
        `extra_counts` [R, V] adds tokens the row has not produced yet (a draft tree node's path)."""
        # Penalty weights only when the penalty stage runs: every gather is a kernel in the graph.
        meta = SamplingMetadata(*(getattr(self, name)[rows] for name in _FIELDS[:5]), positions,
                                *((getattr(self, name)[rows] for name in _FIELDS[5:]) if penalties else (None,) * 3))
        if penalties:
            counts = self.output_counts[rows]
            meta.output_counts = counts if extra_counts is None else counts + extra_counts
            meta.prompt_mask = self.prompt_mask[rows]
            meta.logit_bias = self.logit_bias[rows]
            meta.suppress = self.suppress[rows]
            meta.min_tokens = self.min_tokens[rows]
            meta.num_prompt = self.num_prompt[rows]
        return meta
