"""Frozen configuration, one dataclass per concern; all validation lives here.

Nothing in this module imports torch, so the scheduler can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATIVE_ALGORITHMS = (None, "EAGLE", "EAGLE3", "MTP", "STANDALONE")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # None: sized from memory by the runner

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {self.page_size})")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (got {self.num_pages})")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int = 4096  # prompt + output tokens of one request
    max_num_seqs: int = 64  # cap on running requests
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    # While a waiting request can be admitted, a step admits prompts only and running requests wait a step
    # (scheduler.Scheduler.schedule); False: admissions share the step with the running requests' work.
    prefill_first: bool = False

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str | None = None
    draft_model_path: str | None = None
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4
    adaptive: bool = True  # choose the draft depth per step, or always draft the configured shape

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_adaptive must be True or False (got {self.adaptive!r})")
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} (got {self.algorithm!r})"
            )
        if self.algorithm is None:
            return
        if self.num_steps < 1 or self.eagle_topk < 1 or self.num_draft_tokens < 2:
            raise ValueError("speculative_num_steps >= 1, speculative_eagle_topk >= 1, "
                             "speculative_num_draft_tokens >= 2 are required")
        if self.algorithm == "MTP" and self.eagle_topk != 1:
            # Each MTP module drafts one step of one chain (models/mtp.py): no trees.
            raise ValueError("speculative_algorithm='MTP' drafts a chain: it needs speculative_eagle_topk=1 and "
                             f"speculative_num_draft_tokens == speculative_num_steps + 1 (got topk {self.eagle_topk})")
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                "chain drafting (speculative_eagle_topk=1) needs speculative_num_draft_tokens == "
                f"speculative_num_steps + 1 (got {self.num_draft_tokens} and {self.num_steps})"
            )
        # Step 1 drafts topk nodes; each later step offers topk*topk candidates (topk children of
        # each of the topk kept leaves). The root (verified token) is one of the draft tokens.
        max_tree = 1 + self.eagle_topk + (self.num_steps - 1) * self.eagle_topk ** 2
        if self.num_draft_tokens > max_tree:
            raise ValueError(f"speculative_num_draft_tokens={self.num_draft_tokens} exceeds what "
                             f"{self.num_steps} steps of top-{self.eagle_topk} can draft ({max_tree})")


    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a decode needs past its last token: the verify tree's nodes and the draft's
        scratch nodes (DESIGN §3). Also the most tokens one verify step can produce."""
        if self.algorithm is None:
            return 0
        return max(self.num_draft_tokens, (self.num_steps - 1) * self.eagle_topk)


@dataclass(frozen=True)
class ModelLoadConfig:
    model_path: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    load_format: str = "safetensors"  # safetensors | dummy (random weights, for benchmarks)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy (got {self.load_format!r})")


@dataclass(frozen=True)
class EngineConfig:
    load: ModelLoadConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention_backend: str = "torch"
    disable_overlap_schedule: bool = False
    disable_plan_stream: bool = False
    cuda_graph_max_bs: int = 0  # 0: no CUDA graphs (always so on a CPU)
    # Prefill and mixed steps of up to this many tokens replay piecewise graphs (runtime/piecewise_graphs.py).
    piecewise_cuda_graph_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be torch or triton (got {self.attention_backend!r})")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0 (got {self.cuda_graph_max_bs})")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError("piecewise_cuda_graph_max_tokens must be >= 0 "
                             f"(got {self.piecewise_cuda_graph_max_tokens})")
