"""Tiny GGUF files written with `gguf.GGUFWriter` from random transformers models, the way llama.cpp's
converter writes them: Llama Q/K rows permuted for its rope layout, matrices quantized (gguf.quants
where it can quantize; random valid blocks for the K-quants it can only read), norms in F32."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

# Shapes every block size divides (K-quants pack 256 values along a row).
COMMON = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              max_position_embeddings=512, initializer_range=0.25, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# family -> (transformers config, model class, extra config, GGUF architecture, general.name)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                      rope_theta=500000.0), "llama", "tiny llama"),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4,
                                                           tie_word_embeddings=True), "llama", "tiny llama tied"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1,
                                                            sliding_window=None), "llama", "Mistral tiny"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                      tie_word_embeddings=False), "qwen2", "tiny qwen2"),
    # transformers reads a qwen3 GGUF's head_dim from its config default (128), so the file uses it
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                                      tie_word_embeddings=True), "qwen3", "tiny qwen3"),
}

ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# The K-quants gguf.quants can only dequantize: bytes per 256-value block, offsets of the float16 scales
# (d, then dmin where the type has one) and the largest |integer factor| a value can reach, so random
# blocks stay at the size of the random weights.
K_QUANT_BLOCKS = {"Q2_K": (84, (80, 82), 45), "Q3_K": (110, (108,), 128), "Q4_K": (144, (0, 2), 945),
                  "Q5_K": (176, (0, 2), 1953), "Q6_K": (210, (208,), 4096)}

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, as written there."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a little English and Python, with ChatML's special tokens
    at ids 0-2 (a stand-in for a real model's; also the reference for the GGUF tokenizer tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "def fibonacci(n):\n    return n if n < 2 else 0",
            "import os\nprint(os.path.join('a', 'b'))", "hello world, hello there"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def make_model(family: str, seed: int = 0):
    import transformers

    config_name, model_name, extra, _, _ = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers sets norms and biases to constants; spread them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _gguf_name(hf: str) -> str:
    parts = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, _, suffix = hf.rpartition(".")
    if base in parts:
        return f"{parts[base]}.{suffix}"
    layer, rest = base.split(".")[2], ".".join(base.split(".")[3:])
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}[rest]
    return f"blk.{layer}.{block}.{suffix}"


def random_k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nbytes, scale_offsets, reach = K_QUANT_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, nbytes), dtype=np.uint8)
    for off in scale_offsets:
        d = (rng.uniform(0.5, 1.0, size=blocks.shape[0]) * 0.4 / reach).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf

    gtype = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype in K_QUANT_BLOCKS:
        return random_k_blocks(qtype, w.shape[0], w.shape[1], rng), gtype
    return gguf.quants.quantize(w.astype(np.float32), gtype), gtype


def write_gguf(path: str, model, family: str, types=ALL_TYPES, type_offset: int = 0, tokenizer=True,
               architecture: str | None = None, extra_tensors=(), extra_kv=(), seed: int = 0) -> dict[str, str]:
    """Writes `model` as a GGUF file; matrix i (in file order) gets types[(i + type_offset) % len(types)].
    Returns {GGUF tensor name: type}."""
    import gguf

    _, _, _, arch, name = FAMILIES[family]
    arch = architecture or arch
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    if tokenizer:
        tok = byte_level_tokenizer(cfg.vocab_size)
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        merges = [" ".join(m) for m in _merges(tok)]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([t for t, _ in vocab])
        w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)
    written, matrix = {}, 0
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, kv_heads)
        gname = _gguf_name(hf_name)
        if data.ndim == 2:
            qtype = types[(matrix + type_offset) % len(types)]
            matrix += 1
        else:
            qtype = "F32"
        enc, raw = encode(data, qtype, rng)
        w.add_tensor(gname, enc, raw_dtype=raw)
        written[gname] = qtype
    for gname, data, *raw in extra_tensors:
        w.add_tensor(gname, data, raw_dtype=raw[0] if raw else None)
    for key, value in extra_kv:
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _merges(tok) -> list[tuple[str, str]]:
    import json

    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
            for m in json.loads(tok.to_str())["model"]["merges"]]


def write_family(tmp_dir, family: str, type_offset: int = 0, **kw):
    """(path of the GGUF file, the transformers model it was written from, {tensor: type})."""
    model = make_model(family)
    path = os.path.join(str(tmp_dir), f"{family}.gguf")
    written = write_gguf(path, model, family, type_offset=type_offset, **kw)
    return path, model, written


def llama3_rope_divisors(head_dim, theta, factor, low, high, original):
    """llama.cpp's convert_hf_to_gguf.py Llama-3 rope factors, as written there."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
