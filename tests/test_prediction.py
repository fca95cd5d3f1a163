"""Predicted outputs: where a prediction is found in the output, and that drafting it changes no token.

A prediction (OpenAI's `prediction`) is drafted where the output follows it, whatever the drafter
would have drafted there. With an exact prediction even an always-wrong draft model has every
predicted draft accepted; with any prediction, greedy tokens equal the target alone's and sampled
tokens follow the target's distribution (the draws below, and the random scenarios of
test_engine_scenarios.py / test_served_scenarios.py, which send edited, cut and unrelated ones).
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from models import ShiftedDraft, hf_greedy, perturbed, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine.prediction import MAX_MATCH, NEAR, Prediction, apply_forced, forced_drafts, forced_runs
from specserve.engine.proposers import LayerSkipSpec, PredictionSpec, PromptLookupSpec

MAX_NEW = 40


# -- where the output is in the prediction ------------------------------------------------------------
def test_the_output_s_start_is_the_prediction_s():
    p = Prediction((5, 6, 7, 8))
    assert p.continuation([], 3) == [5, 6, 7]
    assert p.continuation([5], 3) == [6, 7, 8]
    assert p.continuation([5, 6, 7, 8], 3) == []  # the prediction's end: nothing left to draft
    assert p.continuation([], 0) == []


def test_an_edited_output_finds_the_prediction_again():
    text = list(range(10, 40))
    p = Prediction(tuple(text))
    assert p.continuation(text[:5], 4) == text[5:9]
    # a token replaced: the next token alone, just after, realigns
    assert p.continuation(text[:5] + [99, text[6]], 4) == text[7:11]
    # two tokens inserted, then the prediction again: its next pair realigns
    assert p.continuation(text[:8] + [98, 97] + text[8:10], 3) == text[10:13]
    # a stretch deleted: two tokens further on realign
    assert p.continuation(text[:10] + text[16:18], 3) == text[18:21]


def test_a_lone_common_token_far_from_the_last_alignment_is_no_match():
    p = Prediction((1, 2, 3, 4, 5, 6, 7))
    unrelated = [50 + i for i in range(NEAR + 2)]
    assert p.continuation(unrelated + [4], 3) == []  # one token, after more than NEAR unrelated ones
    assert p.continuation(unrelated + [3, 4], 3) == [5, 6, 7]  # two tokens are a match anywhere


def test_repeated_text_is_followed_forward():
    line = [7, 8, 9, 10]
    p = Prediction(tuple(line * 3 + [11]))
    out = []
    for _ in range(3):
        out += line
        assert p.continuation(out, 4) == (line * 3 + [11])[len(out): len(out) + 4]


def test_the_longest_match_wins():
    p = Prediction((1, 2, 3, 9, 5, 2, 3, 8))
    assert p.continuation([5, 2, 3], 1) == [8]  # "5 2 3" beats "2 3" at the start
    assert MAX_MATCH >= 3


def test_forced_drafts_and_their_q():
    forced = forced_drafts([[4, 5], [], [6]], 3)
    assert forced.tolist() == [[4, 5, -1], [-1, -1, -1], [6, -1, -1]]
    assert forced_runs(forced) == {0: [4, 5], 2: [6]}
    assert forced_drafts([[], []], 3) is None
    token, q = torch.tensor([0, 1, 2]), torch.full((3, 8), 1 / 8)
    token, q = apply_forced(token, q, forced[:, 0])
    assert token.tolist() == [4, 1, 6]
    assert q[0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0] and q[1].tolist() == [1 / 8] * 8


def test_a_prediction_is_checked():
    with pytest.raises(ValueError, match="prediction"):
        SamplingParams(prediction=(1, -2))
    assert SamplingParams(prediction=()).prediction is None


# -- lossless, and used -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, 96) for _ in range(rng.choice([3, 9, 20]))] for _ in range(n)]


DRAFTERS = {
    "always-wrong": lambda t: dict(draft=ShiftedDraft(t)),
    "ordinary": lambda t: dict(draft=perturbed(t, 0.6, seed=1)),
    "layer-skip": lambda t: dict(drafter=LayerSkipSpec((0,))),
    "prompt-lookup": lambda t: dict(drafter=PromptLookupSpec(2, 3)),
    "prediction-alone": lambda t: dict(drafter=PredictionSpec()),
}


def engine_for(target, kind: str, gamma: int = 4, **kw) -> SpeculativeEngine:
    made = DRAFTERS[kind](target)
    return SpeculativeEngine(target, made.pop("draft", None), num_speculative_tokens=gamma, adaptive=False, **made, **kw)


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
@pytest.mark.parametrize("paged", [False, True])
def test_an_exact_prediction_is_accepted_whole(target, kind, paged):
    """Every predicted draft is accepted, whichever the drafter (one that is always wrong too);
    each step then takes γ + 1 tokens, and the tokens are HF's greedy ones."""
    engine = engine_for(target, kind, kv_block_size=4 if paged else None)
    batch = prompts(3)
    refs = [hf_greedy(target, p, MAX_NEW) for p in batch]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, prediction=tuple(r)) for r in refs]
    outs = engine.generate(batch, params)
    for out, ref in zip(outs, refs):
        m = out.metrics
        assert out.token_ids == ref
        assert m.num_prediction_accepted == m.num_prediction_drafts > 0
        assert m.num_steps <= -(-MAX_NEW // 5) + 1  # γ 4: five tokens a step (the first from the prompt)


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_any_prediction_leaves_greedy_tokens_as_they_are(target, kind):
    """Edited, cut, unrelated and no predictions in one batch: the target's greedy tokens each."""
    batch = prompts(5)
    refs = [hf_greedy(target, p, MAX_NEW) for p in batch]
    rng = random.Random(3)
    edited = list(refs[1])
    edited[10:12] = [rng.randrange(96) for _ in range(3)]
    predictions = [tuple(refs[0]), tuple(edited), tuple(refs[2][:15]),
                   tuple(rng.randrange(96) for _ in range(30)), None]
    engine = engine_for(target, kind)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, prediction=p) for p in predictions]
    outs = engine.generate(batch, params)
    assert [o.token_ids for o in outs] == refs
    drafted = [o.metrics.num_prediction_drafts for o in outs]
    accepted = [o.metrics.num_prediction_accepted for o in outs]
    assert accepted[0] == drafted[0] > 0 and accepted[1] > 0 and accepted[2] > 0
    assert accepted[2] < drafted[2]  # past the cut prediction's end, its pairs earlier on are drafted and rejected
    assert drafted[4] == 0


def test_the_feature_head_drafts_a_prediction(head_dir):
    """A feature head takes a predicted run as a lookup row: drafted on the host, verified to its end."""
    from specserve.engine.feature_drafter import FeatureDrafterSpec
    from test_feature_drafter import target as head_target

    model = head_target()
    batch = prompts(3)
    refs = [hf_greedy(model, p, MAX_NEW) for p in batch]
    for floor in (None, 0.35):
        engine = SpeculativeEngine(model, drafter=FeatureDrafterSpec(str(head_dir), floor), num_speculative_tokens=4,
                                   adaptive=False)
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, prediction=p)
                  for p in (tuple(refs[0]), tuple(refs[1][:20]), None)]
        outs = engine.generate(batch, params)
        assert [o.token_ids for o in outs] == refs
        assert outs[0].metrics.num_prediction_accepted == outs[0].metrics.num_prediction_drafts > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_captured_draft_loop_takes_the_prediction(target, temperature):
    """Graph mode (graphs emulated on the CPU): a loop that forces drafts is a variant of its own,
    and its tokens are eager's."""
    from test_engine_static import emulate_graphs

    batch = prompts(3)
    refs = [hf_greedy(target, p, MAX_NEW) for p in batch]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=temperature, seed=9, prediction=p)
              for p in (tuple(refs[0]), None, tuple(refs[2][5:]))]
    eager = [o.token_ids for o in engine_for(target, "ordinary", 3).generate(batch, params)]
    engine = engine_for(target, "ordinary", 3, max_batch_size=4)
    for runner in (engine.verifier.runner, engine.proposer.runner):
        emulate_graphs(runner)
    outs = engine.generate(batch, params)
    assert [o.token_ids for o in outs] == eager
    assert any(key[-2] for key in engine.proposer.runner.graphs._entries if key[0] == "draft")  # a forcing loop
    if temperature == 0.0:
        assert eager == refs


def test_without_a_drafter_or_with_gamma_0_a_prediction_is_unused(target):
    batch = prompts(2)
    refs = [hf_greedy(target, p, 12) for p in batch]
    params = [SamplingParams(max_tokens=12, temperature=0.0, prediction=tuple(r)) for r in refs]
    alone = SpeculativeEngine(target, None, num_speculative_tokens=0)
    outs = alone.generate(batch, params)
    assert [o.token_ids for o in outs] == refs and all(o.metrics.num_prediction_drafts == 0 for o in outs)


def test_the_prediction_drafter_drafts_predictions_and_nothing_else(target):
    """`drafter: {kind: prediction}`: a row without a prediction decodes a token a step with no
    draft (beside one whose prediction is drafted), a seeded one too; after a rejected run a row
    tries one predicted token a step until one is accepted, then whole runs again."""
    batch = prompts(4)
    refs = [hf_greedy(target, p, MAX_NEW) for p in batch]
    edited = list(refs[2])
    edited[12:14] = [(t + 1) % 96 for t in edited[12:14]]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, prediction=tuple(refs[0])),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.0, prediction=tuple(edited)),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=3)]
    engine = engine_for(target, "prediction-alone", 6)
    assert not engine.policy.own_drafts and not engine.policy.adaptive
    outs = engine.generate(batch, params)
    assert [o.token_ids for o in outs[:3]] == refs[:3]
    exact, plain, edit, seeded = (o.metrics for o in outs)
    assert exact.num_prediction_accepted == exact.num_prediction_drafts == exact.num_draft_tokens > 0
    assert exact.num_steps <= -(-MAX_NEW // 7) + 1
    for m in (plain, seeded):
        assert m.num_draft_tokens == 0 and m.num_steps == MAX_NEW
    assert edit.num_prediction_accepted > 2 * 6 and edit.num_prediction_drafts > edit.num_prediction_accepted
    assert edit.num_steps < MAX_NEW // 2  # back to whole runs past the edit
    alone = SpeculativeEngine(target, None, num_speculative_tokens=0)
    assert outs[3].token_ids == alone.generate([batch[3]], params[3])[0].token_ids  # (no draft drew a number)


# -- sampled: the target's distribution -----------------------------------------------------------------
def test_sampled_rows_with_and_without_a_prediction_follow_the_target():
    """20,000 seeded sequences, half with a prediction that always matches somewhere (every token,
    twice), in the same batches: the 2nd and 3rd tokens of each half follow the target's exact
    distribution, and the predicted drafts are both accepted and rejected."""
    from test_sampling_distribution import NUM_SEQUENCES, PROMPT, VOCAB, chi_square_pvalue, exact_marginals

    small = dict(vocab=VOCAB, init_range=0.3, layers=1, hidden=16)
    target, draft = tiny_llama(0, **small), tiny_llama(5, **small)
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    exact2, exact3 = exact_marginals(target, params)
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=2, adaptive=False, max_batch_size=2500)
    prediction = tuple(range(VOCAB)) * 2
    seeded = [dataclasses.replace(params, seed=i, prediction=prediction if i % 2 else None)
              for i in range(NUM_SEQUENCES)]
    outs = engine.generate([PROMPT] * NUM_SEQUENCES, seeded)
    predicted = [o for i, o in enumerate(outs) if i % 2]
    drafted = sum(o.metrics.num_prediction_drafts for o in predicted)
    accepted = sum(o.metrics.num_prediction_accepted for o in predicted)
    assert drafted > NUM_SEQUENCES / 2 and 0.02 * drafted < accepted < 0.9 * drafted
    for half in (predicted, [o for i, o in enumerate(outs) if i % 2 == 0]):
        count = lambda pos: torch.tensor(  # noqa: E731
            [sum(o.token_ids[pos] == v for o in half) for v in range(VOCAB)], dtype=torch.float64)
        assert chi_square_pvalue(count(1), exact2) > 1e-4
        assert chi_square_pvalue(count(2), exact3) > 1e-4
