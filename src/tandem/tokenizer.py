"""Tokenizer loading and incremental detokenization with stop strings."""

from __future__ import annotations

import glob
import json
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str):
    """A Hugging Face fast tokenizer for `path` (a model directory or a GGUF file), or None if it has none."""
    from tandem.gguf import is_gguf_path

    if is_gguf_path(path):
        from tandem.gguf.tokenizer import gguf_tokenizer

        return gguf_tokenizer(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_path: str, config_eos: tuple[int, ...], tokenizer) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, together."""
    ids = set(config_eos)
    for gen_cfg in glob.glob(os.path.join(model_path, "generation_config.json")):
        with open(gen_cfg) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class StopStringDetokenizer:
    """Decodes one request's output and finds the first stop string in it.

    Text is decoded from all output tokens each time (simple and exact for multi-byte characters
    split across tokens); a stop string is searched for only in the part that could have changed.
    """

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.stopped = False

    def update(self, output_token_ids: list[int]) -> bool:
        """Re-decodes; returns True when a stop string appeared (text is then cut before it)."""
        if self.tokenizer is None:
            return False
        old_len = len(self.text)
        self.text = self.tokenizer.decode(output_token_ids, skip_special_tokens=self.skip_special_tokens)
        if not self.stop or self.stopped:
            return False
        longest = max(len(s) for s in self.stop)
        search_from = max(0, old_len - longest + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped
