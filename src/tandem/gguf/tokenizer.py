"""A Hugging Face fast tokenizer, chat template included, built from a GGUF file's tokenizer metadata.

Two vocabularies occur in Llama-family files: byte-level BPE (`tokenizer.ggml.model = "gpt2"`: Llama 3,
Qwen2/3, SmolLM) with a pre-tokenizer named by `tokenizer.ggml.pre`, and SentencePiece BPE ("llama":
Llama 2, Mistral 7B), rebuilt as Hugging Face's own Llama tokenizer is (merges ordered by the scores).
"""

from __future__ import annotations

from tandem.gguf.reader import metadata, open_reader

# llama.cpp's token types (llama_token_type): 3 control tokens are special, 4 user-defined ones are
# added tokens that are never split.
_CONTROL, _USER_DEFINED = 3, 4

# The split patterns behind llama.cpp's pre-tokenizer names (llama-vocab.cpp), as the original Hugging
# Face tokenizers write them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2's regex with each digit its own piece (SmolLM, StarCoder).
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")
_LLAMA3_PRES = ("llama-bpe", "llama3")
_PLAIN_PRES = ("default", "gpt2")
SUPPORTED_PRE_TOKENIZERS = _PLAIN_PRES + _DIGIT_SPLIT_PRES + _LLAMA3_PRES + ("qwen2",)


def gguf_tokenizer(path: str):
    """The tokenizer of the GGUF file at `path`, or None if the file carries none."""
    meta = metadata(open_reader(path), bulky=True)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        return None
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(path, meta, tokens)
        add_bos_default = meta.get("tokenizer.ggml.pre") in _LLAMA3_PRES
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types)
        add_bos_default = True
    else:
        raise ValueError(f"GGUF file {path!r} has a {kind!r} tokenizer; supported: gpt2 (byte-level BPE), "
                         "llama (SentencePiece); pass --tokenizer-path to use a Hugging Face tokenizer")
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    _set_post_processor(backend, kind, bos, meta.get("tokenizer.ggml.bos_token_id"), add_bos)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _byte_level_bpe(path, meta, tokens):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    # Llama 3's tokenizer takes a whole word that is in the vocabulary before applying merges.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre in _PLAIN_PRES:
        tok.pre_tokenizer = byte_level
    elif pre in _DIGIT_SPLIT_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRES or pre == "qwen2":
        pattern = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
    else:
        raise ValueError(f"GGUF file {path!r} has pre-tokenizer {pre!r}; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}; "
                         "pass --tokenizer-path to use a Hugging Face tokenizer")
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta, tokens, types):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    # Every split of a piece into two pieces of the vocabulary is a merge, ranked by the merged
    # piece's score (transformers' SentencePieceExtractor: the same rule builds Llama's tokenizer.json).
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "▁")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()] + strip)
    return tok


def _set_post_processor(tok, kind, bos, bos_id, add_bos):
    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    if add_bos:
        steps.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                   special_tokens=[(bos, bos_id)]))
    if steps:
        tok.post_processor = processors.Sequence(steps)
