"""Typed messages survive the msgpack round trip."""

from tandem.engine import ipc
from tandem.request import SamplingParams, TokenLogprob


def test_round_trip():
    msgs = [
        ipc.AddRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.5, stop=["x"], seed=3,
                                                       logit_bias={7: 2.5, 9: -1.0}, min_tokens=2, prompt_logprobs=1)),
        ipc.AbortRequest(["r1", "r2"]),
        ipc.Shutdown(),
        ipc.CoreReady(pid=1, model_path="/m", max_model_len=64, vocab_size=10, page_size=4, num_pages=8,
                      speculative_algorithm=None),
        ipc.CoreOutputs(
            [ipc.TokenDelta("r1", [4, 5], [TokenLogprob(4, -0.5, [(4, -0.5), (7, -1.0)]), TokenLogprob(5, -0.1)],
                            "stop", 2, [None, TokenLogprob(2, -3.0, [(1, -0.2)])])],
            ipc.EngineStats(1, 2, 3, 8, ipc.SpecCounters(4, 12, 5, [3, 2, 0], 2.25, [1, 0, 3], [0.5, 0.4, 0.3], 2, 7))),
        ipc.RequestRejected("r3", "prompt is empty"),
        ipc.CoreFailed("boom"),
    ]
    for msg in msgs:
        back = ipc.decode(ipc.encode(msg))
        assert type(back) is type(msg)
        assert ipc._plain(back) == ipc._plain(msg)
    params = ipc.decode(ipc.encode(msgs[0])).sampling_params
    assert isinstance(params, SamplingParams) and params.stop == ["x"] and params.seed == 3
    assert params.logit_bias == {7: 2.5, 9: -1.0}  # integer map keys survive
    delta = ipc.decode(ipc.encode(msgs[4])).deltas[0]
    assert isinstance(delta.logprobs[0], TokenLogprob) and delta.logprobs[0].top[1][0] == 7
    assert delta.prompt_logprobs[0] is None and isinstance(delta.prompt_logprobs[1], TokenLogprob)
