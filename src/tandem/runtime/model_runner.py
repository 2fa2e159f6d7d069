"""Runs one scheduled step of the target model: builds the flat batch, plans attention, forwards,
samples. Takes a `SchedulerOutput`, returns a `StepResult`; holds no scheduling logic.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from tandem import envs
from tandem.config import EngineConfig
from tandem.distributed.parallel_state import TPGroup, kv_heads_layout
from tandem.kv_cache import KVCache
from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.layers.attention.torch_backend import TorchAttentionBackend
from tandem.layers.sampler import (
    GRAPHED_GENERAL,
    GRAPHED_SAMPLING,
    GREEDY,
    SamplingFeatures,
    choose_tokens,
    graph_features,
    token_logprobs,
)
from tandem.models.hf_config import ModelArchConfig
from tandem.models.llama import StepContext
from tandem.models.draft_registry import build_draft_model
from tandem.models.llama import LlamaAttention
from tandem.models.registry import build_target_model
from tandem.runtime import prompt_logprobs
from tandem.runtime.cuda_graphs import GraphedFunction, GraphInput, capture_all, capture_batch_sizes
from tandem.runtime.decode_plan import decode_metadata
from tandem.runtime.piecewise_graphs import PiecewiseForward, piecewise_supported
from tandem.runtime.plain_state import PlainStatePool, PlainStepHandle
from tandem.runtime.sampling_state import SamplingState
from tandem.runtime.step_result import StepResult, collect_logprobs
from tandem.runtime.streams import FaultInjection, StreamSet
from tandem.speculative.drafter import Drafter
from tandem.speculative.mtp_drafter import MTPDrafter, MTPStatePool
from tandem.speculative.catch_up import CATCH_UP_WINDOW
from tandem.speculative.policy import DepthPolicy
from tandem.speculative.state import SpecStatePool
from tandem.speculative.worker import SpecWorker
from tandem.scheduler.outputs import SchedulerOutput
from tandem.structured.matchers import GrammarRows, allowed_on_device
from tandem.runtime.uploads import to_device

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on a CPU when none is given
GPU_MEMORY_FRACTION = 0.85  # of the memory free after loading weights


@dataclass
class FlatBatch:
    """One step's tokens laid out request by request, plus where to sample."""

    input_ids: list[int]
    positions: list[int]
    attention: AttentionBatch
    sample_index: list[int]  # row of the flat batch whose logits give each sampled request's token
    sample_request_ids: list[str]
    sample_positions: list[int]  # position of each sampled token (keys its noise)
    first_row: dict[str, int] = field(default_factory=dict)  # request id -> its first row
    # Future chunks: rows of the flat batch whose input token is the device's last sampled token.
    future_rows: list[int] = field(default_factory=list)
    future_slots: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArchConfig, max_model_len: int,
                 device_module=None, stream_faults: FaultInjection = FaultInjection(), tp: TPGroup | None = None):
        self.config = config
        # Tensor parallelism: this rank's shard of the target, and of an EAGLE/EAGLE-3 draft layer.
        self.tp = tp or TPGroup.single()
        self.num_kv_heads, _ = kv_heads_layout(arch.num_kv_heads, self.tp)
        # Tests pass a recording stand-in for the device module and faults for negative controls.
        self.device_module = device_module
        self.stream_faults = stream_faults
        self.arch = arch
        self.device = torch.device(config.load.device)
        self.page_size = config.cache.page_size
        spec = config.speculative
        # Verification runs rope up to num_draft_tokens past the last real position.
        max_positions = max_model_len + (spec.num_draft_tokens + spec.num_steps * spec.eagle_topk
                                         if spec.algorithm else 0)
        self.model = build_target_model(config.load, arch, max_positions=max_positions, tp=self.tp)
        self.dtype = self.model.model.embed_tokens.weight.dtype
        draft = None
        if spec.algorithm is not None:
            draft = build_draft_model(spec.algorithm, spec.draft_model_path, self.model, config.load, max_positions,
                                      self.tp)
        # Every rank must have the same pages: rank 0's scheduler hands out page ids for all of them.
        self.num_pages = self.tp.all_reduce_min(config.cache.num_pages or self._pages_that_fit(draft))
        # One page past the scheduler's pool: the sink that padded rows of a CUDA-graph batch write to.
        self.sink_page = self.num_pages
        self.sink_slot = self.sink_page * self.page_size
        self.kv_cache = KVCache(arch.num_layers, self.num_pages + 1, self.page_size, self.num_kv_heads,
                                arch.head_dim, self.dtype, self.device)
        if config.attention_backend == "triton":
            from tandem.layers.attention.triton_backend import TritonAttentionBackend  # imports triton

            self.backend = TritonAttentionBackend()
        else:
            self.backend = TorchAttentionBackend()
        # Sampling parameters and penalty counts per state row, on the device (both pools have this many rows).
        num_state_rows = config.scheduler.max_num_seqs + 8
        self.sampling = SamplingState(num_state_rows, arch.vocab_size, self.device)
        self.spec = None
        if draft is not None:
            self.spec = self._build_spec_worker(draft, max_model_len)
        # Plain decoding: last sampled tokens on the device (overlap's "future" chunks read them), and
        # the position of each request's next token (a future chunk's start_pos is only a lower bound).
        self.plain_state = None if self.spec is not None else PlainStatePool(num_state_rows, self.device)
        self.next_pos: dict[str, int] = {}
        logger.info("KV cache: %d pages of %d tokens", self.num_pages, self.page_size)
        # Structured output: the constrained requests' grammar matchers (attach_grammar; None until the
        # first constrained request), and the last launched step, whose tokens they must see first.
        self.grammar: GrammarRows | None = None
        self._last_handle = None
        self.decode_graphs: dict[SamplingFeatures, GraphedFunction] = {}
        self._staging_in_use: torch.cuda.Event | None = None  # the decode graph's last staging upload
        graphs_here = self.device.type == "cuda" or envs.cuda_graph_emulate()
        if config.cuda_graph_max_bs and graphs_here:
            self._capture_cuda_graphs(max_model_len)
        self.piecewise: PiecewiseForward | None = None
        if config.piecewise_cuda_graph_max_tokens and graphs_here and piecewise_supported(self.model):
            aux = self.spec.drafter.model.aux_layer_ids if self.spec is not None else ()
            self.piecewise = PiecewiseForward(self.model, aux, config.piecewise_cuda_graph_max_tokens, self.sink_slot,
                                              self.device)
            self.piecewise.capture(StepContext(self.backend, None, self.kv_cache.k, self.kv_cache.v))

    # ---- CUDA graphs --------------------------------------------------------------------------
    def _capture_cuda_graphs(self, max_model_len: int) -> None:
        """Plain decoding: one graph of the target's decode step. Speculative decoding: the draft
        tree, verify forward and draft extend (speculative/phases.py). Prefill chunks stay eager."""
        sizes = capture_batch_sizes(min(self.config.cuda_graph_max_bs, self.config.scheduler.max_num_seqs))
        # The graph of penalised and logprob steps (GENERAL) reads the penalty tables: they exist from now.
        self.sampling.allocate_penalty_tables()
        if self.spec is None:
            max_pages = -(-max_model_len // self.page_size)
            self.decode_kv_width = max_pages * self.page_size
            self._decode_staging = torch.zeros(sizes[-1], 4 + max_pages, dtype=torch.long,
                                               pin_memory=self.device.type == "cuda")
            inputs = [GraphInput((), torch.long, 0),  # input token (when known on the host)
                      GraphInput((), torch.long, 0),  # position
                      GraphInput((), torch.long, self.plain_state.pad_slot),  # state row
                      GraphInput((), torch.long, 0),  # 1: the input token is the row's last sampled token
                      GraphInput((max_pages,), torch.long, self.sink_page)]
            for features in GRAPHED_SAMPLING + GRAPHED_GENERAL:
                self.decode_graphs[features] = GraphedFunction(
                    f"target decode ({features.name})", functools.partial(self._decode_forward, features=features),
                    inputs, self.device)
            functions = list(self.decode_graphs.values())
        elif isinstance(self.spec.drafter, MTPDrafter):
            logger.warning("CUDA graphs are not implemented for MTP drafting: its decode steps run eagerly")
            return
        else:
            spec = self.spec
            shapes = spec.policy.options if spec.policy is not None else [spec.phases.configured]
            functions = spec.phases.build_graphs(spec, spec.pool.staging_pages.shape[1] * self.page_size,
                                                 self._draft_feature_size(spec.drafter.model), shapes,
                                                 dormancy=spec.policy is not None and spec.policy.dormancy)
        capture_all(functions, sizes, self.device)
        if self.spec is not None and self.spec.policy is not None and self.device.type == "cuda":
            self.spec.time_graphed_iterations()

    def _decode_forward(self, input_ids, positions, slots, from_device, page_rows, features: SamplingFeatures):
        """One decode step of one-token rows, sampling included: (tokens [B], logits [B, V]), and with
        logprobs (the chosen token's [B], the top-n values and ids [B, n])."""
        input_ids = torch.where(from_device.bool(), self.plain_state.last_token[slots], input_ids)
        metadata = decode_metadata(page_rows, positions, self.decode_kv_width, self.page_size,
                                   self.backend.derives_causal_mask)
        ctx = StepContext(self.backend, metadata, self.kv_cache.k, self.kv_cache.v)
        hidden, _ = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden)
        # The sampled token sits one past its input token: that position keys its noise.
        tokens = choose_tokens(logits, self.sampling.metadata(slots, positions + 1, features.penalties), features)
        if features.logprobs is not None:
            return tokens, logits, *token_logprobs(logits, tokens, features.logprobs)
        return tokens, logits

    def _graphable_decode(self, sched: SchedulerOutput) -> bool:
        graph = self.decode_graphs.get(GREEDY)
        return (graph is not None and graph.fits(len(sched.chunks))
                and all(c.sample and (c.is_future or len(c.token_ids) == 1 and not c.first_chunk)
                        for c in sched.chunks))

    def _decode_graphed(self, sched: SchedulerOutput, positions: list[int], features: SamplingFeatures,
                        allowed: torch.Tensor | None = None):
        """Tokens [B], logits [B, V] and the logprob outputs (None, or the chosen token's, top values and
        ids) of a batch of one-token rows from a captured graph, and the rows' state slots [B] (on the
        device). Features without a graph (a grammar with penalties or logprobs) sample eagerly from
        the greedy graph's logits."""
        b = len(sched.chunks)
        if self._staging_in_use is not None:
            # Pinned staging is reused every step: the previous step's copy out of it must be done.
            self._staging_in_use.synchronize()
        # [token, position, state row, token from the device?, page ids...] per row.
        staging = self._decode_staging[:b]
        # Filled through a numpy view: a torch element or slice assignment per value cost 240 us a
        # step at batch 32 on a CI CPU (20 us this way), on a path where the host is the bottleneck.
        rows_np = staging.numpy()
        rows_np[:] = 0
        for i, (c, pos) in enumerate(zip(sched.chunks, positions)):
            row = rows_np[i]
            row[0] = c.token_ids[0] if not c.is_future else 0
            row[1] = pos
            row[2] = self.plain_state.slot(c.request_id)
            row[3] = int(c.is_future)
            row[4:4 + len(c.page_ids)] = c.page_ids
        rows = staging.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._staging_in_use = torch.cuda.Event()
            self._staging_in_use.record()
        graph = self.decode_graphs.get(graph_features(features))
        slots = rows[:, 2]
        if graph is not None:
            tokens, logits, *logprobs = graph(rows[:, 0], rows[:, 1], slots, rows[:, 3], rows[:, 4:])
            return tokens, logits, (logprobs or None), slots
        _, logits = self.decode_graphs[GREEDY](rows[:, 0], rows[:, 1], slots, rows[:, 3], rows[:, 4:])
        meta = self.sampling.metadata(slots, rows[:, 1] + 1, features.penalties)
        meta.allowed = allowed
        return choose_tokens(logits, meta, features), logits, None, slots

    def _draft_feature_size(self, draft) -> int | None:
        if draft.target_hidden == "final":
            return self.arch.hidden_size
        if draft.target_hidden == "aux":
            return len(draft.aux_layer_ids) * self.arch.hidden_size
        return None

    def _build_spec_worker(self, draft, max_model_len: int) -> SpecWorker:
        spec, sched = self.config.speculative, self.config.scheduler
        attn = _first_attention(draft)
        # A request's pages cover its tokens, a run still in flight, and this step's lookahead.
        max_pages = -(-(max_model_len + 3 * spec.num_lookahead_tokens) // self.page_size)
        feature = self._draft_feature_size(draft)
        draft_hidden = next(p for n, p in draft.named_parameters() if n.endswith("o_proj.weight")).shape[0]
        if spec.algorithm == "MTP":
            # MTP: one module per draft step, with lagging per-module KV and state (speculative/mtp_drafter.py).
            pool = MTPStatePool(sched.max_num_seqs + 8, max_pages, spec.num_steps, draft_hidden, self.dtype,
                                self.device)
            drafter = MTPDrafter(draft, self.backend, pool, self.page_size, self.num_pages, spec.num_steps,
                                 attn.num_kv_heads, attn.head_dim, self.dtype, self.device)
        else:
            # Depth-0 steps defer the draft extend (speculative/catch_up.py).
            pool = SpecStatePool(sched.max_num_seqs + 8, max_pages, spec.eagle_topk, draft_hidden, feature,
                                 self.dtype, self.device, catch_up_window=CATCH_UP_WINDOW if spec.adaptive else 0)
            # The draft cache has the sink page too (padded CUDA-graph rows write there).
            drafter = Drafter(draft, self.backend, pool, self.page_size, self.num_pages + 1, spec.eagle_topk,
                              spec.num_steps, attn.num_kv_heads, attn.head_dim, self.dtype, self.device)
        streams = StreamSet(self.device, use_plan_stream=not self.config.disable_plan_stream,
                            device_module=self.device_module, faults=self.stream_faults)
        policy = None
        if spec.adaptive:
            if spec.algorithm == "MTP":
                logger.info("adaptive speculation is not implemented for MTP drafting: it drafts %d steps always",
                            spec.num_steps)
            else:
                # Tensor parallelism: every rank must keep the same draft state, so no dormant requests.
                policy = DepthPolicy(spec.num_steps, tree=spec.eagle_topk > 1, dormancy=self.tp.size == 1)
        return SpecWorker(self, drafter, spec.num_draft_tokens, streams, self.sampling, policy)

    def _pages_that_fit(self, draft) -> int:
        per_page = KVCache.bytes_per_page(self.arch.num_layers, self.page_size, self.num_kv_heads,
                                          self.arch.head_dim, self.dtype)
        if draft is not None:
            attn = _first_attention(draft)
            per_page += KVCache.bytes_per_page(draft.num_kv_layers, self.page_size, attn.num_kv_heads,
                                               attn.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * GPU_MEMORY_FRACTION)
            return max(1, budget // per_page)
        # On a CPU, no more than every running request at full length needs (zeroed memory is slow).
        sched = self.config.scheduler
        needed = sched.max_num_seqs * -(-sched.max_model_len // self.page_size)
        return max(1, min(CPU_KV_CACHE_BYTES // per_page, needed))

    def drop_requests(self, request_ids) -> None:
        for rid in request_ids:
            self.next_pos.pop(rid, None)
        if self.plain_state is not None:
            self.plain_state.release(request_ids)

    def chunk_start(self, chunk) -> int:
        """The position of the chunk's first token (a future chunk's start_pos is only a lower bound)."""
        if chunk.is_future:
            return self.next_pos[chunk.request_id]
        return chunk.start_pos

    def _advance(self, chunk, start: int) -> None:
        self.next_pos[chunk.request_id] = start + max(1, len(chunk.token_ids))

    def build_batch(self, sched: SchedulerOutput) -> FlatBatch:
        input_ids, positions, slots = [], [], []
        query_lens, page_tables, kv_lens = [], [], []
        sample_index, sample_ids, sample_positions = [], [], []
        ps = self.page_size
        future_rows, future_slots = [], []
        first_row: dict[str, int] = {}
        for chunk in sched.chunks:
            start = self.chunk_start(chunk)
            self._advance(chunk, start)
            row = self.plain_state.slot(chunk.request_id)
            tokens = chunk.token_ids
            if chunk.is_future:
                future_rows.append(len(input_ids))
                future_slots.append(row)
                tokens = (0,)  # replaced on the device by the last sampled token
            else:
                self.sampling.admit_chunk(row, chunk)
            n = len(tokens)
            first_row[chunk.request_id] = len(input_ids)
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            slots.extend(positions_to_slots(chunk.page_ids, range(start, start + n), ps))
            query_lens.append(n)
            page_tables.append(chunk.page_ids)
            kv_lens.append(start + n)
            if chunk.sample:
                sample_index.append(len(input_ids) - 1)
                sample_ids.append(chunk.request_id)
                sample_positions.append(start + n)
        attention = AttentionBatch.paged(query_lens, page_tables, kv_lens, slots, ps)
        return FlatBatch(input_ids, positions, attention, sample_index, sample_ids, sample_positions, first_row,
                         future_rows, future_slots)

    def choose_draft_shape(self, sched: SchedulerOutput):
        """The draft shape of this step's verify rows (adaptive speculation), or None: the runner's own
        choice. Tensor parallelism asks rank 0 and hands its answer to every rank."""
        return None if self.spec is None else self.spec.choose_shape(sched)

    def launch(self, sched: SchedulerOutput, draft_shape=None):
        """Starts one step and returns a handle whose results arrive later (`collect`), so the
        engine can schedule the next step meanwhile (overlap)."""
        self.drop_requests(sched.preempted_ids)
        self.drop_requests(sched.finished_ids)
        if self.spec is not None:
            self.spec.drop_requests(sched.preempted_ids)
            self.spec.drop_requests(sched.finished_ids)
        if self.grammar is not None:
            self._admit_grammars(sched)
        if not sched.chunks:
            return None
        handle = self.spec.launch(sched, draft_shape) if self.spec is not None else self._launch_plain(sched)
        self._last_handle = handle
        return handle

    def attach_grammar(self, compiler) -> None:
        """Structured output on (the engine calls it when the first constrained request arrives)."""
        if self.grammar is None:
            self.grammar = GrammarRows(compiler)
            if self.spec is not None:
                self.spec.grammar = self.grammar

    def _admit_grammars(self, sched: SchedulerOutput) -> None:
        """Matchers for this step's constrained requests, up to date before their masks are computed.
        Their state needs the tokens of the step in flight (overlap launched it before the host read
        it): a step with constrained rows first collects that step, so it waits for the device where
        an unconstrained step would not."""
        grammar = self.grammar
        grammar.drop(sched.preempted_ids)
        grammar.drop(sched.finished_ids)
        for c in sched.chunks:
            if not c.is_future:
                grammar.admit_chunk(c, sched.iteration)
        if any(c.request_id in grammar for c in sched.chunks):
            last = self._last_handle
            if last is not None and last.result is None:
                self.collect(last)

    def collect(self, handle) -> StepResult:
        """Waits for a launched step's results (once: a constrained step may have collected it early)."""
        if handle.result is not None:
            return handle.result
        if isinstance(handle, PlainStepHandle):
            result = self._collect_plain(handle)
        else:
            result = StepResult()
            self.spec.collect(handle, result)
        if self.grammar is not None:
            self.grammar.advance(handle.iteration, result.sampled)
        handle.result = result
        return result

    def grammar_masks(self, request_ids) -> torch.Tensor | None:
        """[B, V] bool on the device: each request's allowed next tokens (None: none is constrained)."""
        if self.grammar is None or not any(r in self.grammar for r in request_ids):
            return None
        bitmask = self.grammar.root_masks(request_ids)
        return allowed_on_device(bitmask, self.device, self.arch.vocab_size)

    @torch.inference_mode()
    def _launch_plain(self, sched: SchedulerOutput) -> PlainStepHandle:
        """Enqueues one plain step (forward, sampling on the device, the sampled tokens into the device
        state and a copy to pinned host memory) without waiting for it."""
        handle = PlainStepHandle(sched.iteration)
        sampling = [c for c in sched.chunks if c.sample]
        features = SamplingFeatures.of([c.sampling_params for c in sampling])
        handle.logprobs_wanted = {c.request_id: c.sampling_params.logprobs for c in sampling
                                  if c.sampling_params.logprobs is not None}
        if self._graphable_decode(sched):
            positions = []
            for chunk in sched.chunks:
                start = self.chunk_start(chunk)
                self._advance(chunk, start)
                positions.append(start)
            handle.request_ids = [c.request_id for c in sched.chunks]
            token_ids, logits, logprobs, slots = self._decode_graphed(sched, positions, features,
                                                                      self.grammar_masks(handle.request_ids))
        else:
            logprobs = None
            batch = self.build_batch(sched)
            hidden = self.forward(batch)
            handle.prompt_logprob_rows = prompt_logprobs.rows_for(sched.chunks, batch.first_row)
            prompt_outputs = ({} if handle.prompt_logprob_rows is None else
                              prompt_logprobs.compute(self.model, hidden, handle.prompt_logprob_rows))
            if not batch.sample_index:
                self._copy_to_host(handle, prompt_outputs)
                return handle
            handle.request_ids = batch.sample_request_ids
            logits = self.model.compute_logits(hidden[self._upload(batch.sample_index, handle)])
            slots = self._upload([self.plain_state.slot(r) for r in handle.request_ids], handle)
            meta = self.sampling.metadata(slots, self._upload(batch.sample_positions, handle), features.penalties)
            meta.allowed = self.grammar_masks(handle.request_ids)
            token_ids = choose_tokens(logits, meta, features)
        # Tensor parallelism: every rank takes rank 0's tokens (they feed the next step on the device).
        token_ids = self.tp.broadcast_(token_ids.contiguous())
        self.plain_state.last_token[slots] = token_ids
        if features.penalties:  # (only penalised rows read their counts; a batch without one skips the kernels)
            self.sampling.add_outputs(slots, token_ids[:, None])
        outputs = {"token_ids": token_ids}
        if features.logprobs is not None:
            # The graph's (top 20: each request keeps its own count when collected), or computed here.
            outputs["logprob"], outputs["top_vals"], outputs["top_ids"] = (
                logprobs or token_logprobs(logits, token_ids, features.logprobs))
        if handle.prompt_logprob_rows is not None:
            outputs.update(prompt_outputs)
        self._copy_to_host(handle, outputs)
        return handle

    def _copy_to_host(self, handle: PlainStepHandle, outputs: dict[str, torch.Tensor]) -> None:
        """Pinned host copies of the step's results, and one event after them (on a GPU)."""
        pin = self.device.type == "cuda"
        for name, t in outputs.items():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            handle.host[name] = host
            handle.keep_alive.append(t)
        if pin and outputs:
            handle.ready = torch.cuda.Event()
            handle.ready.record()

    def _upload(self, values: list[int], handle: PlainStepHandle) -> torch.Tensor:
        """A small index tensor on the device without a host sync: `torch.tensor(..., device=cuda)`
        copies from pageable memory, which waits for the stream (the step in flight) to drain."""
        host = torch.tensor(values, dtype=torch.long, pin_memory=self.device.type == "cuda")
        handle.keep_alive.append(host)  # the asynchronous copy reads it (belt and braces)
        return host.to(self.device, non_blocking=True)

    def _collect_plain(self, handle: PlainStepHandle) -> StepResult:
        result = StepResult()
        if handle.ready is not None:
            handle.ready.synchronize()
        host = handle.host
        if handle.prompt_logprob_rows is not None:
            result.prompt_logprobs = prompt_logprobs.collect(handle.prompt_logprob_rows, host)
        if not handle.request_ids:
            handle.keep_alive.clear()
            return result
        token_ids = host["token_ids"].tolist()
        for i, rid in enumerate(handle.request_ids):
            result.sampled[rid] = [token_ids[i]]
        if "logprob" in host:
            collect_logprobs(handle.logprobs_wanted, handle.request_ids, [[t] for t in token_ids],
                             [1] * len(token_ids), host["logprob"][:, None], host["top_vals"][:, None],
                             host["top_ids"][:, None], result)
        handle.keep_alive.clear()
        return result

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        metadata = self.backend.plan(batch.attention, self.device)
        ctx = StepContext(self.backend, metadata, self.kv_cache.k, self.kv_cache.v)
        input_ids = to_device(batch.input_ids, self.device, torch.long)
        if batch.future_rows:  # input tokens sampled by the step in flight: still on the device
            rows = to_device(batch.future_rows, self.device, torch.long)
            input_ids[rows] = self.plain_state.last_token[to_device(batch.future_slots, self.device, torch.long)]
        positions = to_device(batch.positions, self.device, torch.long)
        hidden, _ = self.target_forward(input_ids, positions, ctx)
        return hidden

    def target_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                       aux_layer_ids: tuple[int, ...] = ()):
        """The target over a flat batch of prompt chunks and decodes: piecewise CUDA graphs where they
        were captured for its size (the outputs are then views their next replay overwrites), else eager."""
        if self.piecewise is not None and self.piecewise.fits(input_ids.shape[0], aux_layer_ids):
            return self.piecewise(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx, aux_layer_ids=aux_layer_ids)



def _first_attention(model) -> LlamaAttention:
    """The draft's attention geometry (its KV cache shape)."""
    return next(m for m in model.modules() if isinstance(m, LlamaAttention))
