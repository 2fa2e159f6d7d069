"""`tandem make-demo-pair`: the bundled demo pair, made from the Python standard library by one seeded command.

    tandem make-demo-pair --output-dir src/tandem/demo_models --device cuda    # docs/demo_pair.md

1. collect the stdlib's `.py` files; the packages in `HELD_OUT_PACKAGES` are held out (stdlib_corpus.py)
2. train a byte-level BPE tokenizer on the training files (special tokens, chat template)
3. pre-train a small Llama target on them (target_lm.py), saved as float16 safetensors
4. train its EAGLE-3 head with tandem's own `train_eagle3` (online target states, training-time test)
5. convert the head to float16 too
6. measure (demo_measure.py) and write results.json: held-out perplexity, acceptance length,
   tokens/s with and without speculation

Output layout (the bundle is `target/` and `eagle3/`; `tandem.demo` loads them):

    OUTPUT_DIR/target/        config.json, generation_config.json, model.safetensors, tokenizer files
    OUTPUT_DIR/eagle3/        config.json, model.safetensors (public EAGLE-3 format)
    OUTPUT_DIR/eval_prompts.json   the held-out prompts every measurement uses (token ids)
    OUTPUT_DIR/results.json        one entry per device type measured on ("cuda", "cpu")

`measure_demo_pair` repeats step 6 on an existing bundle (e.g. CPU tokens/s) and adds its entry.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from tandem.train import demo_measure
from tandem.train import stdlib_corpus as corpus_lib
from tandem.train.config import TrainConfig
from tandem.train.evaluate import heldout_prompts
from tandem.train.target_lm import LMTraining, TargetShape, heldout_perplexity, load_half, save_half, train_lm

logger = logging.getLogger(__name__)

BUNDLE_LIMIT_BYTES = 40_000_000  # target + head + tokenizer, as stored in the repository
HEAD_CALIBRATION = (10, 30)  # with a head time budget: steps after which the step time is read


@dataclass(frozen=True)
class DemoRecipe:
    tokenizer_vocab_size: int
    shape: TargetShape
    target: LMTraining
    # EAGLE-3 head (tandem.train.TrainConfig fields)
    head_steps: int
    head_batch_size: int
    head_seq_len: int
    head_lr: float
    head_warmup_steps: int  # > HEAD_CALIBRATION[1]: a budget-shortened run keeps the same warmup
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # residual streams *entering* these target layers (num_layers = last output)
    # measurement (held-out prompts cut from held-out files)
    eval_prompts: int = 16
    eval_prompt_len: int = 128
    eval_new_tokens: int = 128
    speed_prompts: int = 4
    speed_new_tokens: int = 128
    max_files: int | None = None  # keep only this many training files (tiny runs)


PRESETS = {
    # target: 6 layers, hidden 384, GQA 6/2 heads, tied embeddings: 12.6M parameters, 25 MB in float16;
    # head: 3.8M parameters, 7.7 MB; the whole bundle ~34 MB.
    "full": DemoRecipe(
        tokenizer_vocab_size=8192,
        shape=TargetShape(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                          num_kv_heads=2, max_position_embeddings=2048),
        target=LMTraining(steps=750, batch_size=16, seq_len=2048, lr=1.5e-3, warmup_steps=100),
        head_steps=1500, head_batch_size=16, head_seq_len=1024, head_lr=1e-3, head_warmup_steps=60,
        draft_vocab_size=4096, aux_layer_ids=(2, 4, 6),
    ),
    # the whole recipe in well under a minute on a CPU: for tests and dry runs (its text is noise)
    "tiny": DemoRecipe(
        tokenizer_vocab_size=512,
        shape=TargetShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, max_position_embeddings=256),
        target=LMTraining(steps=30, batch_size=4, seq_len=128, lr=3e-3, warmup_steps=5),
        head_steps=40, head_batch_size=4, head_seq_len=64, head_lr=3e-3, head_warmup_steps=35,
        draft_vocab_size=256, aux_layer_ids=(0, 1, 2),
        eval_prompts=3, eval_prompt_len=16, eval_new_tokens=12, speed_prompts=2, speed_new_tokens=12,
        max_files=24,
    ),
}


def make_demo_pair(output_dir: str, recipe: DemoRecipe, stdlib_dir: str | None = None, seed: int = 0,
                   device: str | None = None, target_seconds: float | None = None,
                   head_seconds: float | None = None, progress: bool = True, command: str | None = None) -> dict:
    """Steps 1-6 of the module docstring; returns the results entry written for this device."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target_dir, draft_dir = os.path.join(output_dir, "target"), os.path.join(output_dir, "eagle3")
    work_dir = os.path.join(output_dir, ".work")
    if os.path.isfile(os.path.join(output_dir, "results.json")):
        os.remove(os.path.join(output_dir, "results.json"))  # its entries measured the old weights
    clock = _Clock()
    torch.manual_seed(seed)

    corpus = corpus_lib.collect_stdlib(stdlib_dir, recipe.max_files)
    fingerprint = corpus.fingerprint()
    logger.info("stdlib corpus: %d training / %d held-out files (%.1f / %.1f MB) from %s", len(corpus.train),
                len(corpus.heldout), fingerprint["train_bytes"] / 1e6, fingerprint["heldout_bytes"] / 1e6, corpus.root)

    tok = corpus_lib.train_tokenizer([f.text for f in corpus.train], recipe.tokenizer_vocab_size, progress)
    if tok.get_vocab_size() != recipe.shape.vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} tokens; the target expects "
                         f"{recipe.shape.vocab_size} (too small a corpus for the vocabulary?)")
    corpus_lib.save_tokenizer(tok, target_dir, recipe.shape.max_position_embeddings)
    train_docs = corpus_lib.encode_documents(tok, corpus.train)
    held_docs = corpus_lib.encode_documents(tok, corpus.heldout)
    clock.mark("data")

    ids = {name: tok.token_to_id(name) for name in (corpus_lib.BOS, corpus_lib.EOS, corpus_lib.PAD)}
    config = recipe.shape.config_json(ids[corpus_lib.BOS], ids[corpus_lib.EOS], ids[corpus_lib.PAD])
    model, target_record = train_lm(config, train_docs, recipe.target, device, seed, target_seconds, progress)
    save_half(model, config, target_dir)
    del model
    clock.mark("target")

    head_record = _train_head(target_dir, train_docs, work_dir, recipe, seed, device, head_seconds, progress)
    _head_to_half(os.path.join(work_dir, "eagle3"), draft_dir)
    shutil.rmtree(work_dir)  # optimizer state and the bfloat16 copy: not part of the bundle
    clock.mark("head")

    prompts = heldout_prompts(held_docs, recipe.eval_prompts, recipe.eval_prompt_len, seed)
    with open(os.path.join(output_dir, "eval_prompts.json"), "w") as f:
        json.dump({"held_out_packages": list(corpus_lib.HELD_OUT_PACKAGES), "seed": seed,
                   "prompt_len": recipe.eval_prompt_len, "prompts": prompts}, f)
    model = load_half(target_dir, device)  # the stored float16 weights, upcast
    perplexity = heldout_perplexity(model, held_docs, fingerprint["heldout_bytes"], recipe.target.seq_len, device,
                                    progress=progress)
    del model
    clock.mark("perplexity")

    entry = {
        "command": command, "recipe": dataclasses.asdict(recipe), "seed": seed, "corpus": fingerprint,
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "train_tokens": sum(map(len, train_docs)),
                      "heldout_tokens": sum(map(len, held_docs)), "special_tokens": list(corpus_lib.SPECIAL_TOKENS)},
        "target": {"parameters": _count_parameters(target_dir), **_thin_history(target_record)},
        "head": {"parameters": _count_parameters(draft_dir), **head_record},
        "heldout_perplexity": perplexity,
        "bundle_bytes": bundle_bytes(output_dir),
    }
    write_results(output_dir, device.type, entry)  # the training record survives a failed measurement
    entry.update(_measure(output_dir, prompts, recipe, str(device), seed, progress))
    clock.mark("measure")
    entry["phase_seconds"] = clock.phases
    write_results(output_dir, device.type, entry)
    if entry["bundle_bytes"] > BUNDLE_LIMIT_BYTES:
        raise ValueError(f"the bundle is {entry['bundle_bytes']} bytes, over {BUNDLE_LIMIT_BYTES}")
    return entry


def measure_demo_pair(output_dir: str, recipe: DemoRecipe, device: str | None = None, seed: int = 0,
                      progress: bool = True, command: str | None = None) -> dict:
    """Step 6 again on an existing bundle (its eval_prompts.json); adds this device type's entry."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with open(os.path.join(output_dir, "eval_prompts.json")) as f:
        prompts = json.load(f)["prompts"]
    entry = {"command": command, "bundle_bytes": bundle_bytes(output_dir),
             **_measure(output_dir, prompts, recipe, device, seed, progress)}
    write_results(output_dir, torch.device(device).type, entry)
    return entry


def _measure(output_dir: str, prompts: list[list[int]], recipe: DemoRecipe, device: str, seed: int,
             progress: bool) -> dict:
    target_dir, draft_dir = os.path.join(output_dir, "target"), os.path.join(output_dir, "eagle3")
    table = demo_measure.acceptance_table(target_dir, draft_dir, prompts, recipe.eval_new_tokens, device, seed,
                                          progress)
    speed = demo_measure.speed(target_dir, draft_dir, prompts[:recipe.speed_prompts], recipe.speed_new_tokens,
                               device, progress=progress)
    return {"environment": environment(device), "acceptance": table, "speed": speed,
            "eval": {"prompts": len(prompts), "prompt_len": recipe.eval_prompt_len,
                     "max_new_tokens": recipe.eval_new_tokens, "drafting": demo_measure.DRAFTING}}


def _train_head(target_dir: str, train_docs: list[list[int]], work_dir: str, recipe: DemoRecipe, seed: int,
                device: torch.device, time_budget_s: float | None, progress: bool) -> dict:
    """`train_eagle3` on the training files, packed into `head_seq_len` windows. With a time budget,
    the step time is read from two short pieces of the run (resumed, so nothing is lost) and the run
    is shortened to fit; inside the warmup, so the schedule equals that of a plain run of that length."""
    from tandem.train.trainer import train_eagle3

    stream = [t for d in train_docs for t in d]
    n = recipe.head_seq_len
    sequences = [stream[i:i + n] for i in range(0, len(stream) - n + 1, n)]
    config = TrainConfig(seq_len=n, eval_fraction=0.0, draft_vocab_size=recipe.draft_vocab_size,
                         aux_layer_ids=recipe.aux_layer_ids, steps=recipe.head_steps,
                         batch_size=recipe.head_batch_size, lr=recipe.head_lr,
                         warmup_steps=recipe.head_warmup_steps, seed=seed, device=str(device), progress=progress)
    out = os.path.join(work_dir, "eagle3")
    start = time.perf_counter()
    steps = recipe.head_steps
    if time_budget_s is not None and HEAD_CALIBRATION[1] < steps:
        first, second = HEAD_CALIBRATION
        t0 = time.perf_counter()
        train_eagle3(target_dir, sequences, out, dataclasses.replace(config, stop_after=first))
        t1 = time.perf_counter()
        train_eagle3(target_dir, sequences, out, dataclasses.replace(config, stop_after=second, resume=True))
        t2 = time.perf_counter()
        # Both pieces pay the same set-up, so their difference is (second - 2 * first) steps; the
        # first also pays one-off warm-ups, so the estimate is floored and given a 10% margin.
        per_step = 1.1 * max(((t2 - t1) - (t1 - t0)) / (second - 2 * first), (t2 - t1) / (second - first) / 2)
        steps = min(steps, second + int((time_budget_s - (t2 - t0)) / per_step))
        config = dataclasses.replace(config, steps=max(steps, second), resume=True)
    summary = train_eagle3(target_dir, sequences, out, config)
    history = summary.history
    last = history[-50:]
    return {"steps_done": summary.steps_done, "steps_planned": recipe.head_steps,
            "train_sequences": summary.num_train_sequences, "vocab_coverage": summary.vocab_coverage,
            "epochs": summary.steps_done * recipe.head_batch_size / max(1, summary.num_train_sequences),
            "train_seconds": time.perf_counter() - start,
            "final_loss": sum(r["loss"] for r in last) / len(last),
            "final_step_accuracy": [sum(r["acc"][j] for r in last) / len(last) for j in range(len(last[0]["acc"]))],
            "loss_history": [{"step": r["step"], "loss": r["loss"]} for r in history[::max(1, len(history) // 40)]]}


def _head_to_half(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors = {k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": "float16"}, f, indent=2)


def bundle_bytes(output_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for sub in ("target", "eagle3")
               for root, _, names in os.walk(os.path.join(output_dir, sub)) for name in names)


def write_results(output_dir: str, device_type: str, entry: dict) -> None:
    """results.json holds one entry per device type; writing one keeps the others."""
    path = os.path.join(output_dir, "results.json")
    results = {}
    if os.path.isfile(path):
        with open(path) as f:
            results = json.load(f)
    results[device_type] = entry
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def environment(device: str) -> dict:
    import tokenizers
    import transformers

    env = {"date": datetime.date.today().isoformat(), "device": device, "python": sys.version.split()[0],
           "torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
           "platform": platform.platform(), "torch_threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def _count_parameters(model_dir: str) -> int:
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    return sum(t.numel() for name, t in tensors.items() if t.is_floating_point())


def _thin_history(record: dict, points: int = 40) -> dict:
    history = record["loss_history"]
    return {**record, "loss_history": history[::max(1, len(history) // points)]}


class _Clock:
    def __init__(self):
        self.phases, self._last = {}, time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._last, 1)
        self._last = now
        logger.info("%s done in %.1f s", phase, self.phases[phase])
