"""What a constrained request asks for, and its compilation into a grammar over the model's tokens.

The grammar library is xgrammar (what vLLM and SGLang use; the measured comparison with llguidance and
outlines-core is in docs/structured_output.md). It is imported only when a constrained request
arrives, so unconstrained serving never loads it.

JSON schemas compile without free whitespace: outputs use the separators `, ` and `: ` and no other
whitespace (`{"a": 1, "b": [2, 3]}`). With whitespace allowed anywhere, a model can pad between tokens
forever and never close the document.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

# A JSON object, any keys: what `response_format: {"type": "json_object"}` asks for.
ANY_JSON_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json_schema", "regex" or "grammar" (EBNF, xgrammar's dialect: `root ::= ...`);
    source: the schema as canonical JSON text, the regex or the EBNF text (hashable: the cache key)."""

    kind: str
    source: str


def spec_of(params) -> GrammarSpec | None:
    """The grammar a SamplingParams asks for (it validated that at most one is set), or None."""
    if params.json_schema is not None:
        schema = params.json_schema
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True, separators=(",", ":"))
        return GrammarSpec("json_schema", text)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.grammar is not None:
        return GrammarSpec("grammar", params.grammar)
    return None


class GrammarError(ValueError):
    """A grammar that does not compile: the message names the field and the reason (a 400)."""


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and caches the results by spec, the `cache_size` most
    recently used (a server fed ever new schemas must not grow without bound). Thread-safe (the server
    compiles off its event loop)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = 512):
        import xgrammar

        self._xgr = xgrammar
        # vocab_size: the model's (its lm_head may be wider than the tokenizer; the extra ids are never
        # allowed). Stop tokens end a grammar's document: the only tokens allowed once it is complete.
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self.cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec):
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            if spec.kind == "json_schema":
                compiled = self._compiler.compile_grammar(json_schema_ebnf(self._xgr, spec.source))
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.source)
            elif spec.kind == "grammar":
                compiled = self._compiler.compile_grammar(spec.source)
            else:
                raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / its own errors with a readable message
            raise GrammarError(f"{spec.kind}: cannot compile: {_first_line(e)}") from e
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec):
        return self._xgr.GrammarMatcher(self.compile(spec))


# Two gaps in xgrammar's (0.2.9) JSON strings: the characters of a string with maxLength / minLength are
# [^"\\\r\n], which lets control characters through (JSON forbids them unescaped), and no string class
# excludes the UTF-16 surrogates U+D800-U+DFFF, whose 3-byte encodings are not valid UTF-8 (byte-level
# tokenizers can emit them). Every string character class gets both exclusions here.
_STRING_CLASS = re.compile(r'\[\^(?:\\0-\\x1f)?\\"\\\\\\r\\n')
_VALID_STRING_CLASS = r'[^\0-\x1f\uD800-\uDFFF\"\\\r\n'


def json_schema_ebnf(xgrammar, schema_text: str) -> str:
    """The EBNF grammar of a JSON schema (no free whitespace, JSON Schema's own semantics: properties
    not listed are allowed unless additionalProperties is false), strings restricted to valid JSON."""
    ebnf = str(xgrammar.Grammar.from_json_schema(schema_text, any_whitespace=False, strict_mode=False))
    return _STRING_CLASS.sub(lambda _: _VALID_STRING_CLASS, ebnf)


# xgrammar's messages start with "[hh:mm:ss] /its/source.cc:94: ": the reason is what follows.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:300]
