"""Grammar matchers and masks (structured/matchers.py) and the sampler's grammar stage.

- Tree masks against a slow reference: for every node, a fresh matcher fed the node's whole path from
  the root (no rollback), versus one depth-first walk with rollbacks.
- Bitmask unpacking against a bit-by-bit loop.
- Recompute after preemption: the re-fed outputs rebuild the matcher's state.
- The masked distribution: logits_to_probs and the Gumbel race with a mask, against the reference
  distribution of tests/unit/test_sampler.py restricted to the allowed tokens and renormalised
  (chi-square), and no forbidden token ever drawn.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.demo import byte_level_tokenizer
from tandem.layers.sampler import SamplingFeatures, choose_tokens, logits_to_probs
from tandem.request import SamplingParams
from tandem.scheduler.outputs import ScheduledChunk
from tandem.structured.grammar import GrammarCompiler, GrammarError, GrammarSpec, spec_of
from tandem.structured.matchers import ALL_ALLOWED, GrammarRows, allowed_from_bitmask, is_allowed
from tests.unit.test_sampler import chi2_999, chi_square, metadata, ref_probs

TOKENIZER = byte_level_tokenizer()
VOCAB = len(TOKENIZER)
EOS = TOKENIZER.eos_token_id
JSON_SPEC = GrammarSpec("json_schema", '{"type":"object","properties":{"a":{"type":"integer"},'
                                       '"b":{"enum":["x","yy"]}},"required":["a"],"additionalProperties":false}')


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER, VOCAB, {EOS})


def byte_token(ch: str) -> int:
    return TOKENIZER.convert_tokens_to_ids(TOKENIZER.tokenize(ch))[0]


def random_tree(rng: random.Random, n: int, prefix: list[int], alphabet: list[int]):
    """A random tree of n nodes (parents before children) whose tokens mostly continue a valid text."""
    parents, tokens = [-1], [0]
    for c in range(1, n):
        p = rng.randrange(c)
        depth = 0
        q = p
        while q > 0:
            q, depth = parents[q], depth + 1
        # Often the next token of the valid text at that depth, else a random one (often forbidden).
        want = prefix[depth] if depth < len(prefix) and rng.random() < 0.7 else rng.choice(alphabet)
        parents.append(p)
        tokens.append(want)
    return tokens, parents


def path_of(parents: list[int], node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_masks_match_a_fresh_matcher_per_node(compiler):
    rng = random.Random(0)
    text = '{"a": -120, "b": "yy"}'
    valid = [byte_token(ch) for ch in text]
    alphabet = sorted(set(valid)) + [byte_token(ch) for ch in 'z]9 "']
    rows = GrammarRows(compiler)
    n_checked = 0
    for trial in range(20):
        consumed = rng.randrange(0, 8)  # the request has already produced this much of the text
        rid = f"r{trial}"
        params = SamplingParams(json_schema=JSON_SPEC.source)
        rows.admit_chunk(ScheduledChunk(rid, (5, 6), 0, (), 2, params, True, request_len=2), iteration=0)
        rows.advance(0, {rid: valid[:consumed]})
        tokens, parents = random_tree(rng, 9, valid[consumed:], alphabet)
        got = rows.tree_masks([rid], torch.tensor([tokens]), torch.tensor([parents]))
        for node in range(9):
            ref = compiler.matcher(JSON_SPEC)
            ok = all(ref.accept_token(t) for t in valid[:consumed])
            assert ok
            reachable = True
            for c in path_of(parents, node):
                if ref.is_terminated() or not ref.accept_token(tokens[c]):
                    reachable = False
                    break
            want = torch.full((1, rows.words), ALL_ALLOWED, dtype=torch.int32)
            if reachable and not ref.is_terminated():
                ref.fill_next_token_bitmask(want, 0)
                n_checked += 1
            assert torch.equal(got[node], want[0]), f"trial {trial}, node {node}"
        rows.drop([rid])
    assert n_checked > 40  # most trees have several reachable nodes


def test_bitmask_unpacking_matches_a_bit_loop():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    allowed = allowed_from_bitmask(bitmask, 150)
    for r in range(3):
        for t in range(150):
            assert bool(allowed[r, t]) == is_allowed(bitmask[r], t) == bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)


def test_recompute_rebuilds_the_matcher_from_re_fed_outputs(compiler):
    """Outputs re-fed by a recompute's chunks advance a new matcher; a stale step's tokens (launched before
    the recompute) are ignored; decode chunks never re-feed what the matcher has seen."""
    params = SamplingParams(json_schema=JSON_SPEC.source)
    out = [byte_token(ch) for ch in '{"a": 1']
    prompt = (7, 8, 9)
    rows = GrammarRows(compiler)
    rows.admit_chunk(ScheduledChunk("r", prompt, 0, (), 3, params, True, request_len=3), iteration=1)
    rows.advance(1, {"r": out[:1]})
    rows.advance(2, {"r": out[1:5]})
    before = rows.root_masks(["r"])
    # Preempted; recomputed at iteration 5 in two chunks (prompt + 4 outputs), then a stale result of 4.
    seq = prompt + tuple(out[:5])
    rows.admit_chunk(ScheduledChunk("r", seq[:4], 0, (), 3, params, False, request_len=len(seq)), iteration=5)
    rows.advance(4, {"r": [byte_token("}")]})  # launched before the recompute: not this matcher's
    rows.admit_chunk(ScheduledChunk("r", seq[4:], 4, (), 3, params, True, request_len=len(seq)), iteration=6)
    assert torch.equal(rows.root_masks(["r"]), before)
    # A decode chunk of the last output does not advance it again.
    rows.admit_chunk(ScheduledChunk("r", (out[4],), len(seq), (), 3, params, True, request_len=len(seq) + 1),
                     iteration=7)
    assert torch.equal(rows.root_masks(["r"]), before)
    rows.advance(7, {"r": out[5:]})  # ' 1'
    assert is_allowed(rows.root_masks(["r"])[0], byte_token("}"))


def test_unconstrained_and_finished_rows_allow_everything(compiler):
    rows = GrammarRows(compiler)
    params = SamplingParams(regex="ab")
    rows.admit_chunk(ScheduledChunk("r", (5,), 0, (), 1, params, True, request_len=1), iteration=0)
    rows.advance(0, {"r": [byte_token("a"), byte_token("b"), EOS]})
    masks = rows.root_masks(["r", "free"])
    assert (masks == ALL_ALLOWED).all()


def test_spec_of_and_compile_errors(compiler):
    assert spec_of(SamplingParams(json_schema={"b": 1, "a": 2})) == spec_of(SamplingParams(json_schema={"a": 2, "b": 1}))
    assert spec_of(SamplingParams()) is None
    with pytest.raises(GrammarError, match="regex: cannot compile"):
        compiler.compile(GrammarSpec("regex", "(unclosed"))
    assert compiler.compile(JSON_SPEC) is compiler.compile(JSON_SPEC)  # cached


def test_the_grammar_cache_is_bounded():
    small = GrammarCompiler(TOKENIZER, VOCAB, {EOS}, cache_size=3)
    first = small.compile(GrammarSpec("regex", "a0"))
    for i in range(1, 6):
        small.compile(GrammarSpec("regex", f"a{i}"))
        small.compile(GrammarSpec("regex", "a0"))  # kept: recently used
    assert len(small._cache) == 3 and small.compile(GrammarSpec("regex", "a0")) is first
    assert GrammarSpec("regex", "a1") not in small._cache


# ---------------------------------------------------------------------------
# The sampler's grammar stage

def random_allowed(gen, rows: int, vocab: int) -> torch.Tensor:
    allowed = torch.rand(rows, vocab, generator=gen) < 0.4
    allowed[:, 0] = True  # at least one token per row
    return allowed


def test_masked_distribution_is_the_reference_restricted_to_allowed_tokens():
    gen = torch.Generator().manual_seed(1)
    vocab = 24
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
              SamplingParams(temperature=1.3, top_k=4), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=0.0)]
    logits = torch.randn(len(params), vocab, generator=gen) * 2
    allowed = random_allowed(gen, len(params), vocab)
    meta = metadata(params)
    meta.allowed = allowed
    got = logits_to_probs(logits, meta, SamplingFeatures(sampled=True, top_k=True, constrained=True))
    for r, p in enumerate(params):
        masked = [v if allowed[r, t] else float("-inf") for t, v in enumerate(logits[r].tolist())]
        want, _ = ref_probs(masked, p)
        assert torch.allclose(got[r].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5), p


def test_draws_follow_the_masked_distribution_and_never_a_forbidden_token():
    """Many draws of one row (each at its own position: independent noise), chi-square against the
    masked reference; greedy rows take the best allowed token."""
    gen = torch.Generator().manual_seed(2)
    vocab, draws = 16, 20000
    logits = torch.randn(1, vocab, generator=gen) * 1.5
    allowed = random_allowed(gen, 1, vocab)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    meta = metadata([p] * draws, positions=list(range(draws)), seeds=[3] * draws)
    meta.allowed = allowed.expand(draws, -1)
    tokens = choose_tokens(logits.expand(draws, -1), meta, SamplingFeatures(sampled=True, constrained=True))
    assert allowed[0, tokens].all()
    masked = [v if allowed[0, t] else float("-inf") for t, v in enumerate(logits[0].tolist())]
    target, _ = ref_probs(masked, p)
    stat, dof = chi_square(tokens, torch.tensor(target))
    assert stat < chi2_999(dof), (stat, dof)
    greedy = metadata([SamplingParams(temperature=0.0)])
    greedy.allowed = allowed
    best = max((v, t) for t, v in enumerate(masked))[1]
    assert choose_tokens(logits, greedy, SamplingFeatures(constrained=True)).item() == best
