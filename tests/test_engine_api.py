"""Seeds, stop tokens, max_tokens, rollback, the incremental API and the step bookkeeping."""
import math

import pytest
import torch

from models import hf_greedy, perturbed
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import CacheMiss, ModelRunner, RowInput
from specserve.engine.rejection import greedy_accept, rejection_sample
from specserve.engine.sampling import BatchSampling, logits_to_probs, sample_with_uniforms
from specserve.engine.policy import SpeculationPolicy, TokenCost, expected_tokens

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, 0.6, seed=1)


def engine_for(target, draft, gamma=4, **kw):
    return SpeculativeEngine(target, draft, num_speculative_tokens=gamma, adaptive=False, **kw)


# -- the acceptance rule on hand-made numbers ---------------------------------------------------
def test_greedy_accept_counts_and_next_token():
    target_argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])  # [B=3, G+1=4]
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [5, 6, 7]])
    result = greedy_accept(target_argmax, drafts, torch.tensor([3, 3, 2]))
    assert result.num_accepted.tolist() == [3, 1, 2]
    assert result.next_token.tolist() == [8, 6, 7]  # bonus, recovered, bonus after g_b = 2
    assert result.tokens(drafts) == [[5, 6, 7, 8], [5, 6], [5, 6, 7]]


def test_rejection_recovered_token_comes_from_residual():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])  # [B=1, G+1=2, V=3]
    q = torch.tensor([[[0.0, 1.0, 0.0]]])  # the draft proposed token 1 with certainty
    drafts = torch.tensor([[1]])
    # u = 0.9 > p/q = 0.5: rejected; residual max(0, p - q) = [0.5, 0, 0] -> token 0 whatever u.
    out = rejection_sample(p, drafts, q, torch.tensor([1]), torch.tensor([[0.9]]), torch.tensor([0.99]))
    assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [0]
    # u = 0.1 < 0.5: accepted; the bonus token comes from p at the next position.
    out = rejection_sample(p, drafts, q, torch.tensor([1]), torch.tensor([[0.1]]), torch.tensor([0.99]))
    assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [2]


def test_rejection_respects_per_row_draft_count():
    p = torch.full((2, 3, 4), 0.25)
    q = torch.full((2, 2, 4), 0.25)
    drafts = torch.tensor([[1, 2], [1, 2]])
    out = rejection_sample(p, drafts, q, torch.tensor([2, 0]), torch.zeros(2, 2), torch.zeros(2))
    assert out.num_accepted.tolist() == [2, 0]


def test_top_k_top_p_and_greedy_probs():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.0)]
    probs = logits_to_probs(logits, BatchSampling.from_params(params))
    assert (probs[0, 2:] == 0).all() and torch.isclose(probs[0].sum(), torch.tensor(1.0))
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0]  # the best token alone holds > 0.5
    assert probs[2].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_inverse_cdf_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 3)
    tokens = sample_with_uniforms(probs, torch.tensor([0.0, 0.4999, 0.9999999]))
    assert tokens.tolist() == [1, 1, 2]


# -- the runner: per-row rollback and cache misses ------------------------------------------------
def test_rollback_then_rewrite_equals_fresh_computation(target):
    runner = ModelRunner(target)
    runner.forward([RowInput("a", 0, [1, 2, 3, 4, 5, 6]), RowInput("b", 0, [7, 8])], logits="none")
    # Roll "a" back to 3 tokens and write different ones; "b" extends normally.
    rolled = runner.forward([RowInput("a", 3, [9, 10]), RowInput("b", 2, [11])], logits="last")
    fresh = ModelRunner(target).forward([RowInput("x", 0, [1, 2, 3, 9, 10]), RowInput("y", 0, [7, 8, 11])])
    assert torch.allclose(rolled, fresh, atol=1e-5)
    assert runner.valid_length("a") == 5


def test_cache_miss_reports_valid_length(target):
    runner = ModelRunner(target)
    runner.forward([RowInput("a", 0, [1, 2, 3])], logits="none")
    with pytest.raises(CacheMiss) as err:
        runner.forward([RowInput("a", 7, [4])])
    assert err.value.valid_length == 3
    with pytest.raises(CacheMiss):
        runner.forward([RowInput("never-seen", 2, [4])])


def test_free_keeps_other_rows_intact(target):
    runner = ModelRunner(target)
    runner.forward([RowInput(r, 0, [i + 1, i + 2, i + 3]) for i, r in enumerate("abc")], logits="none")
    runner.free("a")  # "c" moves into a's slot
    moved = runner.forward([RowInput("c", 3, [9])])
    fresh = ModelRunner(target).forward([RowInput("z", 0, [3, 4, 5, 9])])
    assert torch.allclose(moved, fresh, atol=1e-5) and runner.num_cached() == 2


# -- stop tokens, max_tokens, seeds ---------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_is_exact(target, draft, max_tokens):
    outs = engine_for(target, target, gamma=4).generate([[1, 2, 3]], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    assert len(outs[0].token_ids) == max_tokens and outs[0].finish_reason == "length"


def test_stop_token_ends_inside_a_step(target):
    reference = hf_greedy(target, [4, 5, 6], 20)
    stop = reference[6]
    cut = reference.index(stop)
    # A draft equal to the target accepts 4 tokens a step, so the stop lands inside a step.
    out = engine_for(target, target).generate([[4, 5, 6]], SamplingParams(max_tokens=20, temperature=0.0,
                                                                          stop_token_ids=[stop]))[0]
    assert out.token_ids == reference[: cut + 1] and out.finish_reason == "stop"


def test_eos_from_model_config_and_ignore_eos(target):
    reference = hf_greedy(target, [4, 5, 6], 20)
    eos = reference[3]
    engine = SpeculativeEngine(target, target, 4, adaptive=False, eos_token_ids=[eos])
    out = engine.generate([[4, 5, 6]], GREEDY)[0]
    assert out.token_ids == reference[: reference.index(eos) + 1] and out.finish_reason == "stop"
    out = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == reference


def test_seeded_request_is_independent_of_batch(target, draft):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    alone = engine_for(target, draft).generate([[3, 1, 4]], params)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.0) for n in (3, 9, 16)]
    crowd = SpeculativeEngine(target, draft, 4, adaptive=True).generate(
        [[9, 9], [3, 1, 4], [2, 7, 1, 8, 2, 8], [5]], [others[0], params, others[1], others[2]]
    )
    assert crowd[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=99)
    assert engine_for(target, draft).generate([[3, 1, 4]], other_seed)[0].token_ids != alone


def test_mixed_greedy_and_sampled_rows(target, draft):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [GREEDY, SamplingParams(max_tokens=20, temperature=1.0, seed=7), GREEDY]
    outs = engine_for(target, draft).generate(prompts, params)
    assert outs[0].token_ids == hf_greedy(target, prompts[0], 20)
    assert outs[2].token_ids == hf_greedy(target, prompts[2], 20)


# -- incremental API ------------------------------------------------------------------------------
def test_requests_join_and_leave_between_steps(target, draft):
    engine = engine_for(target, draft, gamma=3)
    engine.add_request("a", [1, 2, 3], GREEDY)
    got = {"a": [], "b": []}
    for step in range(40):
        if step == 3:
            engine.add_request("b", [5, 6, 7, 8], GREEDY)
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        if not engine.has_unfinished():
            break
    assert got["a"] == hf_greedy(target, [1, 2, 3], 20)
    assert got["b"] == hf_greedy(target, [5, 6, 7, 8], 20)
    assert engine.num_cached() == {"target": 0, "draft": 0}


def test_abort_frees_caches(target, draft):
    engine = engine_for(target, draft)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5], GREEDY)
    engine.step()
    assert engine.num_cached() == {"target": 2, "draft": 2}
    engine.abort("a")
    assert engine.num_cached() == {"target": 1, "draft": 1}
    while engine.has_unfinished():
        engine.step()
    assert engine.num_cached() == {"target": 0, "draft": 0}


def test_bad_requests_are_refused(target, draft):
    engine = engine_for(target, draft)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("oov", [1, 10_000], GREEDY)
    with pytest.raises(ValueError, match="at least one"):
        engine.add_request("empty", [], GREEDY)
    engine.add_request("dup", [1], GREEDY)
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("dup", [1], GREEDY)
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0),
                dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_requests_up_to_the_context_limit(target, draft):
    prompt = list(range(1, 60)) * 4  # 236 of 256 positions
    out = engine_for(target, draft, gamma=7).generate([prompt, [1, 2]], SamplingParams(max_tokens=20, temperature=0.0))
    assert out[0].token_ids == hf_greedy(target, prompt, 20)


# -- adaptive speculation length ------------------------------------------------------------------
def test_token_cost_interpolates_and_extrapolates():
    cost = TokenCost(decay=0.5)
    for n, seconds in ((1, 0.080), (2, 0.130), (8, 0.160), (64, 0.400)):
        cost.observe(n, seconds)
    assert cost.predict(2) == 0.130  # measured sizes are used as they are: 1 -> 2 is a jump
    assert abs(cost.predict(5) - 0.145) < 1e-9  # between 2 and 8
    assert cost.predict(128) > cost.predict(64)  # beyond: the last segment's slope
    cost.observe(2, 0.150)
    assert abs(cost.predict(2) - 0.140) < 1e-9  # running mean
    assert TokenCost.bucket(1000) == TokenCost.bucket(1010) and TokenCost.bucket(64) == 64


def policy_with(fixed: float, per_token: float, draft_fixed: float) -> SpeculationPolicy:
    policy = SpeculationPolicy(max_gamma=6)
    for n in (1, 8, 64, 256):
        policy.target_cost.observe(n, fixed + per_token * n)
        policy.draft_cost.observe(n, draft_fixed + per_token * n / 10)
    return policy


def test_gamma_follows_measured_verify_widths():
    """A CPU-like target whose 2-token forward costs 58% more than a 1-token one: speculating one
    free draft pays only above α ≈ 0.58."""
    policy = SpeculationPolicy(max_gamma=1)
    for n, seconds in ((1, 0.082), (2, 0.129)):
        policy.target_cost.observe(n, seconds)
    policy.draft_cost.observe(1, 0.0)
    assert policy.best_gamma([0.3]) == 0 and policy.best_gamma([0.8]) == 1


def test_gamma_shrinks_as_batch_grows_and_turns_off_for_bad_drafts():
    policy = policy_with(fixed=0.050, per_token=0.002, draft_fixed=0.005)
    small, large = policy.best_gamma([0.8]), policy.best_gamma([0.8] * 64)
    assert small >= 3 and large < small
    assert policy.best_gamma([0.02]) == 0
    assert expected_tokens(0.0, 4) == 1.0 and abs(expected_tokens(0.5, 1) - 1.5) < 1e-9


def test_adaptive_engine_turns_off_a_useless_draft(target):
    from models import ShiftedDraft

    engine = SpeculativeEngine(target, ShiftedDraft(target), num_speculative_tokens=4, adaptive=True)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=60, temperature=0.0))[0]
    assert out.token_ids == hf_greedy(target, [1, 2, 3], 60)
    # Speculation is off after the first steps, bar the periodic one-token probes.
    assert out.metrics.num_draft_tokens <= 4 * 3 + 60 // 16


def test_probes_back_off_while_drafting_does_not_pay():
    policy = SpeculationPolicy(max_gamma=4, probe_every=4)
    policy.target_cost.observe(1, 0.08)
    policy.target_cost.observe(2, 0.0801)
    policy.draft_cost.observe(1, 0.0001)  # a probe costs next to nothing
    chosen = [policy.choose([0.01]) for _ in range(60)]
    probes = [i for i, g in enumerate(chosen) if g]
    assert chosen[:3] == [0, 0, 0] and probes[:3] == [3, 11, 27]  # every 4, then 8, then 16 steps
    assert policy.choose([0.95]) > 0  # good acceptance turns drafting straight back on


def test_probes_cost_at_most_their_share_of_the_time_between_them():
    """A probe first catches the draft up on the tokens it skipped (an eager forward on a GPU):
    probes come no more often than their extra cost is PROBE_SHARE of the steps between them."""
    from specserve.engine.policy import PROBE_SHARE

    policy = SpeculationPolicy(max_gamma=4, probe_every=4)
    for n in range(1, 6):
        policy.target_cost.observe(n, 0.010 + 0.0001 * n)
    for n in (1, 16, 64, 256):
        policy.draft_cost.observe(n, 0.006 + 0.0002 * n)  # a catch-up over 200 tokens: ~7x a step
    steps = backlog = probes = 0
    for _ in range(600):
        gamma = policy.choose([0.01], backlog)
        steps, backlog = steps + 1, backlog + 1
        if gamma:
            extra = policy.step_time(1, gamma, backlog - 1) - policy.step_time(1, 0)
            assert extra <= PROBE_SHARE * steps * policy.step_time(1, 0) + 1e-12
            steps, backlog, probes = 0, 0, probes + 1
    assert probes >= 2  # spaced out, not given up


def test_a_probe_drafts_a_block_while_little_is_known_and_one_token_once_drafting_loses():
    """At the prior α drafting does not pay here, but a better drafter would: while the estimate
    rests on few trials a probe drafts a block (a one-token probe adds at most one trial, and the
    back-off spaces probes out before the estimate could move). Once many trials say the drafts
    are rejected, probes draft one token."""
    from specserve.engine.policy import AcceptanceEstimate

    policy = SpeculationPolicy(max_gamma=4)
    for n in range(1, 6):
        policy.target_cost.observe(n, 0.010 + 0.0005 * n)
    policy.draft_cost.observe(1, 0.006)
    assert policy.best_gamma([policy.prior_alpha]) == 0
    assert policy.probe_gamma(1) >= 2
    for _ in range(200):
        policy.observe_acceptance(AcceptanceEstimate(), 0, 1)
    assert policy.probe_gamma(1) == 1


def low_policy(draft_seconds: float) -> SpeculationPolicy:
    """A policy whose 300 one-token drafts were all rejected, on costs where a block would pay at α 0.95
    (draft_seconds 0.002; not at 0.050: a draft forward at 4x the target's)."""
    from specserve.engine.policy import AcceptanceEstimate

    policy = SpeculationPolicy(max_gamma=4)
    for n in range(1, 6):
        policy.target_cost.observe(n, 0.010 + 0.0005 * n)
    policy.draft_cost.observe(1, draft_seconds)
    for _ in range(300):
        policy.observe_acceptance(AcceptanceEstimate(), 0, 1)
    return policy


def test_a_request_no_step_drafted_for_is_tried_once_with_a_block():
    """After a run of rejected drafts the overall rate says drafting loses, and a new request
    starts at that rate. It is tried once with a full block, as soon as that probe costs at most
    NEWCOMER_SHARE of the steps since the last probe; after that only the overall one-token
    probes come. Where drafting could not pay even at a high rate, nobody is tried."""
    from specserve.engine.policy import NEWCOMER_SHARE

    policy = low_policy(0.002)
    assert policy.best_gamma([policy.overall_alpha()]) == 0 and policy.probe_gamma(1) == 1
    newcomer, steps, tried = True, 0, []
    for _ in range(200):
        gamma = policy.choose([policy.overall_alpha()], 0, newcomers=int(newcomer))
        steps += 1
        if gamma:
            if newcomer:
                extra = policy.step_time(1, gamma) - policy.step_time(1, 0)
                assert extra <= NEWCOMER_SHARE * steps * policy.step_time(1, 0) + 1e-12
            tried.append((newcomer, gamma))
            newcomer, steps = False, 0
    assert tried[0][0] and tried[0][1] >= 3  # the newcomer's probe: a block
    assert len(tried) > 1 and all(not new and g == 1 for new, g in tried[1:])  # then the overall probes

    expensive = low_policy(0.050)
    assert all(expensive.choose([expensive.overall_alpha()], 0, newcomers=1) == 0 for _ in range(15))


def test_newcomer_probes_back_off_while_they_find_requests_like_the_rest():
    """Under steady load a new request joins every few steps, and where drafting does not pay for
    any of them each one's block probe is pure cost (the draft model's own trace replayed on its
    CPU costs lost 6-7% at batches 2-8 to them). So each newcomer probe that did not turn drafting
    on halves the share of time the next one may take, down to MIN_NEWCOMER_SHARE; a step that
    drafts again restores NEWCOMER_SHARE, so that a request the drafter serves well after a
    change of traffic is found as soon as before."""
    from specserve.engine.policy import MIN_NEWCOMER_SHARE, NEWCOMER_SHARE, AcceptanceEstimate

    policy = low_policy(0.002)
    extra, plain = policy.step_time(1, 4) - policy.step_time(1, 0), policy.step_time(1, 0)

    def gaps(count: int) -> list[int]:
        """Steps from one probe to the next, every step with a row not yet drafted for."""
        steps, out = 0, []
        while len(out) < count:
            gamma = policy.choose([policy.overall_alpha()], 0, newcomers=1)
            steps += 1
            if gamma:
                assert gamma == 4  # every probe here is a newcomer's block
                out.append(steps)
                steps = 0
        return out

    shares = [NEWCOMER_SHARE / 2 ** k for k in range(3)] + [MIN_NEWCOMER_SHARE] * 3
    assert gaps(6) == [math.ceil(extra / (share * plain)) for share in shares]
    hits = AcceptanceEstimate()
    for _ in range(300):  # the traffic changes: drafts are kept
        policy.observe_acceptance(hits, 1, 1)
    assert policy.choose([policy.alpha(hits)], 0) > 0
    for _ in range(300):  # and changes back
        policy.observe_acceptance(AcceptanceEstimate(), 0, 1)
    assert gaps(2) == [math.ceil(extra / (share * plain)) for share in shares[:2]]


def test_offer_rates_give_the_verify_its_widths_and_a_stopping_loop_its_forwards():
    """Rows that draft each next planned position with chance κ_b: the verify checks the longest
    run any row drafted plus the bonus, and a host-checked loop runs one forward and one per
    further position some row drafts."""
    from specserve.engine.policy import Widths, offered_widths

    one = offered_widths([0.5], max_gamma=2, stops=True)
    assert one.reach == (1.0, 0.5, 0.25)
    assert one.verify(2) == [(1, 0.5), (2, 0.25), (3, 0.25)] and one.verify(0) == [(1, 1.0)]
    assert one.loop(2) == 1.5 and one.loop(1) == 1.0 and offered_widths([0.5], 2, stops=False).loop(2) == 2.0
    two = offered_widths([0.5, 0.5], max_gamma=1, stops=True)
    assert two.reach == (1.0, 0.75)  # either row drafting position 1 widens the verify
    assert offered_widths([1.0, 1.0], 3, stops=True) == Widths.full(3) and Widths.full(3).verify(3) == [(4, 1.0)]


def demo_policy() -> SpeculationPolicy:
    """The README demo's costs (a 2-core CPU, SmolLM2-135M and its feature head), calibrated."""
    from specserve.bench.policy import CPU_DEMO, calibrate

    policy = SpeculationPolicy(max_gamma=6)
    calibrate(policy, CPU_DEMO)
    policy.overhead = CPU_DEMO.overhead
    return policy


def test_a_drafter_that_declines_is_priced_at_what_it_drafts():
    """The demo's head drafts 0.41 of the positions planned, and keeps 0.65 of those: ρ ≈ 0.27 a
    planned position. A declined position yields nothing but costs little: the verify narrows
    and the loop stops. At one stream that pays; at a steady batch of 4 it does not (the replay:
    test_policy_replay.py). Priced at 0.65 a position with every planned one drafted, the batch of
    4 drafted: 0.84x of γ=0."""
    policy = demo_policy()
    policy._loop_stops = True  # (as the eager loop showed it)
    assert policy.best_gamma([0.27], offers=[0.41]) >= 1
    assert policy.best_gamma([0.27] * 4, offers=[0.41] * 4) == 0
    assert policy.best_gamma([0.65] * 4) >= 1  # the over-promise


def test_after_rows_the_drafter_declines_a_request_it_serves_well_is_found():
    """Rows whose every planned position the drafter declined (raw text the head is unsure of) leave
    the overall ρ and κ near 0. A new request it drafts well for is still tried with a block (its
    newcomer probe plans as if it drafted and kept 0.95 of the positions), and once its own steps
    show that, drafting stays on for it. (One global offer rate that scaled even that probe's hope,
    to 0.95 κ, once left chat requests at one stream undrafted: 0.96x of γ=0 where drafting had
    given 1.3x.)"""
    from specserve.engine.policy import AcceptanceEstimate

    policy = demo_policy()
    policy._loop_stops = True
    for _ in range(300):
        policy.observe_acceptance(AcceptanceEstimate(), 0, 6)
        policy.observe_offers(AcceptanceEstimate(), 0, 6)
    assert policy.overall_alpha() < 0.05 and policy.offer(AcceptanceEstimate()) < 0.05
    rho, kappa = AcceptanceEstimate(), AcceptanceEstimate()
    chosen = []
    for step in range(60):
        gamma = policy.choose([policy.alpha(rho)], 0, newcomers=int(not chosen or max(chosen) == 0),
                              offers=[policy.offer(kappa)])
        chosen.append(gamma)
        if gamma:  # it drafts every planned position and the target keeps all but every fourth
            kept = gamma - 1 if step % 4 == 0 else gamma
            policy.observe_acceptance(rho, kept, gamma)
            policy.observe_offers(kappa, gamma, gamma)
    first = next(i for i, g in enumerate(chosen) if g)
    assert first <= 20 and chosen[first] >= 3, chosen
    assert all(chosen[first + 1:]), chosen


def test_a_step_that_plans_drafts_for_a_row_marks_it_drafted_for(target):
    from specserve.engine.step import new_sequence, plan_step

    policy = SpeculationPolicy(max_gamma=3, adaptive=False)
    seqs = [new_sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=m, temperature=0.0), vocab_size=64,
                         max_model_len=64, eos_token_ids=frozenset()) for i, m in enumerate((8, 1))]
    for s in seqs:  # prefilled (a row still carrying its prompt drafts nothing: its first step)
        s.target_len = s.draft_len = 2
    assert not any(s.drafted_for for s in seqs)
    plan_step(seqs, policy)
    assert [s.drafted_for for s in seqs] == [True, False]  # the second may emit one token: no drafts


def test_a_step_that_only_prefills_spends_no_probe_and_a_prefilling_row_is_no_newcomer():
    """At one stream a new request's first step carries its prompt and drafts nothing. Counted as a
    newcomer there, its block probe was chosen on that step, drafted nothing, and put the next
    probe off by its spacing: code requests after chats, SmolLM2 with its draft model at one
    stream, were drafted for in some runs and hardly in others (580 drafts and 1.22x of the target
    alone in one, 156 and 1.00x in the next)."""
    from specserve.engine.step import new_sequence, plan_step

    asked = []

    class Recording(SpeculationPolicy):
        def choose(self, alphas, backlog=0, newcomers=0, offers=None):
            asked.append((len(alphas), newcomers))
            return super().choose(alphas, backlog, newcomers, offers)

    def request(name: str, prefilled: bool):
        seq = new_sequence(name, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0), vocab_size=64,
                           max_model_len=64, eos_token_ids=frozenset())
        seq.target_len = seq.draft_len = 2 if prefilled else 0
        return seq

    policy = Recording(max_gamma=3)
    fresh = request("new", prefilled=False)
    plan = plan_step([fresh], policy)
    assert asked == [] and int(plan.num_draft.sum()) == 0 and not fresh.drafted_for
    older = request("old", prefilled=True)
    plan_step([older, fresh], policy)
    assert asked == [(2, 1)]  # of the two not yet drafted for, the one that can draft
    assert not fresh.drafted_for


def test_cache_memory_follows_live_requests_down(target):
    runner = ModelRunner(target)
    runner.forward([RowInput(f"r{i}", 0, [1] * (40 if i else 250)) for i in range(8)], logits="none")
    peak = runner.cache.memory_bytes()
    for i in range(8):
        if i != 3:
            runner.free(f"r{i}")  # the long one (r0) and most short ones leave
    # 9 slots (8 + the scratch slot padded rows write to) at the peak, 2 (1 + scratch) after
    assert runner.cache.memory_bytes() * 4 <= peak
    kept = runner.forward([RowInput("r3", 40, [9])])
    fresh = ModelRunner(target).forward([RowInput("x", 0, [1] * 40 + [9])])
    assert torch.allclose(kept, fresh, atol=1e-5)  # what the live request holds survived the move


def test_catching_up_a_lagging_drafter_counts_against_drafting():
    policy = SpeculationPolicy(max_gamma=2)
    for n, seconds in ((1, 0.08), (2, 0.09), (3, 0.10), (64, 0.30)):
        policy.target_cost.observe(n, seconds)
        policy.draft_cost.observe(n, seconds / 4)
    assert policy.best_gamma([0.6]) > 0
    assert policy.best_gamma([0.6], backlog=64) == 0  # 64 tokens to prefill first: not worth it



def test_a_fused_drafter_pays_the_call_overhead_once_per_step():
    """A drafter in the target worker drafts inside the verify's call: a step's host time (the
    round trip) is one call's, whatever γ, so it must not be spread over the draft forwards."""
    from specserve.engine.model_runner import ForwardTiming

    def after_one_step(fused: bool) -> SpeculationPolicy:
        policy = SpeculationPolicy(max_gamma=2, fused=fused)
        # a γ=2 step: two 2 ms drafts and a 40 ms verify of 3 tokens, 36 ms of round trip
        policy.observe_step(0.080, [ForwardTiming(1, 0.002)] * 2, [ForwardTiming(3, 0.040)])
        policy.target_cost.observe(1, 0.038)
        return policy

    fused, split = after_one_step(True), after_one_step(False)
    assert abs(fused.overhead - 0.036) < 1e-9 and abs(split.overhead - 0.036 / 3) < 1e-9
    for policy in (fused, split):  # both reproduce the step they saw
        assert abs(policy.step_time(1, 2) - 0.080) < 1e-9
    # a target-only step pays the same round trip: only the fused model knows, and drafts at α 0.3
    assert abs(fused.step_time(1, 0) - (0.038 + 0.036)) < 1e-9
    assert fused.best_gamma([0.3]) > 0 and split.best_gamma([0.3]) == 0


def test_sizes_known_only_from_calibration_follow_the_load():
    """Calibrated on a quiet machine, a batch of 8 then decodes under load, only ever at 8 tokens:
    16 tokens (γ 1) must be predicted at the same load, or drafting looks cheaper than it is."""
    from specserve.engine.model_runner import ForwardTiming

    policy = SpeculationPolicy(max_gamma=1)
    for n, seconds in ((1, 0.035), (8, 0.070), (16, 0.090)):
        policy.calibrate_costs("target", [ForwardTiming(n, seconds)])
    policy.calibrate_costs("draft", [ForwardTiming(8, 0.004)])
    assert policy.best_gamma([0.3] * 8) == 0  # 1.3 tokens for 1.34x the time: no
    calibrated_only = SpeculationPolicy(max_gamma=1)
    calibrated_only.target_cost.observe(16, 0.090)  # the old way: calibration counted as live
    calibrated_only.draft_cost.observe(8, 0.004)
    for _ in range(20):  # the same machine, 1.4x slower under the server's own load
        policy.observe_costs("target", [ForwardTiming(8, 0.100)])
        calibrated_only.observe_costs("target", [ForwardTiming(8, 0.100)])
    assert abs(policy.target_cost.level() - 0.100 / 0.070) < 1e-2
    assert abs(policy.target_cost.predict(16) - 0.090 * 0.100 / 0.070) < 1e-3 * 1.5
    # then a γ 1 stretch at a lighter load: 8 tokens, last measured slow, are read at it too
    for _ in range(30):
        policy.observe_costs("target", [ForwardTiming(16, 0.090 * 1.1)])
    assert abs(policy.target_cost.predict(8) - 0.070 * 1.1) < 0.004
    assert policy.best_gamma([0.3] * 8) == 0
    assert calibrated_only.best_gamma([0.3] * 8) == 1  # 16 tokens at their idle cost: a false win


def test_measured_steps_correct_what_the_per_size_costs_miss():
    """The per-size costs say γ 1 pays at a batch of 8: a verify of 16 tokens plus one head forward
    of 8. A feature head's real step there also re-reads each row's accepted tokens (16 tokens,
    4x the modelled draft time): after a few such steps the policy stops drafting at 8 and keeps
    drafting at 1, and at 8 it expects the same of γ 2."""
    from specserve.engine.model_runner import ForwardTiming

    policy = SpeculationPolicy(max_gamma=1, fused=True)
    for n, seconds in ((1, 0.040), (2, 0.041), (8, 0.090), (16, 0.105)):
        policy.observe_costs("target", [ForwardTiming(n, seconds)])
    for n in (1, 8, 64):
        policy.observe_costs("draft", [ForwardTiming(n, 0.002 + 0.0002 * n)])
    for _ in range(5):  # target-only steps at 8: 10 ms of round trip each
        policy.observe_step(0.100, [], [ForwardTiming(8, 0.090)], batch=8, gamma=0)
    alphas = [0.3] * 8
    assert policy.best_gamma(alphas) == 1 and policy.best_gamma([0.3]) == 1
    for _ in range(6):
        policy.observe_step(0.1306, [ForwardTiming(16, 0.0156)], [ForwardTiming(16, 0.105)], batch=8, gamma=1)
        policy.observe_step(0.100, [], [ForwardTiming(8, 0.090)], batch=8, gamma=0)
    assert policy.best_gamma(alphas) == 0 and policy.best_gamma([0.3]) == 1
    assert policy.step_time(8, 2) - policy.step_time(8, 0) > 2 * (0.0156 - 0.0036)
    # a probe's catch-up over 200 skipped tokens is not held against drafting, even when it cost
    # five times its prediction (an eager forward of an odd size, where the drafts replay a graph)
    before = policy.step_time(1, 1)
    catch_up, draft = 5 * policy.draft_cost.predict(200), policy.draft_cost.predict(1)
    policy.observe_step(before + catch_up, [ForwardTiming(200, catch_up), ForwardTiming(1, draft)],
                        [ForwardTiming(2, 0.041)], batch=1, gamma=1, backlog=200)
    assert abs(policy.step_time(1, 1) - before) < 0.05 * before
    assert policy.draft_cost.predict(200) > 2 * catch_up / 5  # learned for its own size
