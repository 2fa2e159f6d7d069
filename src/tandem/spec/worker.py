"""One speculative iteration (DESIGN §3): draft a tree, verify it with the target, accept, extend.

Rows of a step are either *prefill* chunks (prompt or recompute; the target samples normally after
the last one, then the draft is prefilled on the shifted tokens) or *verify* rows (a decode of a
request whose draft state is ready: root = its last token, plus the drafted tree). Both kinds run in
one target forward; the draft then runs once more over every newly known token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.layers.sampler import SampleRow, apply_penalties, logits_to_probs, sample, seed_for_step
from tandem.models.llama import StepContext
from tandem.request import TokenLogprob
from tandem.scheduler.outputs import ScheduledChunk, SchedulerOutput
from tandem.spec.drafter import DraftFeed, Drafter
from tandem.spec.tree import DraftTree, ancestor_mask
from tandem.spec.verify import AcceptResult, greedy_accept, tree_rejection_sample


@dataclass
class SpecStats:
    """Engine-wide counters (the server exports them as spec_decode_* metrics)."""

    num_drafts: int = 0  # verify steps
    num_draft_tokens: int = 0  # draft tokens proposed (tree nodes besides the root)
    num_accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [depth-1] -> accepted count

    def record(self, accept_len: int, num_proposed: int, max_depth: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += accept_len - 1
        if len(self.accepted_per_position) < max_depth:
            self.accepted_per_position += [0] * (max_depth - len(self.accepted_per_position))
        for d in range(accept_len - 1):
            self.accepted_per_position[d] += 1

    @property
    def mean_accept_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class VerifyRow:
    chunk: ScheduledChunk
    node_offset: int  # row of the flat target batch holding node 0


class SpecWorker:
    def __init__(self, runner, drafter: Drafter, num_draft_tokens: int):
        self.runner = runner  # target model, KV cache, attention backend, token histories
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.stats = SpecStats()

    def drop_requests(self, request_ids) -> None:
        self.drafter.drop(request_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, result) -> None:
        runner = self.runner
        chunks = list(sched.chunks)
        verify_chunks = [c for c in chunks if self._is_verify(c)]
        prefill_chunks = [c for c in chunks if not self._is_verify(c)]
        for c in chunks:
            runner.record_history(c)
        tree = None
        if verify_chunks:
            tree = self.drafter.draft_tree([c.request_id for c in verify_chunks],
                                           [c.token_ids[0] for c in verify_chunks],
                                           [c.page_ids for c in verify_chunks], self.num_draft_tokens)
        hidden, aux, layout = self._target_forward(prefill_chunks, verify_chunks, tree)
        feature = aux if self.drafter.model.target_hidden == "aux" else hidden
        feeds = self._finish_prefills(prefill_chunks, layout, hidden, feature, result)
        if verify_chunks:
            feeds += self._finish_verifies(verify_chunks, layout, tree, hidden, feature, result)
        self.drafter.feed(feeds)

    def _is_verify(self, c: ScheduledChunk) -> bool:
        st = self.drafter.states.get(c.request_id)
        return c.sample and len(c.token_ids) == 1 and c.start_pos > 0 and st is not None and st.ready

    # ---- target forward over prefill chunks and verify trees --------------------------------
    def _target_forward(self, prefill_chunks, verify_chunks, tree: DraftTree | None):
        runner, ps = self.runner, self.runner.page_size
        input_ids, positions, slots, query_lens, kv_slots, masks = [], [], [], [], [], []
        layout = {}  # request id -> first row of its tokens in the flat batch
        for c in prefill_chunks:
            layout[c.request_id] = len(input_ids)
            seq = positions_to_slots(c.page_ids, range(c.end_pos), ps)
            input_ids += c.token_ids
            positions += range(c.start_pos, c.end_pos)
            slots += seq[c.start_pos:]
            query_lens.append(len(c.token_ids))
            kv_slots.append(seq)
            masks.append(None)
        if verify_chunks:
            n_nodes = self.num_draft_tokens
            anc = ancestor_mask(tree.parents).cpu()  # [B, N, N]
            tokens, depths = tree.tokens.tolist(), tree.depths.tolist()
            for i, c in enumerate(verify_chunks):
                layout[c.request_id] = len(input_ids)
                n = c.start_pos  # cached tokens; node j's KV goes to position n + j
                seq = positions_to_slots(c.page_ids, range(n + n_nodes), ps)
                input_ids += tokens[i]
                positions += [n + d for d in depths[i]]
                slots += seq[n:]
                query_lens.append(n_nodes)
                kv_slots.append(seq)
                mask = torch.ones(n_nodes, n + n_nodes, dtype=torch.bool)
                mask[:, n:] = anc[i]  # drafts see the prefix and their own ancestors only
                masks.append(mask)
        batch = AttentionBatch(query_lens, kv_slots, slots, masks)
        metadata = runner.backend.plan(batch, runner.device)
        ctx = StepContext(runner.backend, metadata, runner.kv_cache.k, runner.kv_cache.v)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=runner.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=runner.device)
        hidden, aux = runner.model(ids_t, pos_t, ctx, aux_layer_ids=self.drafter.model.aux_layer_ids)
        aux = torch.cat(aux, dim=-1) if aux else None
        return hidden, aux, layout

    # ---- prefill rows: sample, then prefill the draft on the shifted tokens -----------------
    def _finish_prefills(self, chunks, layout, hidden, feature, result) -> list[DraftFeed]:
        sampling = [c for c in chunks if c.sample]
        sampled: dict[str, int] = {}
        if sampling:
            idx = torch.tensor([layout[c.request_id] + len(c.token_ids) - 1 for c in sampling],
                               device=hidden.device)
            rows = [self.runner.sample_row(c) for c in sampling]
            out = sample(self.runner.model.compute_logits(hidden[idx]), rows)
            token_ids = out.token_ids.tolist()
            for i, c in enumerate(sampling):
                sampled[c.request_id] = token_ids[i]
                result.sampled[c.request_id] = [token_ids[i]]
            if out.logprobs is not None:
                self.runner.collect_logprobs(out, [c.request_id for c in sampling], rows, token_ids, result)
        feeds = []
        for c in chunks:
            first = layout[c.request_id]
            tokens = list(c.token_ids)
            feat = feature[first:first + len(tokens)] if feature is not None else None
            if c.start_pos == 0:
                self.drafter.drop([c.request_id])  # fresh prefill or recompute: start over
            state = self.drafter.state(c.request_id)
            if c.request_id in sampled:
                tokens.append(sampled[c.request_id])
            feeds.append(self._prefill_feed(c, tokens, feat, state))
        return feeds

    def _prefill_feed(self, c: ScheduledChunk, tokens: list[int], feat, state) -> DraftFeed:
        """Pairs each token with the target hidden state of the token before it (EAGLE), or feeds
        the tokens alone (standalone). A chunk's last hidden state waits for the next chunk."""
        if self.drafter.model.token_offset == 0:
            return DraftFeed(c.request_id, tokens, c.start_pos, None, c.page_ids, c.sample)
        # token x[i] pairs with feature f[i-1]; x[0] has no partner and is skipped
        prev = [state.pending_hidden.unsqueeze(0)] if c.start_pos > 0 else []
        feats = torch.cat(prev + [feat]) if feat is not None else None
        if c.start_pos == 0:
            tokens = tokens[1:]
        state.pending_hidden = None if c.sample else feat[-1]
        n = len(tokens)
        return DraftFeed(c.request_id, tokens, max(c.start_pos, 1),
                         feats[:n] if feats is not None else None, c.page_ids, c.sample)

    # ---- verify rows: accept, compact KV, extend the draft ----------------------------------
    def _finish_verifies(self, chunks, layout, tree, hidden, feature, result) -> list[DraftFeed]:
        runner, n_nodes = self.runner, self.num_draft_tokens
        flat = torch.tensor([layout[c.request_id] + j for c in chunks for j in range(n_nodes)],
                            device=hidden.device)
        logits = runner.model.compute_logits(hidden[flat]).view(len(chunks), n_nodes, -1)  # [B, N, V]
        accept = self._accept(chunks, tree, logits)
        lens, paths, outs = accept.accept_lens.tolist(), accept.path.tolist(), accept.out_tokens.tolist()
        self._compact_target_kv(chunks, lens, paths)
        max_depth = int(tree.depths.max())
        feeds = []
        for i, c in enumerate(chunks):
            k = lens[i]
            tokens = outs[i][:k]
            result.sampled[c.request_id] = tokens
            result.accept_lengths[c.request_id] = k
            # The accepted drafts now have target KV: they join the fed-token history.
            runner.histories[c.request_id].extend(tokens[:-1])
            self.stats.record(k, n_nodes - 1, max_depth)
            path = paths[i][:k]
            if c.sampling_params.logprobs is not None:
                self._verify_logprobs(c, logits[i], path, tokens, result)
            feat = None
            if feature is not None:
                rows = torch.tensor([layout[c.request_id] + j for j in path], device=hidden.device)
                feat = feature[rows]  # target hidden at root + accepted drafts pairs with the next token
            feeds.append(DraftFeed(c.request_id, tokens, c.start_pos + 1, feat, c.page_ids, True))
        return feeds

    def _accept(self, chunks, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        b, n_nodes, _ = logits.shape
        node_rows = [self._node_rows(c, tree, i) for i, c in enumerate(chunks)]
        if all(c.sampling_params.greedy for c in chunks):
            flat_rows = [r for rows in node_rows for r in rows]
            penalized = apply_penalties(logits.reshape(b * n_nodes, -1), flat_rows)
            return greedy_accept(tree, penalized.argmax(-1).view(b, n_nodes))
        flat_rows = [r for rows in node_rows for r in rows]
        probs = logits_to_probs(logits.reshape(b * n_nodes, -1), flat_rows).view(b, n_nodes, -1)
        uniforms, noise = self._randomness(chunks, n_nodes, probs.shape[-1], probs.device)
        return tree_rejection_sample(tree, probs, uniforms, noise)

    def _node_rows(self, c: ScheduledChunk, tree: DraftTree, i: int) -> list[SampleRow]:
        """Sampler rows for every tree node: the output history extends along the node's path, so
        penalties at a node see the drafted tokens before it, exactly as plain decoding would."""
        base = self.runner.sample_row(c)
        if not c.sampling_params.needs_penalties:
            return [base] * self.num_draft_tokens
        tokens, parents = tree.tokens[i].tolist(), tree.parents[i].tolist()
        rows = []
        for node in range(self.num_draft_tokens):
            path, j = [], node
            while j > 0:
                path.append(tokens[j])
                j = parents[j]
            rows.append(SampleRow(c.sampling_params, base.prompt_token_ids,
                                  list(base.output_token_ids) + path[::-1]))
        return rows

    def _randomness(self, chunks, n_nodes: int, vocab: int, device):
        uniforms = torch.rand(len(chunks), n_nodes, device=device)
        noise = torch.empty(len(chunks), vocab, device=device).exponential_()
        for i, c in enumerate(chunks):
            seed = c.sampling_params.seed
            if seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed_for_step(seed, len(self.runner.histories[c.request_id]) - c.num_prompt_tokens))
                uniforms[i] = torch.rand(n_nodes, generator=gen, device=device)
                noise[i] = torch.empty(vocab, device=device).exponential_(generator=gen)
        return uniforms, noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _compact_target_kv(self, chunks, lens, paths) -> None:
        """Moves the KV of accepted tree nodes to consecutive positions after the root (chains are
        already in place). Reading every source before writing makes overlapping moves safe."""
        src, dst = [], []
        ps = self.runner.page_size
        for c, k, path in zip(chunks, lens, paths):
            n = c.start_pos
            for j in range(1, k):
                if path[j] != j:
                    src.append(positions_to_slots(c.page_ids, [n + path[j]], ps)[0])
                    dst.append(positions_to_slots(c.page_ids, [n + j], ps)[0])
        if not src:
            return
        src_t = torch.tensor(src, device=self.runner.device)
        dst_t = torch.tensor(dst, device=self.runner.device)
        for cache in (*self.runner.kv_cache.k, *self.runner.kv_cache.v):
            cache[dst_t] = cache[src_t]

    def _verify_logprobs(self, c, node_logits, path, tokens, result) -> None:
        logp = torch.log_softmax(node_logits[path], dim=-1)  # [k, V]: node path[j] predicts tokens[j]
        n = c.sampling_params.logprobs
        chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(1).tolist()
        entries = []
        if n:
            top_v, top_i = logp.topk(min(n, logp.shape[-1]), dim=-1)
            tops = [list(zip(ti, tv)) for ti, tv in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in tokens]
        for tok, lp, top in zip(tokens, chosen, tops):
            entries.append(TokenLogprob(tok, lp, top))
        result.logprobs[c.request_id] = entries
