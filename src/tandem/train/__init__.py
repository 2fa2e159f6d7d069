"""Draft-head training: EAGLE-3 heads trained with training-time test against a frozen target.

    from tandem.train import TrainConfig, train_eagle3, evaluate_acceptance
    summary = train_eagle3("path/to/target", "path/to/corpus", "out/head", TrainConfig(steps=2000))
    report = evaluate_acceptance("path/to/target", "out/head", prompts)   # runs the Engine

Layout: config.py (TrainConfig), corpus.py (reading, packing, batches), vocab.py (d2t / t2d),
target.py (frozen target, online features), attention.py (dense causal + TTT attention), head.py
(config.json + tandem's Eagle3Draft), ttt.py (the unrolled forward and its loss), export.py (public
checkpoint), checkpoint.py (resumable state), trainer.py (the loop), evaluate.py (acceptance via
the Engine), cli.py (`tandem train-draft`).
"""

from tandem.train.config import TrainConfig
from tandem.train.evaluate import AcceptanceReport, evaluate_acceptance

__all__ = ["TrainConfig", "TrainSummary", "train_eagle3", "AcceptanceReport", "evaluate_acceptance"]


def __getattr__(name: str):
    # The trainer imports torch; `tandem --help` (which registers train-draft) should not.
    if name in ("TrainSummary", "train_eagle3"):
        from tandem.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
