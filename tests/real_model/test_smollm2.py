"""SmolLM2-135M-Instruct, pulled by name: greedy text equals transformers', from the converted checkpoint
and from the GGUF file (float32, CPU). `--real-model-prompts N --real-model-tokens T` set the size."""

import os

import torch

from tandem import Engine, SamplingParams
from tests.models.test_hf_parity import _prefill_logits

ENGINE = dict(device="cpu", dtype="float32", page_size=16, max_total_tokens=8192)

# Through the chat template (the model is an instruct model); the last ones are raw continuations.
CHAT = ["What is a Python decorator?", "Explain what a hash table is.", "Write a haiku about the sea.",
        "List three uses of the os module.", "How do I reverse a list in Python?", "What causes rain?",
        "Give me a short recipe for pancakes.", "What is the difference between a list and a tuple?",
        "Summarize the plot of Romeo and Juliet in two sentences.", "Why is the sky blue?",
        "Write a function that checks whether a number is prime.", "What is recursion?",
        "Name five countries in Europe.", "How does a for loop work?", "What is JSON used for?",
        "Translate 'good morning' into French."]
RAW = ["The history of the printing press", "def fibonacci(n):", "import json\n\ndef load(path):",
       "Once upon a time, in a small village,"]


def _prompts(tokenizer, n):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in CHAT]
    raws = [tokenizer(t).input_ids for t in RAW]
    mixed = [p for pair in zip(chats, raws + [None] * len(chats)) for p in pair if p is not None]
    return mixed[:n]


def _transformers_greedy(model, ids, new_tokens):
    model.generation_config.eos_token_id = None  # full-length runs, as ignore_eos does
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_greedy_equals_transformers(smollm2, request):
    from transformers import AutoModelForCausalLM

    path, _ = smollm2
    n, new_tokens = request.config.getoption("--real-model-prompts"), request.config.getoption("--real-model-tokens")
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(path, **ENGINE) as engine:
        prompts = _prompts(engine.tokenizer, n)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(prompts) == min(n, len(CHAT) + len(RAW))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for ids, out in zip(prompts, outs):
        assert out.token_ids == _transformers_greedy(model, ids, new_tokens), out.text


def test_gguf_file_logits_match_transformers_gguf(smollm2):
    """The GGUF file itself (Q4_1, token embeddings Q8_0), loaded both ways, within 1e-4."""
    from transformers import AutoModelForCausalLM

    _, gguf = smollm2
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], list(range(100, 160))]
    with Engine(gguf, **ENGINE) as engine:
        got = _prefill_logits(engine, prompts)
        assert engine.tokenizer.chat_template.startswith("{% for message in messages %}")
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32).eval()
    for ids, g in zip(prompts, got):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        assert (g - want).abs().max() / want.abs().max() <= 1e-4


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2):
    """transformers' GGUF tokenizer prepends <|im_start|> (id 1) although the file says add_bos_token
    false; past that token the ids agree."""
    from transformers import AutoTokenizer

    path, gguf = smollm2
    ours = AutoTokenizer.from_pretrained(path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    for text in ["Hello world, def f(x):\n  return 1", "In 2024, 12345 people ate 3.14 pies!", "  spaces\n\n\ttabs",
                 "naïve café — “quotes” 日本語 😀"] + CHAT[:4]:
        want = ref(text).input_ids
        assert want[0] == 1
        assert ours(text).input_ids == want[1:], text
        assert ours.decode(ours(text).input_ids) == text


def test_its_head_speculates_by_default_and_changes_no_token(smollm2):
    """`Engine("smollm2-135m-instruct")` drafts with the shipped EAGLE-3 head; its greedy tokens equal plain
    decoding's (the checkpoint directory, no draft), and a seeded request gives the same tokens with and
    without speculation, chain and tree. The head accepts something on these prompts (it was trained)."""
    from tandem import named_models

    path, _ = smollm2
    head = named_models.head_dir(named_models.MODELS["smollm2-135m-instruct"])
    assert head is not None and os.path.isfile(os.path.join(head, "model.safetensors"))
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2)]
    with Engine(path, **ENGINE) as plain:
        prompts = _prompts(plain.tokenizer, 4)
        want = [o.token_ids for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
        want_seeded = [o.token_ids for o in plain.generate(input_ids=prompts[:2], sampling_params=seeded)]
    for shape in (dict(), dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)):
        with Engine("smollm2-135m-instruct", **ENGINE, speculative_adaptive="off", **shape) as engine:
            assert engine.args.speculative_draft_model_path == head
            outs = engine.generate(input_ids=prompts, sampling_params=greedy)
            assert [o.token_ids for o in outs] == want
            assert sum(n - 1 for o in outs for n in o.spec_accept_lengths) > 0
            assert [o.token_ids for o in engine.generate(input_ids=prompts[:2], sampling_params=seeded)] == want_seeded
