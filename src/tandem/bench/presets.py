"""Named model shapes for benchmarks with random weights (`--load-format dummy`): a config.json per
shape, and a matching EAGLE-3 head config, written to a directory on demand."""

from __future__ import annotations

import json
import os

LLAMA3_COMMON = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, num_attention_heads=32,
    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000,
    eos_token_id=128001, torch_dtype="bfloat16",
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)

PRESETS = {
    "llama-3.2-1b": dict(LLAMA3_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         head_dim=64, tie_word_embeddings=True),
    "llama-3.1-8b": dict(LLAMA3_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         head_dim=128, tie_word_embeddings=False),
    # For tests only: a ~0.1M-parameter model that runs the whole bench path on a CPU in seconds.
    "tiny-test": dict(LLAMA3_COMMON, vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, torch_dtype="float32", tie_word_embeddings=False,
                      rope_scaling=dict(LLAMA3_COMMON["rope_scaling"], original_max_position_embeddings=64)),
}


def write_preset(name: str, root: str) -> tuple[str, str]:
    """Writes `<root>/<name>/config.json` and `<root>/<name>-eagle3/config.json`; returns both dirs."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    target, head = os.path.join(root, name), os.path.join(root, f"{name}-eagle3")
    head_cfg = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                    "rms_norm_eps", "rope_theta", "max_position_embeddings", "rope_scaling",
                                    "vocab_size", "intermediate_size", "torch_dtype")}
    head_cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                    draft_vocab_size=min(32000, cfg["vocab_size"]),
                    target_hidden_size=cfg["hidden_size"])
    for path, c in ((target, cfg), (head, head_cfg)):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f, indent=1)
    return target, head
