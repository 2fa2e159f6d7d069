"""`tandem bench --workload multi-turn` on the tiny preset: every turn of every conversation runs, and with
the prefix cache on a plain engine serves each later turn's prompt from the cache exactly up to the last
full page of the tokens the previous turn computed (its prompt and its answer but the answer's last
token, which is sampled and never fed); with the cache off nothing is served."""

from __future__ import annotations

import json

from tandem.bench.multi_turn import MultiTurnConfig, run_multi_turn

PAGE = 16  # the engine's default page size


def test_multi_turn_hits_are_the_previous_turns_full_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_RECORD_COMMIT", "abc1234")
    cfg = MultiTurnConfig(engine_kwargs={"device": "cpu", "dtype": "float32"}, preset="tiny-test", conversations=3,
                          turns=3, system_len=40, user_len=10, answer_len=12, spec="off", progress=False,
                          repeats=2, out=str(tmp_path / "mt.json"))
    result = run_multi_turn(cfg)
    on, off = result["runs"]["spec_off/cache_on"], result["runs"]["spec_off/cache_off"]
    for run in (on, off):
        assert sorted((r["conversation"], r["turn"]) for r in run["records"]) == [
            (c, t) for c in range(3) for t in (1, 2, 3)]
        assert all(r["output_tokens"] == 12 for r in run["records"])
    assert all(r["cached_tokens"] == 0 for r in off["records"])
    for r in on["records"]:
        if r["turn"] >= 2:
            computed = r["prompt_tokens"] - cfg.user_len - 1  # the previous prompt and answer, less its last token
            assert r["cached_tokens"] == computed // PAGE * PAGE, r
    assert result["summary"]["spec_off/cache_on"]["hit_rate"] > 0.5
    record = json.load(open(tmp_path / "mt.json"))
    assert record["workload"] == "multi-turn"
    assert record["commit"] == "abc1234" and record["device"] == "cpu"  # named by TANDEM_RECORD_COMMIT
    # Two runs of each engine, the cache's turn at going first alternating; each run's hits are the same.
    assert result["engine_order"] == ["spec_off/cache_on", "spec_off/cache_off", "spec_off/cache_off",
                                      "spec_off/cache_on"]
    again = on["later_repeats"][0]["records"]
    assert [r["cached_tokens"] for r in again] == [r["cached_tokens"] for r in on["records"]]
    # A cached turn's first token comes in its first or second step (the overlap returns a step late).
    assert all(1 <= r["ttft_steps"] <= 2 for r in on["records"] if r["turn"] >= 2)
