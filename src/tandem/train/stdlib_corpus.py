"""The demo pair's data: the Python standard library's source, split by package, and a byte-level BPE
tokenizer trained on the training part (saved as a Hugging Face fast tokenizer with a chat template).

The split is by top-level package, so held-out code is code the models never saw in any form:
every `.py` file under one of `HELD_OUT_PACKAGES` is held out, everything else trains.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass

HELD_OUT_PACKAGES = ("asyncio", "email", "json")  # fixed: the recorded results are measured on these
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)  # ids 0..6, in this order
# One turn: <|role|>\ncontent<|end|>\n; the prompt for a reply ends with <|assistant|>\n.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass
class SourceFile:
    path: str  # relative to the stdlib directory, with '/' separators
    text: str

    @property
    def package(self) -> str:
        return self.path.split("/", 1)[0].removesuffix(".py")


@dataclass
class StdlibCorpus:
    root: str
    train: list[SourceFile]
    heldout: list[SourceFile]

    def fingerprint(self) -> dict:
        """What identifies the corpus: file counts, bytes and a hash over (path, text) in order."""
        digest = hashlib.sha256()
        for f in self.train + self.heldout:
            digest.update(f.path.encode() + b"\0" + f.text.encode() + b"\0")
        nbytes = lambda files: sum(len(f.text.encode()) for f in files)  # noqa: E731
        return {"stdlib_dir": self.root, "train_files": len(self.train), "heldout_files": len(self.heldout),
                "train_bytes": nbytes(self.train), "heldout_bytes": nbytes(self.heldout),
                "heldout_packages": list(HELD_OUT_PACKAGES), "excluded_dirs": list(EXCLUDED_DIRS),
                "sha256": digest.hexdigest()}


def default_stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def collect_stdlib(stdlib_dir: str | None = None, max_files: int | None = None) -> StdlibCorpus:
    """Every `.py` file under the stdlib directory (sorted by path), split by package.

    `max_files` keeps only every k-th file of each split (a tiny corpus for tests and dry runs).
    """
    root = os.path.abspath(stdlib_dir or default_stdlib_dir())
    if not os.path.isdir(root):
        raise FileNotFoundError(f"stdlib directory {root!r} does not exist")
    files = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(names):
            if name.endswith(".py"):
                full = os.path.join(dirpath, name)
                with open(full, encoding="utf-8", errors="replace") as f:
                    files.append(SourceFile(os.path.relpath(full, root).replace(os.sep, "/"), f.read()))
    files.sort(key=lambda f: f.path)
    train = [f for f in files if f.package not in HELD_OUT_PACKAGES]
    heldout = [f for f in files if f.package in HELD_OUT_PACKAGES]
    if not train or not heldout:
        raise ValueError(f"{root!r} has {len(train)} training and {len(heldout)} held-out .py files; "
                         f"expected both (held-out packages: {', '.join(HELD_OUT_PACKAGES)})")
    if max_files is not None:
        train, heldout = _thin(train, max_files), _thin(heldout, max(1, max_files // 4))
    return StdlibCorpus(root, train, heldout)


def _thin(files: list[SourceFile], n: int) -> list[SourceFile]:
    step = max(1, len(files) // n)
    return files[::step][:n]


def train_tokenizer(texts: list[str], vocab_size: int, progress: bool = True):
    """A byte-level BPE `tokenizers.Tokenizer`: GPT-2 pre-tokenization, `SPECIAL_TOKENS` first, and
    a post-processor that puts BOS in front of every encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def save_tokenizer(tok, out_dir: str, model_max_length: int) -> None:
    """tokenizer.json plus a hand-written tokenizer_config.json, so the files read the same under
    transformers 4 and 5 (whose `save_pretrained` outputs differ)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": list(ROLE_TOKENS),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # code: decode must give back the exact text
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": list(ROLE_TOKENS)}, f, indent=2)


def encode_documents(tok, files: list[SourceFile]) -> list[list[int]]:
    """Token ids of each file: BOS, the text, EOS (documents are packed back to back in training)."""
    eos = tok.token_to_id(EOS)
    return [enc.ids + [eos] for enc in tok.encode_batch([f.text for f in files])]
