"""Incremental detokenization in the front end, with stop strings.

Text is decoded over a sliding window of token ids (the method of Hugging Face TGI): decode
ids[prefix:] and ids[prefix:read], and the difference is the new text. The window starts at the
first output token, so the joined pieces equal `tokenizer.decode(output_ids)`, which is what
`Engine.generate` returns. Two kinds of text are held back while the request runs:
- text ending in U+FFFD: a multi-byte character split across tokens; the next token completes it;
- a tail that could be the beginning of a stop string, until the next tokens decide it.
The engine is given the same stop strings and cuts the request right after the token that
completes one; this class cuts the text before it, as the engine does.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop  # keep the stop string that ended the text (cut after it)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (complete characters; cut before a stop string)
        self.stopped = False  # a stop string was found
        self._prefix = 0  # window start: text before it is final
        self._read = 0  # ids[prefix:read] decode to the last piece appended to `text`
        self._sent = 0  # characters of `text` already handed out

    def push(self, new_token_ids: list[int], final: bool = False) -> str:
        """Adds tokens; returns the text that can now be shown. `final` flushes everything."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        old_len = len(self.text)
        self._decode_window(final)
        if self.stop:
            self._find_stop(old_len)
        hold = 0 if final or self.stopped else self._stop_prefix_len()
        end = max(self._sent, len(self.text) - hold)
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def _decode_window(self, final: bool) -> None:
        if self.tokenizer is None:
            return
        ids = self.token_ids
        before = self._decode(ids[self._prefix:self._read])
        after = self._decode(ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith(REPLACEMENT_CHAR)):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, old_len: int) -> None:
        # Only text that is new, plus enough before it to finish a stop string, can hold a new hit.
        start = max(0, old_len - max(len(s) for s in self.stop) + 1)
        hits = [(i, i + len(s)) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            first, end = min(hits)
            self.text = self.text[: end if self.include_stop else first]
            self._sent = min(self._sent, len(self.text))
            self.stopped = True

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
