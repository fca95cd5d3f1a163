"""The acceptance trace (`bench acceptance`) and its replay (`bench policy --trace`).

The trace says, for every output position, what a step starting there drafts and keeps; it is
recorded as fresh requests whose prompts end at that position. So it must agree with a request that
reaches the position by decoding, and the replay must walk it as the engine would.
"""
import json

import pytest
import torch

from specserve.bench.acceptance import output_of, positions
from specserve.bench.policy import CPU_DEMO, Trace, TraceRequest, serve
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.policy import SpeculationPolicy
from models import perturbed, tiny_llama

GAMMA = 3


def _steps_of_a_decoding_request(engine: SpeculativeEngine, prompt: list[int],
                                  tokens: int) -> list[tuple[int, int, int]]:
    """[(output position the step started at, drafts, kept)] of one request decoding alone (its
    prefill step, which drafts nothing, and its last, after which it is gone, left out)."""
    engine.add_request("r", prompt, SamplingParams(max_tokens=tokens, temperature=0.0))
    steps, before = [], (0, 0, 0)
    while engine.has_unfinished():
        seq = engine.sequence("r")
        start = len(seq.output) if seq is not None else 0
        outputs = engine.step()
        seq = engine.sequence("r")
        if seq is None:
            break
        m = seq.metrics
        now = (m.num_steps, m.num_draft_tokens, m.num_accepted_tokens)
        if now[0] > before[0] and start > 0:
            steps.append((start, now[1] - before[1], now[2] - before[2]))
        before = now
        assert all(o.request_id == "r" for o in outputs)
    return steps


def test_the_trace_agrees_with_a_request_that_decodes_to_each_position():
    target = tiny_llama(0, init_range=0.5)  # (a wide init: its greedy output does not settle on one token)
    draft = perturbed(target, 0.02, seed=1)  # right often, not always: runs of hits and misses
    prompt = [5, 17, 33, 2, 80, 41, 9, 60, 12, 7, 3, 90]
    plain = SpeculativeEngine(target, num_speculative_tokens=0)
    output = output_of(plain, prompt, 40)
    recorder = SpeculativeEngine(target, draft, num_speculative_tokens=GAMMA, adaptive=False)
    drafted, kept = positions(recorder, prompt, output, GAMMA, "t")
    assert len(drafted) == len(kept) == len(output) and drafted[0] == kept[0] == 0
    assert all(k <= d <= GAMMA for d, k in zip(drafted, kept))
    assert 0 < sum(kept) < GAMMA * (len(output) - 1)  # some drafts kept, some not: the check below means something
    decoding = SpeculativeEngine(target, draft, num_speculative_tokens=GAMMA, adaptive=False)
    steps = _steps_of_a_decoding_request(decoding, prompt, len(output))
    assert len(steps) >= 5
    for t, d, k in steps:
        assert (drafted[t], kept[t]) == (min(d, GAMMA), k), f"position {t}"
    assert not recorder.has_unfinished() and recorder.num_cached()["target"] == 0  # every request let go


def _walk(request: TraceRequest, gamma: int) -> tuple[int, int]:
    """(steps, tokens) of a request decoding alone at a fixed γ, its first token from the prefill."""
    t, steps, end = 1, 0, len(request.drafted)
    while t < end:
        t += min(request.accepted[t], gamma) + 1
        steps += 1
    return steps, end - 1


def test_the_replay_walks_each_request_of_the_trace_as_the_engine_would():
    code = TraceRequest((0, 3, 3, 3, 3, 2, 3, 3, 3, 3, 3, 1), (0, 3, 3, 2, 3, 2, 3, 3, 3, 3, 3, 1))
    chat = TraceRequest((0, 1, 0, 0, 2, 0, 1, 0, 0, 0), (0, 0, 0, 0, 2, 0, 1, 0, 0, 0))
    trace = Trace((code, chat), gamma=3)
    for gamma in (0, 1, 3):
        served = serve(SpeculationPolicy(gamma, adaptive=False), CPU_DEMO, batch=1, alpha=0.0, rounds=2, tokens=64,
                       trace=trace)
        walked = [_walk(r, gamma) for r in (code, chat)]
        assert (served.steps, served.tokens) == tuple(map(sum, zip(*walked))), f"γ {gamma}"
    # a request is cut at `tokens`
    served = serve(SpeculationPolicy(0, adaptive=False), CPU_DEMO, batch=1, alpha=0.0, rounds=2, tokens=5, trace=trace)
    assert served.tokens == 2 * 4


def test_a_trace_file_is_checked_and_bounds_the_replayed_gamma(tmp_path, capsys):
    from specserve.bench import policy as bench_policy

    good = tmp_path / "trace.json"
    request = {"drafted": [0, 2, 1, 2, 0], "accepted": [0, 2, 0, 1, 0]}
    good.write_text(json.dumps({"gamma": 2, "requests": [request] * 3}))
    out = tmp_path / "policy.json"
    assert bench_policy.main(["--fixture", "cpu-demo", "--trace", str(good), "--max-gamma", "2", "--batches", "1,2",
                              "--rounds", "2", "--seeds", "1", "--by-gamma", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["trace"] == str(good) and [c["alpha"] for c in report["cells"]] == [0.5, 0.5]
    assert all(c["fixed"]["0"]["tokens"] == 2 * c["batch"] * 4 for c in report["cells"])
    for cell in report["cells"]:  # the adaptive policy's steps by γ add up to its steps and tokens
        by_gamma = cell["adaptive"]["by_gamma"].values()
        assert sum(n for n, _, _ in by_gamma) == cell["adaptive"]["steps"]
        assert sum(made for _, _, made in by_gamma) == cell["adaptive"]["tokens"]
    assert "| γ chosen | steps | expected tokens a step | made |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        bench_policy.main(["--trace", str(good), "--max-gamma", "3"])
    assert exit_.value.code == 2 and "above the trace" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gamma": 2, "requests": [{"drafted": [0, 1], "accepted": [0, 2]}]}))
    with pytest.raises(ValueError, match="keeps more drafts than it offers"):
        Trace.load(bad)


def test_the_recorder_writes_a_trace_the_replay_loads(tmp_path):
    from specserve.bench.acceptance import main

    out = tmp_path / "acceptance.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--model", "tiny", "--drafter", "draft-model", "--per-category", "1", "--tokens", "6",
                     "--gamma", "2", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    trace = Trace.load(out)
    assert trace.gamma == 2 and len(trace.requests) == 3  # one prompt of each category
    assert all(len(r.drafted) == 6 and r.drafted[0] == 0 and max(r.drafted) <= 2 for r in trace.requests)
    assert "draft model" in trace.source and "| all | 3 | 15 |" in json.loads(out.read_text())["table"]
