"""Drafting from earlier answers (engine/history.py): what the history finds, and that drafting it
changes no token.

A request whose latest tokens occurred in a finished one drafts what followed there, first, as a
prediction is drafted; greedy tokens equal the target alone's, sampled tokens follow the target's
distribution, and a seeded sampled request never recalls (its tokens would depend on others').
"""
from __future__ import annotations

import random

import pytest
import torch

from models import hf_greedy, perturbed, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine.history import CANDIDATES, MAX_MATCH, History
from specserve.engine.proposers import PredictionSpec

MAX_NEW = 24


# -- what the history finds ----------------------------------------------------------------------------
def test_the_longest_match_gives_what_followed_it():
    h = History(1000, min_match=2)
    h.add([1, 2, 3, 4, 5, 6])
    h.add([9, 9, 2, 3, 7, 8])  # the more recent occurrence of (2, 3), but a shorter match below
    assert h.continuation([0, 1, 2, 3], 3) == [4, 5, 6]  # (1, 2, 3): three tokens beat two
    assert h.continuation([0, 0, 2, 3], 3) == [7, 8]  # equals: the most recent; that request's end
    assert h.continuation([5, 2, 3], 0) == []
    assert h.continuation([3], 3) == []  # shorter than min_match
    assert h.continuation([4, 4], 3) == []  # never seen
    assert (h.num_lookups, h.num_found) == (3, 2)  # (a limit of 0 or a short tail is no lookup)
    h.reset_counts()  # (a stats reset: what it holds stays)
    assert (h.num_lookups, h.num_found, len(h)) == (0, 0, 2) and h.continuation([1, 2, 3], 1) == [4]


def test_a_match_shorter_than_min_match_drafts_nothing():
    h = History(1000, min_match=4)
    h.add(list(range(20)))
    assert h.continuation([9, 10, 11, 12], 2) == [13, 14]
    assert h.continuation([99, 11, 12], 2) == []  # (11, 12) occurs, but only 2 tokens match


def test_requests_too_short_to_match_are_not_kept():
    h = History(1000, min_match=4)
    h.add([1, 2, 3, 4])  # no token after its only 4-gram
    assert len(h) == 0 and h.held_tokens == 0


def test_the_oldest_requests_leave_first_and_the_index_is_rebuilt():
    h = History(30, min_match=2)
    for i in range(10):
        h.add([100 + i, 1, 2, 200 + i, 3, 4])
    assert h.held_tokens <= 30 and len(h) == 5  # the 5 newest
    assert h.continuation([100, 1], 2) == []  # request 0 left
    assert h.continuation([109, 1], 2) == [2, 209]
    assert h.continuation([7, 1, 2], 1) == [209]  # the most recent kept
    index_entries = sum(len(v) for v in h._ends.values())
    assert index_entries <= 2 * (h.held_tokens - len(h) * h.min_match)  # stale entries rebuilt away


def test_a_request_longer_than_the_budget_keeps_its_end():
    h = History(10, min_match=2)
    h.add(list(range(25)))
    assert h.held_tokens == 10
    assert h.continuation([20, 21], 2) == [22, 23] and h.continuation([5, 6], 2) == []


def test_the_search_is_the_full_search_within_its_candidates():
    """Against a brute-force search over every earlier occurrence: the same continuation wherever
    the best match lies among the CANDIDATES most recent occurrences of the last min_match tokens."""
    rng = random.Random(0)
    h = History(10_000, min_match=2)
    kept = []
    for _ in range(12):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(3, 40))]
        h.add(tokens)
        kept.append(tokens)
    for _ in range(300):
        tail = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        occurrences = [(t, j) for t in kept for j in range(2, len(t)) if t[j - 2 : j] == tail[-2:]]
        if len(occurrences) > CANDIDATES:
            continue
        best = max(((_length(t, j, tail), i) for i, (t, j) in enumerate(occurrences)), default=None)
        want = [] if best is None else occurrences[best[1]][0][occurrences[best[1]][1]:][:5]
        assert h.continuation(tail, 5) == want


def _length(tokens, end, tail):
    k = 0
    while k < MAX_MATCH and k < end and k < len(tail) and tokens[end - 1 - k] == tail[-1 - k]:
        k += 1
    return k


# -- through the engine: greedy -------------------------------------------------------------------------
def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 90) for _ in range(rng.randrange(4, 12))] for _ in range(n)]


@pytest.mark.parametrize("drafter", ["none", "draft model"])
def test_asked_again_a_request_drafts_its_earlier_answer_and_keeps_the_target_s_tokens(drafter):
    """Prompts answered once, then again in another order: the second time every row recalls the
    first answer (with no drafter, the history drafts alone), and greedy tokens are HF's."""
    target = tiny_llama(0)
    options = dict(drafter=PredictionSpec()) if drafter == "none" else dict(draft_model=perturbed(target, 0.5, 1))
    engine = SpeculativeEngine(target, num_speculative_tokens=4, adaptive=False,
                               history=History(10_000, min_match=4), **options)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompts = _prompts(6)
    want = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    first = engine.generate(prompts, params)
    again = engine.generate(prompts[::-1], params)
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == want[::-1]
    recalled = sum(o.metrics.num_recalled_accepted for o in again)
    assert recalled == sum(o.metrics.num_recalled_drafts for o in again)  # the same answer: all accepted
    assert recalled >= 0.75 * len(prompts) * MAX_NEW  # (4 recalled + 1 of the target's a step)
    assert all(o.metrics.num_prediction_drafts == 0 for o in again)  # (not the client's prediction)
    assert sum(o.metrics.num_steps for o in again) < sum(o.metrics.num_steps for o in first) / 2


def test_a_wrong_recall_costs_drafts_never_a_token():
    """The history holds answers that begin as the target's and then go elsewhere (another model's
    tokens): rows recall them, the target rejects what differs, and the tokens are still HF's."""
    target, other = tiny_llama(0), tiny_llama(7)
    history = History(10_000, min_match=2)
    prompts = _prompts(5)
    for p in prompts:
        mine = hf_greedy(target, p, 6)
        history.add(p + mine + hf_greedy(other, p + mine, MAX_NEW))
    engine = SpeculativeEngine(target, num_speculative_tokens=4, adaptive=False, drafter=PredictionSpec(),
                               history=history)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, MAX_NEW) for p in prompts]
    drafted = sum(o.metrics.num_recalled_drafts for o in outs)
    assert 0 < sum(o.metrics.num_recalled_accepted for o in outs) < drafted


def test_a_seeded_sampled_request_never_recalls():
    """Its tokens must depend on its seed and its own tokens only: the same with a history that
    holds its own earlier answer as with none."""
    target = tiny_llama(0)
    prompt = _prompts(1)[0]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=11, ignore_eos=True)
    plain = SpeculativeEngine(target, num_speculative_tokens=4, adaptive=False, drafter=PredictionSpec())
    want = plain.generate([prompt], params)[0].token_ids
    history = History(10_000, min_match=2)
    history.add(prompt + want)
    engine = SpeculativeEngine(target, num_speculative_tokens=4, adaptive=False, drafter=PredictionSpec(),
                               history=history)
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == want and out.metrics.num_recalled_drafts == 0


# -- sampled: the target's distribution -----------------------------------------------------------------
def test_sampled_rows_that_recall_follow_the_target():
    """20,000 unseeded sampled sequences of one prompt, each recalling earlier samples of the same
    prompt (a run drafted at every step, right some of the time): the 2nd and 3rd tokens follow
    the target's exact distribution."""
    from test_sampling_distribution import NUM_SEQUENCES, PROMPT, VOCAB, chi_square_pvalue, exact_marginals

    target = tiny_llama(0, vocab=VOCAB, init_range=0.3, layers=1, hidden=16)
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    exact2, exact3 = exact_marginals(target, params)
    history = History(100_000, min_match=2)
    engine = SpeculativeEngine(target, num_speculative_tokens=3, adaptive=False, drafter=PredictionSpec(),
                               max_batch_size=2500, history=history)
    engine.generate([PROMPT] * 2500, params)  # earlier answers to recall
    outs = engine.generate([PROMPT] * NUM_SEQUENCES, params)
    drafted = sum(o.metrics.num_recalled_drafts for o in outs)
    accepted = sum(o.metrics.num_recalled_accepted for o in outs)
    assert drafted > NUM_SEQUENCES and 0.05 * drafted < accepted < 0.9 * drafted
    count = lambda pos: torch.tensor(  # noqa: E731
        [sum(o.token_ids[pos] == v for o in outs) for v in range(VOCAB)], dtype=torch.float64)
    assert chi_square_pvalue(count(1), exact2) > 1e-4
    assert chi_square_pvalue(count(2), exact3) > 1e-4


def test_history_settings_are_checked():
    with pytest.raises(ValueError):
        History(0)
    with pytest.raises(ValueError):
        History(100, min_match=MAX_MATCH + 1)


def test_bench_history_runs_every_workload_and_checks_every_output(tmp_path):
    """`bench history` on the tiny model: every workload's rows, every output target only's, and
    asked again, the history drafts (and is accepted)."""
    import json

    from specserve.bench import history as bench

    out = tmp_path / "history.json"
    assert bench.main(["--model", "tiny", "--prompts", "2", "--max-tokens", "12", "--min-match", "4",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["method"]) for r in rows] == [
        (w, m) for w in ("template", "repeat", "unrelated")
        for m in ("target only", "history alone", "history alone + history")]
    assert all(r["identical"] for r in rows)
    repeat = rows[5]
    assert repeat["recalled_accepted"] == repeat["recalled"] > 0 and repeat["history_found"] > 0


def test_the_policy_learns_the_drafter_s_acceptance_not_the_forced_run_s():
    """A run drafted first (recalled, or a prediction's) is not the drafter's: a step whose run of 3
    was accepted and whose drafter's 2 drafts were rejected teaches α 0 for the drafter; one whose
    run had a draft rejected teaches nothing (the drafter's drafts were never reached)."""
    from types import SimpleNamespace

    from specserve.engine.policy import SpeculationPolicy
    from specserve.engine.step import StepPlan, new_sequence, observe_verified

    policy = SpeculationPolicy(5)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    seqs = [new_sequence(f"r{i}", [1, 2, 3], params, vocab_size=96, max_model_len=64, eos_token_ids=frozenset())
            for i in range(3)]
    plan = StepPlan(seqs, 5, torch.tensor([5, 5, 2]), None, None, None, None, predicted=[3, 3, 0])
    observe_verified(policy, plan, SimpleNamespace(num_accepted=[3, 1, 2]))
    (ran, missed, plain) = (s.acceptance for s in seqs)
    assert (ran.accepted, ran.trials) == (0, 1)  # the drafter's 2: the first rejected
    assert (missed.accepted, missed.trials) == (0, 0)  # rejected inside the run: nothing learned
    assert (plain.accepted, plain.trials) == (2, 2)  # no run: as before
