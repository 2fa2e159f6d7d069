"""Runs one scheduled step of the target model: builds the flat batch, plans attention, forwards,
samples. Takes a `SchedulerOutput`, returns a `StepResult`; holds no scheduling logic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tandem import envs
from tandem.config import EngineConfig
from tandem.distributed.parallel_state import TPGroup, kv_heads_layout
from tandem.kv_cache import KVCache
from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.layers.attention.torch_backend import TorchAttentionBackend
from tandem.layers.sampler import SampleRow, sample
from tandem.models.hf_config import ModelArchConfig
from tandem.models.llama import StepContext
from tandem.models.draft_registry import build_draft_model
from tandem.models.llama import LlamaAttention
from tandem.models.registry import build_target_model
from tandem.runtime.cuda_graphs import GraphedFunction, GraphInput, capture_all, capture_batch_sizes
from tandem.runtime.decode_plan import decode_metadata
from tandem.runtime.streams import FaultInjection, StreamSet
from tandem.spec.drafter import Drafter
from tandem.spec.mtp_drafter import MTPDrafter, MTPStatePool
from tandem.spec.state import SpecStatePool
from tandem.spec.worker import SpecWorker
from tandem.request import TokenLogprob
from tandem.scheduler.outputs import SchedulerOutput

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on a CPU when none is given
GPU_MEMORY_FRACTION = 0.85  # of the memory free after loading weights


@dataclass
class StepResult:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # request id -> new tokens
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    accept_lengths: dict[str, int] = field(default_factory=dict)  # speculative: tokens per verify step
    spec_max_depth: int = 0


@dataclass
class DoneStep:
    """A step that already ran to completion (plain decoding)."""

    iteration: int
    result: StepResult


@dataclass
class FlatBatch:
    """One step's tokens laid out request by request, plus where to sample."""

    input_ids: list[int]
    positions: list[int]
    attention: AttentionBatch
    sample_index: list[int]  # row of the flat batch whose logits give each sampled request's token
    sample_request_ids: list[str]
    sample_rows: list[SampleRow]


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArchConfig, max_model_len: int,
                 device_module=None, stream_faults: FaultInjection = FaultInjection(), tp: TPGroup | None = None):
        self.config = config
        # Tensor parallelism: this rank's shard of the target; the draft is replicated on every rank.
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
            draft = build_draft_model(spec.algorithm, spec.draft_model_path, self.model, config.load, max_positions)
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
        self.spec = None
        if draft is not None:
            self.spec = self._build_spec_worker(draft, max_model_len)
        # Tokens fed so far per request (prompt + outputs): the sampler's penalty and seed inputs.
        self.histories: dict[str, list[int]] = {}
        logger.info("KV cache: %d pages of %d tokens", self.num_pages, self.page_size)
        self.decode_graph: GraphedFunction | None = None
        if config.cuda_graph_max_bs and (self.device.type == "cuda" or envs.cuda_graph_emulate()):
            self._capture_cuda_graphs(max_model_len)

    # ---- CUDA graphs --------------------------------------------------------------------------
    def _capture_cuda_graphs(self, max_model_len: int) -> None:
        """Plain decoding: one graph of the target's decode step. Speculative decoding: the draft
        tree, verify forward and draft extend (spec/phases.py). Prefill chunks stay eager."""
        sizes = capture_batch_sizes(min(self.config.cuda_graph_max_bs, self.config.scheduler.max_num_seqs))
        if self.spec is None:
            max_pages = -(-max_model_len // self.page_size)
            self.decode_kv_width = max_pages * self.page_size
            self._decode_staging = torch.zeros(sizes[-1], 2 + max_pages, dtype=torch.long,
                                               pin_memory=self.device.type == "cuda")
            self.decode_graph = GraphedFunction("target decode", self._decode_forward, [
                GraphInput((), torch.long, 0), GraphInput((), torch.long, 0),
                GraphInput((max_pages,), torch.long, self.sink_page)], self.device)
            functions = [self.decode_graph]
        elif isinstance(self.spec.drafter, MTPDrafter):
            logger.warning("CUDA graphs are not implemented for MTP drafting: its decode steps run eagerly")
            return
        else:
            pool = self.spec.pool
            functions = self.spec.phases.build_graphs(self.spec, pool.staging_pages.shape[1] * self.page_size,
                                                      self._draft_feature_size(self.spec.drafter.model))
        capture_all(functions, sizes, self.device)

    def _decode_forward(self, input_ids, positions, page_rows):
        metadata = decode_metadata(page_rows, positions, self.decode_kv_width, self.page_size,
                                   self.backend.derives_causal_mask)
        ctx = StepContext(self.backend, metadata, self.kv_cache.k, self.kv_cache.v)
        hidden, _ = self.model(input_ids, positions, ctx)
        return (self.model.compute_logits(hidden),)

    def _graphable_decode(self, sched: SchedulerOutput) -> bool:
        return (self.decode_graph is not None and self.decode_graph.fits(len(sched.chunks))
                and all(c.sample and len(c.token_ids) == 1 and c.start_pos > 0 for c in sched.chunks))

    def _decode_logits_graphed(self, sched: SchedulerOutput) -> torch.Tensor:
        """Decode logits [B, V] of a batch of one-token rows, from the captured graph."""
        b = len(sched.chunks)
        # Pinned staging: [token, position, page ids...] per row. Reusing it next step is safe: the
        # plain step reads its sampled tokens back (a sync) before the host writes here again.
        staging = self._decode_staging[:b]
        staging.zero_()
        for i, c in enumerate(sched.chunks):
            staging[i, 0] = c.token_ids[0]
            staging[i, 1] = c.start_pos
            staging[i, 2:2 + len(c.page_ids)] = torch.tensor(c.page_ids)
        rows = staging.to(self.device, non_blocking=True)
        (logits,) = self.decode_graph(rows[:, 0], rows[:, 1], rows[:, 2:])
        return logits

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
            # MTP: one module per draft step, with lagging per-module KV and state (spec/mtp_drafter.py).
            pool = MTPStatePool(sched.max_num_seqs + 8, max_pages, spec.num_steps, draft_hidden, self.dtype,
                                self.device)
            drafter = MTPDrafter(draft, self.backend, pool, self.page_size, self.num_pages, spec.num_steps,
                                 attn.num_kv_heads, attn.head_dim, self.dtype, self.device)
        else:
            pool = SpecStatePool(sched.max_num_seqs + 8, max_pages, spec.eagle_topk, draft_hidden, feature,
                                 self.dtype, self.device)
            # The draft cache has the sink page too (padded CUDA-graph rows write there).
            drafter = Drafter(draft, self.backend, pool, self.page_size, self.num_pages + 1, spec.eagle_topk,
                              spec.num_steps, attn.num_kv_heads, attn.head_dim, self.dtype, self.device)
        streams = StreamSet(self.device, use_plan_stream=not self.config.disable_plan_stream,
                            device_module=self.device_module, faults=self.stream_faults)
        return SpecWorker(self, drafter, spec.num_draft_tokens, streams)

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
            self.histories.pop(rid, None)

    def record_history(self, chunk) -> None:
        history = self.histories.setdefault(chunk.request_id, [])
        if chunk.start_pos == 0:
            history.clear()  # first chunk, or recompute after preemption
        assert len(history) == chunk.start_pos, "runner history out of step with the scheduler"
        history.extend(chunk.token_ids)

    def sample_row(self, chunk) -> SampleRow:
        history = self.histories[chunk.request_id]
        return SampleRow(chunk.sampling_params, history[: chunk.num_prompt_tokens], history[chunk.num_prompt_tokens:])

    def build_batch(self, sched: SchedulerOutput) -> FlatBatch:
        input_ids, positions, slots = [], [], []
        query_lens, kv_slots = [], []
        sample_index, sample_ids, rows = [], [], []
        ps = self.page_size
        for chunk in sched.chunks:
            n = len(chunk.token_ids)
            self.record_history(chunk)
            pos = range(chunk.start_pos, chunk.start_pos + n)
            input_ids.extend(chunk.token_ids)
            positions.extend(pos)
            seq_slots = positions_to_slots(chunk.page_ids, range(chunk.start_pos + n), ps)
            slots.extend(seq_slots[chunk.start_pos:])
            query_lens.append(n)
            kv_slots.append(seq_slots)
            if chunk.sample:
                sample_index.append(len(input_ids) - 1)
                sample_ids.append(chunk.request_id)
                rows.append(self.sample_row(chunk))
        attention = AttentionBatch(query_lens, kv_slots, slots)
        return FlatBatch(input_ids, positions, attention, sample_index, sample_ids, rows)

    def launch(self, sched: SchedulerOutput):
        """Starts one step. Speculative steps return a handle whose results arrive later (overlap);
        plain steps run to completion here and return their result wrapped the same way."""
        self.drop_requests(sched.preempted_ids)
        self.drop_requests(sched.finished_ids)
        if self.spec is not None:
            self.spec.drop_requests(sched.preempted_ids)
            self.spec.drop_requests(sched.finished_ids)
            if not sched.chunks:
                return None
            return self.spec.launch(sched)
        if not sched.chunks:
            return None
        return DoneStep(sched.iteration, self._execute_plain(sched))

    def collect(self, handle) -> StepResult:
        """Waits for a launched step's results."""
        if isinstance(handle, DoneStep):
            return handle.result
        result = StepResult()
        self.spec.collect(handle, result)
        return result

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """launch + collect: the plain (non-overlapped) loop."""
        handle = self.launch(sched)
        return StepResult() if handle is None else self.collect(handle)

    @torch.inference_mode()
    def _execute_plain(self, sched: SchedulerOutput) -> StepResult:
        result = StepResult()
        if self._graphable_decode(sched):
            for chunk in sched.chunks:
                self.record_history(chunk)
            batch = FlatBatch([], [], None, list(range(len(sched.chunks))), [c.request_id for c in sched.chunks],
                              [self.sample_row(c) for c in sched.chunks])
            logits = self._decode_logits_graphed(sched)
        else:
            batch = self.build_batch(sched)
            hidden = self.forward(batch)
            if not batch.sample_index:
                return result
            logits = self.model.compute_logits(hidden[torch.tensor(batch.sample_index, device=self.device)])
        # Tensor parallelism: every rank samples, but only rank 0's tokens are used (they reach the
        # other ranks in the next SchedulerOutput); no device state depends on them.
        out = sample(logits, batch.sample_rows)
        token_ids = out.token_ids.tolist()
        for i, rid in enumerate(batch.sample_request_ids):
            result.sampled[rid] = [token_ids[i]]
        if out.logprobs is not None:
            self.collect_logprobs(out, batch.sample_request_ids, batch.sample_rows, token_ids, result)
        return result

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        metadata = self.backend.plan(batch.attention, self.device)
        ctx = StepContext(self.backend, metadata, self.kv_cache.k, self.kv_cache.v)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        hidden, _ = self.model(input_ids, positions, ctx)
        return hidden

    @staticmethod
    def collect_logprobs(out, request_ids, rows, token_ids: list[int], result: StepResult) -> None:
        chosen = out.logprobs.tolist()
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_vals = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for i, (rid, row) in enumerate(zip(request_ids, rows)):
            n = row.params.logprobs
            if n is None:
                continue
            top = list(zip(top_ids[i][:n], top_vals[i][:n])) if n and top_ids is not None else []
            result.logprobs[rid] = [TokenLogprob(token_ids[i], chosen[i], top)]


def _first_attention(model) -> LlamaAttention:
    """The draft's attention geometry (its KV cache shape)."""
    return next(m for m in model.modules() if isinstance(m, LlamaAttention))
