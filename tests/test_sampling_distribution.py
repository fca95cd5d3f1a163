"""Sampled speculative output follows the target's distribution exactly (Leviathan/Chen rule).

With an 8-token vocabulary the exact distribution of the 2nd and 3rd generated tokens is computed
by enumerating every prefix; 20,000 seeded sequences from the engine must match it (chi-square),
and a deliberately wrong rule (resampling from p instead of the residual on rejection) must not.
"""
import collections

import pytest
import torch

import specserve.engine.verifier as verifier_module
from models import tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine.rejection import (
    AcceptResult, _leading_true, rejection_sample, rejection_sample_deterministic,
)
from specserve.engine.sampling import BatchSampling, logits_to_probs, sample_with_uniforms

VOCAB = 8
PROMPT = [1, 2, 3]
NUM_SEQUENCES = 20_000
# 4 tokens: the first comes from the prompt's forward alone (a first step drafts nothing), then a
# step of γ 2 drafts the 2nd and 3rd, whose marginals are checked
SETTINGS = {
    "plain": SamplingParams(max_tokens=4, temperature=1.0),
    "top_k": SamplingParams(max_tokens=4, temperature=0.8, top_k=3),
    "top_p": SamplingParams(max_tokens=4, temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(max_tokens=4, temperature=1.0, min_p=0.3),
    "min_p_top_p": SamplingParams(max_tokens=4, temperature=0.9, min_p=0.1, top_p=0.8),
}


@pytest.fixture(scope="module")
def pair():
    small = dict(vocab=VOCAB, init_range=0.3, layers=1, hidden=16)
    return tiny_llama(0, **small), tiny_llama(5, **small)


def next_probs(model, prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """[N, V] the sampling distribution after each prefix (all prefixes of one length)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(prefixes)).logits[:, -1]
    return logits_to_probs(logits, BatchSampling.from_params([params] * len(prefixes)))


def exact_marginals(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact P(2nd token) and P(3rd token), each [V]."""
    p1 = next_probs(model, [PROMPT], params)[0]  # [V]
    p2_given = next_probs(model, [PROMPT + [a] for a in range(VOCAB)], params)  # [V(a), V(b)]
    joint12 = p1[:, None] * p2_given  # [V(a), V(b)]
    prefixes = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p3_given = next_probs(model, prefixes, params).view(VOCAB, VOCAB, VOCAB)  # [a, b, c]
    return joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))


def sampled_marginals(target, draft, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=2, adaptive=False, max_batch_size=2500)
    seeded = [SamplingParams(**{**params.__dict__, "seed": i, "ignore_eos": True}) for i in range(NUM_SEQUENCES)]
    outs = engine.generate([PROMPT] * NUM_SEQUENCES, seeded)
    second = collections.Counter(o.token_ids[1] for o in outs)
    third = collections.Counter(o.token_ids[2] for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0.1 * NUM_SEQUENCES  # the rule is exercised
    count = lambda c: torch.tensor([c[v] for v in range(VOCAB)], dtype=torch.float64)  # noqa: E731
    return count(second), count(third)


def enumerated_marginals(dist) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact P(2nd token) and P(3rd token) [V] from dist(output so far) -> P(next) [V] float64."""
    p1 = dist([])
    joint = p1[:, None] * torch.stack([dist([a]) for a in range(VOCAB)])  # [a, b]
    p3 = torch.stack([torch.stack([dist([a, b]) for b in range(VOCAB)]) for a in range(VOCAB)])  # [a, b, c]
    return joint.sum(0), (joint[..., None] * p3).sum((0, 1))


def assert_engine_samples(engine, params: SamplingParams, exact2: torch.Tensor, exact3: torch.Tensor) -> None:
    """NUM_SEQUENCES seeded runs of PROMPT: the 2nd and 3rd tokens follow exact2 / exact3, and
    enough drafts are accepted that the rule is exercised."""
    seeded = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(NUM_SEQUENCES)]
    outs = engine.generate([PROMPT] * NUM_SEQUENCES, seeded)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0.1 * NUM_SEQUENCES
    count = lambda pos: torch.tensor(  # noqa: E731
        [sum(o.token_ids[pos] == v for o in outs) for v in range(VOCAB)], dtype=torch.float64)
    assert chi_square_pvalue(count(1), exact2) > 1e-4
    assert chi_square_pvalue(count(2), exact3) > 1e-4


def chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; a count on a zero-probability token is an outright failure (p = 0)."""
    expected = probs.double() * observed.sum()
    support = expected > 0
    if observed[~support].sum() > 0:
        return 0.0
    stat = ((observed[support] - expected[support]) ** 2 / expected[support]).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def assert_proposer_follows_target(target, proposer) -> None:
    """A drafter's engine (γ 2, every sequence seeded) samples PROMPT's second and third tokens
    from the target's own distribution, and accepts often enough that the rule is exercised."""
    from specserve import SpeculativeEngine

    params = SETTINGS["plain"]
    exact2, exact3 = exact_marginals(target, params)
    engine = SpeculativeEngine(target, proposer=proposer, num_speculative_tokens=2, adaptive=False,
                               max_batch_size=2500)
    seeded = [SamplingParams(**{**params.__dict__, "seed": i, "ignore_eos": True}) for i in range(NUM_SEQUENCES)]
    outs = engine.generate([PROMPT] * NUM_SEQUENCES, seeded)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0.1 * NUM_SEQUENCES  # the rule is exercised
    count = lambda pos: torch.tensor(  # noqa: E731
        [sum(o.token_ids[pos] == v for o in outs) for v in range(VOCAB)], dtype=torch.float64)
    assert chi_square_pvalue(count(1), exact2) > 1e-4
    assert chi_square_pvalue(count(2), exact3) > 1e-4


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_sampling_matches_target_distribution(pair, setting):
    target, draft = pair
    params = SETTINGS[setting]
    exact2, exact3 = exact_marginals(target, params)
    seen2, seen3 = sampled_marginals(target, draft, params)
    assert chi_square_pvalue(seen2, exact2) > 1e-4
    assert chi_square_pvalue(seen3, exact3) > 1e-4


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_likeliest():
    """Against the rule written out: after temperature, p_i >= min_p x max p, then top-k / top-p on
    what is left; a row with min_p 0 in a batch that filters keeps its distribution exactly."""
    gen = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(4, 50, generator=gen)  # [N, V]
    rows = [SamplingParams(temperature=0.7, min_p=0.05), SamplingParams(temperature=1.3, min_p=0.2, top_k=3),
            SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, min_p=1.0)]
    probs = logits_to_probs(logits, BatchSampling.from_params(rows))
    for b, p in enumerate(rows):
        plain = torch.softmax(logits[b] / p.temperature, -1)
        kept = plain >= p.min_p * plain.max()
        if p.top_k:
            kept &= plain >= plain[kept].topk(p.top_k).values[-1]
        want = torch.where(kept, plain, 0.0)
        assert torch.allclose(probs[b], want / want.sum(), atol=1e-6), p
    assert (probs[3] > 0).sum() == 1  # min_p 1: the likeliest token alone
    assert torch.equal(probs[2], logits_to_probs(logits[2:3], BatchSampling.from_params(rows[2:3]))[0])


@pytest.mark.parametrize("drafter", ["draft-model", "feature-head"])
def test_draft_loops_draw_from_min_p_filtered_q(drafter, head_dir, monkeypatch):
    """Every q that reaches the rule (the draft loop's static buffers carry min_p) and every p
    holds no token below min_p x its likeliest: the draft filters as the target does, which keeps
    acceptance up; the output's distribution is the engine test's above."""
    from specserve.engine import DraftModelProposer
    from specserve.engine.proposers import target_vocab_size
    from test_feature_drafter import build, target as head_target

    min_p = 0.3
    model = head_target() if drafter == "feature-head" else tiny_llama(0)
    proposer = build(head_dir, model) if drafter == "feature-head" else \
        DraftModelProposer(tiny_llama(5), target_vocab_size(model))
    seen, rule = [], verifier_module.rejection_sample

    def recording(target_probs, draft_tokens, draft_probs, *rest):
        seen.append((target_probs, draft_probs))
        return rule(target_probs, draft_tokens, draft_probs, *rest)
    monkeypatch.setattr(verifier_module, "rejection_sample", recording)
    engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=3, adaptive=False)
    params = [SamplingParams(max_tokens=12, temperature=0.1, min_p=min_p, seed=s, ignore_eos=True) for s in range(6)]
    engine.generate([[5, 9, 14, 2, 7]] * 6, params)
    assert seen
    for p, q in seen:
        for dist in (p, q):
            live = dist.sum(-1) > 0  # (a row or position without q holds zeros)
            top = dist.amax(-1, keepdim=True)
            assert ((dist == 0) | (dist >= min_p * top * (1 - 1e-3)))[live].all()


def recording_q_dtypes(proposer) -> list:
    """The list that each of the proposer's later proposals extends with its q's dtype (None: no q)."""
    sent, propose = [], proposer.propose

    def recorded(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        sent.append(None if proposal.probs is None else proposal.probs.dtype)
        return proposal
    proposer.propose = recorded
    return sent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q_sent_in_16_bits_keeps_the_targets_distribution(pair, dtype):
    """A draft whose q crosses to the target in 16 bits (a served draft worker of a bfloat16 or
    float16 target) draws from q so rounded, and the target reads it normalised: the output is
    still the target's distribution, and q does reach the rule in that dtype (a lost q would pass
    the chi-square too: the one-hot rule is exact for any q, only slower)."""
    from specserve.engine import DraftModelProposer

    target, draft = pair
    proposer = DraftModelProposer(draft, VOCAB)
    proposer.q_dtype = dtype
    sent = recording_q_dtypes(proposer)
    read, rule = [], verifier_module.rejection_sample

    def reading(target_probs, draft_tokens, draft_probs, *rest):
        read.append(draft_probs.dtype)
        return rule(target_probs, draft_tokens, draft_probs, *rest)
    verifier_module.rejection_sample = reading
    try:
        assert_proposer_follows_target(target, proposer)
    finally:
        verifier_module.rejection_sample = rule
    assert sent and set(sent) == {dtype}
    assert read and set(read) == {torch.float32}


def test_a_draft_draws_from_the_16_bit_q_it_sends(pair):
    """Each draft token is the one the rounded q gives for its uniform (as the target reads it),
    which drawing from the unrounded q would not be for some of 20,000 rows."""
    from specserve.engine import DraftModelProposer
    from specserve.engine.sampling import q_to_send

    proposer = DraftModelProposer(pair[1], VOCAB)
    proposer.q_dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    logits = 2.0 * torch.randn(NUM_SEQUENCES, VOCAB, generator=gen)  # [N, V]
    uniforms = torch.rand(NUM_SEQUENCES, 1, generator=gen)  # [N, G]
    sampling = BatchSampling.from_params([SETTINGS["plain"]] * NUM_SEQUENCES)
    tokens, q = proposer._pick(logits, sampling, sampling.loop_flags(), {"uniforms": uniforms}, 0, True)
    exact = logits_to_probs(logits, sampling)  # [N, V]
    assert torch.equal(q, q_to_send(exact, torch.bfloat16))
    assert torch.equal(tokens, sample_with_uniforms(q, uniforms[:, 0]))
    assert not torch.equal(tokens, sample_with_uniforms(exact, uniforms[:, 0]))


def test_a_16_bit_q_is_drawn_from_and_read_as_one_distribution():
    """`q_to_send` rounds q to values the 16-bit dtype holds (one-hot rows unchanged, float32 q
    untouched); `q_as_read` gives back float32 rows that sum to 1, in proportion to the values
    the draft drew from, and leaves a row of zeros (no q) as zeros."""
    from specserve.engine.sampling import q_as_read, q_to_send

    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(3.0 * torch.randn(4, 1000, generator=gen), -1)  # [N, V]
    q[1] = torch.nn.functional.one_hot(torch.tensor(7), 1000).float()
    assert q_to_send(q, torch.float32) is q
    for dtype in (torch.bfloat16, torch.float16):
        sent = q_to_send(q, dtype)
        assert sent.dtype == torch.float32 and torch.equal(sent.to(dtype).float(), sent)
        assert torch.equal(sent[1], q[1]) and not torch.equal(sent, q)
        read = q_as_read(torch.cat([sent, torch.zeros(1, 1000)]).to(dtype))  # [N + 1, V]
        assert read.dtype == torch.float32 and torch.equal(read[-1], torch.zeros(1000))
        assert torch.allclose(read[:-1].sum(-1), torch.ones(4), atol=1e-6)
        assert torch.allclose(read[:-1], sent / sent.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    assert q_as_read(q) is q
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        q_to_send(q, torch.float64)


def wrong_rule(target_probs, draft_tokens, draft_probs, num_draft, accept_uniforms, final_uniforms):
    """The classic mistake: on rejection, resample from p instead of norm(max(0, p - q))."""
    idx = draft_tokens[..., None]
    p_of_x = target_probs[:, :-1].gather(-1, idx).squeeze(-1)
    q_of_x = draft_probs.gather(-1, idx).squeeze(-1)
    in_range = torch.arange(draft_tokens.shape[1])[None, :] < num_draft[:, None]
    num_accepted = _leading_true((accept_uniforms * q_of_x < p_of_x) & in_range)
    p_next = target_probs[torch.arange(draft_tokens.shape[0]), num_accepted]
    return AcceptResult(num_accepted, sample_with_uniforms(p_next, final_uniforms))


def test_wrong_rule_is_caught(pair, monkeypatch):
    monkeypatch.setattr(verifier_module, "rejection_sample", wrong_rule)
    target, draft = pair
    params = SETTINGS["plain"]
    exact2, exact3 = exact_marginals(target, params)
    seen2, seen3 = sampled_marginals(target, draft, params)
    assert min(chi_square_pvalue(seen2, exact2), chi_square_pvalue(seen3, exact3)) < 1e-6


def test_deterministic_rule_is_the_one_hot_rule_and_follows_p():
    """Drafts with no q (prompt lookup): the rule without [B, G, V] gives exactly what the general
    rule gives with a one-hot q, and the first emitted token follows p (chi-square, 20k draws)."""
    gen = torch.Generator().manual_seed(0)
    width, num = 3, NUM_SEQUENCES
    p = torch.softmax(2.0 * torch.randn(width + 1, VOCAB, generator=gen), -1)  # [G+1, V]
    drafts = torch.tensor([int(p[0].argmax()), 1, int(p[2].argmin())])  # likely, any, unlikely
    probs = p.expand(num, -1, -1)  # [N, G+1, V]
    tokens = drafts.expand(num, -1)  # [N, G]
    num_draft = torch.full((num,), width)
    accept_u, final_u = torch.rand(num, width, generator=gen), torch.rand(num, generator=gen)
    fast = rejection_sample_deterministic(probs, tokens, num_draft, accept_u, final_u)
    one_hot = torch.nn.functional.one_hot(tokens, VOCAB).float()  # [N, G, V]
    general = rejection_sample(probs, tokens, one_hot, num_draft, accept_u, final_u)
    assert torch.equal(fast.num_accepted, general.num_accepted)
    assert torch.equal(fast.next_token, general.next_token)
    first = torch.where(fast.num_accepted > 0, tokens[:, 0], fast.next_token)
    assert 0.1 * num < int((fast.num_accepted > 0).sum()) < 0.9 * num  # both branches exercised
    assert chi_square_pvalue(torch.bincount(first, minlength=VOCAB).double(), p[0]) > 1e-4
    wrong = torch.where(fast.num_accepted > 0, tokens[:, 0], sample_with_uniforms(p[:1].expand(num, -1), final_u))
    assert chi_square_pvalue(torch.bincount(wrong, minlength=VOCAB).double(), p[0]) < 1e-6


def test_a_row_that_filters_nothing_keeps_its_distribution_in_a_batch_that_filters():
    """A row with neither top-k nor top-p has the same probabilities, bit for bit, whether or not a
    batch-mate filters (then the row goes through the sort too); top-p 1 keeps the tail that the
    float sum of the sorted probabilities has already rounded to 1. Draft loops rely on it: their
    sampled variant depends on whether any row filters (`BatchSampling.loop_flags`)."""
    logits = torch.tensor([[0.0, -30.0, -40.0, -45.0, 1.0, -50.0, -60.0, -70.0]] * 2)  # [2, V]: a long thin tail
    plain = SamplingParams(temperature=0.7)
    alone = logits_to_probs(logits[:1], BatchSampling.from_params([plain]))  # [1, V]
    mixed = BatchSampling.from_params([plain, SamplingParams(temperature=0.7, top_k=2)])
    assert mixed.flags() == (True, False)
    beside = logits_to_probs(logits, mixed)  # [2, V]
    assert (alone > 0).all()  # the tail is kept, however thin
    assert torch.equal(beside[0], alone[0])
    assert int((beside[1] > 0).sum()) == 2  # the batch-mate did filter
    nearly_all = logits_to_probs(logits[:1], BatchSampling.from_params([SamplingParams(temperature=0.7, top_p=0.999)]))
    assert int((nearly_all > 0).sum()) < VOCAB  # top-p below 1 still drops what lies past it


def test_draft_loops_come_in_three_variants_whatever_the_mix_of_rows():
    """Greedy rows beside sampled ones take no loop variant of their own: a batch is all greedy
    (None), sampled (False, True) or sampled with some row filtering (True, True)."""
    greedy, hot, top_p = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9), \
        SamplingParams(temperature=0.9, top_p=0.8)
    variant = lambda *ps: BatchSampling.from_params(list(ps)).loop_flags()  # noqa: E731
    assert variant(greedy, greedy) is None
    assert variant(hot) == variant(hot, greedy) == (False, True)
    assert variant(top_p) == variant(top_p, greedy, hot) == (True, True)
