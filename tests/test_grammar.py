"""Structured output under speculation (specserve.engine.grammar): greedy output identical to the
target alone under the same grammar (a one-matcher, one-token-at-a-time reference) through every
drafter, γ 1 and 4, ragged batches with different grammars and a free row; sampling follows the
masked target's distribution (chi-square against a mask written out by hand); masks advance
through the drafts and matchers roll back; logprobs under a grammar; and the engine's refusals."""
from __future__ import annotations

import functools

import llguidance
import pytest
import torch

import specserve.engine.grammar as grammar_module
from models import tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine.grammar import WIDE_SHARE, Grammar, GrammarBook, GrammarRows
from specserve.engine.sampling import BatchSampling, logits_to_probs
from specserve.models.tiny import byte_tokenizer
from test_drafters import prompts
from test_processing import drafter
from test_feature_drafter import target
from test_sampling_distribution import PROMPT, VOCAB, assert_engine_samples, enumerated_marginals

MAX_NEW = 24
DRAFTERS = ["draft-model", "feature-head", "layer-skip", "prompt-lookup"]
# the test models' 96 ids are the bytes 0..95: digits, capitals, [ ] ( ) , - " : and the like
GRAMMARS = [  # one per row of a ragged batch
    Grammar.json_schema({"type": "array", "items": {"type": "integer"}}),
    Grammar("regex", "[A-Z]+(-[0-9]+)*"),
    None,
    Grammar("lark", 'start: item ("," item)*\nitem: /[0-9]{1,2}/ | "(" start ")"'),
    Grammar.json_schema({"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}),
]


def params(grammar: Grammar | None, **extra) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, "grammar": grammar,
                             **extra})


@functools.lru_cache(maxsize=None)
def view(vocab: int):
    return grammar_module.tokenizer_view(byte_tokenizer(), vocab, ())


def allowed_now(matcher, vocab: int) -> torch.Tensor:
    """[V] bool: one matcher's mask as the library computes it for one state (no drafts); all
    tokens once the matcher is stuck or allows none of the model's (no EOS among the test ids)."""
    if matcher.is_error():
        return torch.ones(vocab, dtype=torch.bool)
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:vocab].bool()
    return bits if bits.any() else torch.ones(vocab, dtype=torch.bool)


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...], grammar: Grammar | None) -> list[int]:
    """The target alone under the grammar: a full forward per token, the mask of one matcher."""
    model, tokens, out = target(), list(prompt), []
    vocab = model.config.vocab_size
    matcher = llguidance.LLMatcher(view(vocab), grammar.text(), log_level=0) if grammar else None
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            if matcher is not None:
                logits = logits.masked_fill(~allowed_now(matcher, vocab), float("-inf"))
            token = int(logits.argmax())
            if matcher is not None and not matcher.is_error():
                matcher.consume_token(token)
            out.append(token)
            tokens.append(token)
    return out


def engine_for(name: str, gamma: int, head_dir, model=None, wide: float | None = WIDE_SHARE) -> SpeculativeEngine:
    """wide: the proposer's `wide_share` (0: every grammar row drafts unmasked; None: every one masked)."""
    proposer = drafter(name, head_dir)
    if hasattr(proposer, "wide_share"):
        proposer.wide_share = wide
    return SpeculativeEngine(model or target(), proposer=proposer, num_speculative_tokens=gamma,
                             adaptive=False, tokenizer=byte_tokenizer())


@pytest.mark.parametrize("name,gamma,wide", [(name, gamma, WIDE_SHARE) for name in DRAFTERS for gamma in (1, 4)] +
                         [(name, 4, wide) for name in DRAFTERS[:3] for wide in (0.0, None)])
def test_greedy_identical_to_the_constrained_target_alone(name, gamma, wide, head_dir):
    """Also with every grammar row drafting unmasked (wide 0), and every one masked (None)."""
    batch = prompts(len(GRAMMARS), seed=11)
    engine = engine_for(name, gamma, head_dir, wide=wide)
    outs = engine.generate(batch, [params(g) for g in GRAMMARS])
    for prompt, g, out in zip(batch, GRAMMARS, outs):
        assert out.token_ids == reference(tuple(prompt), g), (name, gamma, g)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    # the grammars are real: every constrained row differs from unconstrained decoding
    plain = [reference(tuple(prompt), None) for prompt in batch]
    assert all(o.token_ids != q for o, q, g in zip(outs, plain, GRAMMARS) if g is not None)
    assert len(engine.grammar) == 0  # every matcher freed with its request


def test_constrained_output_parses():
    """The rows' texts follow their grammars (checked outside the library where Python can)."""
    import json
    import re

    batch = prompts(len(GRAMMARS), seed=11)
    texts = [bytes(reference(tuple(p), g)).decode("latin-1") for p, g in zip(batch, GRAMMARS)]
    def closed(text: str):  # a complete JSON value, then free text (no EOS among the test ids)
        return json.loads(text[: text.index("]") + 1])

    assert all(isinstance(v, int) for v in closed(texts[0]))
    assert re.fullmatch(r"[A-Z]+(-[0-9]+)*", texts[1])
    assert re.fullmatch(r"[0-9(),]+", texts[3])
    value = closed(texts[4])
    assert len(value) <= 2 and all(isinstance(v, str) and len(v) <= 3 for v in value)


def test_the_draft_proposes_valid_tokens():
    """A draft model masks its own proposals: with the target itself as the draft, every draft of
    a constrained row is accepted (an unmasked draft would propose the unconstrained argmax)."""
    model = target()
    engine = SpeculativeEngine(model, proposer=drafter("draft-model", None), num_speculative_tokens=4,
                               adaptive=False, tokenizer=byte_tokenizer())
    (out,) = engine.generate([prompts(1, seed=3)[0]], [params(GRAMMARS[1])])
    assert out.metrics.num_accepted_tokens == out.metrics.num_draft_tokens > 0


def test_a_wide_grammar_row_drafts_unmasked():
    """The target as its own draft: masked, every draft of a constrained row is accepted; drafting
    unmasked (wide 0) it proposes the unconstrained argmax, rejected where the grammar forbids it,
    and the output is the same."""
    outs = {}
    for wide in (None, 0.0):
        engine = SpeculativeEngine(target(), proposer=drafter("draft-model", None), num_speculative_tokens=4,
                                   adaptive=False, tokenizer=byte_tokenizer())
        engine.proposer.wide_share = wide
        (outs[wide],) = engine.generate([prompts(1, seed=3)[0]], [params(GRAMMARS[1])])
    assert outs[None].metrics.num_accepted_tokens == outs[None].metrics.num_draft_tokens
    assert outs[0.0].metrics.num_accepted_tokens < outs[0.0].metrics.num_draft_tokens
    assert outs[0.0].token_ids == outs[None].token_ids


@pytest.mark.parametrize("name", ["draft-model", "feature-head"])
def test_the_first_draft_position_reuses_the_mask_that_chose_the_rows(monkeypatch, name, head_dir):
    """`draft_rows` made each masked row's mask at its committed output: the loop's first position
    takes it, so a γ-position loop makes γ - 1 masks more, not γ (and the output is the same)."""
    made, positions, loops = [], [], []
    real_masks, real_init = GrammarBook.draft_masks, grammar_module.DraftMasks.__init__
    real_apply = grammar_module.DraftMasks.apply
    monkeypatch.setattr(GrammarBook, "draft_masks", lambda self, m, d: made.append(1) or real_masks(self, m, d))
    monkeypatch.setattr(grammar_module.DraftMasks, "__init__",
                        lambda self, *a: loops.append(1) or real_init(self, *a))
    monkeypatch.setattr(grammar_module.DraftMasks, "apply",
                        lambda self, logits: positions.append(1) or real_apply(self, logits))
    engine = engine_for(name, 4, head_dir)
    prompt = prompts(1, seed=3)[0]
    (out,) = engine.generate([prompt], [params(GRAMMARS[1])])
    assert out.token_ids == reference(tuple(prompt), GRAMMARS[1]) and len(positions) > 2 * len(loops) > 0
    assert len(made) == len(positions) - len(loops)


def test_which_rows_draft_masked():
    """A row whose mask allows at least `wide` of the vocabulary drafts unmasked; the others, and
    every row with wide None, are masked; none left: None (the step's loop may be the captured one)."""
    book = GrammarBook(byte_tokenizer, 96, ())
    anything, digits = Grammar("regex", "[\\x00-\\x5f]*"), Grammar("regex", "[0-9]+")
    rows = GrammarRows(["a", "b", "c"], [anything, None, digits], [[], None, [ord("1")]])
    kept = book.draft_rows(rows, 0.9)
    assert kept.grammars == [None, None, digits] and kept.outputs == [None, None, [ord("1")]]
    assert book.draft_rows(rows, None) is rows and book.draft_rows(rows, 0.05) is None  # (10/96 digits)
    assert book.draft_rows(rows.select([0, 1]), 0.9) is None


def test_masks_advance_through_the_drafts():
    """At position j the mask follows drafts 0..j-1; past a forbidden draft nothing is masked."""
    book = GrammarBook(byte_tokenizer, 96, ())
    g = Grammar("regex", "A[0-9]B[0-9]")
    rows = GrammarRows(["r"], [g], [[]])
    drafts = [[ord("A"), ord("7"), ord("X"), ord("3")]]
    allowed = book.verify_masks(rows, drafts, [4], 5, "cpu")[0]  # [W, V]
    assert allowed[0].nonzero().flatten().tolist() == [ord("A")]
    assert allowed[1].nonzero().flatten().tolist() == list(range(ord("0"), ord("9") + 1))
    assert allowed[2].nonzero().flatten().tolist() == [ord("B")]  # "X" is forbidden here ...
    assert allowed[3].all() and allowed[4].all()  # ... so nothing after it is ever used
    # the committed state did not move: the same call gives the same masks
    assert torch.equal(book.verify_masks(rows, drafts, [4], 5, "cpu")[0], allowed)


def test_the_book_follows_the_committed_tokens():
    """Forward, back (a rejected step), across a grammar change and after a free, a request's
    matcher is where its committed tokens put it."""
    book = GrammarBook(byte_tokenizer, 96, ())
    g = Grammar.json_schema({"type": "array", "items": {"type": "integer"}})
    fresh = lambda tokens: allowed_now(book.matcher("other", g, tokens), 96)  # noqa: E731
    for tokens in ([91, 49], [91, 49, 50, 44], [91], [91, 45], [91, 45, 51, 93]):
        assert torch.equal(allowed_now(book.matcher("r", g, tokens), 96), fresh(tokens)), tokens
        book.free("other")
    other = Grammar("regex", "[A-Z]+")
    assert allowed_now(book.matcher("r", other, [65]), 96).nonzero().flatten().tolist() == list(range(65, 91))
    book.free("r")
    assert len(book) == 0


@pytest.mark.parametrize("broken", [False, True])
def test_a_verifier_that_ignores_the_drafts_is_caught(monkeypatch, broken):
    """Prompt lookup proposes a run that the regex allows once only: masks computed from the
    committed state alone (the same mask at every position) would accept the run's later tokens."""
    if broken:
        real = GrammarBook.verify_masks

        def committed_only(self, rows, drafts, num_draft, width, device):
            first = real(self, rows, drafts, [0] * len(num_draft), 1, device)  # [B, 1, V]
            return first.expand(-1, width, -1)
        monkeypatch.setattr(GrammarBook, "verify_masks", committed_only)
    prompt = [ord(c) for c in "7A7A7A7A7"]
    g = Grammar("regex", "A7B[0-9]+")
    engine = SpeculativeEngine(target(), proposer=drafter("prompt-lookup", None), num_speculative_tokens=4,
                               adaptive=False, tokenizer=byte_tokenizer())
    (out,) = engine.generate([prompt], [params(g)])
    assert (out.token_ids == reference(tuple(prompt), g)) != broken
    assert out.metrics.num_accepted_tokens > 0


def test_logprobs_under_a_grammar():
    """Each emitted token's logprob is the masked target's, against one forward per token (1e-4);
    a forbidden alternative never appears above an allowed one."""
    g = GRAMMARS[0]
    prompt = prompts(1, seed=5)[0]
    engine = engine_for("draft-model", 4, None)
    (out,) = engine.generate([prompt], [params(g, logprobs=3)])
    model, tokens = target(), list(prompt)
    matcher = llguidance.LLMatcher(view(96), g.text(), log_level=0)
    with torch.no_grad():
        for token, value, tops in zip(out.token_ids, out.logprobs, out.top_logprobs):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            allowed = allowed_now(matcher, 96)
            logp = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
            assert abs(value - float(logp[token])) < 1e-4
            assert [t for t, _ in tops][: int(allowed.sum())] == logp.topk(3).indices.tolist()[: int(allowed.sum())]
            matcher.consume_token(token)
            tokens.append(token)


def test_the_engine_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeEngine(target(), num_speculative_tokens=0).generate([[1, 2]], [params(GRAMMARS[0])])
    engine = SpeculativeEngine(target(), num_speculative_tokens=0, tokenizer=byte_tokenizer())
    with pytest.raises(ValueError, match="invalid regex grammar"):
        engine.generate([[1, 2]], [params(Grammar("regex", "[A-"))])
    with pytest.raises(ValueError, match="grammar kind"):
        Grammar("yaml", "x")
    with pytest.raises(ValueError, match="not valid JSON"):
        Grammar("json_schema", "{oops")


# -- sampling: the masked distribution, exactly ---------------------------------------------------------
# Over the 8-token test vocabulary: pairs (a, b) with a in {1, 2} then b in {3, 4, 5}, or a in {6, 7}
# then b in {0, 1, 2}; so the mask at each position depends on the token before it.
PAIRS = Grammar("regex", r"([\x01\x02][\x03-\x05]|[\x06\x07][\x00-\x02])+")


def allowed_by_hand(out: list[int]) -> list[int]:
    if len(out) % 2 == 0:
        return [1, 2, 6, 7]
    return [3, 4, 5] if out[-1] in (1, 2) else [0, 1, 2]


@pytest.mark.parametrize("wide", [WIDE_SHARE, 0.0])
def test_sampling_follows_the_masked_target(wide):
    """Drafts masked (the pairs allow at most half the vocabulary: below WIDE_SHARE) or not (wide 0:
    q is the draft's own, unmasked; the rule corrects for it)."""
    small = dict(vocab=VOCAB, init_range=0.3, layers=1, hidden=16)
    model, draft = tiny_llama(0, **small), tiny_llama(5, **small)
    p = SamplingParams(max_tokens=4, temperature=1.0, grammar=PAIRS, ignore_eos=True)  # (token 1: the prompt forward)

    def dist(out: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + out])).logits[0, -1]
        mask = torch.full((VOCAB,), float("-inf"))
        mask[allowed_by_hand(out)] = 0.0
        return logits_to_probs((logits + mask)[None], BatchSampling.from_params([p]))[0].double()

    engine = SpeculativeEngine(model, draft, num_speculative_tokens=2, adaptive=False, max_batch_size=2500,
                               tokenizer=byte_tokenizer())
    engine.proposer.wide_share = wide
    assert_engine_samples(engine, p, *enumerated_marginals(dist))


@pytest.mark.parametrize("floor", [None, 0.025])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_feature_head_masks_as_the_host_loop_did(head_dir, sampled, floor):
    """Grammar rows keep their per-position host reads (each mask follows the drafts before it),
    in the loop that stays on the device otherwise: proposals are the per-position host loop's,
    token for token, with a confidence floor or without, greedy rows the constrained target's."""
    from test_feature_drafter import HostLoop, build, twin

    proposer, reference_proposer = build(head_dir, min_confidence=floor), build(head_dir, min_confidence=floor)
    proposer.host_stop = False  # grammar rows stop where no row drafts anyway: their masks read the drafts
    reference_proposer.__class__ = HostLoop
    engine = SpeculativeEngine(target(), proposer=proposer, num_speculative_tokens=4, adaptive=False,
                               tokenizer=byte_tokenizer())
    assert proposer.grammar is not None  # the engine gave the head its grammar book
    compared = twin(engine, reference_proposer)
    batch = prompts(len(GRAMMARS), seed=11)
    rows = [params(g, temperature=0.8 if sampled and i % 2 else 0.0, seed=i) for i, g in enumerate(GRAMMARS)]
    outs = engine.generate(batch, rows)
    for prompt, g, p, out in zip(batch, GRAMMARS, rows, outs):
        if p.temperature == 0:
            assert out.token_ids == reference(tuple(prompt), g), g
    assert len(compared) > 5


def test_the_served_workers_take_the_configured_wide_share():
    """speculation.grammar_wide_share reaches the drafter beside the target and a draft worker's
    model (the default is the engine's)."""
    from specserve.config import LayerSkipDrafter, SpeculationConfig, TinySource
    from specserve.serve.workers import DraftWorker, TargetWorker, TokenizerSource

    assert SpeculationConfig().grammar_wide_share == WIDE_SHARE
    source = TinySource(layers=2)
    beside = TargetWorker(source, 64, drafter=LayerSkipDrafter(skip_layers=[1]), wide_share=None)
    assert beside.proposer.wide_share is None
    draft = DraftWorker(source, 259, 64, tokenizer=TokenizerSource(source), wide_share=0.5)
    assert draft.model.wide_share == 0.5 and DraftWorker(source, 259, 64).model.wide_share == WIDE_SHARE


@pytest.mark.parametrize("wide", [None, 0.0])
def test_a_complete_grammar_allows_only_its_end_through_the_drafts(wide):
    """A model that declares no EOS (a random load-test model) under a grammar that completes,
    with ignore_eos: every token after the grammar's end is the tokenizer's EOS, the grammar's own
    end, at every position of a verified block too (where the library leaves the masks after a
    draft past the end empty), so speculation gives the target alone's tokens, masked or not."""
    from specserve.bench.gpu import random_llama
    from specserve.engine.proposers import DraftModelProposer, target_vocab_size

    model = random_llama("tiny-target", "cpu", torch.float32, 0, peaked=True)
    draft = random_llama("tiny-draft", "cpu", torch.float32, 1, peaked=False)
    ends = byte_tokenizer().eos_token_id
    batch = [[(7 * b + 3 * i) % 250 + 1 for i in range(16)] for b in range(3)]
    rows = [params(Grammar("regex", "[a-z ]{1,3}")), params(None), params(Grammar("regex", "[0-9]+"))]
    alone = SpeculativeEngine(model, num_speculative_tokens=0, tokenizer=byte_tokenizer()).generate(batch, rows)
    first = alone[0].token_ids
    cut = next(j for j, t in enumerate(first) if t == ends)
    assert 1 <= cut <= 3 and set(first[cut:]) == {ends}
    proposer = DraftModelProposer(draft, target_vocab_size(model))
    proposer.wide_share = wide
    engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=4, adaptive=False,
                               tokenizer=byte_tokenizer())
    assert [o.token_ids for o in engine.generate(batch, rows)] == [o.token_ids for o in alone]


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_prediction_under_a_grammar_changes_no_token(name, head_dir):
    """Predicted drafts are forced past the drafter's masks: a prediction equal to the constrained
    answer is accepted, and one of tokens its grammar forbids (the unconstrained answer) is
    rejected where it stands; either way every row is the constrained target's."""
    batch = prompts(len(GRAMMARS), seed=11)
    right = [reference(tuple(p), g) for p, g in zip(batch, GRAMMARS)]
    wrong = [reference(tuple(p), None) for p in batch]
    for predictions, accepted in ((right, True), (wrong, False)):
        engine = engine_for(name, 4, head_dir)
        outs = engine.generate(batch, [params(g, prediction=tuple(pred)) for g, pred in zip(GRAMMARS, predictions)])
        for out, want in zip(outs, right):
            assert out.token_ids == want, (name, accepted)
        kept, drafted = (sum(getattr(o.metrics, f"num_prediction_{k}") for o in outs) for k in ("accepted", "drafts"))
        assert drafted > 0 and (kept == drafted if accepted else kept < drafted), (name, kept, drafted)
        assert len(engine.grammar) == 0
