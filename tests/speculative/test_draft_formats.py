"""Public draft-checkpoint formats load; missing, extra or mis-shaped tensors give errors naming them."""

import json
import os

import pytest
import torch

from tandem import Engine
from tandem.models.eagle3 import eagle3_aux_layer_ids
from tests.speculative.conftest import CHAIN, ENGINE
from tests.speculative.draft_checkpoints import write_eagle3_head, write_eagle_head


def _engine(target, alg, path):
    return Engine(target, speculative_algorithm=alg, speculative_draft_model_path=path, **CHAIN, **ENGINE)


@pytest.fixture(scope="module")
def target_cfg(spec_models):
    return json.load(open(os.path.join(spec_models["target"], "config.json")))


def test_eagle3_reduced_vocab_maps_to_target_ids(spec_models):
    with _engine(spec_models["target"], "EAGLE3", spec_models["EAGLE3"]) as engine:
        draft = engine.runner.spec.drafter.model
        from safetensors.torch import load_file

        stored = load_file(os.path.join(spec_models["EAGLE3"], "model.safetensors"))
        assert draft.draft_vocab_size == stored["lm_head.weight"].shape[0] < engine.arch.vocab_size
        mapped = draft.to_target_ids(torch.arange(draft.draft_vocab_size))
        assert torch.equal(mapped, torch.nonzero(stored["t2d"]).squeeze(1))  # d2t agrees with t2d
        assert torch.equal(draft.fc.weight, stored["fc.weight"])
        assert torch.equal(draft.midlayer.self_attn.qkv_proj.weight[: stored["midlayer.self_attn.q_proj.weight"].shape[0]],
                           stored["midlayer.self_attn.q_proj.weight"])


def test_eagle3_aux_layer_ids():
    assert eagle3_aux_layer_ids({}, 32) == (2, 16, 29)
    # checkpoint ids name the layer whose output is used: the stream entering the next layer
    assert eagle3_aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32) == (2, 16, 29)


def test_eagle1_loads_and_uses_fc_bias(spec_models):
    with _engine(spec_models["target"], "EAGLE", spec_models["EAGLE"]) as engine:
        from safetensors.torch import load_file

        stored = load_file(os.path.join(spec_models["EAGLE"], "model.safetensors"))
        draft = engine.runner.spec.drafter.model
        assert torch.equal(draft.fc.bias, stored["fc.bias"])
        assert torch.equal(draft.layers[0].mlp.down_proj.weight, stored["layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("writer,alg,name", [
    (write_eagle_head, "EAGLE", "layers.0.self_attn.k_proj.weight"),
    (write_eagle_head, "EAGLE", "fc.weight"),
    (write_eagle3_head, "EAGLE3", "midlayer.hidden_norm.weight"),
    (write_eagle3_head, "EAGLE3", "d2t"),
    (write_eagle3_head, "EAGLE3", "lm_head.weight"),
])
def test_missing_tensor_is_named(spec_models, target_cfg, tmp_path, writer, alg, name):
    writer(str(tmp_path), target_cfg, drop=[name])
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _engine(spec_models["target"], alg, str(tmp_path))


@pytest.mark.parametrize("writer,alg", [(write_eagle_head, "EAGLE"), (write_eagle3_head, "EAGLE3")])
def test_extra_tensor_is_named(spec_models, target_cfg, tmp_path, writer, alg):
    writer(str(tmp_path), target_cfg, extra={"layers.7.surprise.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"layers\.7\.surprise\.weight"):
        _engine(spec_models["target"], alg, str(tmp_path))


def test_misshaped_tensor_names_tensor_and_shapes(spec_models, target_cfg, tmp_path):
    h = target_cfg["hidden_size"]
    write_eagle3_head(str(tmp_path), target_cfg, extra={"fc.weight": torch.zeros(h, 2 * h)})
    with pytest.raises(ValueError, match=rf"fc\.weight.*\({h}, {3 * h}\).*\({h}, {2 * h}\)"):
        _engine(spec_models["target"], "EAGLE3", str(tmp_path))


def test_standalone_with_other_vocab_is_refused(spec_models, tmp_path):
    from tests.models.tiny_checkpoints import COMMON, make_checkpoint

    make_checkpoint("qwen2", str(tmp_path), seed=3)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["vocab_size"] = COMMON["vocab_size"] + 1
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="vocab_size"):
        _engine(spec_models["target"], "STANDALONE", str(tmp_path))


def test_bad_speculative_settings():
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        Engine(speculative_algorithm="EAGLE3", speculative_draft_model_path="x", speculative_eagle_topk=1,
               speculative_num_steps=3, speculative_num_draft_tokens=6, device="cpu")
    with pytest.raises(ValueError, match="speculative_algorithm"):
        Engine(speculative_algorithm="MEDUSA", speculative_draft_model_path="x", device="cpu")
