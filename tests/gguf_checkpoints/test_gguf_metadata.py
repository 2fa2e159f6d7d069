"""What a GGUF file's metadata becomes (config, rope scaling), and the files we refuse, by name."""

import numpy as np
import pytest
import torch

from tandem import Engine
from tandem.gguf.config import gguf_config
from tandem.models.hf_config import load_model_config
from tests.gguf_checkpoints.gguf_files import llama3_rope_divisors, make_model, write_family, write_gguf
from tests.models.test_hf_parity import _prefill_logits

ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_total_tokens=512)


def test_config_from_metadata(tmp_path):
    path, _, _ = write_family(tmp_path, "llama", types=("F16",))
    arch = load_model_config(path)
    assert (arch.architecture, arch.num_layers, arch.hidden_size, arch.intermediate_size) == \
        ("LlamaForCausalLM", 2, 256, 512)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (4, 2, 64, 320)
    assert (arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings) == (500000.0, None, 512)
    assert not arch.tie_word_embeddings and not arch.qkv_bias
    assert (arch.bos_token_id, arch.eos_token_ids, arch.torch_dtype) == (1, (2,), None)  # Q4_1 file type: quantized
    assert arch.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.parametrize("family,want", [("llama_tied", ("LlamaForCausalLM", True, False, False)),
                                          ("mistral", ("MistralForCausalLM", False, False, False)),
                                          ("qwen2", ("Qwen2ForCausalLM", False, True, False)),
                                          ("qwen3", ("Qwen3ForCausalLM", True, False, True))])
def test_family_switches_from_the_file(tmp_path, family, want):
    path, _, _ = write_family(tmp_path, family, types=("F16",))
    arch = load_model_config(path)
    assert (arch.architecture, arch.tie_word_embeddings, arch.qkv_bias, arch.qk_norm) == want
    if family == "mistral":
        assert arch.sliding_window is None  # the file names no window: full attention


def test_llama3_rope_divisors_become_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3's rope scaling as a rope_freqs tensor of divisors; the parameters come
    back from it and the logits equal transformers' model with those parameters (its GGUF reader
    ignores the tensor, so the reference here is the Hugging Face checkpoint)."""
    import transformers

    from tests.gguf_checkpoints.gguf_files import COMMON

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=scaling)).eval()
    divisors = llama3_rope_divisors(64, 500000.0, 8.0, 1.0, 4.0, 64)
    assert 1.0 < divisors[4] < 8.0  # the smooth band is exercised
    path = str(tmp_path / "llama3.gguf")
    write_gguf(path, model, "llama", types=("F32",), extra_tensors=[("rope_freqs.weight", divisors)])
    assert gguf_config(path)["rope_scaling"] == scaling
    ids = [list(range(3, 200, 3))]  # 66 positions: past original_max_position_embeddings
    with Engine(path, **ENGINE) as engine:
        got = _prefill_logits(engine, ids)[0]
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits[0]
    assert (got - want).abs().max() / want.abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_named_in_the_metadata(tmp_path, kind):
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(path, make_model("llama"), "llama", types=("F16",),
               extra_kv=[("llama.rope.scaling.type", kind), ("llama.rope.scaling.factor", 4.0)])
    if kind == "linear":
        assert gguf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    else:
        with pytest.raises(ValueError, match="'yarn'"):
            gguf_config(path)


def _raises_naming(path, *words):
    for load in (load_model_config, lambda p: Engine(p, **ENGINE)):
        with pytest.raises(ValueError) as err:
            load(path)
        assert all(w in str(err.value) for w in words), str(err.value)


def test_another_architecture_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "phi3.gguf")
    write_gguf(path, make_model("llama"), "llama", types=("F16",), architecture="phi3")
    _raises_naming(path, "'phi3'", "llama")


def test_an_unsupported_tensor_type_is_an_error_naming_it(tmp_path):
    import gguf

    path = str(tmp_path / "iq4.gguf")
    block = np.zeros((4, 18 * 8), dtype=np.uint8)  # IQ4_NL: 18 bytes per 32 values; 4 rows of 256
    write_gguf(path, make_model("llama"), "llama", types=("F16",),
               extra_tensors=[("blk.0.extra.weight", block, gguf.GGMLQuantizationType.IQ4_NL)])
    _raises_naming(path, "IQ4_NL", "blk.0.extra.weight")


def test_a_tensor_with_no_place_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "fused.gguf")
    write_gguf(path, make_model("llama"), "llama", types=("F16",),
               extra_tensors=[("blk.0.attn_qkv.weight", np.zeros((4, 256), dtype=np.float32))])
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        Engine(path, **ENGINE)


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model_config(str(path))
