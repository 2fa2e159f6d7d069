"""Self-distillation: each line is the prompt (through the chat template for chat kinds) followed by the
target's own answer (greedy: transformers' greedy tokens), and a stopped run resumes."""

import json
import os

import pytest
import torch

from tandem.train.instruction_set import Prompt
from tandem.train.self_distill import distill, prompt_ids

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PROMPTS = [Prompt("chat", "What is a list?", True, "list", 0), Prompt("code", "def f(x):\n", False, "m", 0),
           Prompt("list", "Name three colours.", True, "colours", 1), Prompt("explain", "Explain tides.", True, "t", 2),
           Prompt("code", "import os\n", False, "os", 1)]
ENGINE = dict(device="cpu", dtype="float32", page_size=4)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tests.engine.helpers import make_tokenizer_checkpoint

    path, model, tokenizer = make_tokenizer_checkpoint(str(tmp_path_factory.mktemp("distill") / "t"), seed=3)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def _lines(path):
    return [json.loads(line) for line in open(path)]


def test_lines_are_prompt_then_the_targets_greedy_answer(target, tmp_path):
    path, model, tokenizer = target
    out = str(tmp_path / "d.jsonl")
    distill(path, PROMPTS, out, max_new_tokens=6, batch_size=2, sampled_every=0, **ENGINE)
    lines = _lines(out)
    assert [(x["kind"], x["temperature"]) for x in lines] == [(p.kind, 0.0) for p in PROMPTS]
    for p, x in zip(PROMPTS, lines):
        ids = prompt_ids(tokenizer, p)
        assert x["input_ids"][:len(ids)] == ids and x["prompt_len"] == len(ids)
        if p.chat:
            assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
        model.generation_config.eos_token_id = None
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        eos = tokenizer.eos_token_id
        want = want[:want.index(eos) + 1] if eos in want else want  # the engine stops at EOS
        assert x["input_ids"][len(ids):] == want


def test_a_stopped_run_resumes(target, tmp_path):
    path, _, _ = target
    out = str(tmp_path / "d.jsonl")
    distill(path, PROMPTS[:3], out, max_new_tokens=4, batch_size=2, sampled_every=2, **ENGINE)
    assert [x["temperature"] for x in _lines(out)] == [0.0, 0.7, 0.0]
    with open(out, "a") as f:
        f.write('{"input_ids": [1, 2')  # a line cut short by a kill
    summary = distill(path, PROMPTS, out, max_new_tokens=4, batch_size=2, sampled_every=2, **ENGINE)
    assert summary["answered_now"] == 2
    lines = _lines(out)
    assert [x["kind"] for x in lines] == [p.kind for p in PROMPTS] and os.path.getsize(out) > 0
    assert distill(path, PROMPTS, out, max_new_tokens=4, **ENGINE)["answered_now"] == 0


def test_float16_copy_of_a_head(tmp_path):
    from safetensors.torch import load_file, save_file

    from tandem.train.export import save_as

    src, dst = tmp_path / "h", tmp_path / "h16"
    src.mkdir()
    tensors = {"fc.weight": torch.randn(4, 12), "d2t": torch.arange(4), "t2d": torch.ones(8, dtype=torch.bool)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"draft_vocab_size": 4, "torch_dtype": "float32"}))
    save_as(str(src), str(dst), "float16")
    got = load_file(str(dst / "model.safetensors"))
    assert got["fc.weight"].dtype == torch.float16 and torch.equal(got["fc.weight"], tensors["fc.weight"].half())
    assert torch.equal(got["d2t"], tensors["d2t"]) and torch.equal(got["t2d"], tensors["t2d"])
    assert json.loads((dst / "config.json").read_text()) == {"draft_vocab_size": 4, "torch_dtype": "float16"}
