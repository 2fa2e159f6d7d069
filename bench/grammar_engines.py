"""Which grammar library tandem's structured output uses: xgrammar, llguidance and outlines-core side by
side on our tokenizers, over random JSON schemas (tandem.bench.json_schemas).

Per library and tokenizer: schema compile time (cold, per schema), and the time to compute one
next-token mask plus advance by one token, along the tokenization of a document that satisfies the
schema (every token must be allowed by the mask before it: a check that the three agree on the
language). Prints a table and writes JSON.

    .venv/bin/pip install xgrammar llguidance outlines-core
    OMP_NUM_THREADS=1 .venv/bin/python bench/grammar_engines.py --out grammar_engines.json

The "large" tokenizer is a byte-level BPE trained here on the Python standard library (no download
is possible on CI machines): a stand-in for Llama-3's 128k vocabulary.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import sysconfig
import time

import torch

from tandem.bench import report
from tandem.bench.json_schemas import random_instance, schemas


def demo_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from tandem.demo import demo_model_paths
    return PreTrainedTokenizerFast.from_pretrained(demo_model_paths()[0])


def large_tokenizer(vocab: int, cache: pathlib.Path):
    """A byte-level BPE of `vocab` tokens trained on the standard library's sources (cached)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    path = cache / f"stdlib-bpe-{vocab}.json"
    if not path.exists():
        texts = []
        for f in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                texts.append(f.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):  # a few test files are deliberately not UTF-8
                pass
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(texts, vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=True)
        cache.mkdir(parents=True, exist_ok=True)
        bpe.save(str(path))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    return tok


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.vocab = len(tok)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allowed(self, m, bitmask) -> torch.Tensor:
        m.fill_next_token_bitmask(bitmask, 0)
        return bitmask

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
        self.vocab = len(tok)

    def compile(self, schema: dict):
        schema = dict(schema, **{"x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                                "key_separator": ":"}})
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.ll.LLMatcher(self.tok, grammar)  # compiling happens when the first matcher is built
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def allowed(self, m, bitmask):
        self.ll.torch.fill_next_token_bitmask(m, bitmask, 0)
        return bitmask

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)

    def bitmask(self):
        return self.ll.torch.allocate_token_bitmask(1, self.vocab)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        self.oc = outlines_core
        self.regex_of = build_regex_from_schema
        self.vocab = len(tok)
        # Byte-level BPE: token strings are bytes spelled with the GPT-2 byte alphabet.
        byte_of = {c: b for b, c in _gpt2_byte_alphabet().items()}
        tokens: dict = {}
        for text, i in tok.get_vocab().items():
            if i == tok.eos_token_id:
                continue
            try:
                key = bytes(byte_of[c] for c in text)
            except KeyError:  # a special token
                continue
            tokens.setdefault(key, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_id, tokens)

    def compile(self, schema: dict):
        return self.oc.Index(self.regex_of(json.dumps(schema), whitespace_pattern=""), self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def allowed(self, m, bitmask):
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)
        return bitmask

    def advance(self, m, token: int) -> bool:
        m.advance(token)
        return True

    def bitmask(self):
        return torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32)


def _gpt2_byte_alphabet() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def is_allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def measure(engine, tok, schema_list, seed: int) -> dict:
    rng = random.Random(seed)
    compile_ms, step_us, rejected, steps = [], [], 0, 0
    bitmask = engine.bitmask()
    for schema in schema_list:
        start = time.perf_counter()
        compiled = engine.compile(schema)
        compile_ms.append(1e3 * (time.perf_counter() - start))
        text = json.dumps(random_instance(schema, rng), separators=(",", ":"))
        m = engine.matcher(compiled)
        for t in tok.encode(text, add_special_tokens=False):
            start = time.perf_counter()
            engine.allowed(m, bitmask)
            ok = is_allowed(bitmask, t) and engine.advance(m, t)
            step_us.append(1e6 * (time.perf_counter() - start))
            steps += 1
            if not ok:
                rejected += 1
                break
    return {"compile_ms_median": statistics.median(compile_ms), "compile_ms_max": max(compile_ms),
            "mask_us_median": statistics.median(step_us), "mask_us_p99": sorted(step_us)[int(0.99 * len(step_us))],
            "tokens": steps, "documents_rejected": rejected}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--large-vocab", type=int, default=128000)
    ap.add_argument("--cache", default=".cache/tokenizers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tokenizers = {"demo (8192)": demo_tokenizer()}
    if args.large_vocab:
        tokenizers[f"stdlib BPE ({args.large_vocab})"] = large_tokenizer(args.large_vocab, pathlib.Path(args.cache))
    schema_list = schemas(args.schemas, seed=0)
    rows = []
    for tok_name, tok in tokenizers.items():
        for cls in (XGrammar, LLGuidance, OutlinesCore):
            start = time.perf_counter()
            try:
                engine = cls(tok)
                setup_ms = 1e3 * (time.perf_counter() - start)
                row = dict(library=cls.name, tokenizer=tok_name, vocab=len(tok), setup_ms=setup_ms,
                           **measure(engine, tok, schema_list, seed=1))
            except Exception as exc:  # a library that cannot run here is recorded, not fatal
                row = dict(library=cls.name, tokenizer=tok_name, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    print(f"{'library':14} {'tokenizer':22} {'setup ms':>9} {'compile ms (med/max)':>21} "
          f"{'mask+advance us (med/p99)':>26} {'rejected':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['library']:14} {r['tokenizer']:22} error: {r['error']}")
            continue
        print(f"{r['library']:14} {r['tokenizer']:22} {r['setup_ms']:9.0f} "
              f"{r['compile_ms_median']:10.1f} / {r['compile_ms_max']:8.1f} "
              f"{r['mask_us_median']:12.1f} / {r['mask_us_p99']:10.1f} {r['documents_rejected']:8d}")
    if args.out:
        report.write_json({"schemas": args.schemas, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
