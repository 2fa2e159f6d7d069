"""bench/precision_equality.py's CPU check (`--quick`): the demo pair in float32, where speculation's tokens are
plain decoding's for greedy and seeded requests alike, so the record must say every request was equal."""

import importlib.util
import json
import os

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load_script():
    spec = importlib.util.spec_from_file_location("precision_equality",
                                                  os.path.join(REPO, "bench", "precision_equality.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_compare_counts_equal_requests_and_where_the_others_differ():
    compare = load_script().compare
    assert compare([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 0]]) == {
        "equal": 1, "total": 3, "first_divergence": [1, 2]}  # (a longer output differs where the shorter ends)
    assert compare([[5, 6]], [[0, 6]]) == {"equal": 0, "total": 1, "first_divergence": [0]}


def test_quick_run_records_float32_equality(tmp_path):
    script = load_script()
    out = tmp_path / "precision.json"
    assert script.main(["--quick", "--out", str(out)]) == 0
    record = json.load(open(out))
    assert record["dtype"] == "float32" and record["device"] == "cpu"
    configs = record["models"]["demo"]["configs"]
    assert set(configs) == {"fixed", "adaptive"}
    for name, c in configs.items():
        for kind in ("greedy", "seeded"):
            assert c[kind] == {"equal": 4, "total": 4, "first_divergence": []}, (name, kind, c[kind])
