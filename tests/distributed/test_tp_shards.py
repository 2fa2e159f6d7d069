"""Each rank holds only its slice of the sharded weights, cut from the checkpoint at load time."""

import multiprocessing
import os
import socket

import torch
from safetensors.torch import load_file

from tandem import Engine
from tests.distributed.conftest import ENGINE


def test_engine_rank0_holds_half(tp_models):
    with Engine(tp_models["llama3"], tp_size=2, **ENGINE) as engine:
        model = engine.runner.model
        attn = model.model.layers[0].self_attn
        # 4 query heads and 2 KV heads of 16 dims over 2 ranks: (2 + 1 + 1) heads here.
        assert attn.qkv_proj.weight.shape == (4 * 16, 64)
        assert attn.o_proj.weight.shape == (64, 2 * 16)
        assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 48, 64)
        assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 48)
        assert model.model.embed_tokens.weight.shape == (160, 64)
        assert model.lm_head.weight.shape == (160, 64)
        assert engine.runner.kv_cache.k[0].shape[1] == 1  # one KV head per rank
        worker = engine.runner.workers[0]
    assert worker.exitcode == 0  # shutdown let rank 1 finish cleanly


def _load_rank(rank, port, path, results):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    from tandem.config import ModelLoadConfig
    from tandem.distributed.launcher import init_tp_group
    from tandem.models.hf_config import load_model_config
    from tandem.models.registry import build_target_model

    import datetime

    tp = init_tp_group(2, rank, torch.device("cpu"), datetime.timedelta(seconds=30))
    model = build_target_model(ModelLoadConfig(path, "float32"), load_model_config(path), 64, tp=tp)
    # numpy arrays pickle by value (torch tensors would be shared through the exiting process)
    results.put((rank, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}))
    tp.control_barrier()  # both ranks are done with the group; the parent ends the processes


def _spawn_ranks(path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_load_rank, args=(r, port, path, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, params = results.get(timeout=60)
        got[rank] = {n: torch.from_numpy(a) for n, a in params.items()}
    for p in procs:
        p.join(10)
        if p.is_alive():  # gloo's teardown at exit can hang; the results are in
            p.kill()
            p.join()
    return got


def test_each_rank_loads_its_slice_with_kv_replication(tp_models):
    """mistral has one KV head: both ranks hold it; query heads, MLP columns and vocab rows split."""
    path = tp_models["mistral"]
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    ranks = _spawn_ranks(path)
    d, q_rows = 16, 2 * 16  # head_dim; 2 of the 4 query heads per rank
    for rank, params in ranks.items():
        qkv = params["model.layers.1.self_attn.qkv_proj.weight"]
        pre = "model.layers.1.self_attn"
        assert torch.equal(qkv[:q_rows], ckpt[f"{pre}.q_proj.weight"][rank * q_rows:(rank + 1) * q_rows])
        assert torch.equal(qkv[q_rows:q_rows + d], ckpt[f"{pre}.k_proj.weight"])  # replicated KV head
        assert torch.equal(qkv[q_rows + d:], ckpt[f"{pre}.v_proj.weight"])
        o = params[f"{pre}.o_proj.weight"]
        assert torch.equal(o, ckpt[f"{pre}.o_proj.weight"][:, rank * q_rows:(rank + 1) * q_rows])
        down = params["model.layers.1.mlp.down_proj.weight"]
        assert torch.equal(down, ckpt["model.layers.1.mlp.down_proj.weight"][:, rank * 48:(rank + 1) * 48])
        gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up[48:], ckpt["model.layers.1.mlp.up_proj.weight"][rank * 48:(rank + 1) * 48])
        emb = params["model.embed_tokens.weight"]
        assert torch.equal(emb, ckpt["model.embed_tokens.weight"][rank * 160:(rank + 1) * 160])
        assert torch.equal(params["model.norm.weight"], ckpt["model.norm.weight"])  # replicated


def test_eagle3_draft_layer_is_split_like_the_target(tp_models):
    """The EAGLE-3 head's decoder layer is sharded (measured faster than replicating it on two
    H200s); fc and its lm_head stay whole. Rank 0's slices are the checkpoint's first halves."""
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=tp_models["EAGLE3"],
                speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4)
    ckpt = load_file(os.path.join(tp_models["EAGLE3"], "model.safetensors"))
    o_proj = next(v for k, v in ckpt.items() if k.endswith("self_attn.o_proj.weight"))
    down = next(v for k, v in ckpt.items() if k.endswith("mlp.down_proj.weight"))
    fc = next(v for k, v in ckpt.items() if k.endswith("fc.weight"))
    with Engine(tp_models["llama3"], tp_size=2, **ENGINE, **spec) as engine:
        draft = engine.runner.spec.drafter.model
        layer = draft.midlayer
        assert (layer.self_attn.num_heads, layer.self_attn.num_kv_heads) == (2, 1)
        assert layer.self_attn.qkv_proj.weight.shape == (4 * 16, 2 * 64)  # input: embedding and hidden
        assert torch.equal(layer.self_attn.o_proj.weight, o_proj[:, : o_proj.shape[1] // 2])
        assert torch.equal(layer.mlp.down_proj.weight, down[:, : down.shape[1] // 2])
        assert torch.equal(draft.fc.weight, fc)  # whole
        assert draft.lm_head.weight.shape[0] == draft.draft_vocab_size
        assert engine.runner.spec.drafter.kv_cache.k[0].shape[1] == 1  # the draft's KV head on this rank
