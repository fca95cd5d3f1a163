"""Penalties, logit bias and min_tokens under speculation (specserve.engine.processing): greedy output identical
to the target alone with the same processing (an independent from-scratch reference) through every
drafter, γ 1 and 4, rows with different settings in one batch; sampled output follows the processed
target's distribution (chi-square); and a verifier that forgets to count the drafts is caught."""
from __future__ import annotations

import collections
import functools

import pytest
import torch

import specserve.engine.processing as processing_module
from models import tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine.proposers import DraftModelProposer, LayerSkipSpec, PromptLookupSpec, target_vocab_size
from specserve.engine.sampling import BatchSampling, logits_to_probs
from test_drafters import prompts
from test_feature_drafter import build as build_head, target
from test_sampling_distribution import PROMPT, VOCAB, assert_engine_samples, enumerated_marginals

MAX_NEW = 24
SETTINGS = [  # one per row of a ragged batch
    dict(presence_penalty=1.5, frequency_penalty=0.5),
    dict(repetition_penalty=1.6),
    dict(logit_bias={5: 6.0, 17: -100.0, 40: 3.0}),
    dict(),
    dict(presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=0.8, logit_bias={7: 2.5}),
    dict(allowed_token_ids=tuple(range(0, 96, 3)), frequency_penalty=0.3),
]


def params(setting: dict, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **{**setting, **extra})


def processed_naively(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """The documented rule, one position, in plain Python over a float64 copy."""
    logits = logits.double().clone()
    for token, value in p.logit_bias:
        logits[token] += value
    if p.allowed_token_ids is not None:
        banned = torch.ones_like(logits, dtype=torch.bool)
        banned[list(p.allowed_token_ids)] = False
        logits[banned] = float("-inf")
    if p.repetition_penalty != 1.0:
        for token in set(prompt + out):
            value = logits[token]
            logits[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token, count in collections.Counter(out).items():
        logits[token] -= p.frequency_penalty * count + p.presence_penalty
    if len(out) < p.min_tokens:
        logits[list(p.stop_token_ids)] = float("-inf")
    for word in p.bad_words_ids:
        if len(word) == 1 or out[len(out) - len(word) + 1:] == list(word[:-1]):
            logits[word[-1]] = float("-inf")
    return logits


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...], p: SamplingParams) -> list[int]:
    """The target alone, a full forward per token, processing from scratch (a stop id ends it, kept)."""
    model, tokens, out = target(), list(prompt), []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            token = int(processed_naively(logits, list(prompt), out, p).argmax())
            out.append(token)
            tokens.append(token)
            if token in p.stop_token_ids:
                break
    return out


def drafter(name: str, head):
    model = target()
    if name == "draft-model":  # the target itself: every unprocessed guess is the target's own argmax
        return DraftModelProposer(tiny_llama(0, layers=4), target_vocab_size(model))
    if name == "feature-head":
        return build_head(head)
    spec = {"layer-skip": LayerSkipSpec((1, 2)), "prompt-lookup": PromptLookupSpec(1, 3)}[name]
    return spec.build(model, target_vocab_size(model), None)


@pytest.mark.parametrize("name", ["draft-model", "feature-head", "layer-skip", "prompt-lookup"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_identical_to_the_processed_target_alone(name, gamma, head_dir):
    batch = prompts(len(SETTINGS), seed=7)
    rows = [params(s) for s in SETTINGS]
    engine = SpeculativeEngine(target(), proposer=drafter(name, head_dir), num_speculative_tokens=gamma,
                               adaptive=False)
    outs = engine.generate(batch, rows)
    for prompt, p, out in zip(batch, rows, outs):
        assert out.token_ids == reference(tuple(prompt), p), (name, gamma, p)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    # the processing is real: the penalised rows differ from plain greedy decoding
    plain = [reference(tuple(prompt), params({})) for prompt in batch]
    assert sum(o.token_ids != q for o, q in zip(outs, plain)) >= 3


def test_counts_advance_through_the_drafts():
    """At position j the counts include drafts 0..j-1 (and never the draft at j itself)."""
    from specserve.engine.processing import LogitsProcessing

    proc = LogitsProcessing([0.5], [1.0], [2.0], [((9, 4.0),)], [[5]], [[1, 5]])
    logits = torch.ones(1, 3, 12)
    out = proc.apply(logits, torch.tensor([[5, 7]]))[0]  # [W=3, V]
    assert out[:, 5].tolist() == [0.5 - 1.5, 0.5 - 2.5, 0.5 - 2.5]  # /2 (seen), then 1 then 2 counted
    assert out[:, 7].tolist() == [1.0, 1.0, 0.5 - 1.5]  # only once draft 1 is before it
    assert out[:, 9].tolist() == [5.0, 5.0, 5.0] and out[:, 1].tolist() == [0.5] * 3


@pytest.mark.parametrize("broken", [False, True])
def test_a_verifier_that_does_not_count_the_drafts_is_caught(monkeypatch, broken):
    """Prompt lookup proposes a run of token 11 that a bias favours and a frequency penalty wears
    down: counting only the committed tokens would accept more of the run than the processed
    target chooses. The real rule matches the reference; the broken one is caught."""
    if broken:
        monkeypatch.setattr(processing_module, "_drafts_before",
                            lambda drafts, width, vocab, device: torch.zeros(drafts.shape[0], width, vocab))
    prompt = [11] * 12
    # (a bias at which the broken rule's extra acceptances fall inside one step's drafts)
    p = params(dict(logit_bias={11: 10.0}, frequency_penalty=2.0))
    engine = SpeculativeEngine(target(), proposer=drafter("prompt-lookup", None), num_speculative_tokens=4,
                               adaptive=False)
    (out,) = engine.generate([prompt], [p])
    assert (out.token_ids == reference(tuple(prompt), p)) != broken
    assert out.token_ids[:2] == [11, 11] and out.metrics.num_accepted_tokens > 0


# -- min_tokens: the row's stop ids held back until its output is that long --------------------------
@pytest.mark.parametrize("name", ["draft-model", "feature-head", "layer-skip", "prompt-lookup"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_min_tokens_holds_stops_back_as_the_target_alone_does(name, gamma, head_dir):
    """Each row stops at its plain greedy output's 2nd token; with min_tokens 7 that token is held
    back through the first 7 outputs (drafts included) and ends the row later, if it comes again.
    Rows with and without min_tokens, and with penalties as well, share the batch."""
    batch = prompts(4, seed=11)
    stops = [reference(tuple(prompt), params({}))[1] for prompt in batch]
    rows = [params(dict(stop_token_ids=(stop,), min_tokens=m, **extra)) for stop, m, extra in
            zip(stops, [7, 0, 7, 3], [{}, {}, dict(frequency_penalty=0.5), {}])]
    engine = SpeculativeEngine(target(), proposer=drafter(name, head_dir), num_speculative_tokens=gamma,
                               adaptive=False)
    outs = engine.generate(batch, rows)
    for prompt, p, out in zip(batch, rows, outs):
        expected = reference(tuple(prompt), p)
        assert out.token_ids == expected, (name, gamma, p)
        assert p.stop_token_ids[0] not in expected[: p.min_tokens]
    assert len(outs[1].token_ids) == 2 and outs[1].finish_reason == "stop"  # min_tokens 0: stops at once
    assert all(len(o.token_ids) > 7 for o in (outs[0], outs[2]))


def test_min_tokens_holds_the_models_eos_back():
    """EOS (the engine's, not ignored) is a stop id like any other: held back, then it ends the row."""
    (prompt,) = prompts(1, seed=3)
    eos = reference(tuple(prompt), params({}))[0]
    engine = SpeculativeEngine(target(), proposer=drafter("layer-skip", None), num_speculative_tokens=3,
                               adaptive=False, eos_token_ids=[eos])
    free, held = engine.generate([prompt, prompt], [SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
                                                    SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=5)])
    assert free.token_ids == [eos] and free.finish_reason == "stop"
    assert held.token_ids == reference(tuple(prompt), params(dict(stop_token_ids=(eos,), min_tokens=5)))
    assert eos not in held.token_ids[:5] and len(held.token_ids) >= 5


def test_min_tokens_masks_by_position_in_the_block():
    from specserve.engine.processing import LogitsProcessing

    proc = LogitsProcessing([0.0] * 2, [0.0] * 2, [1.0] * 2, [(), ()], [[], []], None, [2, 0], [(3, 9, 40), ()])
    out = proc.apply(torch.zeros(2, 4, 12), torch.zeros(2, 3, dtype=torch.long))  # [B, W, V]
    assert out[0, :2, [3, 9]].isinf().all() and not out[0, 2:].isinf().any()
    assert not out[1].isinf().any() and not out[0, :, [0, 1, 2, 4]].isinf().any()


# -- bad words: a word's last token forbidden where the output (drafts included) ends with the rest -----
@pytest.mark.parametrize("name", ["draft-model", "feature-head", "layer-skip", "prompt-lookup"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_bad_words_are_never_generated_as_the_target_alone_decides(name, gamma, head_dir):
    """Each row bans two-token words its plain greedy output holds and a one-token word; rows with
    and without bad words share the batch."""
    batch = prompts(3, seed=5)
    plain = [reference(tuple(prompt), params({})) for prompt in batch]
    bans = [((out[2], out[3]), (out[8], out[9]), (out[14],)) for out in plain[:2]] + [()]
    rows = [params(dict(bad_words_ids=words)) for words in bans]
    engine = SpeculativeEngine(target(), proposer=drafter(name, head_dir), num_speculative_tokens=gamma,
                               adaptive=False)
    outs = engine.generate(batch, rows)
    for prompt, p, out, was in zip(batch, rows, outs, plain):
        assert out.token_ids == reference(tuple(prompt), p), (name, gamma, p)
        for word in p.bad_words_ids:
            n = len(word)
            assert all(tuple(out.token_ids[i:i + n]) != word for i in range(len(out.token_ids) - n + 1))
    assert outs[0].token_ids != plain[0] and outs[2].token_ids == plain[2]


def test_bad_words_match_through_the_drafts():
    """At position j a word's last token is banned where the output's tail and drafts 0..j-1 end
    with the rest of it: a 2-token word inside the drafts, a 3-token word across the committed
    tail and the drafts, a 1-token word everywhere; a row without bad words is untouched."""
    from specserve.engine.processing import LogitsProcessing

    words = ((5, 7), (9, 3, 8), (2,))
    proc = LogitsProcessing([0.0] * 2, [0.0] * 2, [1.0] * 2, [(), ()], [[], []], None,
                            bad_words=[words, ()], recent=[[9, 3], []])
    drafts = torch.tensor([[5, 7, 5], [5, 7, 5]])
    out = proc.apply(torch.zeros(2, 4, 12), drafts).isinf()  # [B, W, V]
    assert out[0, :, 7].tolist() == [False, True, False, True]  # after the drafts 5 at 0 and 2
    assert out[0, :, 8].tolist() == [True, False, False, False]  # the committed 9 3, then no more
    assert out[0, :, 2].all() and out[0].sum() == 2 + 1 + 4 and not out[1].any()


# -- sampling: the processed distribution, exactly ------------------------------------------------------
SAMPLED = SamplingParams(max_tokens=4, temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6,
                         repetition_penalty=1.5, logit_bias={3: 1.0, 6: -1.5}, allowed_token_ids=(0, 1, 3, 4, 6, 7))


def test_sampling_follows_the_processed_target():
    """Exact P(2nd token) and P(3rd token) under the processing, by enumerating prefixes."""
    small = dict(vocab=VOCAB, init_range=0.3, layers=1, hidden=16)
    model, draft = tiny_llama(0, **small), tiny_llama(5, **small)

    def dist(out: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + out])).logits[0, -1]
        processed = processed_naively(logits, PROMPT, out, SAMPLED).float()[None]
        return logits_to_probs(processed, BatchSampling.from_params([SAMPLED]))[0].double()

    engine = SpeculativeEngine(model, draft, num_speculative_tokens=2, adaptive=False, max_batch_size=2500)
    assert_engine_samples(engine, SAMPLED, *enumerated_marginals(dist))


def test_sampling_with_min_tokens_follows_the_target_with_its_stops_held_back():
    """Two likely tokens are stop ids, held back for the first 2 outputs: the 2nd token never is
    one (the step's first draft position), the 3rd follows the unmasked distribution."""
    small = dict(vocab=VOCAB, init_range=0.3, layers=1, hidden=16)
    model, draft = tiny_llama(0, **small), tiny_llama(5, **small)
    with torch.no_grad():
        likely = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].topk(2).indices.tolist()
    held = SamplingParams(max_tokens=4, temperature=1.0, stop_token_ids=likely, min_tokens=2)

    def dist(out: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + out])).logits[0, -1]
        processed = processed_naively(logits, PROMPT, out, held).float()[None]
        return logits_to_probs(processed, BatchSampling.from_params([held]))[0].double()

    exact2, exact3 = enumerated_marginals(dist)
    assert exact2[likely].sum() == 0 and exact3[likely].sum() > 0.05
    engine = SpeculativeEngine(model, draft, num_speculative_tokens=2, adaptive=False, max_batch_size=2500)
    assert_engine_samples(engine, held, exact2, exact3)


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    assert SamplingParams(logit_bias={"9": 1, 2: -1.0}).logit_bias == ((2, -1.0), (9, 1.0))
    assert not SamplingParams().processed and SamplingParams(repetition_penalty=1.1).processed
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=())
    assert SamplingParams(allowed_token_ids=[5, 2, 5]).allowed_token_ids == (2, 5)
    assert SamplingParams(allowed_token_ids=[5]).processed
    assert SamplingParams(bad_words_ids=[[3, 4], (3, 4), [5]]).bad_words_ids == ((3, 4), (5,))
    with pytest.raises(ValueError, match="bad_words_ids"):
        SamplingParams(bad_words_ids=[[]])
    from specserve.engine.grammar import Grammar
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_ids=[[4]], grammar=Grammar("json_object"))
    from specserve.engine.step import InvalidPrompt, new_sequence
    with pytest.raises(InvalidPrompt, match="allowed_token_ids"):
        new_sequence("r", [1], SamplingParams(allowed_token_ids=[99]), vocab_size=96, max_model_len=64,
                     eos_token_ids=frozenset())
    with pytest.raises(InvalidPrompt, match="allowed_token_ids"):  # nothing but the stop: min_tokens unmeetable
        new_sequence("r", [1], SamplingParams(allowed_token_ids=[3], min_tokens=2), vocab_size=96, max_model_len=64,
                     eos_token_ids=frozenset({3}))
