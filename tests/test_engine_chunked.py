"""Chunked prefill: prompts enter the caches a bounded chunk per step, beside the running decodes.

Greedy output stays the target's own (HF generate) for prompts many chunks long joining a running
batch, at odd chunk sizes down to 1; seeded sampled output is the same sample with or without
chunking; chunks go FIFO; running streams get a token every step while a long prompt prefills, and
no target forward is longer than the chunk or the step; the Ray coordinator's prefill protocol
(chunks, cache misses after a restart) gives the same greedy tokens.
"""
import asyncio
import collections
import functools
import math
import random
import types
from unittest import mock

import pytest

from models import hf_greedy, perturbed, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import DraftModelProposer, TargetVerifier
from specserve.engine.proposers import LayerSkipSpec, PromptLookupSpec
from specserve.engine.step import new_sequence, prefill_rows

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@functools.lru_cache(None)
def target():
    return tiny_llama(0)


@functools.lru_cache(None)
def draft():
    return perturbed(target(), 0.6, seed=1)


@functools.lru_cache(None)
def reference(prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(target(), list(prompt), MAX_NEW)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 96) for _ in range(length)]


def run_with_arrivals(engine: SpeculativeEngine, running: list[list[int]], arriving: list[list[int]],
                      params: SamplingParams = GREEDY, after_steps: int = 2) -> dict[str, list[int]]:
    """Start `running`, step a few times, then add `arriving` while they decode; run all to the end."""
    ids = []
    for i, p in enumerate(running):
        engine.add_request(f"run-{i}", p, params)
        ids.append(f"run-{i}")
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    for n in range(10_000):
        if n == after_steps:
            for i, p in enumerate(arriving):
                engine.add_request(f"new-{i}", p, params)
                ids.append(f"new-{i}")
                outputs[f"new-{i}"] = []
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if n >= after_steps and not engine.has_unfinished():
            return outputs
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("chunk", [1, 7, 13, 64, 0])
def test_greedy_identical_with_long_prompts_joining_running_decodes(chunk):
    running = [prompt(n, seed=n) for n in (3, 9, 20)]
    arriving = [prompt(n, seed=100 + n) for n in (150, 97, 1, 2)]  # 150 tokens: 12+ chunks of 13
    engine = SpeculativeEngine(target(), draft(), num_speculative_tokens=3, adaptive=False,
                               prefill_chunk_tokens=chunk)
    outputs = run_with_arrivals(engine, running, arriving)
    for rid, p in zip([f"run-{i}" for i in range(3)] + [f"new-{i}" for i in range(4)], running + arriving):
        assert outputs[rid] == reference(tuple(p)), (rid, chunk)
    assert engine.num_cached() == {"target": 0, "draft": 0}


@pytest.mark.parametrize("drafter", [LayerSkipSpec((1,)), PromptLookupSpec()], ids=["layer-skip", "prompt-lookup"])
def test_greedy_identical_with_colocated_drafters(drafter):
    engine = SpeculativeEngine(target(), drafter=drafter, num_speculative_tokens=3, adaptive=False,
                               prefill_chunk_tokens=11)
    running, arriving = [prompt(12, seed=1)], [prompt(90, seed=2), prompt(33, seed=3)]
    outputs = run_with_arrivals(engine, running, arriving)
    for rid, p in zip(["run-0", "new-0", "new-1"], running + arriving):
        assert outputs[rid] == reference(tuple(p))


def test_seeded_sampling_is_the_same_sample_with_or_without_chunks():
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=s) for s in range(4)]
    prompts = [prompt(n, seed=n) for n in (5, 120, 61, 2)]

    def sample(chunk):
        engine = SpeculativeEngine(target(), draft(), num_speculative_tokens=3, prefill_chunk_tokens=chunk)
        return [o.token_ids for o in engine.generate(prompts, params)]

    whole = sample(0)
    assert sample(9) == whole
    assert sample(64) == whole
    assert len({tuple(t) for t in whole}) == len(whole)  # really sampled (the seeds differ)


def test_chunks_go_fifo_and_bound_the_padded_forward():
    seqs = [new_sequence(rid, [1] * n, GREEDY, vocab_size=96, max_model_len=256, eos_token_ids=frozenset())
            for rid, n in (("a", 21), ("b", 6), ("c", 30))]
    rows = prefill_rows(seqs, "target_len", 8)
    assert [(r.request_id, r.start, len(r.tokens)) for r in rows] == [("a", 0, 8)]  # 2 x 8 > 8: a alone
    seqs[0].target_len = 16  # a lacks 4 (its prefill ends before its last token, at 20)
    rows = prefill_rows(seqs, "target_len", 8)
    assert [(r.request_id, r.start, len(r.tokens)) for r in rows] == [("a", 16, 4), ("b", 0, 4)]  # 2 x 4 <= 8
    seqs[0].target_len, seqs[1].target_len = 20, 4
    rows = prefill_rows(seqs, "target_len", 8)
    assert [(r.request_id, r.start, len(r.tokens)) for r in rows] == [("b", 4, 1), ("c", 0, 1)]
    assert prefill_rows(seqs, "draft_len", 100)[0].request_id == "a"  # each model by its own mark


def test_the_prompts_last_chunk_goes_with_the_first_step_unless_a_seeded_row_resumes():
    from specserve.engine.step import folding, prefilling

    seqs = [new_sequence(rid, [1] * n, GREEDY, vocab_size=96, max_model_len=256, eos_token_ids=frozenset())
            for rid, n in (("a", 21), ("b", 6), ("c", 30))]
    assert folding(seqs, 8) == frozenset()  # a's chunk [0, 8) is not its last
    seqs[0].target_len = 16
    fold = folding(seqs, 8)
    assert fold == {"a"}  # [16, 20) ends a's prompt; b's [0, 4) does not
    rows = prefill_rows(seqs, "target_len", 8, fold)
    assert [(r.request_id, r.start, len(r.tokens)) for r in rows] == [("b", 0, 4)]  # the same forward less a's
    assert not prefilling(seqs[0], False, fold) and prefilling(seqs[0], False)
    assert prefilling(seqs[0], True, fold)  # ... but it waits while the draft lacks the prompt
    seqs[0].draft_len = 20
    assert not prefilling(seqs[0], True, fold)
    # a seeded sampled request resumed with output keeps drafting from its first step here
    resumed = new_sequence("r", [1] * 6, SamplingParams(max_tokens=8, temperature=1.0, seed=3), vocab_size=96,
                           max_model_len=256, eos_token_ids=frozenset())
    resumed.output = [2, 3]
    greedy = new_sequence("g", [1] * 6, GREEDY, vocab_size=96, max_model_len=256, eos_token_ids=frozenset())
    greedy.output = [2, 3]
    assert folding([resumed, greedy], 64) == {"g"}


@pytest.mark.parametrize("chunk", [0, 16, 64])
def test_a_first_token_costs_the_target_one_forward_over_the_prompts_last_chunk(chunk):
    """A lone request: the target's forwards before its first token are the prompt's chunks, the
    last of them carrying the prompt's last token too (no forward of that token alone after it);
    the draft's prefill is unchanged, and the output is the target's."""
    p = prompt(40, seed=4)
    engine = SpeculativeEngine(target(), draft(), num_speculative_tokens=3, adaptive=False,
                               prefill_chunk_tokens=chunk)
    sizes = forward_sizes(engine.verifier.runner)
    engine.add_request("a", p, GREEDY)
    tokens = []
    while not tokens:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    expected = [40] if chunk in (0, 64) else [16, 16, 8]
    assert sizes == expected and tokens == reference(tuple(p))[:1]
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == reference(tuple(p))


def test_a_verify_of_a_prompts_last_chunk_beside_drafting_rows_is_each_alone():
    """One verify over a row carrying a prompt's last chunk (no drafts) and rows verifying drafts:
    the same verdict as each row verified in a target of its own, and the logits at the chunk's
    end are a plain forward's (rows of unequal lengths: the output head only where each ends)."""
    import torch

    from specserve.engine import RowInput
    from specserve.engine.sampling import BatchSampling

    def verify(verifier, rows, drafts, num_draft):
        params = [GREEDY] * len(rows)
        return verifier.verify(rows, torch.tensor(drafts), None, torch.tensor(num_draft),
                               BatchSampling.from_params(params), None, None)

    prompts = {"long": prompt(23, seed=1), "short": prompt(9, seed=2), "d1": prompt(6, seed=3), "d2": prompt(11, seed=4)}
    together = TargetVerifier(target(), None, "eager")
    for rid in ("d1", "d2"):  # decoding rows: all but their last token cached
        together.prefill([RowInput(rid, 0, prompts[rid][:-1])])
    rows = [RowInput("long", 0, prompts["long"]), RowInput("d1", 5, prompts["d1"][-1:]),
            RowInput("short", 0, prompts["short"]), RowInput("d2", 10, prompts["d2"][-1:])]
    drafts = [[0, 0], [7, 9], [0, 0], [3, 3]]
    verdict = verify(together, rows, drafts, [0, 2, 0, 2])
    for b, row in enumerate(rows):
        alone = TargetVerifier(target(), None, "eager")
        if row.start:
            alone.prefill([RowInput(row.request_id, 0, prompts[row.request_id][:-1])])
        one = verify(alone, [row], [drafts[b]], [0 if not row.start else 2])
        assert (verdict.num_accepted[b], verdict.next_token[b]) == (one.num_accepted[0], one.next_token[0]), b
    fresh = TargetVerifier(target(), None, "eager")
    logits = fresh.runner.prefill_last([RowInput("long", 0, prompts["long"]), RowInput("short", 0, prompts["short"])])
    with torch.no_grad():
        for b, rid in enumerate(("long", "short")):
            plain = target()(input_ids=torch.tensor([prompts[rid]])).logits[0, -1]
            torch.testing.assert_close(logits[b], plain, rtol=1e-4, atol=1e-4)
    assert [f.prefill for f in verdict.forwards].count(True) == 1  # the two chunks: one prefill forward


def test_admission_and_first_tokens_follow_arrival_order():
    engine = SpeculativeEngine(target(), draft(), num_speculative_tokens=2, adaptive=False, max_batch_size=2,
                               prefill_chunk_tokens=16)
    lengths = [70, 40, 40, 3]
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", prompt(n, seed=i), SamplingParams(max_tokens=4, temperature=0.0))
    first_token_step: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
    order = sorted(first_token_step, key=lambda r: (first_token_step[r], r))
    assert order == ["r0", "r1", "r2", "r3"]
    assert first_token_step["r0"] == math.ceil(69 / 16)  # r1 waited behind r0's chunks, not beside them


def forward_sizes(runner) -> list[int]:
    """Wrap a runner's forward (and a first step's prompt forward, `prefill_last`) so that each
    call's token count (tail included) is logged."""
    sizes: list[int] = []
    inner, inner_last = runner.forward, runner.prefill_last

    def forward(rows, logits="last", tail=None):
        sizes.append(sum(len(r.tokens) for r in rows) + (0 if tail is None else len(rows) * tail.shape[1]))
        return inner(rows, logits, tail=tail)

    def prefill_last(rows):
        sizes.append(sum(len(r.tokens) for r in rows))
        return inner_last(rows)

    runner.forward, runner.prefill_last = forward, prefill_last
    return sizes


@pytest.mark.parametrize("chunk", [16, 0])
def test_running_streams_get_a_token_every_step_while_a_long_prompt_prefills(chunk):
    gamma, streams = 3, 4
    engine = SpeculativeEngine(target(), draft(), num_speculative_tokens=gamma, adaptive=False,
                               prefill_chunk_tokens=chunk)
    for i in range(streams):
        engine.add_request(f"run-{i}", prompt(8, seed=i), SamplingParams(max_tokens=200, temperature=0.0))
    while not all(engine.sequence(f"run-{i}").output for i in range(streams)):  # all decoding
        engine.step()
    sizes = forward_sizes(engine.verifier.runner)
    engine.add_request("long", prompt(200, seed=9), SamplingParams(max_tokens=4, temperature=0.0))
    steps = 0
    while True:
        steps += 1
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}
        assert all(outputs.get(f"run-{i}") for i in range(streams)), steps  # nobody skipped a step
        if outputs.get("long"):
            break
    if chunk:
        assert steps == math.ceil(199 / chunk)  # 13 steps, the last one also the long prompt's first
        assert max(sizes) <= max(chunk, (streams + 1) * (gamma + 1))  # every forward bounded
    else:
        assert steps == 1 and max(sizes) >= 199  # the whole prompt in one forward: the stall


# -- the coordinator's prefill protocol, with in-process workers -----------------------------------
class _Actor:
    """A worker object whose methods answer `.remote(...)` with an awaitable, as a Ray actor's do."""

    def __init__(self, worker, log: list) -> None:
        self._worker, self._log = worker, log

    def __getattr__(self, name):
        fn = getattr(self._worker, name)
        log = self._log

        async def call(*args):
            log.append(name)
            return fn(*args)

        return types.SimpleNamespace(remote=call)


def _workers():
    from specserve.serve import workers

    tw = object.__new__(workers.TargetWorker)
    workers._Worker.__init__(tw, None)
    tw.model = TargetVerifier(target(), None, "eager")
    dw = object.__new__(workers.DraftWorker)
    workers._Worker.__init__(dw, None)
    dw.model = DraftModelProposer(draft(), tw.model.vocab_size, None, "eager")
    return tw, dw


def test_coordinator_prefills_in_chunks_and_rebuilds_after_a_restart(monkeypatch):
    from specserve.config import Deadlines
    from specserve.engine.policy import SpeculationPolicy
    from specserve.serve import workers
    from specserve.engine.admission import Admission
    from specserve.engine.loop import StepLoop
    from specserve.serve.calls import ProposerSide
    from specserve.serve.executor import RemoteExecutor

    monkeypatch.setattr(workers, "_FAULTS_DIR", None)
    tw, dw = _workers()
    log: list = []
    t, d = _Actor(tw, log), _Actor(dw, log)
    chunk = 10
    config = types.SimpleNamespace(deadlines=Deadlines(),
                                   speculation=types.SimpleNamespace(pipelined=False, transport="actor_calls",
                                                                     place_q=False))
    policy, totals = SpeculationPolicy(3, adaptive=False), dict.fromkeys(
        ["prefill_tokens", "steps", "target_only_steps", "spec_decode_num_draft_tokens",
         "spec_decode_num_accepted_tokens", "spec_decode_num_prediction_tokens",
         "spec_decode_num_accepted_prediction_tokens", "spec_decode_num_recalled_tokens",
         "spec_decode_num_accepted_recalled_tokens"], 0)
    admission = Admission(8, None, 3)
    executor = RemoteExecutor(config, t, d, ProposerSide.of_draft_worker(d), policy, admission, totals,
                              collections.deque(), mock.MagicMock())
    loop = StepLoop(admission, executor, policy, chunk)
    prompts = {"a": prompt(6, seed=1), "b": prompt(75, seed=2), "c": prompt(31, seed=3)}
    seqs = [new_sequence(rid, p, GREEDY, vocab_size=96, max_model_len=256, eos_token_ids=frozenset())
            for rid, p in prompts.items()]

    async def run():
        iterations = 0
        while any(s.finish_reason is None for s in seqs):
            iterations += 1
            live = [s for s in seqs if s.finish_reason is None]
            await loop.iterate(live)
            if iterations == 4:  # the target restarts mid-prefill: empty caches, the same object
                tw.model = TargetVerifier(target(), None, "eager")
        return iterations

    asyncio.run(run())
    for s in seqs:
        assert s.output == reference(tuple(prompts[s.request_id])), s.request_id
    assert log.count("prefill") >= 2 * math.ceil(74 / chunk)  # b's prompt went in chunks, to both workers
    # the restart (b mid-prefill) made the target take b's first chunks again
    assert totals["prefill_tokens"] > sum(len(p) - 1 for p in prompts.values())


def test_a_prefill_call_deadline_is_priced_by_its_padded_chunk():
    from specserve.config import Deadlines
    from specserve.engine import RowInput
    from specserve.engine.model_runner import ForwardTiming
    from specserve.engine.policy import SpeculationPolicy
    from specserve.serve.calls import WorkerCalls

    policy = SpeculationPolicy(4)
    policy.observe_costs("target", [ForwardTiming(n, 0.001 * n) for n in (1, 8, 32, 64)])
    policy.observe_costs("draft", [ForwardTiming(n, 0.0001 * n) for n in (1, 8, 32, 64)])
    calls = WorkerCalls(None, Deadlines(multiple=10, target_floor_s=2, draft_floor_s=0.5), policy, {})
    chunk = [RowInput("long", 1024, [1] * 512), RowInput("short", 0, [1] * 3)]  # padded: 2 x 512
    assert calls.deadline("target", chunk) == pytest.approx(2 + 10 * 0.001 * 1024)
    assert calls.deadline("draft", chunk) == pytest.approx(0.5 + 10 * 0.0001 * 1024)
