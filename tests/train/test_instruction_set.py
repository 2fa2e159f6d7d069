"""The composed instruction set: prompts filled from the modules they name, and a held-out part that
shares no subject, template or text with the training part."""

import re
import textwrap

import pytest

from tandem.train import instruction_set as iset


@pytest.fixture(scope="module")
def prompts():
    return iset.build_prompts(iset.read_stdlib_modules(), per_module=3, seed=0)


def test_read_modules_by_hand(tmp_path):
    (tmp_path / "alpha.py").write_text(textwrap.dedent('''
        """Alpha: tools for
        counting things.

        More text."""

        def count(xs, start=0):
            """Count the items of xs.

            Long description."""
            return len(xs) + start

        def _private():
            """Hidden."""

        class Counter:
            """A counter."""
    '''))
    (tmp_path / "_hidden.py").write_text('"""Private module."""\ndef f():\n    """F."""\n')
    (tmp_path / "nodoc.py").write_text("def f():\n    return 1\n")
    modules = iset.read_stdlib_modules(str(tmp_path))
    assert [m.name for m in modules] == ["alpha"]
    (m,) = modules
    assert m.doc == "Alpha: tools for counting things."
    assert [(f.name, f.args, f.doc) for f in m.functions] == [("count", "xs, start=0", "Count the items of xs.")]
    assert m.functions[0].source.startswith("def count(xs, start=0):")
    assert m.classes == [("Counter", "A counter.")]
    made = iset.build_prompts(modules, per_module=3)
    assert any(p.text == "How do I use `alpha.count()`? Show a short example." for p in made)
    head = [p for p in made if p.kind == "code" and p.template == 0]
    assert head and head[0].text == 'def count(xs, start=0):\n    """Count the items of xs."""\n'
    assert not head[0].chat and all(p.chat for p in made if p.kind != "code")


def test_every_template_field_is_filled(prompts):
    fields = set(re.findall(r"\{(\w+)\}", " ".join(t for ts in iset.TEMPLATES.values() for _, t in ts)))
    for p in prompts:
        assert not any("{" + f + "}" in p.text for f in fields), p.text


def test_heldout_shares_no_subject_template_or_text_with_training(prompts):
    train, held = iset.split(prompts)
    last = {k: len(t) - 1 for k, t in iset.TEMPLATES.items()}
    assert not any(iset.is_heldout(p.subject) or p.template == last[p.kind] for p in train)
    assert not {p.text for p in train} & {p.text for p in held}
    for kind in iset.KINDS:
        assert sum(p.kind == kind for p in train) >= 500 and sum(p.kind == kind for p in held) >= 60, kind
    held_subjects = {p.subject for p in held if iset.is_heldout(p.subject)}
    assert len(held_subjects) >= 10  # whole modules and topics, not only templates


def test_heldout_sample(prompts):
    _, held = iset.split(prompts)
    sample = iset.heldout_sample(held, 60, seed=0)
    assert [sum(p.kind == k for p in sample) for k in iset.KINDS] == [60] * 4
    assert len({p.text for p in sample}) == 240 and all(p in held for p in sample)
    assert sample == iset.heldout_sample(held, 60, seed=0)  # seeded
    with pytest.raises(ValueError, match="held-out"):
        iset.heldout_sample(held, 10_000)


def test_prompts_round_trip_through_jsonl(prompts, tmp_path):
    path = str(tmp_path / "p.jsonl")
    iset.write_prompts(path, prompts[:50])
    assert iset.read_prompts(path) == prompts[:50]
