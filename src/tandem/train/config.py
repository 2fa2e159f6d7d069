"""Settings of one draft-head training run; all validation lives here."""

from __future__ import annotations

from dataclasses import dataclass

# File types read from a corpus directory (recursively) unless told otherwise.
DEFAULT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
                      ".js", ".ts", ".sh", ".toml", ".yaml", ".yml", ".html", ".css")


@dataclass(frozen=True)
class TrainConfig:
    # data
    seq_len: int = 512  # tokens per training sequence (text corpora are packed to this length)
    eval_fraction: float = 0.05  # documents held out for evaluation
    extensions: tuple[str, ...] = DEFAULT_EXTENSIONS
    # head
    draft_vocab_size: int | None = None  # None: min(32000, target vocab)
    intermediate_size: int | None = None  # None: the target's
    aux_layer_ids: tuple[int, ...] | None = None  # target layers whose *entering* residual is used; None: default
    # training-time test
    ttt_steps: int = 3  # draft steps unrolled per position
    step_loss_decay: float = 0.8  # loss weight of step j is decay ** (j - 1)
    # optimisation
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # None: 3% of the steps
    lr_decay: str = "cosine"  # cosine | linear (to zero at the last step)
    grad_clip: float = 0.5
    seed: int = 0
    # where and how
    device: str | None = None  # None: cuda if available, else cpu
    target_dtype: str = "auto"  # the frozen target's dtype (auto: float32 on CPU, bfloat16 on GPU)
    save_every: int = 0  # also write a resumable checkpoint every this many steps (0: only at the end)
    resume: bool = False  # continue from the output directory's training_state.pt if there is one
    stop_after: int | None = None  # stop (with a checkpoint) after this step, e.g. to split a run in pieces
    progress: bool = True  # tqdm bar

    def __post_init__(self) -> None:
        positive = ("seq_len", "ttt_steps", "steps", "batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.seq_len < self.ttt_steps + 2:
            raise ValueError(f"seq_len={self.seq_len} leaves no position to train {self.ttt_steps} TTT steps on")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1) (got {self.eval_fraction})")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be > 0")
        if self.lr_decay not in ("cosine", "linear"):
            raise ValueError(f"lr_decay must be cosine or linear (got {self.lr_decay!r})")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps] (got {self.warmup_steps})")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1 (got {self.draft_vocab_size})")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0 (got {self.save_every})")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after must be in [1, steps] (got {self.stop_after})")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError("EAGLE-3 takes exactly three auxiliary target layers")

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else self.steps * 3 // 100

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based): linear warmup, then decay to zero."""
        import math

        warm = self.num_warmup_steps
        if step < warm:
            return self.lr * (step + 1) / warm
        span = max(1, self.steps - warm)
        frac = min(1.0, (step - warm) / span)
        if self.lr_decay == "linear":
            return self.lr * (1.0 - frac)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * frac))
