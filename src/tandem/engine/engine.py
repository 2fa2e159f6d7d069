"""`Engine`: the in-process Python API (DESIGN §2). Validates input, owns the scheduler and the runner,
and turns scheduler results into `RequestOutput`s.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, fields
from typing import Sequence

from tandem.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig, SpeculativeConfig
from tandem.models.hf_config import load_model_config
from tandem.request import FinishReason, Request, RequestDelta, RequestOutput, SamplingParams, StepOutput, TokenLogprob
from tandem.scheduler import PrefixCacheStats, Scheduler
from tandem.structured.grammar import spec_of
from tandem.tokenizer import StopStringDetokenizer, eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """Every `Engine` keyword argument; each is also a CLI flag (`--tp-size` -> tp_size)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "auto"
    load_format: str = "safetensors"
    seed: int = 0
    context_length: int | None = None  # None: the model's max_position_embeddings
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    page_size: int = 16
    max_total_tokens: int | None = None  # KV capacity in tokens; None: sized from memory
    attention_backend: str | None = None  # None: triton on a GPU (if installed), torch on a CPU
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    # True: choose the draft depth per step (speculative/policy/); False: always the configured shape. The
    # strings "on" and "off" (the CLI's spelling) are taken too.
    speculative_adaptive: bool = True
    # on: a step that can admit a waiting request admits prompts only (running requests wait that step);
    # off: prompts share steps with decodes; auto: on with speculation, off without (see Scheduler.schedule)
    prefill_first: str = "auto"
    disable_overlap_schedule: bool = False
    disable_plan_stream: bool = False
    # Keep full KV pages indexed by content after their request ends, so a later prompt that starts the
    # same way skips their prefill (scheduler/prefix_cache.py). CLI alias: --disable-radix-cache.
    disable_prefix_caching: bool = False
    disable_cuda_graph: bool = False  # GPU only: replay captured decode steps instead of launching them
    cuda_graph_max_bs: int = 64  # largest decode batch captured (capped at max_running_requests)
    # Steps with prompt tokens (up to this many tokens, capped at chunked_prefill_size) replay one graph per
    # layer between the attention calls; 0: they run eagerly. (SGLang's flag of the same name.)
    piecewise_cuda_graph_max_tokens: int = 2048
    tp_size: int = 1
    dp_size: int = 1

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def on_off(value, name: str) -> bool:
    """A switch given as a bool or as the CLI's "on" / "off"."""
    if isinstance(value, bool):
        return value
    if value in ("on", "off"):
        return value == "on"
    raise ValueError(f"{name} must be True or False ('on' or 'off') (got {value!r})")


def default_attention_backend(device: str) -> str:
    """triton on a GPU: CUDA graphs give every decode step the widest KV window, which the triton
    kernels skip past each row's length and the torch reference backend does not."""
    if not device.startswith("cuda"):
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("triton is not installed: attention falls back to the slow torch backend")
        return "torch"
    return "triton"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Engine:
    def __init__(self, model_path: str | None = None, _runner_hooks: dict | None = None, **kwargs):
        unknown = set(kwargs) - set(EngineArgs.names())
        if unknown:
            raise TypeError(f"unknown Engine arguments: {sorted(unknown)}")
        args = EngineArgs(model_path=model_path, **kwargs)
        from tandem.demo import is_demo, with_demo_pair

        if is_demo(args.model_path):  # the bundled demo pair: its target, drafted by its EAGLE-3 head
            args = with_demo_pair(args)
        else:  # a model by name (tandem/named_models.py): pulled into the cache on first use
            from tandem.named_models import with_named_model

            args = with_named_model(args)
        if args.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1 (got {args.tp_size})")
        if args.dp_size != 1:
            # Replicas are separate processes behind a router; one Engine is one replica.
            raise ValueError(f"dp_size={args.dp_size}: the offline Engine runs a single replica; serve "
                             "data-parallel replicas with `tandem serve --dp-size N`")
        if args.speculative_algorithm is not None and args.speculative_draft_model_path is None:
            raise ValueError(f"speculative_algorithm={args.speculative_algorithm!r} needs "
                             "speculative_draft_model_path")
        if args.prefill_first not in ("auto", "on", "off"):
            raise ValueError(f"prefill_first must be auto, on or off (got {args.prefill_first!r})")
        args = dataclasses.replace(args, speculative_adaptive=on_off(args.speculative_adaptive, "speculative_adaptive"))
        self.args = args
        self.arch = load_model_config(args.model_path)
        max_model_len = args.context_length or self.arch.max_position_embeddings
        if self.arch.sliding_window is not None and max_model_len > self.arch.sliding_window:
            # Sliding-window attention is not implemented; within the window it is plain attention.
            logger.warning("capping context length at the model's sliding window (%d)", self.arch.sliding_window)
            max_model_len = self.arch.sliding_window
        self.max_model_len = max_model_len
        device = args.device or default_device()
        num_pages = None if args.max_total_tokens is None else -(-args.max_total_tokens // args.page_size)
        self.config = EngineConfig(
            load=ModelLoadConfig(args.model_path, args.dtype, device, args.load_format, args.seed),
            cache=CacheConfig(args.page_size, num_pages),
            scheduler=SchedulerConfig(max_model_len, args.max_running_requests, args.chunked_prefill_size,
                                      prefill_first=args.prefill_first == "on" or (
                                          args.prefill_first == "auto" and args.speculative_algorithm is not None)),
            speculative=SpeculativeConfig(args.speculative_algorithm, args.speculative_draft_model_path,
                                          args.speculative_num_steps, args.speculative_eagle_topk,
                                          args.speculative_num_draft_tokens, args.speculative_adaptive),
            attention_backend=args.attention_backend or default_attention_backend(device),
            disable_overlap_schedule=args.disable_overlap_schedule,
            disable_plan_stream=args.disable_plan_stream,
            cuda_graph_max_bs=0 if args.disable_cuda_graph else args.cuda_graph_max_bs,
            piecewise_cuda_graph_max_tokens=0 if args.disable_cuda_graph else min(
                args.piecewise_cuda_graph_max_tokens, args.chunked_prefill_size),
        )
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.eos_token_ids = eos_token_ids(args.model_path, self.arch.eos_token_ids, self.tokenizer)
        import torch

        from tandem.runtime.model_runner import ModelRunner

        torch.manual_seed(args.seed)
        if args.tp_size > 1:  # this process is rank 0; the other ranks mirror its steps
            from tandem.distributed.launcher import start_tensor_parallel

            self.runner = start_tensor_parallel(args.tp_size, self.config, self.arch, max_model_len, args.seed,
                                                **(_runner_hooks or {}))
        else:
            self.runner = ModelRunner(self.config, self.arch, max_model_len, **(_runner_hooks or {}))
        spec = self.config.speculative
        # Overlap: schedule step N+1 while step N runs. A plain decode scheduled ahead writes its KV
        # one position past the tokens the host knows: a lookahead of one.
        self.overlap = not args.disable_overlap_schedule
        lookahead = spec.num_lookahead_tokens if spec.algorithm else int(self.overlap)
        # A request whose worst case exceeds the whole pool could never be scheduled, even alone.
        capacity = self.runner.num_pages * args.page_size - lookahead + 1
        if capacity < self.max_model_len:
            logger.warning("context length capped at what the KV pool holds (%d tokens)", capacity)
            self.max_model_len = capacity
            self.config = dataclasses.replace(
                self.config, scheduler=dataclasses.replace(self.config.scheduler, max_model_len=capacity))
        self.scheduler = Scheduler(self.config.scheduler, args.page_size, self.runner.num_pages,
                                   num_lookahead_tokens=lookahead, async_decode=self.overlap,
                                   prefix_caching=self._prefix_caching(), draft_model=spec.algorithm is not None,
                                   draftless_hits=self._dormancy())
        self._inflight = None  # the launched step whose results are not processed yet
        self._ids = itertools.count()
        self._detok: dict[str, StopStringDetokenizer] = {}
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        # Prompt logprobs by token index while the prompt is prefilled (a recompute gives them again:
        # the first stays); handed out with the request's first delta.
        self._prompt_logprobs: dict[str, dict[int, TokenLogprob]] = {}
        self._prompt_logprobs_sent: set[str] = set()
        self._grammar_compiler = None  # structured/grammar.GrammarCompiler, made for the first constrained request

    # ---- public API -------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        input_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts (text, or token ids) to completion; one output per prompt, in order."""
        token_lists = self._prompt_token_ids(prompts, input_ids)
        params = self._params_per_prompt(sampling_params, len(token_lists))
        for ids in token_lists:  # validate everything before adding anything
            self.validate_prompt(ids)
        rids: list[str] = []
        try:
            for ids, p in zip(token_lists, params):
                rids.append(self.add_request(ids, p))
        except Exception:
            # A bad request (e.g. invalid SamplingParams) must not leave the ones before it queued:
            # they would hold KV pages, and the next generate() would count their outputs as its own
            # and fail with a KeyError.
            for rid in rids:
                self.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(rids):
            for out in self.step().finished:
                done[out.request_id] = out
        return [done[r] for r in rids]

    def validate_prompt(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, the context length is {self.max_model_len} "
                             "(prompt plus at least one new token must fit)")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.arch.vocab_size}): {bad[:5]}")

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queues one request. Everything that can fail for this request alone (its prompt, its
        parameters against the vocabulary and the tables they are stored in, its grammar) fails here,
        before anything is counted, so a bad request never reaches a step."""
        self.validate_prompt(prompt_token_ids)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams (got {type(params).__name__})")
        params.validate(self.arch.vocab_size)
        if params.constrained:
            self._compile_grammar(params)
        rid = request_id or f"req-{next(self._ids)}"
        detok = StopStringDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        self.scheduler.add_request(Request(rid, list(prompt_token_ids), params, self.eos_token_ids))
        self._detok[rid] = detok
        self._logprobs[rid] = []
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[rid] = {}
        return rid

    def _compile_grammar(self, params: SamplingParams) -> None:
        """Compiles (or finds cached) the request's grammar, so a bad one is refused at submission
        (GrammarError, a ValueError naming the field), and turns structured output on in the runner."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError(f"structured output needs a tokenizer; model {self.args.model_path!r} has none")
            from tandem.structured.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self._grammar_compiler.compile(spec_of(params))
        self.runner.attach_grammar(self._grammar_compiler)

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._forget(request_id)

    def flush_cache(self) -> bool:
        """Drops every cached KV page no request holds. True when the whole pool is free afterwards; False
        while requests hold pages (theirs stay)."""
        return self.scheduler.flush_cache()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up and found in the prefix cache so far, and the pages it holds now."""
        sched = self.scheduler
        return dataclasses.replace(sched.prefix_stats, cached_pages=sched.allocator.num_cached)

    def _dormancy(self) -> bool:
        """Whether the adaptive policy may run requests without draft state (then one can start from cached
        pages that hold no draft KV for it)."""
        policy = getattr(self.runner.spec, "policy", None) if self.runner.spec is not None else None
        return policy is not None and policy.dormancy

    def _prefix_caching(self) -> bool:
        if self.args.disable_prefix_caching:
            return False
        if self.config.speculative.algorithm == "MTP":
            # MTP module k's KV at position t needs tokens up to t+k+1 and the module outputs before it,
            # which a hit's first chunk does not have; its drafts also write scratch entries below the
            # target's length (speculative/mtp_drafter.py).
            logger.info("prefix caching is off with MTP drafting")
            return False
        return True

    def step(self) -> StepOutput:
        """One engine iteration: the new tokens of every request that got some, and the requests
        that finished in it (complete outputs)."""
        handle = self._launch_next()
        return StepOutput() if handle is None else self._process(handle)

    def _launch_next(self):
        """Schedules and launches a step; returns the step to process now (with overlap: the one
        launched before, which ran while this one was scheduled)."""
        sched = self.scheduler.schedule()
        handle = self.runner.launch(sched)
        if self.overlap:
            # Launch N, then process N-1 while N runs; the next call schedules N+1.
            handle, self._inflight = self._inflight, handle
        return handle

    def _process(self, handle) -> StepOutput:
        """Applies one finished step's results: scheduler update, stop strings, logprobs, outputs."""
        result = self.runner.collect(handle)
        update = self.scheduler.update(result.sampled, handle.iteration, result.draft_behind)
        finished = list(update.finished)
        by_id = {r.request_id: r for r in finished}
        for rid, by_index in result.prompt_logprobs.items():
            store = self._prompt_logprobs.get(rid)
            if store is not None:
                for t, lp in by_index.items():
                    store.setdefault(t, lp)
        out = StepOutput()
        for rid, new_ids in update.new_token_ids.items():
            req = self.scheduler.get_request(rid) or by_id[rid]
            accept_len = result.accept_lengths.get(rid)
            if accept_len is not None:
                # Counted only for steps whose tokens were used (overlap may run one step too many).
                req.spec_accept_lengths.append(accept_len)
                spec = self.runner.spec
                spec.stats.record(accept_len, result.spec_num_proposed, result.spec_max_depth)
            before = len(req.output_token_ids) - len(new_ids)
            if not req.is_finished and self._hit_stop_string(req, len(new_ids)):
                self.scheduler.finish_request(rid, FinishReason.STOP)
                finished.append(req)
                new_ids = req.output_token_ids[before:]  # cut after the stop string
            new_logprobs = None
            if rid in result.logprobs:
                new_logprobs = result.logprobs[rid][: len(new_ids)]
                self._logprobs[rid].extend(new_logprobs)
            prompt_lps = None
            if rid in self._prompt_logprobs and rid not in self._prompt_logprobs_sent:
                self._prompt_logprobs_sent.add(rid)  # the prompt is all prefilled once a token comes
                prompt_lps = self._prompt_logprob_list(req)
            out.deltas.append(RequestDelta(rid, list(new_ids), new_logprobs,
                                           req.finish_reason.value if req.is_finished else None, accept_len,
                                           prompt_lps, req.num_cached_tokens if before == 0 else None))
        out.finished = [self._final_output(req) for req in finished]
        if self._inflight is not None and not self.scheduler.has_unfinished():
            # The step in flight ran only for requests that have finished meanwhile: collect it now
            # (its tokens are dropped) so an idle engine holds nothing.
            stale, self._inflight = self._inflight, None
            result = self.runner.collect(stale)
            self.scheduler.update(result.sampled, stale.iteration, result.draft_behind)
        return out

    def _hit_stop_string(self, req: Request, num_new: int) -> bool:
        """Checks each newly appended token in turn (a speculative step appends several), and cuts
        the output right after the token that completed a stop string, as plain decoding would."""
        detok = self._detok[req.request_id]
        if not detok.stop:
            return False
        out = req.output_token_ids
        for m in range(len(out) - num_new + 1, len(out) + 1):
            if detok.update(out[:m]):
                del out[m:]
                return True
        return False

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def shutdown(self) -> None:
        close = getattr(self.runner, "close", None)  # tensor parallelism: stop the other ranks
        if close is not None:
            close()
        self.runner = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---- helpers ------------------------------------------------------------------------------
    def _prompt_token_ids(self, prompts, input_ids) -> list[list[int]]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts or input_ids")
        if input_ids is not None:
            return [list(ids) for ids in input_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        if self.tokenizer is None:
            raise ValueError(f"model {self.args.model_path!r} has no tokenizer; pass input_ids")
        for p in prompts:
            if not isinstance(p, str):
                raise ValueError(f"prompts must be strings (got {type(p).__name__})")
        return [self.tokenizer.encode(p) for p in prompts]

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
        return list(sampling_params)

    def _final_output(self, req: Request) -> RequestOutput:
        detok = self._detok[req.request_id]
        if not detok.stopped:
            detok.update(req.output_token_ids)
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = self._logprobs[req.request_id][: len(req.output_token_ids)]
        prompt_lps = self._prompt_logprob_list(req) if req.request_id in self._prompt_logprobs else None
        self._forget(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=detok.text,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            logprobs=logprobs,
            spec_accept_lengths=list(req.spec_accept_lengths),
            prompt_logprobs=prompt_lps,
            num_cached_tokens=req.num_cached_tokens,
        )

    def _prompt_logprob_list(self, req: Request) -> list[TokenLogprob | None]:
        store = self._prompt_logprobs[req.request_id]
        return [None] + [store.get(t) for t in range(1, len(req.prompt_token_ids))]

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self._prompt_logprobs_sent.discard(request_id)
