"""A varied instruction set composed here, for training a draft head on a chat model's own answers.

Four kinds of prompt, built from templates over the Python standard library (module, function and
class names, signatures, docstrings and short function bodies, read with `ast`, nothing imported) and
over general topics written below:
    chat     questions, through the chat template
    explain  "explain this code / these two functions / this idea", through the chat template
    list     lists, tables, JSON, numbered steps, rewrites: format-following tasks, through the template
    code     raw code completion: a function's signature and docstring, a class header, an import line

Held out, never seen in training: every prompt built from a held-out module or topic (a fixed hash
of its name picks about one in six) or from a held-out template (the last of each kind's list), so
a held-out prompt differs from every training prompt in its subject and often in its phrasing.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
from dataclasses import asdict, dataclass

from tandem.train.stdlib_corpus import EXCLUDED_DIRS, default_stdlib_dir

KINDS = ("chat", "explain", "list", "code")
HELDOUT_SHARE = 6  # one subject in this many is held out


@dataclass(frozen=True)
class Prompt:
    kind: str  # one of KINDS
    text: str  # the user message (chat=True) or the raw text to continue
    chat: bool  # through the model's chat template
    subject: str  # the module or topic it was built from
    template: int  # index in its kind's template list

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Function:
    module: str
    name: str
    args: str
    doc: str  # first line of the docstring
    source: str  # the whole definition, when short


@dataclass
class Module:
    name: str
    doc: str
    functions: list[Function]
    classes: list[tuple[str, str]]  # (name, first docstring line)


TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "the printing press",
    "volcanoes", "the immune system", "climate change", "the Roman Empire", "electric cars", "honey bees",
    "the moon landing", "plate tectonics", "vaccines", "the Internet", "coral reefs", "the Great Wall of China",
    "solar panels", "the human heart", "rainbows", "the Industrial Revolution", "dinosaurs", "tea",
    "the stock market", "recycling", "earthquakes", "the Renaissance", "sleep", "bread baking", "chess",
    "the piano", "glaciers", "democracy", "the speed of light", "gravity", "the Olympic Games", "coffee",
    "penguins", "the Silk Road", "antibiotics", "wind energy", "the pyramids of Egypt", "origami",
    "jazz music", "the metric system", "bicycles", "the ocean tides", "friendship", "public libraries",
    "the seasons", "magnets", "the Amazon rainforest", "languages", "weather forecasts", "gardening",
    "money", "the solar system", "running", "museums", "compost", "maps", "trains", "bridges", "clocks",
]

TASKS = [
    "make a cup of tea", "plant a tree", "learn a new language", "prepare for a job interview",
    "write a good email", "start running", "organize a small party", "save money each month",
    "clean a laptop keyboard", "study for an exam", "set up a Python virtual environment",
    "debug a failing test", "review a pull request", "back up important files", "cook rice",
    "write a short story", "choose a good password", "read a research paper", "pack for a trip",
    "fix a flat bicycle tire", "plan a weekly meal menu", "make a budget spreadsheet",
]

# Each kind's templates; the last one of each list is held out. Fields: {module} {mdoc} {func} {args}
# {fdoc} {f2} {f3} {cls} {cdoc} {source} {topic} {task} {words}.
TEMPLATES = {
    "chat": [
        ("module", "What is the `{module}` module in Python used for?"),
        ("func", "How do I use `{module}.{func}()`? Show a short example."),
        ("func", "What does `{module}.{func}` return, and when would I call it?"),
        ("class", "When should I use the `{cls}` class from `{module}`?"),
        ("topic", "What is {topic}?"),
        ("topic", "Why is {topic} important?"),
        ("task", "How do I {task}?"),
        ("topic", "Tell me something surprising about {topic}."),
        ("func", "I want to call `{module}.{func}({args})`. What should I pass to it?"),
    ],
    "explain": [
        ("source", "Explain what this Python function does:\n\n```python\n{source}\n```"),
        ("pair", "Explain the difference between `{module}.{func}` and `{module}.{f2}`."),
        ("module", "Explain in simple words what this means: \"{mdoc}\""),
        ("topic", "Explain how {topic} works."),
        ("topic", "Explain {topic} to a ten-year-old."),
        ("func", "Explain this docstring of `{module}.{func}`: \"{fdoc}\""),
        ("source", "Walk me through this code line by line:\n\n```python\n{source}\n```"),
    ],
    "list": [
        ("module", "List five things you can do with the `{module}` module."),
        ("triple", "Make a markdown table with the columns Function and Purpose for `{module}.{func}`, "
                   "`{module}.{f2}` and `{module}.{f3}`."),
        ("func", "Give a JSON object with the keys \"name\", \"module\" and \"purpose\" that describes "
                 "`{module}.{func}`."),
        ("task", "Write the steps to {task} as a numbered list."),
        ("topic", "Give me three facts about {topic} as a bulleted list."),
        ("triple", "Sort these names alphabetically and number them: {words}."),
        ("func", "Rewrite this sentence as a short title: \"{fdoc}\""),
        ("topic", "Write a list of five questions a student might ask about {topic}."),
    ],
    "code": [
        ("source_head", "{head}"),
        ("module", "# {mdoc}\nimport {module}\n\n\ndef main():\n"),
        ("class", "import {module}\n\n\nclass {cls}Helper:\n    \"\"\"A small helper around {module}.{cls}.\"\"\"\n\n"
                  "    def __init__(self"),
        ("func", "import {module}\n\n\ndef example_{func}():\n    \"\"\"Show how {module}.{func} is used.\"\"\"\n"),
        ("source_head", "# from the {module} module\n{head}"),
    ],
}


def is_heldout(subject: str) -> bool:
    return int(hashlib.sha256(subject.encode()).hexdigest(), 16) % HELDOUT_SHARE == 0


def read_stdlib_modules(stdlib_dir: str | None = None) -> list[Module]:
    """Top-level public modules and packages (`__init__.py`) of the standard library, parsed."""
    root = stdlib_dir or default_stdlib_dir()
    entries = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(("_", ".")) or name in EXCLUDED_DIRS or name in ("idlelib", "turtledemo", "lib2to3"):
            continue
        if name.endswith(".py"):
            entries.append((name[:-3], path))
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            entries.append((name, os.path.join(path, "__init__.py")))
    modules = []
    for name, path in entries:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        funcs, classes = [], []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = _first_line(ast.get_docstring(node))
                if doc:
                    source = ast.get_source_segment(text, node) or ""
                    funcs.append(Function(name, node.name, ast.unparse(node.args), doc,
                                          source if 3 <= source.count("\n") + 1 <= 16 else ""))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                doc = _first_line(ast.get_docstring(node))
                if doc:
                    classes.append((node.name, doc))
        mdoc = _first_line(ast.get_docstring(tree))
        if mdoc and (funcs or classes):
            modules.append(Module(name, mdoc, funcs, classes))
    return modules


def _first_line(doc: str | None) -> str:
    if not doc:
        return ""
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return " ".join(line.split())[:200]


def build_prompts(modules: list[Module], per_module: int = 3, seed: int = 0) -> list[Prompt]:
    """Every prompt the templates make over the modules (up to `per_module` functions or classes of each
    per template), topics and tasks, in a seeded order."""
    rng = random.Random(seed)
    out = []
    for kind, templates in TEMPLATES.items():
        for t_index, (slot, template) in enumerate(templates):
            for subject, fields in _fillings(slot, modules, rng, per_module):
                out.append(Prompt(kind, template.format(**fields), kind != "code", subject, t_index))
    out = list({p.text: p for p in out}.values())  # two fillings can give the same text: keep one
    rng.shuffle(out)
    return out


def _fillings(slot: str, modules: list[Module], rng: random.Random, per_module: int):
    """(subject, template fields) for every subject a template slot applies to."""
    if slot == "topic":
        for topic in TOPICS:
            yield topic, {"topic": topic}
        return
    if slot == "task":
        for task in TASKS:
            yield task, {"task": task}
        return
    for m in modules:
        base = {"module": m.name, "mdoc": m.doc}
        funcs = m.functions
        if slot == "module":
            yield m.name, base
        elif slot == "func":
            for f in rng.sample(funcs, min(per_module, len(funcs))):
                yield m.name, {**base, "func": f.name, "args": f.args, "fdoc": f.doc}
        elif slot == "class":
            for cls, cdoc in rng.sample(m.classes, min(per_module, len(m.classes))):
                yield m.name, {**base, "cls": cls, "cdoc": cdoc}
        elif slot in ("source", "source_head"):
            with_source = [f for f in funcs if f.source] if slot == "source" else funcs
            for f in rng.sample(with_source, min(per_module, len(with_source))):
                head = f"def {f.name}({f.args}):\n    \"\"\"{f.doc}\"\"\"\n"
                yield m.name, {**base, "source": f.source, "head": head}
        elif slot in ("pair", "triple"):
            need = 2 if slot == "pair" else 3
            for _ in range(min(per_module, len(funcs) // need)):
                picked = rng.sample(funcs, need)
                names = [f.name for f in picked]
                yield m.name, {**base, "func": names[0], "f2": names[1], "f3": names[-1],
                               "words": ", ".join(names + [m.name])}


def split(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts): held out by subject or by template (see the module doc)."""
    last = {kind: len(t) - 1 for kind, t in TEMPLATES.items()}
    held = [p for p in prompts if is_heldout(p.subject) or p.template == last[p.kind]]
    train = [p for p in prompts if not (is_heldout(p.subject) or p.template == last[p.kind])]
    return train, held


def write_prompts(path: str, prompts: list[Prompt]) -> None:
    import json

    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps(p.as_dict()) + "\n")


def read_prompts(path: str) -> list[Prompt]:
    import json

    with open(path) as f:
        return [Prompt(**json.loads(line)) for line in f if line.strip()]


def heldout_sample(held: list[Prompt], per_kind: int, seed: int = 0) -> list[Prompt]:
    """`per_kind` held-out prompts of each kind (seeded), for measuring acceptance."""
    rng = random.Random(seed)
    out = []
    for kind in KINDS:
        pool = [p for p in held if p.kind == kind]
        if len(pool) < per_kind:
            raise ValueError(f"only {len(pool)} held-out {kind} prompts (asked for {per_kind})")
        out += rng.sample(pool, per_kind)
    return out
