"""The constrained requests' grammar matchers, on the host, and the token masks they give each step.

A matcher holds a request's grammar state after exactly the tokens the request has produced: each step's
results advance it (`advance`), and a recompute after preemption rebuilds it from the re-fed outputs
(`admit_chunk`). Masks are bitmasks, [rows, ceil(V / 32)] int32, bit t of a row set when token t is
allowed; rows of unconstrained requests allow everything.

A speculative step needs a mask at every node of the draft tree: the grammar state after the node's
own path (`tree_masks` walks the tree depth first, accepting each node's token and rolling it back after
its subtree). A node whose token the grammar forbids at its parent is never accepted (the target's
masked draw at the parent cannot equal it), so it and its subtree keep an all-allowed mask that no
acceptance ever reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tandem.structured.grammar import GrammarCompiler, spec_of

logger = logging.getLogger(__name__)

ALL_ALLOWED = -1  # an int32 word with every bit set


@dataclass
class _Entry:
    matcher: object
    admitted_at: int  # the iteration of its admission: results of earlier steps are not its tokens
    admitted_len: int  # prompt + outputs at admission (outputs below it are re-fed by the chunks)
    broken: bool = False  # a token the grammar refused (cannot happen under the mask; logged)


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.words = (compiler.vocab_size + 31) // 32
        self._entries: dict[str, _Entry] = {}
        self.mask_seconds = 0.0  # host time spent computing masks (tandem bench --json-schema reports it)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __bool__(self) -> bool:
        return bool(self._entries)

    def admit_chunk(self, chunk, iteration: int) -> None:
        """A chunk of known tokens: a first chunk (re)starts the request's matcher; earlier outputs that a
        recompute re-feeds advance it."""
        spec = spec_of(chunk.sampling_params)
        if spec is None:
            return
        known = zip(range(chunk.start_pos, chunk.end_pos), chunk.token_ids)
        if chunk.first_chunk:
            self._entries[chunk.request_id] = _Entry(self.compiler.matcher(spec), iteration, chunk.request_len)
            # (After a prefix-cache hit, earlier outputs may sit in the cached part.)
            known = [*enumerate(chunk.cached_token_ids), *known]
        entry = self._entries.get(chunk.request_id)
        if entry is None:
            return
        for pos, token in known:
            if chunk.num_prompt_tokens <= pos < entry.admitted_len:
                self._accept(chunk.request_id, entry, token)

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._entries.pop(rid, None)

    def advance(self, iteration: int, tokens: dict[str, list[int]]) -> None:
        """The tokens one step produced, per request."""
        for rid, new in tokens.items():
            entry = self._entries.get(rid)
            if entry is None or iteration < entry.admitted_at:
                continue
            for token in new:
                if entry.matcher.is_terminated():
                    break  # the document is complete (its stop token was accepted): the request ends
                self._accept(rid, entry, token)

    def _accept(self, rid: str, entry: _Entry, token: int) -> None:
        if entry.broken or entry.matcher.is_terminated():
            return
        if not entry.matcher.accept_token(token):
            logger.error("request %s: the grammar refused token %d; its output is no longer constrained", rid, token)
            entry.broken = True

    def _active(self, rid: str):
        entry = self._entries.get(rid)
        if entry is None or entry.broken or entry.matcher.is_terminated():
            return None
        return entry.matcher

    def root_masks(self, request_ids) -> torch.Tensor:
        """[B, W] int32 on the host: each request's next-token mask."""
        started = time.perf_counter()
        out = torch.full((len(request_ids), self.words), ALL_ALLOWED, dtype=torch.int32)
        for i, rid in enumerate(request_ids):
            m = self._active(rid)
            if m is not None:
                m.fill_next_token_bitmask(out, i)
        self.mask_seconds += time.perf_counter() - started
        return out

    def tree_masks(self, request_ids, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """[B * N, W] int32 on the host: the mask at every node of each row's draft tree (row-major).
        tokens, parents: [B, N] on the host (parents[:, 0] = -1, parents[c] < c)."""
        started = time.perf_counter()
        b, n = tokens.shape
        out = torch.full((b * n, self.words), ALL_ALLOWED, dtype=torch.int32)
        tokens_l, parents_l = tokens.tolist(), parents.tolist()
        for i, rid in enumerate(request_ids):
            m = self._active(rid)
            if m is None:
                continue
            children: list[list[int]] = [[] for _ in range(n)]
            for c in range(1, n):
                if parents_l[i][c] >= 0:
                    children[parents_l[i][c]].append(c)
            _fill_subtree(m, 0, tokens_l[i], children, out, i * n)
        self.mask_seconds += time.perf_counter() - started
        return out


def _fill_subtree(m, node: int, tokens: list[int], children: list[list[int]], out: torch.Tensor, base: int) -> None:
    """The mask at `node` (the matcher is in the state after node's path), then each allowed child's."""
    m.fill_next_token_bitmask(out, base + node)
    row = out[base + node]
    for c in children[node]:
        t = tokens[c]
        if not is_allowed(row, t) or not m.accept_token(t):
            continue  # never accepted: its subtree's masks stay all-allowed
        if not m.is_terminated():
            _fill_subtree(m, c, tokens, children, out, base)
        m.rollback(1)


def is_allowed(mask_row: torch.Tensor, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def allowed_on_device(bitmask: torch.Tensor, device: torch.device, vocab: int) -> torch.Tensor:
    """A host bitmask [R, W] as [R, V] bool on the device: uploaded from pinned memory without waiting
    for the stream, unpacked there."""
    if device.type == "cuda":
        bitmask = bitmask.pin_memory().to(device, non_blocking=True)
    return allowed_from_bitmask(bitmask, vocab)


def allowed_from_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, V] bool (on the bitmask's device)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask[:, :, None] >> bits) & 1  # [R, W, 32]; >> on int32 sign-extends, & 1 keeps the bit
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab].bool()

