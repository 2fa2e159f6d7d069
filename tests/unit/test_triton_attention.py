"""The triton attention backend against the torch reference on small random shapes.

Without a GPU the kernels run in triton's CPU interpreter (TRITON_INTERPRET=1, set here before the
kernels are imported); with one they run compiled on it. Shapes are small because the interpreter is slow.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "tandem.layers.attention.triton_kernels" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.2,<4')")

from tandem.layers.attention.base import AttentionBatch  # noqa: E402
from tandem.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tandem.layers.attention.triton_backend import TritonAttentionBackend, interpreting  # noqa: E402
from tandem.speculative import plan as spec_plan  # noqa: E402
from tandem.speculative.tree import ancestor_mask  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
if DEVICE.type == "cpu" and not interpreting():
    pytest.skip("the triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
NUM_SLOTS = 512


def make_cache(kv_heads, head_dim, dtype, gen):
    k = torch.randn(NUM_SLOTS, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(NUM_SLOTS, kv_heads, head_dim, generator=gen).to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


def make_qkv(n, heads, kv_heads, head_dim, dtype, gen):
    # q as a strided view of a wider projection output, as the model hands it over.
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)


def compare(metadata_fn, n, heads, kv_heads, head_dim, dtype, seed=0, num_kv_splits=None):
    """Runs both backends on identical inputs and caches; checks outputs and the written caches."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = make_cache(kv_heads, head_dim, dtype, gen)
    q, k, v = make_qkv(n, heads, kv_heads, head_dim, dtype, gen)
    ref_backend, tri_backend = TorchAttentionBackend(), TritonAttentionBackend(num_kv_splits)
    scale = head_dim ** -0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = ref_backend.forward(q, k, v, ref_k, ref_v, metadata_fn(ref_backend), scale)
    out = tri_backend.forward(q, k, v, k_cache, v_cache, metadata_fn(tri_backend), scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def random_batch(query_lens, prefix_lens, gen, custom=None):
    """Rows whose KV (cached prefix + new tokens) lives in distinct, scattered cache slots."""
    perm = torch.randperm(NUM_SLOTS, generator=gen).tolist()
    kv_slots, slot_mapping, used = [], [], 0
    for q_len, prefix in zip(query_lens, prefix_lens):
        slots = perm[used:used + prefix + q_len]
        used += prefix + q_len
        kv_slots.append(slots)
        slot_mapping += slots[prefix:]
    return AttentionBatch(list(query_lens), kv_slots, slot_mapping, custom)


def planned(batch):
    return lambda backend: backend.plan(batch, DEVICE)


# (query_lens, cached prefix lens): prefill chunks with and without a prefix, decodes, mixed.
BATCHES = {
    "prefill": ([7, 19], [0, 0]),
    "chunks_with_prefix": ([5, 12, 1], [9, 40, 0]),
    "decode": ([1, 1, 1, 1], [3, 70, 17, 0]),
    "mixed": ([9, 1, 1, 4, 1], [0, 33, 2, 11, 90]),
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 24), (4, 4, 64)],
                         ids=["gqa2_d16", "gqa3_d24", "mha_d64"])
def test_causal_batches_match_torch(name, heads, kv_heads, head_dim):
    q_lens, prefixes = BATCHES[name]
    batch = random_batch(q_lens, prefixes, torch.Generator().manual_seed(1))
    compare(planned(batch), sum(q_lens), heads, kv_heads, head_dim, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision(dtype):
    q_lens, prefixes = BATCHES["mixed"]
    batch = random_batch(q_lens, prefixes, torch.Generator().manual_seed(2))
    compare(planned(batch), sum(q_lens), 4, 1, 32, dtype)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_split_kv_matches_torch(name, splits):
    """Flash-decoding: the KV walk split across programs, partial softmaxes merged by a second kernel."""
    q_lens, prefixes = BATCHES[name]
    batch = random_batch(q_lens, prefixes, torch.Generator().manual_seed(3))
    compare(planned(batch), sum(q_lens), 4, 2, 16, torch.float32, num_kv_splits=splits)
    compare(planned(batch), sum(q_lens), 4, 2, 16, torch.bfloat16, num_kv_splits=splits)


def test_plan_builds_the_torch_index_tensors():
    q_lens, prefixes = BATCHES["mixed"]
    batch = random_batch(q_lens, prefixes, torch.Generator().manual_seed(4))
    ref, tri = TorchAttentionBackend().plan(batch, DEVICE), TritonAttentionBackend().plan(batch, DEVICE)
    assert tri.causal and tri.mask is None
    for name in ("slot_mapping", "query_index", "query_valid", "kv_slots"):
        assert torch.equal(getattr(tri, name), getattr(ref, name)), name
    assert tri.q_lens.tolist() == q_lens and tri.kv_lens.tolist() == [q + p for q, p in zip(q_lens, prefixes)]


def random_parents(num_rows, num_nodes, gen):
    parents = torch.full((num_rows, num_nodes), -1, dtype=torch.long)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (num_rows,), generator=gen)
    return parents


def test_custom_tree_masks_through_plan():
    """Verify trees passed as AttentionBatch.custom_masks, next to a causal row."""
    gen = torch.Generator().manual_seed(5)
    q_lens, prefixes = [6, 3, 5], [10, 0, 37]
    anc = ancestor_mask(random_parents(3, 6, gen))
    custom = []
    for r, (q_len, prefix) in enumerate(zip(q_lens, prefixes)):
        if r == 1:
            custom.append(None)
            continue
        mask = torch.zeros(q_len, prefix + q_len, dtype=torch.bool)
        mask[:, :prefix] = True
        mask[:, prefix:] = anc[r, :q_len, :q_len]
        custom.append(mask)
    batch = random_batch(q_lens, prefixes, gen, custom)
    compare(planned(batch), sum(q_lens), 4, 2, 24, torch.float32)
    compare(planned(batch), sum(q_lens), 8, 1, 16, torch.float32)  # group 8: two query blocks per row
    compare(planned(batch), sum(q_lens), 4, 2, 24, torch.bfloat16)


# ---- metadata built on the device by speculative/plan.py (uniform rows: query_valid None) ---------------
PAGE_SIZE = 4


def page_rows(num_rows, pages_per_row, gen):
    pages = torch.randperm(NUM_SLOTS // PAGE_SIZE, generator=gen)[:num_rows * pages_per_row]
    return pages.view(num_rows, pages_per_row).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_metadata(dtype):
    gen = torch.Generator().manual_seed(6)
    num_rows, num_nodes, kv_bound = 3, 8, 96
    rows = page_rows(num_rows, kv_bound // PAGE_SIZE, gen)
    seq_lens = torch.tensor([5, 60, 88], device=DEVICE)  # padded window: most of row 0 is masked
    vplan = spec_plan.plan_verify(rows, seq_lens, num_nodes, kv_bound, PAGE_SIZE)
    anc = ancestor_mask(random_parents(num_rows, num_nodes, gen)).to(DEVICE)
    compare(lambda _: spec_plan.verify_metadata(vplan, anc), num_rows * num_nodes, 4, 2, 16, dtype)


def test_extend_metadata():
    gen = torch.Generator().manual_seed(7)
    num_rows, num_queries, kv_bound = 3, 4, 72
    rows = page_rows(num_rows, kv_bound // PAGE_SIZE, gen)
    first_pos = torch.tensor([0, 30, 67], device=DEVICE)
    meta = spec_plan.extend_metadata(rows, first_pos, num_queries, kv_bound, PAGE_SIZE)
    compare(lambda _: meta, num_rows * num_queries, 6, 2, 24, torch.float32)


@pytest.mark.parametrize("splits", [None, 3])
def test_draft_step_metadata(splits):
    """Draft-tree rows: B*K single-query rows over the prefix plus scattered scratch slots of their path."""
    gen = torch.Generator().manual_seed(8)
    num_rows, topk, depth, kv_bound = 2, 3, 3, 48
    rows = page_rows(num_rows, (kv_bound + depth * topk) // PAGE_SIZE + 1, gen)
    base = torch.tensor([7, 40], device=DEVICE)
    paths = torch.randint(0, topk, (num_rows, topk, depth), generator=gen)
    # As in a real tree, frontier node k's own entry is slot k: no two rows store to one slot.
    paths[:, :, -1] = torch.arange(topk)
    paths = paths.to(DEVICE)
    meta, _ = spec_plan.draft_step_metadata(rows, base, paths, topk, kv_bound, PAGE_SIZE)
    compare(lambda _: meta, num_rows * topk, 4, 1, 16, torch.float32, num_kv_splits=splits)


@pytest.mark.parametrize("splits", [None, 3])
def test_chain_step_metadata(splits):
    """Chain drafting's shortcut: the same keys, stores, lengths and positions as the general
    draft-step metadata with topk 1 (so the same attention output), and triton agrees with torch."""
    gen = torch.Generator().manual_seed(9)
    num_rows, steps, kv_bound = 3, 4, 48
    rows = page_rows(num_rows, (kv_bound + steps) // PAGE_SIZE + 1, gen)
    base = torch.tensor([0, 7, 47], device=DEVICE)  # an empty prefix, a short one, a full window
    window = spec_plan.draft_window(rows, kv_bound + steps - 1, PAGE_SIZE)
    for depth in range(1, steps):
        meta, pos = spec_plan.chain_step_metadata(window, base, depth)
        paths = torch.zeros(num_rows, 1, depth, dtype=torch.long, device=DEVICE)
        general, general_pos = spec_plan.draft_step_metadata(rows, base, paths, 1, kv_bound, PAGE_SIZE)
        assert torch.equal(pos, general_pos) and torch.equal(meta.slot_mapping, general.slot_mapping)
        assert torch.equal(meta.kv_lens, general.kv_lens)
        gen_q = torch.Generator().manual_seed(depth)
        k_cache, v_cache = make_cache(1, 16, torch.float32, gen_q)
        q, k, v = make_qkv(num_rows, 4, 1, 16, torch.float32, gen_q)
        outs = [TorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), m, 0.25)
                for m in (meta, general)]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
        compare(lambda _: meta, num_rows, 4, 1, 16, torch.float32, seed=depth, num_kv_splits=splits)


# ---- whole engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.models.tiny_checkpoints import make_checkpoint

    path = str(tmp_path_factory.mktemp("triton_llama3"))
    make_checkpoint("llama3", path)
    return path


def test_engine_greedy_equals_torch_backend(tiny_llama):
    from tandem import Engine, SamplingParams
    from tests.models.tiny_checkpoints import prompts

    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    ids = prompts(4, seed=11)
    outputs = {}
    for backend in ("torch", "triton"):
        # chunked_prefill_size 8 splits the longer prompts into chunks that attend to a cached prefix.
        with Engine(tiny_llama, attention_backend=backend, device=DEVICE.type, dtype="float32", page_size=4,
                    max_total_tokens=512, chunked_prefill_size=8) as engine:
            assert type(engine.runner.backend).__name__.lower().startswith(backend)
            outputs[backend] = [o.token_ids for o in engine.generate(input_ids=ids, sampling_params=params)]
    assert outputs["triton"] == outputs["torch"]


def test_speculative_engine_greedy_equals_torch_backend(tiny_llama, tmp_path):
    from tests.speculative.test_adaptive import CyclingPolicy

    """Tree drafting and verification through speculative/plan.py's device-built metadata."""
    import json

    from tandem import Engine, SamplingParams
    from tests.models.tiny_checkpoints import prompts
    from tests.speculative.draft_checkpoints import write_eagle3_head

    head = str(tmp_path / "eagle3")
    write_eagle3_head(head, json.load(open(os.path.join(tiny_llama, "config.json"))), seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ids = prompts(3, seed=12)
    outputs = {}
    for backend in ("torch", "triton"):
        with Engine(tiny_llama, attention_backend=backend, device=DEVICE.type, dtype="float32", page_size=4,
                    max_total_tokens=1024, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                    speculative_eagle_topk=2, speculative_num_steps=3, speculative_num_draft_tokens=5) as engine:
            assert type(engine.runner.spec.drafter.backend).__name__.lower().startswith(backend)
            # Every draft shape in turn, depth 0 (the root alone, on plain decoding's metadata) included.
            engine.runner.spec.policy = CyclingPolicy(engine.runner.spec.policy)
            outputs[backend] = [o.token_ids for o in engine.generate(input_ids=ids, sampling_params=params)]
            assert engine.runner.spec.stats.num_drafts > 0 and engine.runner.spec.stats.steps_by_depth[0] > 0
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("name", list(BATCHES))
def test_a_paged_batch_builds_its_slots_from_the_page_tables(name):
    """`AttentionBatch.paged` (page tables and KV lengths; the slots are built on the device) against the
    torch backend on the same KV listed slot by slot here. Pages are scattered, and each table holds more
    pages than the row's KV needs (the scheduler's lookahead), which must not be read."""
    ps, gen = 4, torch.Generator().manual_seed(4)
    q_lens, prefixes = BATCHES[name]
    pages = torch.randperm(NUM_SLOTS // ps, generator=gen).tolist()
    tables, listed, slot_mapping, kv_lens = [], [], [], []
    for q_len, prefix in zip(q_lens, prefixes):
        kv_len = prefix + q_len
        table, pages = pages[:-(-kv_len // ps) + 2], pages[-(-kv_len // ps) + 2:]
        slots = [table[p // ps] * ps + p % ps for p in range(kv_len)]
        tables.append(table)
        listed.append(slots)
        kv_lens.append(kv_len)
        slot_mapping += slots[prefix:]
    paged = AttentionBatch.paged(list(q_lens), tables, kv_lens, slot_mapping, ps)
    explicit = AttentionBatch(list(q_lens), listed, slot_mapping)
    compare(lambda backend: backend.plan(explicit if isinstance(backend, TorchAttentionBackend) else paged, DEVICE),
            sum(q_lens), 4, 2, 16, torch.float32)
    assert paged.slot_lists() == listed  # what a backend without the device path reads
