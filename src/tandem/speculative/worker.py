"""One speculative iteration (DESIGN §3), launched without waiting for the previous one's results.

A step's rows are *verify* rows (decoding requests: root = last token, plus the drafted tree) and
*prefill* rows (prompt chunks or a recompute; the target samples after the last chunk, then the
draft is prefilled on the shifted tokens). Verify rows go first:

  host:         page tables into pinned staging (waits: previous step's copy out of it)
  plan stream:  upload page-table rows ─► verify plan (waits: previous step's seq_lens) ─┐
  main stream:  draft tree (waits: page table) ──────────────────────────────────────────┴► verify
                (waits: verify plan) ─► accept, compact KV, new seq_lens
  plan stream:  ... ─► extend plan (padded to the deepest run: needs no verify output) ─┐
  main stream:  draft extend (waits: extend plan) ─► prefill rows ─► results to pinned memory

The verify plan depends only on seq_lens and the page table, and the extend plan only on those
too, so the plan stream's whole step overlaps the draft; nothing waits for "the whole draft".
Results reach the CPU through a pinned copy and one event, so the engine can schedule the next step
while this one runs.

With CUDA graphs, a step replays the whole iteration as one graph on the main stream
(`decode_iteration`, one per sampling kind and draft shape: greedy, sampled, sampled with top-k, and
GENERAL for penalties, logit bias, min_tokens and logprobs): the graph builds the plans itself, so the
plan stream has nothing left to overlap (measured: with graphs it neither helped nor hurt,
docs/performance.md). A constrained step that drafts replays two graphs with the host's tree masks
between; constrained steps with penalties, logprobs or top-k keep the choreography above, with the
three phases graphed separately. A depth-0 step (adaptive speculation) is plain decoding's step on the
pool with the draft extend deferred (speculative/root_step.py); a step that drafts after depth-0 steps
first runs the draft over their deferred tokens (speculative/catch_up.py); and a batch of dormant rows,
which keep no draft state, runs plain decoding's step alone (`_launch_dormant`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.layers.sampler import (GRAPHED_CONSTRAINED, GRAPHED_GENERAL, GRAPHED_SAMPLING, SamplingFeatures,
                                   choose_tokens, graph_features, step_mode, token_logprobs)
from tandem.models.llama import StepContext
from tandem.runtime import prompt_logprobs
from tandem.runtime.sampling_state import SamplingState
from tandem.runtime.step_result import collect_logprobs
from tandem.runtime.streams import Edge, StreamSet
from tandem.runtime.uploads import to_device
from tandem.scheduler.outputs import NO_DRAFT_KV, ScheduledChunk, SchedulerOutput
from tandem.speculative import catch_up, plan
from tandem.speculative.drafter import Drafter, PrefillFeed, target_feature
from tandem.speculative.phases import SpecPhases
from tandem.speculative.policy import GREEDY_MODE, DepthPolicy, DraftShape
from tandem.speculative.root_step import RootStep
from tandem.speculative.tree import DraftTree
from tandem.speculative.verify import AcceptResult, accept_target_tokens
from tandem.structured.matchers import allowed_on_device

logger = logging.getLogger(__name__)

# How often (in steps) the running batch is checked for requests that should drop their draft state
# (DepthPolicy.demote: a pass over the batch and one cost comparison).
DEMOTE_EVERY = 16


@dataclass
class SpecStats:
    """Engine-wide counters (the server exports them as spec_decode_* metrics)."""

    num_drafts: int = 0  # verify steps
    num_draft_tokens: int = 0  # draft tokens proposed (tree nodes besides the root)
    num_accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [depth-1] -> accepted count
    steps_by_depth: list[int] = field(default_factory=list)  # [depth] -> engine steps that drafted that deep
    catch_ups: int = 0  # steps that first ran the draft over deferred tokens (speculative/catch_up.py)
    dormant_admitted: int = 0  # requests admitted without draft state (policy.admit)
    dormant_steps: int = 0  # steps whose rows were all dormant: plain decoding's step (SpecWorker._launch_dormant)
    dormant_demoted: int = 0  # running requests that dropped their draft state (policy.demote)

    def record(self, accept_len: int, num_proposed: int, max_depth: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += accept_len - 1
        if len(self.accepted_per_position) < max_depth:
            self.accepted_per_position += [0] * (max_depth - len(self.accepted_per_position))
        for d in range(accept_len - 1):
            self.accepted_per_position[d] += 1

    def record_step(self, depth: int) -> None:
        if len(self.steps_by_depth) <= depth:
            self.steps_by_depth += [0] * (depth + 1 - len(self.steps_by_depth))
        self.steps_by_depth[depth] += 1

    @property
    def mean_accept_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SpecStepHandle:
    """One launched iteration: its events and the host copies of its results. Holding the handle
    keeps every input tensor of the iteration alive until its results are read."""

    iteration: int
    ready: Edge | None = None  # results are in host memory after this event
    tokens_ready: Edge | None = None  # a prompt-only step's tokens are, before its draft prefill (first tokens)
    seq_lens_ready: Edge | None = None  # the next iteration's verify plan waits on it
    staging_released: Edge | None = None  # the plan stream has copied the page-table staging buffer
    verify_ids: list[str] = field(default_factory=list)
    prefill_ids: list[str] = field(default_factory=list)
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    logprobs_wanted: dict[str, int] = field(default_factory=dict)
    max_depth: int = 0
    shape: DraftShape | None = None  # what the verify rows drafted
    padded_batch: int = 0  # the batch size the policy keys its cost table by
    mode: str = GREEDY_MODE  # the verify rows' sampling mode (`step_mode`: the policy's cost table)
    catch_up_ms: float = 0.0  # time of the catch-up it ran first: not its shape's (deferred by earlier steps)
    catch_up_queries: int = 0  # queries per row it ran: the deferred steps it could hold (0: no catch-up)
    catch_up_batch: int = 0  # the padded size of the rows it caught up (dormant rows never do)
    dormant: bool = False  # its rows were all dormant: plain decoding's step, no option of the policy's
    launched_at: float = 0.0  # host clock at launch (the policy's step timing)
    launch_ms: float = 0.0  # host time inside launch: the whole step on a CPU, where launching runs it
    draft_prefill: object | None = None  # DraftPrefillTimer of the draft's prefill in this step (an upkeep cost)
    prompt_logprob_rows: object | None = None  # runtime/prompt_logprobs.PromptLogprobRows of the prefill rows
    draft_behind: dict[str, int] = field(default_factory=dict)  # StepResult.draft_behind
    result: object | None = None  # its StepResult once collected (runtime/model_runner.py)
    keep_alive: list = field(default_factory=list)


class SpecWorker:
    def __init__(self, runner, drafter: Drafter, num_draft_tokens: int, streams: StreamSet, sampling: SamplingState,
                 policy: DepthPolicy | None = None):
        self.runner = runner  # target model, KV cache, attention backend
        self.drafter = drafter
        self.phases = SpecPhases(runner, drafter, num_draft_tokens)  # eager, or CUDA graphs once captured
        self.root_step = RootStep(runner, drafter.pool, sampling, drafter.model)  # depth 0: plain decoding's step
        self.pool = drafter.pool
        self.sampling = sampling  # rows indexed by self.pool's slots
        self.num_draft_tokens = num_draft_tokens
        self.streams = streams
        self.stats = SpecStats()
        self.ready: set[str] = set()  # requests that decode (verify rows); the policy's dormant ones lack draft state
        self._last: SpecStepHandle | None = None  # previous iteration (its events feed this one)
        self.policy = policy  # None: always the configured shape (--speculative-adaptive off)
        self.step_clock = StepClock()
        # Host mirror of each request's deferred draft extends (pool.lag): known at launch from the shapes
        # this worker chose, so deciding on a catch-up needs no device value.
        self.lag: dict[str, int] = {}
        self.catch_up_ms: dict[int, float] = {}  # padded batch -> catch-up graph time (start-up timing)
        self.grammar = None  # structured/matchers.GrammarRows once a constrained request arrived (the runner's)
        self._coin_buffers: dict[int, torch.Tensor] = {}  # nodes -> [rows, nodes] False (no synthetic coins)
        self._steps_since_demotion = 0
        # Prompt-only steps collected at their tokens, before their draft prefill ran: held until it has
        # (their tensors kept alive, the prefill's time read for the policy).
        self._finishing: list[SpecStepHandle] = []
        self._untimed_next = False  # the next step's time would count such a draft prefill

    def drop_requests(self, request_ids) -> None:
        for rid in request_ids:
            self.ready.discard(rid)
            self.lag.pop(rid, None)
        self.pool.release(request_ids)
        if self.policy is not None:
            self.policy.forget(request_ids)

    def time_graphed_iterations(self, replays: int = 5) -> None:
        """Seeds the policy's cost tables: each draft shape's whole-iteration graph in every captured sampling
        mode, replayed at each captured batch size on padded rows only (they touch only the sink page and
        the pad row); each mode's dormant-decode graph; and the catch-up graph's time, which the steps that
        run it leave out of their own. (Each mode has a table of its own: on an H200 the demo pair's
        batch-32 step costs 0.5 ms greedy and 1.3 ms with every sampling stage on.)"""
        started = time.perf_counter()
        # Batch size by batch size, every shape of a mode side by side, twice, keeping each one's faster
        # round: the policy compares shapes at one batch size, and timed shape by shape a slow stretch of the
        # GPU would land on one shape at every batch size.
        graphs = {(features, shape): self.phases.iteration_graph(features, shape)
                  for features in GRAPHED_SAMPLING + GRAPHED_GENERAL for shape in self.policy.options}
        # Constrained batches: only depth 0 replays a graph; the drafting shapes are timed as they run.
        graphs.update({(features, DraftShape(0)): self.phases.iteration_graph(features, DraftShape(0))
                       for features in GRAPHED_CONSTRAINED})
        graphs = {key: graph for key, graph in graphs.items() if graph is not None}
        sizes = sorted({bs for graph in graphs.values() for bs in graph.graphs})
        best: dict = {}
        for _ in range(2):
            for bs in sizes:
                for key, graph in graphs.items():
                    if bs in graph.graphs:
                        ms = _replay_ms(graph.graphs[bs], replays)
                        best[(bs, key)] = min(ms, best.get((bs, key), ms))
        for (bs, (features, shape)), ms in best.items():
            self.policy.observe_time(bs, shape, ms, weight=1.0, mode=step_mode(features))
        dormant_graphs = [(f, self.phases.dormant_graph(f)) for f in GRAPHED_SAMPLING + GRAPHED_GENERAL]
        dormant_graphs = [(f, graph) for f, graph in dormant_graphs if graph is not None]
        for features, dormant in dormant_graphs:
            for bs in sorted(dormant.graphs):
                self.policy.observe_dormant_time(bs, _replay_ms(dormant.graphs[bs], replays), weight=1.0,
                                                 mode=step_mode(features))
        catch_up_graph = self.phases.graphs.get("catch_up")
        for bs, graph in (catch_up_graph.graphs.items() if catch_up_graph is not None else ()):
            self.catch_up_ms[bs] = _replay_ms(graph, replays)
            # (depth 0's share of it, before any catch-up runs)
            self.policy.observe_catch_up(bs, self.catch_up_ms[bs] / self.pool.catch_up_window)
        self._time_draft_prefill()
        torch.cuda.synchronize(self.runner.device)
        timed = len(graphs) + len(dormant_graphs) + (catch_up_graph is not None)
        logger.info("adaptive speculation: timed %d graphs at up to %d batch sizes in %.1f s", timed, len(sizes),
                    time.perf_counter() - started)

    def _time_draft_prefill(self, sizes=(16, 512), repeats=3) -> None:
        """The draft's prefill timed at two sizes (the faster of `repeats` calls each) on the first pages, which
        hold nobody's KV before the engine serves; the policy keeps the line's intercept as the fixed part
        of a call (speculative/prefill_cost.py)."""
        ps, feature_size = self.runner.page_size, self.runner._draft_feature_size(self.drafter.model)
        calls = []
        for n in sizes:
            pages = tuple(range(-(-(n + 1) // ps)))
            if len(pages) > self.runner.num_pages:
                return
            features = (torch.zeros(n, feature_size, dtype=self.runner.dtype, device=self.runner.device)
                        if self.drafter.model.token_offset else None)
            feed = PrefillFeed(slot=0, token_ids=[0] * n, first_token_index=1, features=features, page_ids=pages,
                               final=False)
            times = []
            for _ in range(repeats):
                timer = DraftPrefillTimer(self.runner.device, n)
                self.drafter.prefill([feed], None, {})
                timer.stop()
                if timer.cuda:
                    timer.end.synchronize()
                times.append(timer.elapsed_ms())
            calls.append((n, min(times)))
        self.policy.observe_draft_prefill_startup(calls)

    def padded_batch(self, b: int) -> int:
        graph = self.phases.graphs.get("verify")
        return min((s for s in graph.graphs if s >= b), default=b) if graph is not None else b

    def is_verify(self, c: ScheduledChunk) -> bool:
        return c.is_future or (c.sample and len(c.token_ids) == 1 and not c.first_chunk and c.request_id in self.ready)

    # ---- launch ------------------------------------------------------------------------------
    def choose_shape(self, sched: SchedulerOutput) -> DraftShape | None:
        """What this step's verify rows draft: the policy's choice for them (None without verify rows or
        without a policy). Call before `launch` and drop requests first (tensor parallelism does both)."""
        self.drop_requests(sched.preempted_ids)
        self.drop_requests(sched.finished_ids)
        verify = [c for c in sched.chunks if self.is_verify(c)]
        if self.policy is None or not verify:
            return None
        self._steps_since_demotion += 1
        if self._steps_since_demotion >= DEMOTE_EVERY:
            self._steps_since_demotion = 0
            demoted = self.policy.demote([c.request_id for c in verify], self.padded_batch(len(verify)),
                                         mode=step_mode(SamplingFeatures.of([c.sampling_params for c in verify])))
            for rid in demoted:
                self.lag.pop(rid, None)  # (its deferred extends are dropped with its draft state)
            self.stats.dormant_demoted += len(demoted)
        ids = tuple(c.request_id for c in verify)
        if self._all_dormant(ids):
            # No row has draft state: drafts would accept nothing and teach nothing. (Asking the policy
            # costs 63-66 us a step on an H200's host, a quarter of the demo pair's plain decode step.)
            return self.policy.options[0]
        pure_decode = len(verify) == len(sched.chunks)
        if pure_decode:  # (policy.REPEAT_DEPTH0_STEPS; constrained batches keep their choices under another key)
            again = self.policy.repeat_depth0(ids, self.padded_batch(len(verify)))
            if again is not None:
                return again
        mode = step_mode(SamplingFeatures.of([c.sampling_params for c in verify]))
        prefill_rows = 0 if pure_decode else len({c.request_id for c in sched.chunks if not self.is_verify(c)})
        lags = [self.lag.get(c.request_id, 0) for c in verify if not self._dormant(c.request_id)]  # rows that defer
        # Tokens each may still emit: the root at start_pos is its newest (a lower bound for a future chunk).
        remaining = [c.sampling_params.max_new_tokens - (c.start_pos + 1 - c.num_prompt_tokens) for c in verify]
        # Rows whose length is fixed, when nothing queued will take the slots they free: the batch is done
        # when the slowest is (a batch job; plain decoding's rows all finish at the same step).
        draining = sched.batch_ahead <= len(verify) + prefill_rows
        together = [_fixed_length(c.sampling_params) for c in verify] if draining else []
        # Whether drafting now would run a catch-up that a depth-0 step would not.
        forced = self._catch_up_needed(lags, drafts=True) and not self._catch_up_needed(lags, drafts=False)
        return self.policy.choose(ids, self.padded_batch(len(verify)),
                                  mode=mode, prefill_rows=prefill_rows,
                                  catch_up_batch=self.padded_batch(len(lags)) if lags else 0,
                                  remaining=remaining, finish_together=together if any(together) else None,
                                  catch_up_forced=forced)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, shape: DraftShape | None = None) -> SpecStepHandle:
        """Enqueues one step. `shape`: what the verify rows draft (default: `choose_shape`'s answer)."""
        s = self.streams
        handle = SpecStepHandle(sched.iteration, launched_at=time.perf_counter())
        verify_chunks = [c for c in sched.chunks if self.is_verify(c)]
        prefill_chunks = [c for c in sched.chunks if not self.is_verify(c)]
        outputs: dict[str, torch.Tensor] = {}
        if verify_chunks:
            self._launch_verify(verify_chunks, handle, outputs, shape or self.choose_shape(sched))
        if prefill_chunks:
            self._launch_prefill(prefill_chunks, handle, outputs, sched.batch_ahead)
        handle.draft_behind = self._draft_behind(verify_chunks, prefill_chunks)
        handle.logprobs_wanted = {c.request_id: c.sampling_params.logprobs for c in sched.chunks
                                  if c.sampling_params.logprobs is not None}
        handle.seq_lens_ready = s.record("main", "seq_lens_ready")
        handle.ready = self._copy_results(handle, outputs, "results")
        self._last = handle
        handle.launch_ms = 1e3 * (time.perf_counter() - handle.launched_at)
        return handle

    def _draft_behind(self, verify_chunks, prefill_chunks) -> dict[str, int]:
        """Per request of the step just launched: how many of its tokens with target KV lack draft KV after
        it (the prefix cache indexes a page only once both caches hold it). A verify row lags by the draft
        extends it deferred (depth 0); a prefill chunk's last entry needs the next chunk's first token (an
        EAGLE-style draft); a dormant request keeps no draft KV at all."""
        behind = {}
        for c in verify_chunks:
            behind[c.request_id] = NO_DRAFT_KV if self._dormant(c.request_id) else self.lag.get(c.request_id, 0)
        for c in prefill_chunks:
            behind[c.request_id] = (NO_DRAFT_KV if self._dormant(c.request_id)
                                    else 0 if c.sample else self.drafter.model.token_offset)
        return behind

    def _launch_verify(self, chunks, handle: SpecStepHandle, outputs, shape: DraftShape | None) -> None:
        s, runner, pool = self.streams, self.runner, self.pool
        it = handle.iteration
        b = len(chunks)
        features = SamplingFeatures.of([c.sampling_params for c in chunks])
        handle.mode = step_mode(features)
        handle.verify_ids = [c.request_id for c in chunks]
        handle.padded_batch = self.padded_batch(b)
        shape = shape or self.phases.configured
        handle.shape = shape
        ps, n_nodes = runner.page_size, self.phases.num_nodes(shape)
        # A CUDA graph was captured for one KV window, the widest; eager steps use their own bound.
        kv_bound = self.phases.graph_kv_width if self.phases.graphed(b) else max(len(c.page_ids) for c in chunks) * ps

        self._stage_page_tables(chunks)
        if not shape.drafts and not features.constrained and self._all_dormant(handle.verify_ids):
            self._launch_dormant(b, features, handle, outputs, kv_bound)
            return
        catch_up_window, catch_up_rows = self._plan_catch_up(handle.verify_ids, shape)
        needs_catch_up = catch_up_window > 0
        if needs_catch_up:
            self.stats.catch_ups += 1
            # On a CPU launching runs the step, so the catch-up is timed where it runs (below); on a GPU
            # its time comes from start-up timing of its graph.
            rows = b if catch_up_rows is None else len(catch_up_rows)
            handle.catch_up_batch = self.padded_batch(rows)
            handle.catch_up_ms = self.catch_up_ms.get(handle.catch_up_batch, 0.0)
            # A graph runs every row's whole buffer; an eager catch-up the batch's largest lag.
            handle.catch_up_queries = pool.catch_up_window if self.phases.catch_up_graphed(rows) else catch_up_window
        graphed = graph_features(features)
        if self.phases.iteration_graphed(b, graphed, shape) or (
                features.constrained and shape.drafts and self.phases.split_graphed(b, features, shape)):
            self._launch_verify_graphed(b, graphed, shape, handle, outputs, needs_catch_up, catch_up_rows)
            return
        if not shape.drafts:
            self._launch_root_eager(b, features, handle, outputs, kv_bound, catch_up_window, catch_up_rows)
            return

        # Plan stream: upload, then the verify plan.
        with s.on("plan"):
            s.read("page_table_staging", "plan")
            s.begin("plan", "page_table")
            s.write(f"page_rows[{it}]", "plan")
            slots, page_rows = self._upload_staging(b)
            handle.staging_released = s.record("plan", "staging_released")
            table_ready = s.record("plan", "page_table")
            # Futures: seq_lens come from the previous step's verify/prefill on the main stream.
            s.wait("plan", self._last.seq_lens_ready if self._last else None)
            s.begin("plan", "verify_plan")
            s.read("seq_lens", "plan")
            s.write(f"verify_plan[{it}]", "plan")
            vplan = plan.plan_verify(page_rows, pool.seq_lens[slots], n_nodes, kv_bound, ps)
            verify_plan_ready = s.record("plan", "verify_plan")
        for t in (slots, page_rows, *vars(vplan).values()):
            if t is not None:
                s.keep_alive(t, "main")

        # Main stream: draft the tree while the plan stream works.
        s.wait("main", table_ready)
        s.read(f"page_rows[{it}]", "main")
        if needs_catch_up:
            self._eager_catch_up(handle, slots, page_rows, catch_up_rows, kv_bound, catch_up_window)
        s.write(f"draft_tree[{it}]", "main")
        tree = self.phases.draft_tree(slots, page_rows, kv_bound, shape)
        allowed = self._tree_grammar_masks(handle, tree) if features.constrained else None
        s.wait("main", verify_plan_ready)
        s.read(f"verify_plan[{it}]", "main")
        logits, hidden, aux = self.phases.verify(tree, vplan)  # [B, N, V], [B*N, H], [B*N, H] each
        s.write("seq_lens", "main")
        accept = self._accept_and_commit(slots, vplan, tree, logits, features, self._synthetic_coins(tree), allowed)
        handle.max_depth = tree.max_depth
        if shape.drafts:  # (see _launch_verify_graphed)
            outputs["accept_lens"] = accept.accept_lens
        outputs["out_tokens"] = accept.out_tokens
        if features.logprobs is not None:
            outputs["verify_logprob"], outputs["verify_top_v"], outputs["verify_top_i"] = self._verify_logprobs(
                logits, accept, features.logprobs)
        # Plan stream: draft-extend metadata. It is padded to the deepest possible run, so it needs
        # only the page rows and the old lengths (both the plan stream's own): no wait on verify.
        q = tree.max_depth + 1
        with s.on("plan"):
            s.begin("plan", "extend_plan")
            s.write(f"extend_plan[{it}]", "plan")
            first_pos = vplan.seq_lens + 1 - self.drafter.model.token_offset  # draft position of the first new token
            ext_meta = plan.extend_metadata(page_rows, first_pos, q, kv_bound, ps)
            extend_plan_ready = s.record("plan", "extend_plan")
        for t in (first_pos, *vars(ext_meta).values()):
            if isinstance(t, torch.Tensor):
                s.keep_alive(t, "main")

        features_in = self._accepted_features(hidden, aux, accept)
        s.wait("main", extend_plan_ready)
        s.read(f"extend_plan[{it}]", "main")
        self.phases.extend(slots, ext_meta, accept.out_tokens, features_in, accept.accept_lens, first_pos)

    # ---- the iteration body: acceptance and its state updates, shared by the eager and graphed paths ----
    def _accept_and_commit(self, slots, vplan: plan.VerifyPlan, tree: DraftTree, logits, features: SamplingFeatures,
                           coins, allowed=None) -> AcceptResult:
        """The target's own token at every tree node (greedy or sampled with position-keyed noise), the
        accepted path, and the commit: compacted KV, new lengths, the next root, penalty counts.
        allowed: [B * N, V] bool, each node's grammar mask (structured output), or None."""
        pool = self.pool
        b, n, vocab = logits.shape
        positions = predicted_positions(vplan.seq_lens, tree.depths)  # [B, N]: keys each node's noise
        path_counts = _path_token_counts(tree, vocab).view(b * n, vocab) if features.penalties else None
        node_rows = slots[:, None].expand(b, n).reshape(-1)
        meta = self.sampling.metadata(node_rows, positions.reshape(-1), features.penalties, path_counts)
        meta.allowed = allowed
        target_tokens = choose_tokens(logits.view(b * n, vocab), meta, features).view(b, n)
        use_coins = None if coins is None else coins[1]
        accept = self._same_on_every_rank(accept_target_tokens(tree, target_tokens, None if coins is None else coins[0],
                                                               use_coins))
        self._compact_target_kv(vplan, accept)
        pool.seq_lens[slots] = vplan.seq_lens + accept.accept_lens
        if n == 1:  # the root alone: its one token (a gather by accept_lens is three kernels more)
            pool.verified_id[slots] = accept.out_tokens[:, 0]
        else:
            pool.verified_id[slots] = accept.out_tokens.gather(1, (accept.accept_lens - 1)[:, None]).squeeze(1)
        if features.penalties:  # (only penalised rows read their counts)
            self.sampling.add_outputs(slots, accept.out_tokens)
        return accept

    def _tree_grammar_masks(self, handle: SpecStepHandle, tree: DraftTree):
        """[B * N, V] bool on the device: the grammar mask at every node of the drafted tree, from each
        node's own path (structured/matchers.py). The host needs the tree: the one place a constrained
        step waits for the device mid-iteration (after the draft, before verify)."""
        grammar = self.grammar
        if grammar is None or not any(rid in grammar for rid in handle.verify_ids):
            return None  # (tensor parallelism: only rank 0 keeps matchers; every rank takes its tokens)
        s = self.streams
        s.host_wait(s.record("main", "draft_tree"))
        s.read(f"draft_tree[{handle.iteration}]", "host")
        bitmask = grammar.tree_masks(handle.verify_ids, tree.tokens.cpu(), tree.parents.cpu())
        return allowed_on_device(bitmask, self.runner.device, self.runner.arch.vocab_size)

    def _accepted_features(self, hidden, aux, accept: AcceptResult):
        """[B, Q, F]: the root's and accepted drafts' target features, which pair with the next tokens
        in the draft extend (None for a standalone draft)."""
        feature = self._feature(hidden, aux)
        if feature is None:
            return None
        b = accept.path.shape[0]
        n = hidden.shape[0] // b  # tree nodes per row
        rows = accept.path.clamp(min=0) + torch.arange(b, device=hidden.device)[:, None] * n
        return feature[rows]

    def _dormant(self, request_id: str) -> bool:
        return self.policy is not None and request_id in self.policy.dormant

    def _plan_catch_up(self, request_ids: list[str], shape: DraftShape) -> tuple[int, list[int] | None]:
        """Whether this step first runs the draft over deferred tokens (before a step that drafts, or
        when a deferring step would overflow a lag buffer): the largest lag it catches up (0: none), and
        the batch rows it runs on (None: all; dormant rows keep no draft state, so never catch up).
        Updates the host mirror of the lags."""
        kept = [i for i, rid in enumerate(request_ids) if not self._dormant(rid)]
        lags = [self.lag.get(request_ids[i], 0) for i in kept]
        needed = self._catch_up_needed(lags, shape.drafts)
        for i, lag in zip(kept, lags):
            rid, lag = request_ids[i], 0 if needed else lag
            if shape.drafts:
                self.lag.pop(rid, None)
            else:
                self.lag[rid] = lag + 1
        if not needed:
            return 0, None
        return max(lags), (None if len(kept) == len(request_ids) else kept)

    def _catch_up_needed(self, lags: list[int], drafts: bool) -> bool:
        """Whether a step first catches up rows with these lags: any deferred extend before a step that
        drafts; before one that does not, only once a buffer is full."""
        return any(lags) and (drafts or max(lags) >= self.pool.catch_up_window)

    def _catch_up_rows(self, slots, page_rows, rows: list[int] | None):
        """The slots and page rows a catch-up runs on: the batch's, or (dormant rows left out) those of
        `rows`, uploaded from the host staging."""
        if rows is None:
            return slots, page_rows
        pool, device = self.pool, self.runner.device
        return (to_device(pool.staging_slots[rows], device, torch.long),
                to_device(pool.staging_pages[rows], device, torch.long))

    def _synthetic_coins(self, tree: DraftTree):
        """BENCHMARK ONLY: `tandem bench --synthetic-acceptance P` (tandem.bench.synthetic.install) sets
        `bench_synthetic_acceptance`; nothing else does. Its coins REPLACE the token match: the emitted
        tokens are then the draft's, not the target's. Returns (coins [B, N], use_coins [B]) or None."""
        synthetic = getattr(self, "bench_synthetic_acceptance", None)
        if synthetic is None:
            return None
        device = tree.tokens.device
        b = tree.tokens.shape[0]
        return synthetic.coins(tuple(tree.tokens.shape), device), torch.ones(b, dtype=torch.bool, device=device)

    def _stage_page_tables(self, chunks) -> None:
        """Host: fills the pinned staging buffer with this step's pool rows and page tables. It is
        reused every step, so first wait until the previous step's copy out of it is done."""
        s, pool, b = self.streams, self.pool, len(chunks)
        if self._last is not None and self._last.staging_released is not None:
            s.host_wait(self._last.staging_released)
        s.write("page_table_staging", "host")
        # Through numpy views: a torch tensor and slice copy per row costs 240 us a step at batch 32 on a
        # CI CPU (20 us this way), and a tiny model's steps wait on the host.
        pool.staging_slots.numpy()[:b] = [pool.slot(c.request_id) for c in chunks]
        pages = pool.staging_pages.numpy()
        pages[:b] = 0
        for i, c in enumerate(chunks):
            pages[i, : len(c.page_ids)] = c.page_ids

    # ---- rows without draft state: plain decoding's step ---------------------------------------
    def _all_dormant(self, request_ids) -> bool:
        dormant = self.policy.dormant if self.policy is not None else ()
        return bool(dormant) and all(rid in dormant for rid in request_ids)

    def _launch_dormant(self, b: int, features: SamplingFeatures, handle: SpecStepHandle, outputs,
                        kv_bound: int) -> None:
        """A step whose rows are all dormant (policy.admit): none has draft state to keep, so it is plain
        decoding's step on the pool's device state (`RootStep` without the deferred extends), on a GPU
        the dormant-decode graph. Grammar-constrained batches keep the depth-0 iteration."""
        s = self.streams
        self.stats.dormant_steps += 1
        handle.dormant = True
        slots, page_rows = self._upload_on_main(b, handle)
        s.read("seq_lens", "main")
        s.write("seq_lens", "main")
        graphed = graph_features(features)
        if self.phases.dormant_graphed(b, graphed):
            out_tokens, *logprobs = self.phases.dormant(graphed, slots, page_rows)
        else:
            out_tokens, *logprobs = self.root_step(slots, page_rows, kv_bound, features, defer=False)
        self._root_outputs(handle, outputs, out_tokens, logprobs)

    def _launch_root_eager(self, b: int, features: SamplingFeatures, handle: SpecStepHandle, outputs, kv_bound: int,
                           catch_up_window: int, catch_up_rows: list[int] | None) -> None:
        """An eager depth-0 step: the catch-up when one is due, then the root step (speculative/root_step.py).
        Everything on the main stream: there is no verify plan for the plan stream to prepare."""
        s = self.streams
        slots, page_rows = self._upload_on_main(b, handle)
        if catch_up_window:
            self._eager_catch_up(handle, slots, page_rows, catch_up_rows, kv_bound, catch_up_window)
        allowed = self.runner.grammar_masks(handle.verify_ids) if features.constrained else None
        s.read("seq_lens", "main")
        s.write("seq_lens", "main")
        out_tokens, *logprobs = self.root_step(slots, page_rows, kv_bound, features, allowed)
        self._root_outputs(handle, outputs, out_tokens, logprobs)

    def _eager_catch_up(self, handle: SpecStepHandle, slots, page_rows, rows: list[int] | None, kv_bound: int,
                        window: int) -> None:
        """The draft over the deferred tokens, before an eager step; on a CPU, where launching runs it, timed
        here (on a GPU its time comes from start-up timing of its graph)."""
        started = time.perf_counter()
        self.phases.catch_up(*self._catch_up_rows(slots, page_rows, rows), kv_bound, window)
        if self.runner.device.type != "cuda":
            handle.catch_up_ms = 1e3 * (time.perf_counter() - started)

    def _upload_on_main(self, b: int, handle: SpecStepHandle):
        """The staged pool rows and page rows, uploaded on the main stream (steps without a plan to prepare)."""
        s = self.streams
        s.read("page_table_staging", "main")
        s.write(f"page_rows[{handle.iteration}]", "main")
        slots, page_rows = self._upload_staging(b)
        handle.staging_released = s.record("main", "staging_released")
        return slots, page_rows

    @staticmethod
    def _root_outputs(handle: SpecStepHandle, outputs, out_tokens, logprobs) -> None:
        handle.max_depth = 0
        outputs["out_tokens"] = out_tokens
        if logprobs:
            outputs["verify_logprob"], outputs["verify_top_v"], outputs["verify_top_i"] = logprobs

    def _upload_staging(self, b: int):
        """The step's pool rows [B] and page rows [B, P] on the device, in one copy (views of one upload)."""
        rows = self.pool.staging[:b].to(self.runner.device, non_blocking=True, copy=True)
        return rows[:, 0], rows[:, 1:]

    # ---- the whole iteration as one CUDA graph -----------------------------------------------
    def _launch_verify_graphed(self, b: int, features: SamplingFeatures, shape: DraftShape, handle: SpecStepHandle,
                               outputs, needs_catch_up: bool, catch_up_rows: list[int] | None = None) -> None:
        """Everything on the main stream: the graph builds its own metadata from the page rows and the
        pool's device state, so there is nothing for the plan stream to prepare in parallel. A constrained
        step that drafts replays two graphs, the draft and the rest, with the host's tree masks between."""
        s, device = self.streams, self.runner.device
        it = handle.iteration
        slots, page_rows = self._upload_on_main(b, handle)
        synthetic = getattr(self, "bench_synthetic_acceptance", None)  # BENCHMARK ONLY (see _synthetic_coins)
        coin_shape = (b, self.phases.num_nodes(shape))
        no_coins = self._no_coins(coin_shape, device)
        coins = synthetic.coins(coin_shape, device) if synthetic is not None else no_coins
        use_coins = torch.ones_like(coins[:, 0]) if synthetic is not None else no_coins[:, 0]
        vocab = self.runner.arch.vocab_size
        allowed = None
        if features.constrained and not shape.drafts:  # the root's mask, known before launch
            allowed = self.runner.grammar_masks(handle.verify_ids)
            if allowed is None:  # (tensor parallelism: ranks without matchers take rank 0's tokens)
                allowed = torch.ones(b, vocab, dtype=torch.bool, device=device)
        s.read("seq_lens", "main")
        s.write("seq_lens", "main")
        if needs_catch_up:
            self.phases.catch_up(*self._catch_up_rows(slots, page_rows, catch_up_rows), self.phases.graph_kv_width)
        if features.constrained and shape.drafts:
            s.write(f"draft_tree[{it}]", "main")
            tree = self.phases.draft_half(shape, slots, page_rows)
            allowed = self._tree_grammar_masks(handle, tree)  # [B * N, V]: waits for the draft
            n = coin_shape[1]
            allowed = (torch.ones(b, n, vocab, dtype=torch.bool, device=device) if allowed is None
                       else allowed.view(b, n, vocab))
            handle.keep_alive.append(tree)
            accept_lens, out_tokens = self.phases.verify_half(features, shape, slots, page_rows, tree, coins, use_coins,
                                                              allowed)
        else:
            accept_lens, out_tokens, *logprobs = self.phases.iteration(features, shape, slots, page_rows, coins,
                                                                       use_coins, allowed)
            if logprobs:
                outputs["verify_logprob"], outputs["verify_top_v"], outputs["verify_top_i"] = logprobs
        handle.max_depth = out_tokens.shape[1] - 1
        if shape.drafts:  # (a depth-0 step accepts its root alone: the host knows its lengths)
            outputs["accept_lens"] = accept_lens
        outputs["out_tokens"] = out_tokens

    def _no_coins(self, shape: tuple[int, int], device) -> torch.Tensor:
        """[B, N] False, sliced from one kept buffer: creating it every step would be a kernel a step."""
        buf = self._coin_buffers.get(shape[1])
        if buf is None or buf.shape[0] < shape[0]:
            buf = self._coin_buffers[shape[1]] = torch.zeros(max(shape[0], 8), shape[1], dtype=torch.bool,
                                                             device=device)
        return buf[:shape[0]]

    def decode_iteration(self, slots, page_rows, coins, use_coins, kv_bound: int, features: SamplingFeatures,
                         shape: DraftShape, allowed=None):
        """One speculative iteration from device state alone (the body of the whole-iteration graph):
        draft tree, verify, accept and commit, draft extend. The eager path (`_launch_verify`) runs the
        same phases with the plan stream preparing metadata beside the draft. Depth 0 is the root step."""
        if not shape.drafts:
            out_tokens, *logprobs = self.root_step(slots, page_rows, kv_bound, features, allowed)
            return (torch.ones_like(out_tokens[:, 0]), out_tokens, *logprobs)  # (accept lengths: the root alone)
        tree = self.draft_for_iteration(slots, page_rows, kv_bound, shape)
        return self.verify_and_commit(slots, page_rows, tree, coins, use_coins, kv_bound, features, shape, allowed)

    def draft_for_iteration(self, slots, page_rows, kv_bound: int, shape: DraftShape) -> DraftTree:
        """The first half of `decode_iteration`: the draft tree (a graph of its own for constrained steps,
        whose host computes the tree's grammar masks before the second half)."""
        pool, drafter = self.pool, self.drafter
        # Padded rows share the pool's pad row; start it from zero so their positions stay small.
        pool.seq_lens[pool.pad_slot:pool.pad_slot + 1].zero_()  # (a kernel: no host value inside a capture)
        pool.draft_entries[pool.pad_slot:pool.pad_slot + 1].zero_()
        n = self.phases.num_nodes(shape)
        if shape == self.phases.configured:
            return drafter.draft_tree(slots, page_rows, kv_bound, n)
        return drafter.draft_tree(slots, page_rows, kv_bound, n, shape.depth)  # a shorter chain of the policy's

    def verify_and_commit(self, slots, page_rows, tree: DraftTree, coins, use_coins, kv_bound: int,
                          features: SamplingFeatures, shape: DraftShape, allowed=None):
        """The second half of `decode_iteration`: verify, accept and commit, draft extend (or its deferral).
        (accept_lens, out_tokens), and with features.logprobs the produced tokens' logprobs (chosen,
        top values, top ids). allowed: [B * N, V] bool, each node's grammar mask, or None."""
        pool, drafter = self.pool, self.drafter
        n, ps = self.phases.num_nodes(shape), self.runner.page_size
        seq_lens = pool.seq_lens[slots]
        vplan = plan.plan_verify(page_rows, seq_lens, n, kv_bound, ps)
        logits, hidden, *aux = self.phases.verify_forward(tree.tokens, tree.parents, tree.depths, vplan.seq_lens,
                                                          vplan.node_slots, vplan.node_cols, vplan.kv_slots,
                                                          vplan.prefix_mask, chain=tree.chain)
        accept = self._accept_and_commit(slots, vplan, tree, logits, features, (coins, use_coins), allowed)
        results = (accept.accept_lens, accept.out_tokens)
        if features.logprobs is not None:
            results += self._verify_logprobs(logits, accept, features.logprobs)
        first_pos = seq_lens + 1 - drafter.model.token_offset
        ext_meta = plan.extend_metadata(page_rows, first_pos, tree.max_depth + 1, kv_bound, ps)
        features_in = self._accepted_features(hidden.reshape(-1, hidden.shape[-1]),
                                              [a.reshape(-1, a.shape[-1]) for a in aux], accept)
        drafter.extend(slots, ext_meta, accept.out_tokens, features_in, accept.accept_lens, first_pos)
        return results

    def _feature(self, hidden, aux):
        return target_feature(self.drafter.model, hidden, aux)

    def _same_on_every_rank(self, accept: AcceptResult) -> AcceptResult:
        """Tensor parallelism: every rank takes rank 0's decisions. Each rank has the same
        full-vocabulary logits (all-gathered) and draws the same position-keyed noise, so in exact
        arithmetic the ranks agree anyway; the broadcast (three small tensors per step, on the device,
        no host sync) makes agreement independent of any rank-to-rank rounding difference, so every
        rank's KV, draft state and next tree stay identical. Its cost is unmeasured on two GPUs."""
        tp = self.runner.tp
        if tp.size == 1:
            return accept
        return AcceptResult(*(tp.broadcast_(t.contiguous()) for t in
                              (accept.accept_lens, accept.path, accept.out_tokens)))

    def _compact_target_kv(self, vplan: plan.VerifyPlan, accept: AcceptResult) -> None:
        """Moves the KV of accepted tree nodes to consecutive positions after the root (a no-op copy
        for unaccepted depths). Every source is read before any write."""
        depth = accept.path.shape[1]
        if depth <= 1 or getattr(self.drafter, "topk", 1) == 1:
            # A chain's accepted nodes are 1..k in order: already where compaction would put them
            # (and skipping it saves two kernels per KV layer every step).
            return
        j = torch.arange(1, depth, device=accept.path.device)
        src_node = torch.where(j < accept.accept_lens[:, None], accept.path[:, 1:], j)  # [B, D]
        src = vplan.node_slots.gather(1, src_node).reshape(-1)
        dst = vplan.node_slots[:, 1:depth].reshape(-1)
        for cache in (*self.runner.kv_cache.k, *self.runner.kv_cache.v):
            cache[dst] = cache[src]

    def _verify_logprobs(self, logits, accept: AcceptResult, top_n: int):
        """Raw-model logprobs of each produced token (node path[j] predicts out_tokens[j]): the chosen
        tokens' [B, Q], and the top-n values and ids [B, Q, n]."""
        b, q = accept.path.shape
        node_logits = logits.gather(1, accept.path.clamp(min=0)[:, :, None].expand(-1, -1, logits.shape[-1]))
        chosen, top_v, top_i = token_logprobs(node_logits.reshape(b * q, -1), accept.out_tokens.reshape(-1), top_n)
        return chosen.view(b, q), top_v.view(b, q, -1), top_i.view(b, q, -1)

    # ---- prefill rows: CPU-planned, results stay on the device ------------------------------
    def _launch_prefill(self, chunks, handle: SpecStepHandle, outputs, batch_ahead: int = 0) -> None:
        runner, pool, s = self.runner, self.pool, self.streams
        # The batch a new request joins: the decoding requests, those whose prompts run now, and the queued
        # ones with room to follow (a burst of prompts is prefilled a chunk budget at a time: judged by the
        # running batch alone, its first prompts would keep drafting at the small sizes where drafting pays,
        # then decode at the full size where it does not).
        prompts = {c.request_id for c in chunks}
        rows = len(self.ready - prompts) + len(prompts)
        joins = self.padded_batch(max(batch_ahead, rows))
        draining = batch_ahead <= rows  # (nothing queued with room to refill the batch, as in choose_shape)
        for c in chunks:
            if c.first_chunk and c.draftless:
                # Its prefix-cache hit holds no draft KV for it (pages of dormant requests): it runs dormant.
                self.ready.discard(c.request_id)
                self.policy.dormant.add(c.request_id)  # (what policy.admit records of a dormant admission)
                self.stats.dormant_admitted += 1
            elif c.first_chunk:
                self.ready.discard(c.request_id)  # fresh prefill or recompute: start over
                if self.policy is not None and self.policy.admit(
                        c.request_id, joins, c.num_prompt_tokens, c.sampling_params.max_new_tokens,
                        sampled=not c.sampling_params.greedy,
                        finish_together=draining and _fixed_length(c.sampling_params),
                        mode=step_mode(SamplingFeatures.of([c.sampling_params]))):
                    self.stats.dormant_admitted += 1  # dormant: no draft prefill, no catch-ups
            self.sampling.admit_chunk(pool.slot(c.request_id), c)
        hidden, aux, first_row = self._target_prefill(chunks)
        handle.prompt_logprob_rows = prompt_logprobs.rows_for(chunks, first_row)
        if handle.prompt_logprob_rows is not None:
            outputs.update(prompt_logprobs.compute(runner.model, hidden, handle.prompt_logprob_rows))
        sampling = [c for c in chunks if c.sample]
        sampled = None
        if sampling:
            device = hidden.device
            idx = to_device([first_row[c.request_id] + len(c.token_ids) - 1 for c in sampling], device, torch.long)
            slots = to_device([pool.slot(c.request_id) for c in sampling], device, torch.long)
            end_pos = to_device([c.end_pos for c in sampling], device, torch.long)
            features = SamplingFeatures.of([c.sampling_params for c in sampling])
            logits = runner.model.compute_logits(hidden[idx])
            # The sampled token's position is the chunk's end: the same noise plain decoding would use.
            meta = self.sampling.metadata(slots, end_pos, features.penalties)
            meta.allowed = self.runner.grammar_masks([c.request_id for c in sampling])
            tokens = choose_tokens(logits, meta, features)
            sampled = runner.tp.broadcast_(tokens.contiguous())  # see _same_on_every_rank
            s.write("seq_lens", "main")
            pool.verified_id[slots] = sampled
            pool.seq_lens[slots] = end_pos
            pool.lag.index_fill_(0, slots, 0)  # the draft prefill below brings the draft up to date
            for c in sampling:
                self.lag.pop(c.request_id, None)
            if features.penalties:
                self.sampling.add_outputs(slots, sampled[:, None])
            outputs["prefill_tokens"] = sampled
            if features.logprobs is not None:
                chosen, top_v, top_i = token_logprobs(logits, sampled, features.logprobs)
                outputs["prefill_logprob"], outputs["prefill_top_v"], outputs["prefill_top_i"] = chosen, top_v, top_i
            handle.prefill_ids = [c.request_id for c in sampling]
            for c in sampling:
                self.ready.add(c.request_id)
        dormant = [c for c in chunks if self._dormant(c.request_id)]
        if dormant:
            # Drafts of a dormant row (in steps that draft for others) start from its own positions.
            done = [c for c in dormant if c.sample]
            if done:
                pool.draft_entries[to_device([pool.slot(c.request_id) for c in done], runner.device, torch.long)] = \
                    to_device([c.end_pos + 1 - self.drafter.model.token_offset for c in done], runner.device,
                              torch.long)
        if not handle.verify_ids:
            # A prompt-only step's tokens go to the host before the draft's prefill runs: the first token
            # does not wait for it (time to first token as plain decoding's).
            handle.tokens_ready = self._copy_results(handle, outputs, "prefill_results")
            outputs.clear()
        feature = self._feature(hidden, aux)
        feeds, sampled_row = [], {}
        sampled_index = {c.request_id: i for i, c in enumerate(sampling)}
        for c in chunks:
            if self._dormant(c.request_id):
                continue
            first = first_row[c.request_id]
            feat = feature[first:first + len(c.token_ids)] if feature is not None else None
            feed = self._prefill_feed(c, feat)
            if c.sample:
                sampled_row[len(feeds)] = sampled_index[c.request_id]
            feeds.append(feed)
        tokens = sum(len(f.token_ids) for f in feeds)
        timer = DraftPrefillTimer(runner.device, tokens) if tokens and self.policy is not None else None
        self.drafter.prefill(feeds, sampled, sampled_row)
        if timer is not None:
            handle.draft_prefill = timer.stop()

    def _target_prefill(self, chunks):
        runner, ps = self.runner, self.runner.page_size
        input_ids, positions, slots, query_lens = [], [], [], []
        first_row = {}
        for c in chunks:
            first_row[c.request_id] = len(input_ids)
            input_ids += c.token_ids
            positions += range(c.start_pos, c.end_pos)
            slots += positions_to_slots(c.page_ids, range(c.start_pos, c.end_pos), ps)
            query_lens.append(len(c.token_ids))
        batch = AttentionBatch.paged(query_lens, [c.page_ids for c in chunks], [c.end_pos for c in chunks], slots, ps)
        metadata = runner.backend.plan(batch, runner.device)
        ctx = StepContext(runner.backend, metadata, runner.kv_cache.k, runner.kv_cache.v)
        ids_t = to_device(input_ids, runner.device, torch.long)
        pos_t = to_device(positions, runner.device, torch.long)
        hidden, aux = runner.target_forward(ids_t, pos_t, ctx, aux_layer_ids=self.drafter.model.aux_layer_ids)
        return hidden, aux, first_row

    def _prefill_feed(self, c: ScheduledChunk, feat) -> PrefillFeed:
        """Pairs each token with the target feature of the token before it (EAGLE), or feeds the
        tokens alone (standalone). A chunk's last feature waits in the pool for the next chunk."""
        pool = self.pool
        slot = pool.slot(c.request_id)
        tokens = list(c.token_ids) + ([-1] if c.sample else [])  # -1: this step's sampled token
        if self.drafter.model.token_offset == 0:
            return PrefillFeed(slot, tokens, c.start_pos, None, c.page_ids, c.sample)
        feats = None
        if feat is not None:
            prev = [pool.pending_feature[slot: slot + 1]] if not c.first_chunk else []
            feats = torch.cat(prev + [feat])
            if not c.sample:
                pool.pending_feature[slot] = feat[-1]
        first_index = c.start_pos
        if c.first_chunk:
            # x[0] has no feature before it; after a prefix-cache hit at s, the entry pairing x[s] with the
            # target's features at s-1 is the cached page's own (exact: the page's content includes x[s]).
            tokens, first_index = tokens[1:], c.start_pos + 1
        n = len(tokens)
        return PrefillFeed(slot, tokens, first_index, feats[:n] if feats is not None else None,
                           c.page_ids, c.sample)

    # ---- results -------------------------------------------------------------------------------
    def _copy_results(self, handle: SpecStepHandle, outputs: dict[str, torch.Tensor], buffer: str) -> Edge:
        """Queues the copy of `outputs` into the handle's host tensors; returns the event after it."""
        s = self.streams
        pin = self.runner.device.type == "cuda"
        # Fresh tensors per iteration: named per iteration (their memory is never shared across steps).
        s.write(f"{buffer}[{handle.iteration}]", "main")
        for name, t in outputs.items():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            handle.host[name] = host
            handle.keep_alive.append(t)
        return s.record("main", buffer)

    def collect(self, handle: SpecStepHandle, result) -> None:
        """Waits for one iteration's results (one event; a prompt-only step's tokens, which come before
        its draft prefill) and fills a StepResult."""
        early = handle.tokens_ready is not None
        self.streams.host_wait(handle.tokens_ready if early else handle.ready)
        step_ms = self.step_clock.collected(handle.launched_at)
        # On a GPU, a step collected after an early one was timed from it, and so counts its draft prefill.
        timed = not (self._untimed_next and self.runner.device.type == "cuda")
        self._untimed_next = early
        self.streams.read(f"{'prefill_results' if early else 'results'}[{handle.iteration}]", "host")
        host = handle.host
        if handle.prompt_logprob_rows is not None:
            result.prompt_logprobs = prompt_logprobs.collect(handle.prompt_logprob_rows, host)
        result.draft_behind = handle.draft_behind
        if handle.prefill_ids:
            tokens = host["prefill_tokens"].tolist()
            for i, rid in enumerate(handle.prefill_ids):
                result.sampled[rid] = [tokens[i]]
            if "prefill_logprob" in host:
                collect_logprobs(handle.logprobs_wanted, handle.prefill_ids, [[t] for t in tokens], [1] * len(tokens),
                                 host["prefill_logprob"][:, None], host["prefill_top_v"][:, None],
                                 host["prefill_top_i"][:, None], result)
        if handle.verify_ids:
            lens = host["accept_lens"].tolist() if "accept_lens" in host else [1] * len(handle.verify_ids)
            outs = host["out_tokens"].tolist()
            for i, rid in enumerate(handle.verify_ids):
                k = lens[i]
                result.sampled[rid] = outs[i][:k]
                result.accept_lengths[rid] = k
            result.spec_max_depth = handle.max_depth
            result.spec_num_proposed = self.phases.num_nodes(handle.shape) - 1
            self.stats.record_step(handle.shape.depth)
            self._inform_policy(handle, lens, step_ms if timed else None)
            if "verify_logprob" in host:
                collect_logprobs(handle.logprobs_wanted, handle.verify_ids, outs, lens, host["verify_logprob"],
                                 host["verify_top_v"], host["verify_top_i"], result)
        if early:
            self._finishing.append(handle)
        else:
            self._finish(handle)
        self._finish_ended_steps()

    def _finish_ended_steps(self) -> None:
        still_running = []
        for h in self._finishing:
            if self.streams.done(h.ready):
                self._finish(h)
            else:
                still_running.append(h)
        self._finishing = still_running

    def _finish(self, handle: SpecStepHandle) -> None:
        """A step the device has run to its end: its draft prefill's time to the policy, its tensors freed."""
        self._observe_draft_prefill(handle)
        handle.keep_alive.clear()

    def _observe_draft_prefill(self, handle: SpecStepHandle) -> None:
        """The draft's prefill time in this step, per prompt token: what keeping a new request's draft costs
        up front (`DepthPolicy.admit` weighs it against what drafting gains)."""
        ms = handle.draft_prefill.elapsed_ms() if handle.draft_prefill is not None else None
        if ms is not None:
            self.policy.observe_draft_prefill(handle.draft_prefill.tokens, ms)

    def _inform_policy(self, handle: SpecStepHandle, lens: list[int], step_ms: float | None) -> None:
        """Accept lengths and this step's time (less a catch-up's, which earlier steps deferred), for steps
        without prefill rows (they would count prefill time). On a GPU the step's time is `step_ms`
        (StepClock: what throughput sees, host and device; None: not known); on a CPU launching runs the step."""
        if self.policy is None:
            return
        self.policy.observe_step(handle.shape, handle.verify_ids, lens)
        if step_ms is None:
            return
        if handle.dormant and not handle.prefill_ids:  # (plain decoding's step: no option of the policy's)
            self.policy.observe_dormant_time(handle.padded_batch,
                                             step_ms if self.runner.device.type == "cuda" else handle.launch_ms,
                                             mode=handle.mode)
        elif not handle.prefill_ids:
            ms = step_ms if self.runner.device.type == "cuda" else handle.launch_ms
            catch_up_ms = min(handle.catch_up_ms, 0.5 * ms)
            self.policy.observe_time(handle.padded_batch, handle.shape, ms - catch_up_ms, mode=handle.mode)
            if handle.catch_up_queries:  # the depth-0 steps that deferred the work pay for it
                self.policy.observe_catch_up(handle.catch_up_batch, catch_up_ms / handle.catch_up_queries)


def _fixed_length(params) -> bool:
    """Whether a request runs to max_new_tokens whatever it generates (no EOS, stop or grammar end)."""
    return params.ignore_eos and not params.stop and not params.stop_token_ids and not params.constrained


class StepClock:
    """A step's time on a GPU: from the later of its launch and the previous step's results (of any step)
    to its own results. With overlap a step is launched while the one before still runs, so timed from
    its launch alone it also counts the rest of that one. Prompt-only steps move the previous results'
    time too: else the first decode step after them counts their prefill (~30 ms at batch 32, 8B shape,
    H200), and depth 0, its usual choice, reads dearer than it is, so drafting looks worth it where it is not."""

    def __init__(self):
        self.last = 0.0

    def collected(self, launched_at: float, now: float | None = None) -> float:
        """ms of the step launched at `launched_at` whose results arrived `now` (default: this instant)."""
        now = time.perf_counter() if now is None else now
        started, self.last = max(launched_at, self.last), now
        return 1e3 * (now - started)


class DraftPrefillTimer:
    """The time of the draft's prefill of `tokens` prompt tokens in one step: CUDA events on the stream it
    runs on (read once the step's results are in, which come after it on that stream), or the host clock
    on a CPU, where the call runs the work."""

    def __init__(self, device: torch.device, tokens: int):
        self.tokens = tokens
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.started, self.ms = time.perf_counter(), None

    def stop(self) -> "DraftPrefillTimer":
        if self.cuda:
            self.end.record()
        else:
            self.ms = 1e3 * (time.perf_counter() - self.started)
        return self

    def elapsed_ms(self) -> float | None:
        """ms, or None where the device has not finished it."""
        if not self.cuda:
            return self.ms
        return self.start.elapsed_time(self.end) if self.end.query() else None


def _replay_ms(graph, replays: int) -> float:
    """Mean time of one replay of a captured CUDA graph, after one untimed replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def predicted_positions(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[B, N]: the position of the token each tree node predicts. The root (the last verified token) sits
    at position seq_len, a node of depth d at seq_len + d, and its prediction one further on."""
    return seq_lens[:, None] + depths + 1


def _path_token_counts(tree: DraftTree, vocab: int) -> torch.Tensor:
    """[B, N, V] float32: how often each token occurs on node c's path below the root (c included). A
    node's penalties see the request's outputs plus these drafted tokens, as plain decoding would."""
    b, n = tree.tokens.shape
    counts = torch.zeros(b, n, vocab + 1, dtype=torch.float32, device=tree.tokens.device)
    node = torch.arange(n, device=tree.tokens.device).expand(b, n)
    for _ in range(tree.max_depth):
        below_root = node > 0
        token = torch.where(below_root, tree.tokens.gather(1, node), vocab)  # the root adds to the spare column
        counts.scatter_add_(2, token[:, :, None], torch.ones(b, n, 1, device=counts.device))
        node = torch.where(below_root, tree.parents.gather(1, node), 0)
    return counts[:, :, :vocab]
