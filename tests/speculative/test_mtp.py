"""MTP draft modules (models/mtp.py, speculative/mtp_drafter.py): the checkpoint format loads by its exact
names; each module computes the documented formula; the drafts equal a from-scratch reference of the
documented semantics; greedy speculative output equals plain greedy output; a hand-built head whose
drafts are always right is always accepted; pages are all returned, aborts included."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from tandem import Engine, SamplingParams
from tandem.layers.attention.base import AttentionBatch
from tandem.layers.attention.torch_backend import TorchAttentionBackend
from tandem.models.llama import StepContext
from tests.engine.helpers import instrument_preemptions
from tests.models.tiny_checkpoints import prompts
from tests.speculative.conftest import ENGINE, TREE
from tests.speculative.draft_checkpoints import write_mtp_head

NUM_MODULES = 3
NEW_TOKENS = 20
PROMPTS = prompts(10, seed=3) + prompts(10, seed=4) + prompts(10, seed=5) + prompts(2, seed=6)  # 32 prompts


def chain(steps: int) -> dict:
    return dict(speculative_eagle_topk=1, speculative_num_steps=steps, speculative_num_draft_tokens=steps + 1)


def greedy(n=NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def mtp_engine(target, head, steps=NUM_MODULES, **kw):
    return Engine(target, speculative_algorithm="MTP", speculative_draft_model_path=head, **chain(steps),
                  **{**ENGINE, **kw})


@pytest.fixture(scope="module")
def target_cfg(spec_models):
    return json.load(open(os.path.join(spec_models["target"], "config.json")))


@pytest.fixture(scope="module")
def mtp_head(spec_models, target_cfg, tmp_path_factory):
    """Three modules; module 1 stores its own output head, the others use the target's lm_head."""
    path = str(tmp_path_factory.mktemp("mtp"))
    write_mtp_head(path, target_cfg, NUM_MODULES, seed=7, own_heads=(1,))
    return path


@pytest.fixture(scope="module")
def reference(spec_models):
    with Engine(spec_models["target"], **ENGINE) as engine:
        return [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=greedy())]


# ---- format --------------------------------------------------------------------------------------
def test_format_loads_by_exact_names(spec_models, mtp_head):
    stored = load_file(os.path.join(mtp_head, "model.safetensors"))
    assert "model.embed_tokens.weight" in stored  # present, and ignored
    with mtp_engine(spec_models["target"], mtp_head) as engine:
        draft = engine.runner.spec.drafter.model
        assert draft.num_modules == NUM_MODULES and len(engine.runner.spec.drafter.kv_cache.k) == NUM_MODULES
        for k, layer in enumerate(draft.model.layers):
            p = f"model.layers.{k}."
            for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight",
                         "post_attention_layernorm.weight", "shared_head.norm.weight", "mlp.down_proj.weight",
                         "self_attn.o_proj.weight"):
                assert torch.equal(layer.get_parameter(name), stored[p + name]), p + name
            q = stored[p + "self_attn.q_proj.weight"]
            assert torch.equal(layer.self_attn.qkv_proj.weight[: q.shape[0]], q)
            assert (layer.shared_head.head is not None) == (k == 1)
        assert torch.equal(draft.model.layers[1].shared_head.head.weight,
                           stored["model.layers.1.shared_head.head.weight"])
        h = torch.randn(2, engine.arch.hidden_size)
        target = engine.runner.model
        assert torch.equal(draft.module_logits(0, h), target.compute_logits(draft.model.layers[0].shared_head.norm(h)))


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_module_computes_the_documented_formula(spec_models, mtp_head, target_cfg):
    """One token with no context (attention over a single entry returns its value, so no rotary is
    needed): h = block(eh_proj(cat[enorm(embed(x)), hnorm(h_prev)])), logits = head(shared_head.norm(h)),
    written out from the checkpoint tensors."""
    w = load_file(os.path.join(mtp_head, "model.safetensors"))
    tw = load_file(os.path.join(spec_models["target"], "model.safetensors"))
    eps = target_cfg["rms_norm_eps"]
    heads, kv_heads = target_cfg["num_attention_heads"], target_cfg["num_key_value_heads"]
    hd = target_cfg["hidden_size"] // heads
    with mtp_engine(spec_models["target"], mtp_head) as engine:
        draft = engine.runner.spec.drafter.model
        backend = TorchAttentionBackend()
        for k in range(NUM_MODULES):
            p = f"model.layers.{k}."
            token, h_prev = torch.tensor([17]), torch.randn(1, target_cfg["hidden_size"])
            e = tw["model.embed_tokens.weight"][token]
            x = torch.cat([_rms(e, w[p + "enorm.weight"], eps), _rms(h_prev, w[p + "hnorm.weight"], eps)], -1)
            x = x @ w[p + "eh_proj.weight"].T
            v = (_rms(x, w[p + "input_layernorm.weight"], eps) @ w[p + "self_attn.v_proj.weight"].T).view(kv_heads, hd)
            x = x + v.repeat_interleave(heads // kv_heads, 0).reshape(1, -1) @ w[p + "self_attn.o_proj.weight"].T
            y = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            act = F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
            x = x + act @ w[p + "mlp.down_proj.weight"].T
            head = w.get(p + "shared_head.head.weight", tw["lm_head.weight"])
            want = _rms(x, w[p + "shared_head.norm.weight"], eps) @ head.T

            caches = [torch.zeros(1, kv_heads, hd) for _ in range(NUM_MODULES)]
            ctx = StepContext(backend, backend.plan(AttentionBatch([1], [[0]], [0]), torch.device("cpu")), caches,
                              [torch.zeros(1, kv_heads, hd) for _ in range(NUM_MODULES)])
            got = draft.forward_module(k, token, torch.tensor([5]), h_prev, ctx)
            torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(draft.module_logits(k, got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["model.layers.1.eh_proj.weight", "model.layers.2.self_attn.k_proj.weight",
                                  "model.layers.0.shared_head.norm.weight", "model.layers.0.input_layernorm.weight",
                                  "model.layers.2.hnorm.weight"])
def test_missing_tensor_is_named(spec_models, target_cfg, tmp_path, name):
    write_mtp_head(str(tmp_path), target_cfg, NUM_MODULES, drop=[name])
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        mtp_engine(spec_models["target"], str(tmp_path))


@pytest.mark.parametrize("name", ["model.layers.3.enorm.weight", "mtp.surprise.weight"])
def test_extra_tensor_is_named(spec_models, target_cfg, tmp_path, name):
    write_mtp_head(str(tmp_path), target_cfg, NUM_MODULES, extra={name: torch.ones(target_cfg["hidden_size"])})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        mtp_engine(spec_models["target"], str(tmp_path))


def test_config_needs_num_nextn_predict_layers(spec_models, target_cfg, tmp_path):
    write_mtp_head(str(tmp_path), target_cfg, NUM_MODULES)
    cfg = json.load(open(tmp_path / "config.json"))
    del cfg["num_nextn_predict_layers"]
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        mtp_engine(spec_models["target"], str(tmp_path))


def test_more_steps_than_modules_is_refused(spec_models, mtp_head):
    with pytest.raises(ValueError, match=r"speculative_num_steps=4 needs 4 MTP modules.*has 3"):
        mtp_engine(spec_models["target"], mtp_head, steps=4)


def test_tree_shapes_are_refused(spec_models, mtp_head):
    with pytest.raises(ValueError, match="speculative_eagle_topk=1"):
        Engine(spec_models["target"], speculative_algorithm="MTP", speculative_draft_model_path=mtp_head,
               **TREE, **ENGINE)


# ---- drafts against a from-scratch reference -------------------------------------------------------
def _run_dense(model_fn, ids, positions, hidden, kv_lists, num_layers, kv_heads, hd):
    """Runs `model_fn` over one sequence with a fresh dense cache; kv_lists: the KV slots each query
    row sees (one row per query: any subset of slots)."""
    n = len(ids)
    backend = TorchAttentionBackend()
    batch = AttentionBatch([1] * n, kv_lists, list(range(n)))
    size = max(max(s) for s in kv_lists) + 1
    ctx = StepContext(backend, backend.plan(batch, torch.device("cpu")),
                      [torch.zeros(size, kv_heads, hd) for _ in range(num_layers)],
                      [torch.zeros(size, kv_heads, hd) for _ in range(num_layers)])
    return model_fn(torch.tensor(ids), torch.tensor(positions), hidden, ctx)


def _check_drafts(engine, tokens: list[int], m: int, drafts: list[int]) -> None:
    """Recomputes, from x[0..m] alone, every module's real outputs and each draft step (module k at
    position m-1 seeing its real prefix [0, m-1-k] plus its own entry), feeding the drafter's own
    earlier drafts, and checks each draft is the reference's argmax."""
    target, draft = engine.runner.model, engine.runner.spec.drafter.model
    arch = engine.arch
    kv_heads, hd = arch.num_kv_heads, arch.head_dim
    n_mod = draft.num_modules
    # Target hidden states h_t for t < m; each position in its own row, seeing [0, t].
    causal = [list(range(t + 1)) for t in range(m)]
    prev, _ = _run_dense(lambda i, p, h, c: target(i, p, c), tokens[:m], list(range(m)), None, causal,
                         arch.num_layers, kv_heads, hd)
    outs = []  # outs[k][t]: module k's real output at position t (t <= m-1-k)
    for k in range(len(drafts)):
        count = m - k
        if count <= 0:
            outs.append(None)
            continue
        ids = tokens[k + 1: k + 1 + count]  # x[t+k+1]
        fn = lambda i, p, h, c, k=k: draft.forward_module(k, i, p, h, c)  # noqa: E731
        prev = _run_dense(fn, ids, list(range(count)), prev[:count], causal[:count], n_mod, kv_heads, hd)
        outs.append(prev)
    hidden = outs[0][m - 1: m]
    for k, d in enumerate(drafts):
        if k > 0:
            real = list(range(max(m - k, 0)))
            fn = lambda i, p, h, c, k=k: draft.forward_module(k, i, p, h, c)  # noqa: E731
            # Real prefix recomputed in the same dense cache, then the scratch query at position m-1.
            ids = tokens[k + 1: k + 1 + len(real)] + [drafts[k - 1]]
            hin = torch.cat([outs[k - 1][: len(real)], hidden]) if real else hidden
            rows = [list(range(t + 1)) for t in real] + [real + [len(real)]]
            hidden = _run_dense(fn, ids, real + [m - 1], hin, rows, n_mod, kv_heads, hd)[-1:]
        logits = draft.module_logits(k, hidden)[0]
        assert logits[d] >= logits.max() - 1e-3, f"draft step {k + 1} at m={m}: {d} vs {int(logits.argmax())}"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_drafts_match_from_scratch_reference(spec_models, mtp_head, overlap):
    """Batches mix prefill chunks (a 64-token budget splits the long prompts) and verify steps, and
    include prompts shorter than the modules' lag."""
    ids = prompts(10, seed=9)[:9]
    with mtp_engine(spec_models["target"], mtp_head, disable_overlap_schedule=not overlap,
                    max_running_requests=4) as engine:
        drafter, pool = engine.runner.spec.drafter, engine.runner.spec.pool
        seen: dict[str, list[list[int]]] = {}
        draft_tree = drafter.draft_tree

        def spy(slots, *args):
            tree = draft_tree(slots, *args)
            owner = {s: r for r, s in pool.slot_of.items()}
            for s, row in zip(slots.tolist(), tree.tokens.tolist()):
                seen.setdefault(owner[s], []).append(row)
            return tree

        drafter.draft_tree = spy
        rids = [engine.add_request(p, greedy(12)) for p in ids]
        done = {}
        while engine.has_unfinished():
            for out in engine.step().finished:
                done[out.request_id] = out
        for rid, prompt in zip(rids, ids):
            out = done[rid]
            tokens = prompt + out.token_ids
            m = len(prompt)
            for accept, tree in zip(out.spec_accept_lengths, seen[rid]):
                assert tree[0] == tokens[m]  # the root is the newest verified token
                _check_drafts(engine, tokens, m, tree[1:])
                m += accept


# ---- end to end ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_greedy_speculative_equals_plain(spec_models, mtp_head, reference, overlap):
    with mtp_engine(spec_models["target"], mtp_head, disable_overlap_schedule=not overlap) as engine:
        for batch in (1, 3, 16):
            engine.scheduler.config = engine.scheduler.config.__class__(
                engine.max_model_len, batch, engine.scheduler.config.max_num_batched_tokens)
            outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
            for i, (out, want) in enumerate(zip(outs, reference)):
                assert out.token_ids == want, f"batch {batch}: prompt {i} differs"
                assert sum(out.spec_accept_lengths) >= NEW_TOKENS - 1
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


@pytest.mark.parametrize("plan", [True, False], ids=["plan_stream", "one_stream"])
def test_pipeline_passes_the_stream_checker(spec_models, mtp_head, reference, monkeypatch, plan):
    """The overlapped pipeline with MTP drafting, under the stream-order checker and a recording
    device module: no unordered cross-stream access, no blanket waits, same greedy tokens."""
    from tests.speculative.test_streams import RecordingDeviceModule

    monkeypatch.setenv("TANDEM_STREAM_CHECK", "1")
    module = RecordingDeviceModule()
    with mtp_engine(spec_models["target"], mtp_head, max_running_requests=16, disable_plan_stream=not plan,
                    _runner_hooks={"device_module": module}) as engine:
        outs = engine.generate(input_ids=PROMPTS[:16], sampling_params=greedy())
        assert [o.token_ids for o in outs] == reference[:16]
    kinds = {entry[0] for entry in module.log}
    assert "wait_stream" not in kinds and "device_synchronize" not in kinds


def test_fewer_steps_than_modules(spec_models, mtp_head, reference):
    with mtp_engine(spec_models["target"], mtp_head, steps=2) as engine:
        assert len(engine.runner.spec.drafter.kv_cache.k) == 2  # the unused module gets no KV
        outs = engine.generate(input_ids=PROMPTS[:12], sampling_params=greedy())
        assert [o.token_ids for o in outs] == reference[:12]


@pytest.fixture(scope="module")
def copy_pair(spec_models, target_cfg, tmp_path_factory):
    """A target whose layers add nothing (o_proj and down_proj zero), so its greedy next token is a
    function of the current token alone: x[t+1] = f(x[t]) = argmax lm_head(norm(embed(x[t]))). An MTP
    head whose modules compute exactly that from their input token (eh_proj = [I, 0], identity block,
    shared_head.norm = the target's final norm, the target's lm_head): module k fed d_k drafts
    f(d_k), which is the target's own continuation, so every draft is accepted if (and only if) each
    module gets the right token."""
    root = tmp_path_factory.mktemp("mtp_copy")
    target = str(root / "target")
    shutil.copytree(spec_models["target"], target)
    weights = load_file(os.path.join(target, "model.safetensors"))
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, os.path.join(target, "model.safetensors"))
    h = target_cfg["hidden_size"]
    overrides = {}
    for k in range(NUM_MODULES):
        p = f"model.layers.{k}."
        overrides.update({p + "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
                          p + "enorm.weight": torch.ones(h),
                          p + "self_attn.o_proj.weight": torch.zeros(h, h),
                          p + "mlp.down_proj.weight": torch.zeros(h, target_cfg["intermediate_size"]),
                          p + "shared_head.norm.weight": weights["model.norm.weight"].clone()})
    head = str(root / "mtp")
    write_mtp_head(head, target_cfg, NUM_MODULES, seed=8, overrides=overrides)
    return target, head


@pytest.mark.parametrize("steps", [3, 2])
def test_always_right_head_is_always_accepted(copy_pair, steps):
    target, head = copy_pair
    ids = PROMPTS[:12]
    with Engine(target, **ENGINE) as plain:
        want = [o.token_ids for o in plain.generate(input_ids=ids, sampling_params=greedy())]
    with mtp_engine(target, head, steps=steps) as engine:
        outs = engine.generate(input_ids=ids, sampling_params=greedy())
        assert [o.token_ids for o in outs] == want
        for o in outs:
            assert o.spec_accept_lengths == [steps + 1] * len(o.spec_accept_lengths)
        assert engine.runner.spec.stats.mean_accept_length == steps + 1


def test_preemption_recomputes_module_state(spec_models, mtp_head, reference):
    """A KV pool too small for all requests forces retraction mid-speculation; the recomputed
    prefill rebuilds every module's lagging state and the output is unchanged."""
    with mtp_engine(spec_models["target"], mtp_head, max_total_tokens=140) as engine:
        preempted = instrument_preemptions(engine)
        outs = engine.generate(input_ids=PROMPTS[:10], sampling_params=greedy())
        assert preempted, "the pool was meant to force preemption"
        assert [o.token_ids for o in outs] == reference[:10]
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


def test_abort_mid_run_frees_pages(spec_models, mtp_head):
    with mtp_engine(spec_models["target"], mtp_head) as engine:
        total = engine.scheduler.allocator.num_total
        rids = [engine.add_request(p, greedy(40)) for p in prompts(6, seed=13)]
        for _ in range(4):
            engine.step()
        assert engine.scheduler.allocator.num_free < total
        for rid in rids[::2]:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        engine.step()  # lets the runner drop the state of the finished requests
        assert engine.scheduler.allocator.num_free + engine.scheduler.allocator.num_cached == total
        assert not engine.runner.spec.pool.slot_of
        assert not engine.runner.spec.ready
