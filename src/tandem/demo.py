"""The demo model that `Engine()` and `tandem generate` use when no model path is given.

Until the trained demo pair is bundled, this is a tiny Llama with random weights and a byte-level
tokenizer, made on first use in the cache directory: the whole pipeline runs, the text is noise.
"""

from __future__ import annotations

import logging
import os

from tandem import envs

logger = logging.getLogger(__name__)

TINY_RANDOM_NAME = "tiny-random-llama-v1"


def demo_model_paths() -> tuple[str, str | None]:
    """(target directory, draft directory); the draft is None until a trained head is bundled."""
    path = os.path.join(envs.cache_dir(), TINY_RANDOM_NAME)
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_random_llama(path)
    return path, None


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def make_tiny_random_llama(path: str, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    logger.info("making the placeholder demo model in %s", path)
    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    torch.manual_seed(seed)
    tmp = path + ".tmp"
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)  # atomic: a half-written directory is never used
