"""Depth 0: plain decoding's step on the speculative pool.

When the adaptive policy drafts nothing (speculative/policy.py), a step is plain decoding's: the root (the
last verified token, at position seq_len) goes through the target, its token is sampled with the noise
of its position, exactly as verifying the root alone would (so the same seeded tokens), and the pool
moves on by one. A request that keeps draft state has the draft extend over the new token deferred
(speculative/catch_up.py); a dormant one (policy.admit) has none to defer for. Verifying the root as a
one-node tree cost ten kernels more (1.4% of an 8B-shape step on an H200:
bench/results/depth0-cost-llama-3.1-8b-h200-6603c51.json).

Device state only, no host values: the body of the depth-0 and dormant-decode CUDA graphs
(speculative/phases.py) and of eager depth-0 steps alike.
"""

from __future__ import annotations

from tandem.layers.sampler import SamplingFeatures, choose_tokens, token_logprobs
from tandem.models.llama import StepContext
from tandem.runtime.decode_plan import decode_metadata
from tandem.speculative import catch_up
from tandem.speculative.drafter import target_feature


class RootStep:
    def __init__(self, runner, pool, sampling, draft_model):
        self.runner = runner  # target model, KV cache, attention backend, tensor-parallel group
        self.pool = pool  # SpecStatePool: each request's last verified token and length
        self.sampling = sampling  # rows indexed by the pool's slots
        self.draft_model = draft_model  # which target features its extend pairs with the tokens

    def __call__(self, slots, page_rows, kv_bound: int, features: SamplingFeatures, allowed=None, defer: bool = True):
        """slots [B], page_rows [B, P]; allowed: [B, V] bool, the root's grammar masks, or None; `defer`:
        keep the draft's extend for a catch-up (False: dormant rows). Returns (out_tokens [B, 1],) and with
        features.logprobs the chosen token's logprob [B, 1] and the top values and ids [B, 1, n]."""
        pool, runner = self.pool, self.runner
        pool.seq_lens[pool.pad_slot:pool.pad_slot + 1].zero_()  # (padded graph rows: keep their positions small)
        positions = pool.seq_lens[slots]
        metadata = decode_metadata(page_rows, positions, kv_bound, runner.page_size, runner.backend.derives_causal_mask)
        ctx = StepContext(runner.backend, metadata, runner.kv_cache.k, runner.kv_cache.v)
        aux_layers = self.draft_model.aux_layer_ids if defer else ()
        hidden, aux = runner.model(pool.verified_id[slots], positions, ctx, aux_layer_ids=aux_layers)
        logits = runner.model.compute_logits(hidden)
        meta = self.sampling.metadata(slots, positions + 1, features.penalties)
        meta.allowed = allowed
        # Tensor parallelism: every rank takes rank 0's tokens (as SpecWorker._same_on_every_rank does).
        tokens = runner.tp.broadcast_(choose_tokens(logits, meta, features).contiguous())
        pool.verified_id[slots] = tokens
        pool.seq_lens[slots] = positions + 1
        if features.penalties:  # (only penalised rows read their counts)
            self.sampling.add_outputs(slots, tokens[:, None])
        if defer:
            catch_up.defer_extend(pool, slots, tokens, target_feature(self.draft_model, hidden, aux))
        if features.logprobs is None:
            return (tokens[:, None],)
        chosen, top_v, top_i = token_logprobs(logits, tokens, features.logprobs)
        return tokens[:, None], chosen[:, None], top_v[:, None], top_i[:, None]
