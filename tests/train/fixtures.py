"""A tiny target with an EAGLE-3 head trained to imitate it: high acceptance, for the speculative tests.

    from tests.train.fixtures import trained_eagle3_head   # in a conftest.py or test module
    def test_x(trained_eagle3_head):
        trained_eagle3_head.target, trained_eagle3_head.draft, trained_eagle3_head.accept_length

The target is the tiny "llama3" test checkpoint with its layers' output projections (o_proj,
down_proj) scaled down and its lm_head scaled up: the next token then depends mostly on the last
few tokens and the distributions are peaked (low entropy), which a one-layer head can learn on a
CPU in seconds. The unmodified random checkpoint is chaotic: a head trained the same way agrees
with it on ~3% of held-out positions. The training data are the target's own greedy continuations
of random prompts; acceptance is measured by the Engine on prompts the head never saw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny_checkpoints import make_checkpoint

LAYER_OUTPUT_SCALE = 0.012  # on o_proj and down_proj: each layer adds a little to the token's embedding
LM_HEAD_SCALE = 2.0  # sharper next-token distributions
VOCAB = 320
ENGINE = dict(device="cpu", dtype="float32", page_size=4)
CHAIN = dict(num_steps=3, topk=1)
TRAIN = dict(steps=300, batch_size=8, seq_len=64, lr=5e-3, warmup_steps=20, draft_vocab_size=256,
             eval_fraction=0.0, ttt_steps=3, seed=0, device="cpu", progress=False)
ACCEPT_FLOOR = 2.4  # measured 2.81 (chain of 3 drafts, 16 held-out prompts, 48 new tokens, CPU float32)


@dataclass
class TrainedHead:
    target: str  # target model directory
    draft: str  # EAGLE-3 head directory (load with speculative_algorithm="EAGLE3")
    accept_length: float  # mean acceptance length measured by the Engine, chain of 3 drafts
    report: object  # tandem.train.AcceptanceReport of that measurement (histogram of accept lengths)
    eval_prompts: list[list[int]]  # held-out prompts it was measured on
    summary: object  # tandem.train.TrainSummary


def make_low_entropy_target(path: str, seed: int = 0) -> str:
    make_checkpoint("llama3", path, seed=seed)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * LAYER_OUTPUT_SCALE
        elif name == "lm_head.weight":
            tensors[name] = tensors[name] * LM_HEAD_SCALE
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=gen).tolist()


def greedy_continuations(target: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """prompt + the target's own greedy continuation, for each prompt (tandem's Engine, no speculation)."""
    from tandem import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(target, context_length=max(map(len, prompts)) + new_tokens + 1, **ENGINE) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def make_trained_eagle3_head(root: str) -> TrainedHead:
    from tandem.train import TrainConfig, evaluate_acceptance, train_eagle3

    target = make_low_entropy_target(os.path.join(root, "target"))
    draft = os.path.join(root, "eagle3")
    sequences = greedy_continuations(target, random_prompts(256, 4, seed=0), new_tokens=60)
    summary = train_eagle3(target, sequences, draft, TrainConfig(**TRAIN))
    eval_prompts = random_prompts(16, 6, seed=1)  # the training prompts came from seed 0
    report = evaluate_acceptance(target, draft, eval_prompts, max_new_tokens=48, ignore_eos=True,
                                 num_steps=CHAIN["num_steps"], topk=CHAIN["topk"], **ENGINE)
    return TrainedHead(target, draft, report.mean_accept_length, report, eval_prompts, summary)


@pytest.fixture(scope="session")
def trained_eagle3_head(tmp_path_factory) -> TrainedHead:
    return make_trained_eagle3_head(str(tmp_path_factory.mktemp("trained_eagle3")))
