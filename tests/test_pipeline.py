"""Pipelined speculation (speculation.pipelined, specserve.serve.pipeline) is lossless and draws the
sequential loop's random numbers.

The real Coordinator runs in this process (no Ray; the `local_coordinator` fixture, see
tests/local_actors.py), so the coordinator's loop, admission, cache-miss protocol and pipeline
run unchanged.
(That the two calls really overlap, and recovery from killed workers, is for the Serve tests and
`specserve bench overlap`.)
"""
from __future__ import annotations

import asyncio
import collections
import uuid

import pytest
import torch

from models import hf_greedy, tiny_llama
from specserve.config import AppConfig
from specserve.engine import SamplingParams
from specserve.engine.policy import AcceptanceEstimate, OverlappedPolicy, SpeculationPolicy
from specserve.engine.model_runner import ForwardTiming

TINY = {"kind": "tiny", "seed": 0, "layers": 2, "hidden_size": 64}


def config(pipelined: bool, gamma: int = 4, adaptive: bool = False, place_q: bool = True, **kw) -> AppConfig:
    return AppConfig.model_validate(dict(
        served_model_name="tiny", target=TINY, draft={**TINY, "noise": 0.15, "noise_seed": 1},
        speculation=dict(num_speculative_tokens=gamma, adaptive=adaptive, pipelined=pipelined, execution="eager",
                         transport="actor_calls",  # no Ray here: plain calls on the stand-in actors
                         place_q=place_q),
        max_model_len=256, **kw))


def generate(coordinator, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Every request at once through the coordinator's own loop -> tokens per request."""
    from specserve.serve.coordinator import Delta, GenerateRequest

    async def one(prompt, p) -> list[int]:
        tokens = []
        async for item in coordinator.generate(GenerateRequest(uuid.uuid4().hex, prompt, p)):
            assert type(item).__name__ in ("Accepted", "Delta"), item
            if isinstance(item, Delta):
                tokens += item.token_ids
        return tokens

    async def run():
        try:
            return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))
        finally:
            coordinator._loop_task.cancel()

    return asyncio.run(run())


NUM_SEQUENCES = 8_000
PROMPTS = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 113, 117, 105, 99, 107], [97],
           list(range(48, 58)) * 3]


def test_pipelined_greedy_is_the_targets_greedy(local_coordinator):
    coordinator = local_coordinator(config(pipelined=True))
    assert coordinator.executor.pipeline is not None and isinstance(coordinator.policy, OverlappedPolicy)
    lengths = [24, 17, 30, 9]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    # one at a time (every step can use a prepared block) and all together
    alone = [generate(coordinator, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    together = generate(coordinator, PROMPTS, params)
    target = coordinator.target._obj.model.runner.model
    expected = [hf_greedy(target, p, n) for p, n in zip(PROMPTS, lengths)]
    assert alone == expected and together == expected
    totals = coordinator._totals
    assert totals["pipelined_hits"] > 0 and totals["pipelined_prepared"] > totals["pipelined_hits"]
    assert asyncio.run(coordinator.num_cached()) == {"target": 0, "draft": 0}


def test_a_discarded_prepared_block_leaves_no_draft_mark_past_the_rows_tokens(local_coordinator, monkeypatch):
    """The draft's cache holds a prepared block's first drafts past each matched row's tokens, and
    the row's draft mark says so; a block thrown away instead of verified (a target-only retry,
    the draft lost) must take the mark back, or the next propose would start past the row's own
    tokens with nothing to feed."""
    from specserve.serve.pipeline import Pipeline

    coordinator = local_coordinator(config(pipelined=True))
    marks = []
    settle = Pipeline._settle_reply

    def settle_then_discard(self, *args, **kwargs):
        result = settle(self, *args, **kwargs)
        if self._prepared is not None:
            owners = [self._prepared.owners[b] for b in self._prepared.rows.values()]
            self.discard()
            marks.extend(s.draft_len <= s.num_tokens - 1 for s in owners)
        return result

    monkeypatch.setattr(Pipeline, "_settle_reply", settle_then_discard)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    out = generate(coordinator, PROMPTS[:1], params)
    target = coordinator.target._obj.model.runner.model
    assert out == [hf_greedy(target, PROMPTS[0], 24)]
    assert marks and all(marks) and coordinator.executor.draft_ok
    assert coordinator._totals["pipelined_hits"] == 0 and coordinator._totals["pipelined_prepared"] > 0


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.5, top_k=3, top_p=0.9)])
def test_pipelined_seeded_sampling_draws_the_sequential_numbers(local_coordinator, sampling):
    """The same seeds give the same tokens as the sequential loop: a prepared block used on a hit
    drew exactly the numbers the sequential plan would, and a discarded one put them back. (At
    temperature 1 the tiny models' distributions are flat: the bonus guess is rarely right, so
    nearly every prepared block is discarded; with top-k 3 many are used.)"""
    params = [SamplingParams(max_tokens=40, seed=10 + i, ignore_eos=True, **sampling) for i in range(len(PROMPTS))]
    sequential = generate(local_coordinator(config(pipelined=False, gamma=2)), PROMPTS, params)
    coordinator = local_coordinator(config(pipelined=True, gamma=2))
    alone = [generate(coordinator, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    totals = coordinator._totals
    assert totals["pipelined_prepared"] > 20
    assert totals["pipelined_hits"] > (2 if "top_k" in sampling else -1)
    together = generate(coordinator, PROMPTS, params)
    assert alone == sequential and together == sequential


def token_marginal(model, params: SamplingParams, k: int) -> torch.Tensor:
    """Exact P(k-th token) [V] after the shared PROMPT, by enumerating every prefix of k - 1 tokens."""
    from test_sampling_distribution import PROMPT, VOCAB, next_probs

    prefixes, weights = [[]], torch.ones(1, dtype=torch.float64)
    for _ in range(k - 1):
        step = next_probs(model, [PROMPT + q for q in prefixes], params).double()  # [N, V]
        weights = (weights[:, None] * step).reshape(-1)
        prefixes = [q + [a] for q in prefixes for a in range(VOCAB)]
    return (weights[:, None] * next_probs(model, [PROMPT + q for q in prefixes], params).double()).sum(0)


def test_pipelined_sampling_follows_the_targets_distribution(local_coordinator):
    """γ 1 and 5 tokens per request. The first token comes from the prompt's forward (no drafts),
    the second and third from the first drafting step, whose verify prepares the next block: so
    the fourth often comes from a prepared block. Its marginal, like the second's, is the target's
    exact one (chi-square)."""
    from test_sampling_distribution import PROMPT, VOCAB, chi_square_pvalue

    small = dict(vocab=VOCAB, init_range=0.3, layers=1, hidden=16)
    target, draft = tiny_llama(0, **small), tiny_llama(0, **small)
    with torch.no_grad():  # a draft close to the target: most blocks are accepted, some rejected
        generator = torch.Generator().manual_seed(1)
        for w in draft.parameters():
            w.add_(0.1 * w.std() * torch.randn(w.shape, generator=generator))
    plain = SamplingParams(max_tokens=5, temperature=0.6, ignore_eos=True)
    num = NUM_SEQUENCES
    # prompts prefilled whole: with chunks, a few hundred rows would join every step and nearly every
    # step would have a row without a prepared block (the policy then prepares none)
    coordinator = local_coordinator(config(pipelined=True, gamma=1, max_batch_size=num, max_queued_requests=num,
                                           prefill_chunk_tokens=0), {"target": target, "draft": draft})
    outs = generate(coordinator, [PROMPT] * num, [plain] * num)
    assert coordinator._totals["pipelined_hits"] > 0.1 * num  # the prepared path is exercised
    for k in (2, 4):
        seen = collections.Counter(o[k - 1] for o in outs)
        count = torch.tensor([seen[v] for v in range(VOCAB)], dtype=torch.float64)
        assert chi_square_pvalue(count, token_marginal(target, plain, k)) > 1e-3, k


def test_pipelined_requires_a_draft_worker():
    with pytest.raises(ValueError, match="pipelined needs a draft worker"):
        AppConfig.model_validate(dict(served_model_name="t", target=TINY, drafter={"kind": "prompt_lookup"},
                                      speculation=dict(pipelined=True)))
    with pytest.raises(ValueError, match="pipelined needs a draft worker"):
        AppConfig.model_validate(dict(served_model_name="t", target=TINY, drafter={"kind": "eagle", "path": "h"},
                                      speculation=dict(pipelined=True)))


def _policy(cls, draft_s: float, target_s: float, verify_growth: float = 0.0):
    policy = cls(4, adaptive=True)
    policy.observe_costs("draft", [ForwardTiming(n, draft_s) for n in range(1, 9)])
    policy.observe_costs("target", [ForwardTiming(n, target_s * (1 + verify_growth * (n - 1))) for n in range(1, 33)])
    return policy


def test_overlapped_policy_prices_a_step_at_the_slower_side():
    policy = _policy(OverlappedPolicy, 0.5, 1.0)
    policy.observe_guesses(8, 8)
    # α 0.9, γ 2, c 0.5: max(1, 3 x 0.5) + (1 - 0.9^2 x β) x 1, below the sequential 1 + 2 x 0.5
    assert policy.overlapped_time(1, 2, [0.9]) < policy.step_time(1, 2)
    assert policy.overlapped_time(1, 2, [0.9]) >= 1.5
    assert policy.overlap_pays([0.9], 2)
    # at a large batch a whole-batch hit never happens: preparing only delays the fresh drafts
    assert not policy.overlap_pays([0.9] * 64, 4)


def test_overlapped_policy_drafts_longer_than_sequential_where_overlap_pays_and_never_where_drafting_loses():
    overlapped, sequential = _policy(OverlappedPolicy, 0.2, 1.0), _policy(SpeculationPolicy, 0.2, 1.0)
    for policy in (overlapped, sequential):
        for _ in range(50):
            policy.observe_acceptance(AcceptanceEstimate(), 4, 4)
    overlapped.observe_guesses(40, 50)
    assert overlapped.best_gamma([0.95]) >= sequential.best_gamma([0.95]) >= 1
    # a draft as slow as the target, with poor acceptance: γ 0 in both models
    for policy in (_policy(OverlappedPolicy, 1.0, 1.0), _policy(SpeculationPolicy, 1.0, 1.0)):
        assert policy.best_gamma([0.1, 0.1]) == 0


def test_pipelined_penalties_and_logprobs_are_the_sequential_ones(local_coordinator):
    """Penalties (and min_tokens, bad words) counted through the drafts and log-probabilities of
    each token: a prepared block verified one step later sees the tokens of the step it was drafted
    ahead of, so pipelined output and log-probabilities equal the sequential loop's."""
    from specserve.serve.coordinator import Delta, GenerateRequest

    # the third row's stop token is its plain output's 2nd token, held back for 12 tokens (min_tokens),
    # and its 6th and 7th tokens are a bad word
    plain3 = generate(local_coordinator(config(pipelined=False)), PROMPTS[2:3],
                      [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])[0]
    stop = plain3[1]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2, presence_penalty=0.4,
                             frequency_penalty=0.2, logit_bias={72: 1.0}),
              SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True, logprobs=0, repetition_penalty=1.1),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0, stop_token_ids=(stop,),
                             min_tokens=12, bad_words_ids=[tuple(plain3[5:7])])]

    def run(coordinator) -> list[tuple[list[int], list[float]]]:
        async def one(prompt, p):
            tokens, logprobs = [], []
            async for item in coordinator.generate(GenerateRequest(uuid.uuid4().hex, prompt, p)):
                if isinstance(item, Delta):
                    tokens += item.token_ids
                    logprobs += item.logprobs
            return tokens, logprobs

        async def both():
            try:
                return await asyncio.gather(*(one(pr, p) for pr, p in zip(PROMPTS, params)))
            finally:
                coordinator._loop_task.cancel()

        return asyncio.run(both())

    pipelined = local_coordinator(config(pipelined=True))
    got = run(pipelined)
    expected = run(local_coordinator(config(pipelined=False)))
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert pipelined._totals["pipelined_hits"] > 0
    assert stop not in got[2][0][:12] and len(got[2][0]) >= 12
    assert all(got[2][0][i:i + 2] != plain3[5:7] for i in range(len(got[2][0]) - 1))
    plain = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True) for p in params[:2]]
    assert generate(local_coordinator(config(pipelined=False)), PROMPTS[:2], plain) != [t for t, _ in got]


def test_pipelined_grammar_rows_are_the_sequential_ones(local_coordinator):
    """A step with a grammar row prepares nothing ahead (its next drafts are masked from the state
    its verdict sets); once the grammar rows finish, the free rows pipeline again. Every row's
    tokens equal the sequential loop's, and the grammar rows' answers follow their grammars."""
    import json

    from specserve.engine.grammar import Grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=40, grammar=Grammar.json_schema(schema)),
              SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, grammar=Grammar("regex", "[a-z]{3}-[0-9]{2}")),
              SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)]
    pipelined = local_coordinator(config(pipelined=True))
    got = generate(pipelined, PROMPTS, params)
    assert got == generate(local_coordinator(config(pipelined=False)), PROMPTS, params)
    assert pipelined._totals["pipelined_hits"] > 0
    assert set(json.loads(bytes(got[0][:-1]).decode())) == {"n"} and got[0][-1] in (256, 258)  # then EOS
    assert bytes(got[2][:6]).decode()[3] == "-" and got[2][-1] in (256, 258)


def test_a_block_combined_from_prepared_and_fresh_drafts_keeps_q_and_its_dtype():
    """combine_drafts: each row's drafts and q from the part it takes them from, in its first
    columns; q in the dtype it crossed in (16 bits from a bfloat16 target's draft worker: the rule
    normalises only such a q, so an upcast copy would skew it), zeros for a part without q."""
    from specserve.serve.pipeline import combine_drafts

    prepared = torch.tensor([[5, 6, 7], [8, 9, 10]])  # [2, 3]
    fresh = torch.tensor([[1, 2]])  # [1, 2]
    q_prepared = torch.rand(2, 3, 11).bfloat16()
    q_fresh = torch.rand(1, 2, 11).bfloat16()
    tokens, probs = combine_drafts([1, None, 0], 3, (prepared, q_prepared), (fresh, q_fresh))
    assert tokens.tolist() == [[8, 9, 10], [1, 2, 0], [5, 6, 7]]
    assert probs.dtype == torch.bfloat16 and probs.shape == (3, 3, 11)
    assert torch.equal(probs[0], q_prepared[1]) and torch.equal(probs[2], q_prepared[0])
    assert torch.equal(probs[1, :2], q_fresh[0]) and not probs[1, 2].any()
    _, greedy_part = combine_drafts([1, None], 3, (prepared, q_prepared), (fresh, None))
    assert greedy_part.dtype == torch.bfloat16 and not greedy_part[1].any()
    assert combine_drafts([None], 2, (None, None), (fresh, None))[1] is None


def test_the_coordinator_admits_by_priority(local_coordinator):
    """One running slot, four requests sent at once: the first runs at once, then the rest by
    priority (lower first), whatever their arrival order."""
    from specserve.serve.coordinator import Delta, GenerateRequest

    coordinator = local_coordinator(config(pipelined=False, max_batch_size=1))
    finished: list[str] = []

    async def one(name: str, priority: int) -> None:
        request = GenerateRequest(name, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                  priority=priority)
        async for item in coordinator.generate(request):
            if isinstance(item, Delta) and item.finish_reason is not None:
                finished.append(name)

    async def run():
        try:
            await asyncio.gather(one("first", 9), one("low", 5), one("high", -1), one("mid", 0))
        finally:
            coordinator._loop_task.cancel()

    asyncio.run(run())
    assert finished == ["first", "high", "mid", "low"]
