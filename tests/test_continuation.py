"""A request continued on a fresh replica (no Ray): the coordinator's `_continue` on real tiny models.

A replica runs a batch for a few steps and is "lost"; a fresh verifier + drafter (new caches, as on
another replica) continue each request from its delivered tokens (`Resume`), and the outputs equal
an undisturbed run's: greedy, and seeded sampling too (its generator state rides in the Delta).
Unseeded sampling stays a valid sample: tests/test_sampling_distribution.py covers every step, and a
continuation is just steps from a prefix.
"""
from __future__ import annotations

import pytest

from specserve.engine import DraftModelProposer, SamplingParams, TargetVerifier
from specserve.engine.policy import SpeculationPolicy
from specserve.engine.executor import speculative_step
from specserve.engine.step import InvalidPrompt, new_sequence
from specserve.models.tiny import tiny_llama
from specserve.serve.coordinator import Resume, _continue

MAX_LEN = 256
GAMMA = 3
PARAMS = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=33, temperature=1.2, top_k=20, seed=5, ignore_eos=True)]
PROMPTS = [[5, 17, 99, 3], [200, 201, 7], [42] * 9]


def _replica(models):
    target, draft = models
    verifier = TargetVerifier(target, MAX_LEN)
    return verifier, DraftModelProposer(draft, verifier.vocab_size, MAX_LEN), SpeculationPolicy(GAMMA, adaptive=False)


def _seq(i: int, params: SamplingParams):
    return new_sequence(f"r{i}", PROMPTS[i], params, vocab_size=259, max_model_len=MAX_LEN, eos_token_ids=frozenset())


def _run(models, seqs, steps: int | None = None):
    """Step the batch until every request finished (or `steps` steps); returns the live sequences."""
    verifier, proposer, policy = _replica(models)
    live = [s for s in seqs if s.finish_reason is None]
    taken = 0
    while live and (steps is None or taken < steps):
        speculative_step(live, proposer, verifier, policy)
        live = [s for s in live if s.finish_reason is None]
        taken += 1
    return seqs


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=0, max_position_embeddings=MAX_LEN), tiny_llama(seed=0, max_position_embeddings=MAX_LEN,
                                                                             noise=0.15)


@pytest.mark.parametrize("lost_after", [1, 4])
def test_continuation_on_a_fresh_replica_equals_the_undisturbed_run(models, lost_after):
    undisturbed = [list(s.output) for s in _run(models, [_seq(i, p) for i, p in enumerate(PARAMS)])]
    lost = _run(models, [_seq(i, p) for i, p in enumerate(PARAMS)], steps=lost_after)
    # what the ingress holds: the delivered tokens, and the seeded requests' state from the last Delta
    resumes = [Resume(tuple(s.output), s.generator.get_state().numpy().tobytes() if s.reproducible else None)
               for s in lost]
    assert all(0 < len(r.generated) < p.max_tokens for r, p in zip(resumes, PARAMS))
    continued = [_seq(i, p) for i, p in enumerate(PARAMS)]
    for seq, resume in zip(continued, resumes):
        _continue(seq, resume, vocab_size=259)
    _run(models, continued)
    assert [list(s.output) for s in continued] == undisturbed
    assert [len(s.output) for s in continued] == [p.max_tokens for p in PARAMS]


def test_a_continuation_is_prefilled_in_chunks(models):
    """A continuation's prompt + delivered tokens enter the new replica's caches a chunk per step
    (not as one forward in its first step), and the output is still the undisturbed run's."""
    from specserve.engine.executor import prefill_step

    chunk = 4
    undisturbed = [list(s.output) for s in _run(models, [_seq(i, p) for i, p in enumerate(PARAMS)])]
    lost = _run(models, [_seq(i, p) for i, p in enumerate(PARAMS)], steps=3)
    continued = [_seq(i, p) for i, p in enumerate(PARAMS)]
    for seq, old in zip(continued, lost):
        _continue(seq, Resume(tuple(old.output), old.generator.get_state().numpy().tobytes()
                              if old.reproducible else None), vocab_size=259)
    verifier, proposer, policy = _replica(models)
    live, waited = list(continued), {s.request_id: 0 for s in continued}
    while live:
        ready = prefill_step(live, proposer, verifier, chunk)
        for s in live:
            waited[s.request_id] += s not in ready
        if ready:
            speculative_step(ready, proposer, verifier, policy)
        live = [s for s in live if s.finish_reason is None]
    # the first request (FIFO) gets whole chunks: ceil((tokens - 1) / chunk) - 1 steps before its first
    first = lost[0].num_tokens - 1
    assert waited["r0"] == -(-first // chunk) - 1 and first > chunk
    assert [list(s.output) for s in continued] == undisturbed


def test_seeded_continuation_without_the_state_draws_fresh_numbers(models):
    """No state: the seed's stream must not replay the numbers that drew the tokens already there
    (the continuation would correlate with its own prefix); it gets a fresh stream instead."""
    params = PARAMS[1]
    lost = _run(models, [_seq(1, params)], steps=2)[0]
    replayed, fresh = _seq(1, params), _seq(1, params)
    _continue(fresh, Resume(tuple(lost.output)), vocab_size=259)
    assert not (fresh.generator.get_state() == replayed.generator.get_state()).all()


@pytest.mark.parametrize("generated,why", [((1,) * 40, "leave nothing"), ((1, 999), "must lie in")])
def test_a_continuation_that_cannot_be_one_is_refused(generated, why):
    with pytest.raises(InvalidPrompt, match=why):
        _continue(_seq(0, PARAMS[0]), Resume(generated), vocab_size=259)


class _Stream:
    """A handle stream stand-in: yields `items`, then raises `then` (or hangs when then == "hang")."""

    def __init__(self, items, then=None) -> None:
        self.items, self.then, self.cancelled = list(items), then, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        import asyncio

        if self.items:
            return self.items.pop(0)
        if self.then == "hang":
            await asyncio.sleep(3600)
        if self.then is not None:
            raise self.then
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


def test_no_replica_taking_over_before_the_deadline_is_engine_lost():
    """The replica dies after 2 tokens and no other answers: the continuation gives up at the
    request's deadline (EngineLost, which the ingress sends as 503 / an SSE error), not never."""
    import asyncio
    import time

    from ray.exceptions import ActorDiedError

    from specserve.serve.continuation import Continuation, EngineLost
    from specserve.serve.coordinator import Accepted, Delta, GenerateRequest

    sent, streams = [], [_Stream([Accepted(4), Delta([7, 8], None, 4, 2, 1)], ActorDiedError()), _Stream([], "hang")]

    def submit(request):
        sent.append(request)
        return streams[len(sent) - 1]

    async def run():
        cont = Continuation(submit, GenerateRequest("r", [1, 2, 3, 4], PARAMS[0]), max_resumes=3,
                            deadline=time.monotonic() + 0.5, counts={})
        assert isinstance(await cont.start(), Accepted)
        got = []
        with pytest.raises(EngineLost, match="before its deadline"):
            async for delta in cont.items():
                got.append(delta.token_ids)
        return cont, got

    began = time.monotonic()
    cont, got = asyncio.run(run())
    assert time.monotonic() - began < 2.0 and got == [[7, 8]]
    assert sent[1].resume.generated == (7, 8) and sent[1].request_id == "r.1" and streams[0].cancelled
    assert cont.counts == {"continuations": 1, "given_up": 1} and streams[1].cancelled


def test_mid_stream_continuations_wait_ahead_of_new_requests_in_arrival_order():
    from specserve.engine.admission import Admission
    from specserve.serve.coordinator import Coordinator

    coordinator = object.__new__(Coordinator.func_or_class)
    coordinator.admission = Admission(1, None, GAMMA)
    for rid, generated in [("new1", ()), ("cont1", (5, 6)), ("new2", ()), ("none1", ()), ("cont2", (7,))]:
        seq = new_sequence(rid, [1, 2], PARAMS[0], vocab_size=259, max_model_len=MAX_LEN, eos_token_ids=frozenset())
        if generated:
            _continue(seq, Resume(generated), vocab_size=259)
        coordinator.admission.enqueue(seq)
    assert [s.request_id for s in coordinator.admission.waiting] == ["cont1", "cont2", "new1", "new2", "none1"]
