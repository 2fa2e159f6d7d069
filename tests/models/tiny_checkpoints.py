"""Tiny random Hugging Face checkpoints, one per supported family, made with transformers itself."""

from __future__ import annotations

import os

import torch

# Large-ish init so logits are peaked: greedy ties (which any two float orders may break
# differently) become vanishingly rare.
INIT_RANGE = 0.25

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=512, initializer_range=INIT_RANGE,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = {
    # GQA and Llama-3 rope scaling, untied embeddings
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # tied embeddings, multi-head (no GQA), Llama-2 style
    "llama2_tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # head_dim != hidden / heads, attention bias on q/k/v/o
    "llama_headdim": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, head_dim=24,
                                                              attention_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32,
                                                      tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=4096)),
}


def make_checkpoint(family: str, path: str, seed: int = 0, dtype=torch.float32):
    """Saves a random checkpoint of `family` to `path`; returns the transformers model (float32, eval)."""
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    _spread_norm_weights(model, seed)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return model.float()


def _spread_norm_weights(model, seed):
    # transformers initialises norms (and biases) to constants; random values exercise that we
    # load them into the right place.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=gen))


def prompts(n: int = 8, seed: int = 0, vocab: int = 320) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 7, 12, 17, 25, 33, 48, 5, 60][:n]
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def checkpoint_dir(tmp_path_factory, family: str) -> tuple[str, object]:
    path = str(tmp_path_factory.mktemp(family))
    model = make_checkpoint(family, path)
    return os.path.abspath(path), model
