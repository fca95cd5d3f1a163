"""The feature drafter (EAGLE-style head): lossless like every drafter, and it loads the public
EAGLE-3 checkpoint layout.

A head is trained for a few seconds on a tiny target's own greedy continuations (the distill
trainer), so that it really drafts something the target accepts; the loader test writes a randomly
initialised head by hand in the EAGLE-3 layout (fc over three layers' features, reduced draft
vocabulary with d2t/t2d) and runs it.
"""
import collections
import functools
import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from models import hf_greedy, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.config import FeatureDrafter, load_app_config
from specserve.distill.data import FeatureCapture
from specserve.distill.train import TrainSettings, choose_draft_vocab, init_head, train_head
from specserve.engine.feature_drafter import (
    FeatureDrafterProposer, FeatureDrafterSpec, FeatureStore, eagle3_feature_layers, feature_modules,
    load_feature_head, save_feature_head,
)
from specserve.engine.grammar import DraftMasks
from specserve.engine.model_runner import RowInput
from specserve.engine.proposers import target_vocab_size
from specserve.engine.sampling import one_hot
from test_engine_static import emulate_graphs
from test_sampling_distribution import VOCAB, assert_proposer_follows_target, recording_q_dtypes

MAX_NEW = 24
LAYERS = 4


@functools.lru_cache(maxsize=None)
def target():
    return tiny_llama(0, layers=LAYERS)


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed + batch)
    return [[rng.randrange(1, 96) for _ in range(rng.choice([2, 5, 9, 17]))] for _ in range(batch)]


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(target(), list(prompt), MAX_NEW)


@torch.no_grad()
def training_rows(model, seqs: list[list[int]], prompt_len: int) -> list[dict]:
    capture = FeatureCapture(model)
    try:
        rows = []
        for seq in seqs:
            logits = model(input_ids=torch.tensor([seq])).logits[0]
            rows.append({"ids": torch.tensor(seq, dtype=torch.int32), "features": capture.take()[0].half(),
                         "argmax": logits.argmax(-1).to(torch.int32), "prompt_len": prompt_len})
        return rows
    finally:
        capture.remove()


def train_tiny_head(model, out):
    """A head trained briefly on `model`'s greedy continuations of random prompts, saved to `out`."""
    rows = training_rows(model, [p + hf_greedy(model, p, 32) for p in prompts(48, seed=100)], prompt_len=0)
    torch.manual_seed(0)
    head = init_head(model, choose_draft_vocab(rows, 64, target_vocab_size(model), reserved=0))
    settings = TrainSettings(max_steps=200, max_epochs=100, batch_tokens=512, lr=3e-3, warmup_steps=5,
                             checkpoint_every=1e9)  # by steps: the same head on a loaded machine
    train_head(head, rows, settings, out / "checkpoint.pt")
    save_feature_head(head, out, store_lm_head=False)
    return out


def build(path, model=None, min_confidence=None, lookup_min_n=None):
    model = model or target()
    return FeatureDrafterSpec(str(path), min_confidence, lookup_min_n).build(model, target_vocab_size(model), None)


# -- lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identical_to_hf_generate(head_dir, gamma, batch):
    model = target()
    engine = SpeculativeEngine(model, proposer=build(head_dir), num_speculative_tokens=gamma, adaptive=False)
    batch_prompts = prompts(batch)
    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for prompt, out in zip(batch_prompts, outs):
        assert out.token_ids == reference(tuple(prompt)), (gamma, prompt)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # really speculating, not just running


def test_a_compiled_target_yields_the_features_an_eager_one_does(head_dir):
    """The tap is an output of the target's forward (ModelRunner.tap), not a side effect that a
    compiled (or captured) forward would skip: under torch.compile (fullgraph) the head gets the
    features an eager target gives it, and drafts and decodes the same."""
    model = target()
    engines = {execution: SpeculativeEngine(model, proposer=build(head_dir), num_speculative_tokens=3,
                                            adaptive=False, execution=execution)
               for execution in ("eager", "compile")}
    stores = {name: kept_features(engine) for name, engine in engines.items()}
    batch_prompts = prompts(3, seed=5)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outs = {name: {f"r{i}": [] for i in range(len(batch_prompts))} for name in engines}

    def step(name):
        for out in engines[name].step():
            outs[name][out.request_id] += out.new_token_ids

    for name, engine in engines.items():
        for i, prompt in enumerate(batch_prompts):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(4):
            step(name)
    for i in range(len(batch_prompts)):
        written = stores["eager"].written(f"r{i}")
        assert written == stores["compile"].written(f"r{i}") > len(batch_prompts[i])
        torch.testing.assert_close(stores["compile"].read(f"r{i}", 0, written),
                                   stores["eager"].read(f"r{i}", 0, written), atol=1e-5, rtol=1e-5)
    assert engines["compile"].verifier.runner._compiled is not None  # the verify forwards ran compiled
    accepted = sum(engines["compile"].sequence(f"r{i}").metrics.num_accepted_tokens for i in range(3))
    for name in engines:
        while engines[name].has_unfinished():
            step(name)
    for i, prompt in enumerate(batch_prompts):
        assert outs["compile"][f"r{i}"] == outs["eager"][f"r{i}"] == reference(tuple(prompt)), i
    assert accepted > 0  # the head drafted from the compiled target's features, and was right


def test_adaptive_and_joining_requests_identical(head_dir):
    """Requests join and leave between steps; adaptive γ switches drafting on and off."""
    model = target()
    engine = SpeculativeEngine(model, drafter=FeatureDrafterSpec(str(head_dir)), num_speculative_tokens=4)
    batch_prompts = prompts(5, seed=3)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outputs = {f"r{i}": [] for i in range(len(batch_prompts))}

    def step():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids

    for i, prompt in enumerate(batch_prompts[:2]):
        engine.add_request(f"r{i}", prompt, params)
    step()
    step()
    for i, prompt in enumerate(batch_prompts[2:], start=2):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        step()
    for i, prompt in enumerate(batch_prompts):
        assert outputs[f"r{i}"] == reference(tuple(prompt)), i
    assert engine.proposer.num_cached() == 0 and len(engine.proposer.features) == 0  # all freed


def kept_features(engine) -> FeatureStore:
    """A second reader of the features the engine's target taps for its head, which releases
    nothing (the head releases what it consumed from its own store) -> its store."""
    kept, runner = FeatureStore(), engine.verifier.runner
    layers = engine.proposer.head.cfg.feature_layers
    runner.tap(feature_modules(runner.model, layers), "a feature drafter reads the target's hidden states "
               "at every position", lambda rid, start, features: kept.write(rid, start, features.clone()))
    return kept


def test_the_feature_store_keeps_what_is_not_yet_consumed():
    """Rows written, read, released below what the head consumed, grown and shrunk: reads of held
    positions return what was written there; a read below what was released is refused; a
    rewrite from below starts over from there; storage shrinks once a prompt is consumed."""
    store, width = FeatureStore(), 3
    feats = lambda start, n: torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, width)  # noqa: E731
    store.write("a", 0, feats(0, 500))  # a prompt
    assert torch.equal(store.read("a", 10, 20), feats(10, 10)) and store.written("a") == 500
    big = store.held_bytes()
    store.release("a", 499)  # the head consumed the prompt's pairs
    assert store.held_bytes() < big / 4 and torch.equal(store.read("a", 499, 500), feats(499, 1))
    with pytest.raises(RuntimeError, match="released"):
        store.read("a", 498, 500)
    for start in range(500, 1500, 4):  # decoding: a step's tokens written, the previous ones consumed
        store.write("a", start, feats(start, 4))
        store.release("a", start)
        assert torch.equal(store.read("a", start, start + 4), feats(start, 4))
    assert store.held_bytes() <= 128 * width * 4
    store.write("a", 1497, feats(7000, 2))  # a rejected draft's position rewritten: beyond is stale
    assert store.written("a") == 1499 and torch.equal(store.read("a", 1496, 1499)[1:], feats(7000, 2))
    store.write("a", 3, feats(3, 5))  # below what is held (a target re-prefilled): from there on
    assert store.written("a") == 8 and torch.equal(store.read("a", 3, 8), feats(3, 5))
    store.free("a")
    assert len(store) == 0 and store.held_bytes() == 0


def test_a_head_keeps_features_of_what_it_has_not_consumed_only(head_dir):
    """Decoding long prompts, the head's store holds a few positions per request (the step's new
    ones), not every position of every context; greedy output is the target's."""
    model = target()
    engine = SpeculativeEngine(model, drafter=FeatureDrafterSpec(str(head_dir)), num_speculative_tokens=3,
                               adaptive=False)
    batch_prompts = [[(7 * i + k) % 90 + 1 for i in range(200)] for k in range(3)]
    width = engine.proposer.head.cfg.feature_size
    held = []
    for i, prompt in enumerate(batch_prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    outputs = {f"r{i}": [] for i in range(len(batch_prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        held.append(engine.proposer.features.held_bytes())
    for i, prompt in enumerate(batch_prompts):
        assert outputs[f"r{i}"] == hf_greedy(model, prompt, MAX_NEW), i
    assert held[0] >= 3 * 200 * width * 4  # the prompts' features, before the head's first catch-up
    assert max(held[3:-1]) <= 3 * 128 * width * 4  # then at most 64 rows' storage per request, twice over


def test_trained_head_beats_chance(head_dir):
    model = target()
    engine = SpeculativeEngine(model, proposer=build(head_dir), num_speculative_tokens=3, adaptive=False)
    outs = engine.generate(prompts(8, seed=7), SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert accepted / drafted > 0.1  # a random guess among 96 tokens would accept about 1%


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_sampling_matches_target_distribution(tmp_path, q_dtype):
    """An untrained head on the vocabulary-8 model: sampled output follows the target (chi-square),
    also with q sent in 16 bits (a head on the draft worker of a bfloat16 target), whose q the
    proposals then carry in that dtype."""
    torch.manual_seed(1)
    small = tiny_llama(0, vocab=VOCAB, init_range=0.3, layers=3, hidden=16)
    head = init_head(small, torch.arange(VOCAB))
    save_feature_head(head, tmp_path, store_lm_head=True)
    proposer = build(tmp_path, small)
    proposer.q_dtype = q_dtype
    sent = recording_q_dtypes(proposer)
    assert_proposer_follows_target(small, proposer)
    assert set(sent) - {None} == {q_dtype}


class CountingVerifies:
    """Records the draft counts and block widths the target verifies (wraps the engine's verifier)."""

    def __init__(self, engine) -> None:
        self.counts, self.widths, real = [], [], engine.verifier.verify

        def verify(rows, draft_tokens, draft_probs, num_draft, *rest):
            self.counts += num_draft.tolist()
            verdict = real(rows, draft_tokens, draft_probs, num_draft, *rest)
            self.widths.append(len(verdict.draft_tokens[0]))
            return verdict

        engine.verifier.verify = verify


def test_a_confidence_floor_drafts_fewer_and_stays_identical(head_dir):
    """Rows stop drafting where the head is unsure: the same tokens, fewer drafts, a higher share
    of them accepted, and the target verifies a block no wider than the longest row's drafts."""
    model = target()
    batch_prompts = prompts(6, seed=11)
    results = {}
    for floor in (None, 0.025):  # this briefly trained head is unsure: top probabilities 0.02-0.04
        engine = SpeculativeEngine(model, proposer=build(head_dir, min_confidence=floor), num_speculative_tokens=4,
                                   adaptive=False)
        seen = CountingVerifies(engine)
        outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        for prompt, out in zip(batch_prompts, outs):
            assert out.token_ids == reference(tuple(prompt)), (floor, prompt)
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        accepted = sum(o.metrics.num_accepted_tokens for o in outs)
        results[floor] = drafted, accepted / drafted, seen
    (full, full_rate, _), (cut, cut_rate, seen) = results[None], results[0.025]
    assert 0 < cut < full and cut_rate > full_rate, results
    assert sum(seen.counts) == cut and min(seen.widths) < 4  # narrower verifies where every row stopped


def test_positions_the_floor_declines_are_misses_the_offer_rate_counts(head_dir):
    """A floor this head never reaches declines every position. Nothing is verified; the policy
    counts each planned position as a miss (it yields nothing, as a rejection) and as declined
    (the offer rate, which prices the verify narrowing to what rows drafted). No verify widens."""
    engine = SpeculativeEngine(target(), proposer=build(head_dir, min_confidence=0.99), num_speculative_tokens=4,
                               adaptive=False)
    seen = CountingVerifies(engine)
    outs = engine.generate(prompts(3, seed=5), SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert sum(o.metrics.num_draft_tokens for o in outs) == 0 and sum(seen.counts) == 0
    policy = engine.policy
    assert policy.global_alpha.trials > 0 and policy.global_alpha.accepted == 0
    assert policy.global_offers.trials == policy.global_alpha.trials and policy.global_offers.accepted == 0
    assert max(seen.widths) == 0, seen.widths


def record_kept(proposer) -> list[int]:
    """The list that each of the proposer's later proposals extends with its rows' draft counts."""
    kept, real = [], proposer.propose

    def propose(*args):
        proposal = real(*args)
        kept.extend(proposal.num_draft.tolist())
        return proposal

    proposer.propose = propose
    return kept


def test_sampling_with_a_confidence_floor_matches_target_distribution(tmp_path):
    """Whether a row drafts position j depends on the head's distribution there, not on the token
    it samples: sampled output still follows the target (chi-square), with rows stopping early."""
    torch.manual_seed(1)
    small = tiny_llama(0, vocab=VOCAB, init_range=0.3, layers=3, hidden=16)
    head = init_head(small, torch.arange(VOCAB))
    save_feature_head(head, tmp_path, store_lm_head=True)
    # 0.3: rows sharing one prompt and first token share the head's confidence there, all under 0.35
    proposer = build(tmp_path, small, min_confidence=0.3)
    kept = record_kept(proposer)
    assert_proposer_follows_target(small, proposer)
    assert 0 < kept.count(0) + kept.count(1) < len(kept), collections.Counter(kept)  # some rows stopped early


@pytest.mark.parametrize("gamma,floor", [(1, None), (3, None), (4, 0.025)])
def test_rows_that_repeat_an_ngram_draft_by_lookup_and_stay_identical(head_dir, gamma, floor):
    """With `lookup_min_n`, rows whose suffix repeats an earlier n-gram draft what followed it,
    the others run the head, in the same steps; output is the target's, and a looked-up row's
    head catches up on the tokens it skipped when it drafts again. With a confidence floor too
    (the demo's drafter), head rows stop where unsure while looked-up rows draft in full."""
    model = target()
    batch_prompts = prompts(4, seed=5) + [[7, 8, 9, 7, 8]]  # the last one repeats "7 8" at once
    drafted = {}
    for min_confidence in (None,) if floor is None else (None, floor):
        proposer = build(head_dir, min_confidence=min_confidence, lookup_min_n=2)
        engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=gamma, adaptive=False)
        seen = CountingVerifies(engine)
        outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        for prompt, out in zip(batch_prompts, outs):
            assert out.token_ids == reference(tuple(prompt)), (gamma, min_confidence, prompt)
        assert 0 < proposer.num_looked_up < proposer.num_rows, (proposer.num_looked_up, proposer.num_rows)
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
        drafted[min_confidence] = sum(o.metrics.num_draft_tokens for o in outs)
        assert sum(seen.counts) == drafted[min_confidence]  # what was verified is what was counted
    if floor is not None:  # head rows stopped early where unsure
        assert drafted[floor] < drafted[None], drafted


def test_sampling_with_lookup_rows_matches_target_distribution(tmp_path):
    """Whether a row drafts by lookup depends only on its tokens so far: sampled output still
    follows the target (chi-square), with looked-up and head rows side by side."""
    torch.manual_seed(1)
    small = tiny_llama(0, vocab=VOCAB, init_range=0.3, layers=3, hidden=16)
    save_feature_head(init_head(small, torch.arange(VOCAB)), tmp_path, store_lm_head=True)
    proposer = build(tmp_path, small, lookup_min_n=1)
    assert_proposer_follows_target(small, proposer)
    assert 0.05 < proposer.num_looked_up / proposer.num_rows < 0.95, (proposer.num_looked_up, proposer.num_rows)


def test_sampling_with_lookup_rows_and_a_confidence_floor_matches_target_distribution(tmp_path):
    """The demo's drafter: lookup rows and head rows that stop where unsure, side by side. Both
    choices read only what precedes the drawn token, so sampled output still follows the target."""
    torch.manual_seed(1)
    small = tiny_llama(0, vocab=VOCAB, init_range=0.3, layers=3, hidden=16)
    save_feature_head(init_head(small, torch.arange(VOCAB)), tmp_path, store_lm_head=True)
    proposer = build(tmp_path, small, min_confidence=0.3, lookup_min_n=1)  # see the test above
    kept = record_kept(proposer)
    assert_proposer_follows_target(small, proposer)
    assert 0.05 < proposer.num_looked_up / proposer.num_rows < 0.95, (proposer.num_looked_up, proposer.num_rows)
    assert 0 < kept.count(0) + kept.count(1), collections.Counter(kept)  # some head rows stopped early


# -- the draft loop on the device ------------------------------------------------------------------
class HostLoop(FeatureDrafterProposer):
    """The reference: the draft loop as it ran before it stayed on the device. Per position it reads
    the drafts (to stage the next rows' forward) and the floor (stopping where no row drafts) on
    the host; positions past the stop hold copies of the last draft, q one-hot there. Features and
    feedback are put in the runner's sorted row order (what the staged ids are in)."""

    def _draft(self, rows, seqs, num_tokens, sampling, uniforms):
        catch_up, feats = self._catch_up(rows, seqs)
        order = sorted(range(len(rows)), key=lambda b: self.runner._slot(rows[b].request_id))  # sorted -> caller
        back = torch.tensor(order).argsort()  # caller -> sorted
        width = max(len(r.tokens) for r in catch_up)
        self.head.set_features(torch.stack([F.pad(feats[b], (0, 0, 0, width - len(feats[b]))) for b in order]), False)
        logits = self.runner.forward(catch_up, logits="last")  # [b, K] caller order
        ends = torch.tensor([len(catch_up[b].tokens) - 1 for b in order])
        feedback = self.head.last_feedback[torch.arange(len(rows)), ends][back]  # [b, H] caller order
        masks = None
        if sampling.grammar is not None and self.grammar is not None:
            masks = DraftMasks(self.grammar, sampling.grammar, list(range(len(rows))))
        try:
            out, qs, kept = self._host_loop(rows, seqs, logits, feedback, order, back, num_tokens, sampling, uniforms,
                                            masks)
        finally:
            if masks is not None:
                masks.close()
        if len(out) < num_tokens:  # positions no row verifies: copies of the last token (or draft)
            fill = out[-1] if out else torch.tensor([s[-1] for s in seqs])
            qs += [one_hot(fill, self.vocab_size)] * (num_tokens - len(qs))
            out += [fill] * (num_tokens - len(out))
        probs = None if sampling.all_greedy else torch.stack(qs, dim=1)
        return torch.stack(out, dim=1), probs, kept

    def _host_loop(self, rows, seqs, logits, feedback, order, back, num_tokens, sampling, uniforms, masks):
        flags = None if sampling.all_greedy else sampling.flags()
        inputs, last = {"uniforms": uniforms}, [len(s) - 1 for s in seqs]
        floor, product = self.min_confidence, None
        kept = torch.full((len(rows),), num_tokens if floor is None else 0)
        out, qs = [], []
        for j in range(num_tokens):
            if masks is not None:
                logits = masks.apply(self._to_target_vocab(logits))
            if floor is not None:
                top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
                product = top if product is None else product * top
                kept += (product >= floor).long()
                if not bool((product >= floor).any()):
                    break
            token, q = self._pick(logits, sampling, flags, inputs, j, masks is not None)
            if masks is not None:
                masks.advance(token)
            out.append(token)
            qs.append(q)
            if j + 1 == num_tokens:
                break
            self.head.set_features(feedback[order][:, None], feedback=True)
            step_rows = [RowInput(r.request_id, p + j, [t]) for r, p, t in zip(rows, last, token.tolist())]
            logits = self.runner.forward(step_rows, logits="last")
            feedback = self.head.last_feedback[:, -1][back]
        return out, qs, kept


def twin(engine, reference) -> list[int]:
    """Runs `reference` (a proposer on the same head, tapping the same target) beside the engine's
    proposer, call for call, and checks that every proposal is the same: tokens, q and counts.
    -> the list of the proposals compared: (rows, whether the head's slots were out of the rows' order)."""
    proposer, compared = engine.proposer, []
    reference.attach_target(engine.verifier.runner)
    reference.grammar = proposer.grammar
    real_propose, real_prefill, real_free = proposer.propose, proposer.prefill, proposer.free

    def propose(rows, num_tokens, sampling, uniforms, *rest):
        want = reference.propose(rows, num_tokens, sampling, uniforms)
        got = real_propose(rows, num_tokens, sampling, uniforms, *rest)
        assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
        assert (got.num_draft is None) == (want.num_draft is None)
        assert got.num_draft is None or torch.equal(got.num_draft, want.num_draft), (got.num_draft, want.num_draft)
        assert (got.probs is None) == (want.probs is None)
        assert got.probs is None or torch.equal(got.probs, want.probs)
        slots = [s for s in (proposer.runner._slot_of.get(r.request_id) for r in rows) if s is not None]
        compared.append((len(rows), slots != sorted(slots)))  # (rows, the head's slots out of their order)
        return got

    def prefill(rows):
        reference.prefill(rows)
        return real_prefill(rows)

    def free(request_id):
        reference.free(request_id)
        real_free(request_id)

    proposer.propose, proposer.prefill, proposer.free = propose, prefill, free
    return compared


def joining_and_leaving(engine, batch_prompts, params) -> dict[str, list[int]]:
    """Half the requests first, the rest after two steps, each with its own params (and length):
    rows join, leave, and the head's runner moves its slots out of the callers' row order."""
    outputs = {f"r{i}": [] for i in range(len(batch_prompts))}
    half = len(batch_prompts) // 2
    for i in range(half):
        engine.add_request(f"r{i}", batch_prompts[i], params[i])
    for k in range(2):
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    for i in range(half, len(batch_prompts)):
        engine.add_request(f"r{i}", batch_prompts[i], params[i])
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return outputs


def decode_beside(engine, reference_proposer, sampled: bool) -> list:
    """Six requests joining and leaving (`joining_and_leaving`), `reference_proposer` proposing
    beside the engine's own call for call (`twin`); greedy rows checked against the target alone
    -> what `twin` compared."""
    compared = twin(engine, reference_proposer)
    batch_prompts = prompts(5, seed=3) + [[7, 8, 9, 7, 8]]
    params = mixed_params(len(batch_prompts), sampled)
    outputs = joining_and_leaving(engine, batch_prompts, params)
    for i, (prompt, p) in enumerate(zip(batch_prompts, params)):
        if p.temperature == 0:
            assert outputs[f"r{i}"] == reference(tuple(prompt))[: p.max_tokens], i
    return compared


def mixed_params(count: int, sampled: bool) -> list[SamplingParams]:
    """Greedy rows of different lengths, and (sampled) every other row sampling with top-p."""
    return [SamplingParams(max_tokens=MAX_NEW - 3 * (i % 4), temperature=0.8 if sampled and i % 2 else 0.0,
                           top_p=0.9, seed=i, ignore_eos=True) for i in range(count)]


@pytest.mark.parametrize("host_stop", [False, True])
@pytest.mark.parametrize("lookup_min_n", [None, 2])
@pytest.mark.parametrize("floor", [None, 0.025])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_device_loop_proposes_what_the_host_loop_proposed(head_dir, sampled, floor, lookup_min_n, host_stop):
    """Token for token, q for q and count for count, the loop that stays on the device (with or
    without the host's stop where no row drafts) proposes what the per-position host loop did, over
    rows that join and leave (the head's slots out of the callers' order), rows without features
    yet, looked-up rows, greedy and sampled rows; greedy rows still decode as the target alone."""
    model = target()
    proposer = build(head_dir, min_confidence=floor, lookup_min_n=lookup_min_n)
    proposer.host_stop = host_stop
    engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=4, adaptive=False)
    reference_proposer = build(head_dir, min_confidence=floor, lookup_min_n=lookup_min_n)
    reference_proposer.__class__ = HostLoop
    compared = decode_beside(engine, reference_proposer, sampled)
    assert len(compared) > 10 and max(n for n, _ in compared) == 6
    assert any(shuffled for _, shuffled in compared)  # the runner's row order was not the callers'


@pytest.mark.parametrize("floor", [None, 0.025])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_captured_loop_proposes_what_the_eager_loop_proposed(head_dir, sampled, floor):
    """Graph mode (graphs emulated on the CPU: test_engine_static.emulate_graphs): the head's whole
    draft loop is one replay per shape, the tapped target's verify forwards too; proposals equal
    the eager loop's call for call (its catch-ups padded to the same widths), greedy rows decode
    as the target alone. The loops were captured before the first request (`capture_ahead`),
    except those whose rows filter (top-p), captured when first met."""
    model = target()
    proposer = build(head_dir, min_confidence=floor)
    proposer.host_stop = False  # (a GPU's setting: the floor never stops the loop from the host)
    emulate_graphs(proposer.runner)
    engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=4, adaptive=False, max_batch_size=8)
    emulate_graphs(engine.verifier.runner)
    for runner in (proposer.runner, engine.verifier.runner):
        runner.pad_batches = True  # as on a GPU: batches padded up to their bucket, B real rows of B'
    engine.calibrate()  # the head's timing forwards (features unset) must not become graphs that real calls replay
    engine.capture_graphs(progress=False)
    ahead = set(proposer.runner.graphs._entries)
    # buckets 8, 4, 2, 1 x γ 1..4 x catch-up widths 4, 8 (up to γ + 1 = 5) x greedy, sampled
    assert len(ahead) == 4 * 4 * 2 * 2
    replayed = keys_run(proposer.runner)
    reference_proposer = build(head_dir, min_confidence=floor)
    reference_proposer.host_stop = False
    reference_proposer.runner.pad_batches = True  # (the same B': a forward's numbers depend on its rows)
    reference_proposer.loop_width = proposer.loop_width  # (and the same backlogs run first: 8, the widest captured)
    compared = decode_beside(engine, reference_proposer, sampled)
    head_keys = set(proposer.runner.graphs._entries)
    assert len(replayed) > 10 and set(replayed) <= head_keys  # loops replayed
    assert all(key[0] == "head" for key in head_keys)  # never a single head forward
    assert all(key[5] == (True, True) for key in head_keys - ahead)  # only filtering loops captured later
    assert (head_keys > ahead) == sampled
    assert len(compared) > 10 and len(engine.verifier.runner.graphs) > 0


def keys_run(runner) -> list[tuple]:
    """From now on, the key of every graph `runner` replays (or captures first) -> their list."""
    keys, run = [], runner.graphs.run

    def counted(key, fn, inputs=()):
        keys.append(key)
        return run(key, fn, inputs)

    runner.graphs.run = counted
    return keys


def test_graph_mode_never_replays_a_head_forward_alone(head_dir):
    """The head reads features set on it before each forward, which a replayed single forward
    would not see: in graph mode its single forwards run eagerly (only whole loops are captured)."""
    proposer = build(head_dir)
    emulate_graphs(proposer.runner)
    runner, width = proposer.runner, proposer.head.cfg.feature_size
    runner.forward([RowInput("a", 0, [1, 2, 3, 4])], logits="none")
    logits = []
    for value in (0.0, 1.0):
        proposer.head.set_features(torch.full((1, 1, width), value), feedback=False)
        logits.append(runner.forward([RowInput("a", 4, [5])], logits="last"))
    assert len(runner.graphs) == 0 and not torch.equal(logits[0], logits[1])


class NoHostReads:
    """Within the block, reading a tensor back to the host raises (on a CPU these would not
    wait, but on a GPU each one is a sync)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def refuse(name):
            def read(*args, **kwargs):
                raise AssertionError(f"Tensor.{name} inside the device-only draft loop")
            return read

        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse(name))

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


def loops_without_host_reads(proposer) -> list[int]:
    """Makes every draft loop of `proposer` run under NoHostReads -> the list that counts them."""
    loops, real = [], proposer._loop

    def loop(*args):
        with NoHostReads():
            out = real(*args)
        loops.append(1)
        return out

    proposer._loop = loop
    return loops


def test_no_host_reads_refuses_them():
    with NoHostReads():
        with pytest.raises(AssertionError):
            torch.ones(2).tolist()
        with pytest.raises(AssertionError):
            bool(torch.ones(1))
    assert torch.ones(2).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("floor", [None, 0.025])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_draft_loop_reads_nothing_back_to_the_host(head_dir, sampled, floor):
    """After staging the catch-up rows, the whole loop (the catch-up forward, G-1 single-token
    forwards, the picks, the floor's counts) runs without a host read; the drafts and counts come
    back in one copy afterwards. Greedy rows still decode as the target alone."""
    model = target()
    proposer = build(head_dir, min_confidence=floor)
    proposer.host_stop = False  # as on a GPU
    loops = loops_without_host_reads(proposer)
    engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=4, adaptive=False)
    batch_prompts = prompts(4, seed=9)
    params = mixed_params(len(batch_prompts), sampled)
    outs = engine.generate(batch_prompts, params)
    for prompt, p, out in zip(batch_prompts, params, outs):
        if p.temperature == 0:
            assert out.token_ids == reference(tuple(prompt))[: p.max_tokens]
    assert len(loops) > 5 and sum(o.metrics.num_accepted_tokens for o in outs) > 0


# -- the EAGLE-3 checkpoint layout ------------------------------------------------------------------
def write_eagle3_head(folder, model, draft_vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A randomly initialised head written the way public EAGLE-3 heads are published."""
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    hidden, vocab = c.hidden_size, c.vocab_size
    head_dim = hidden // c.num_attention_heads
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.05  # noqa: E731
    hot = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # [K] target ids
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": rand(c.num_attention_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(c.num_key_value_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(c.num_key_value_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, c.num_attention_heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(c.intermediate_size, hidden),
        "midlayer.mlp.up_proj.weight": rand(c.intermediate_size, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, c.intermediate_size),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": hot - torch.arange(draft_vocab),  # target id = draft id + d2t[draft id]
        "t2d": t2d,
    }
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "float16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def test_loads_the_eagle3_layout_and_stays_lossless(tmp_path):
    model = tiny_llama(0, layers=8)
    tensors = write_eagle3_head(tmp_path, model, draft_vocab=40)
    head = load_feature_head(tmp_path, model)
    assert head.cfg.feature_layers == eagle3_feature_layers(8) == (1, 3, 4)
    assert head.cfg.feature_size == 3 * model.config.hidden_size and head.cfg.feedback == "direct"
    assert torch.equal(head.draft_token_map, tensors["d2t"] + torch.arange(40))
    assert torch.equal(head.fc.weight, tensors["fc.weight"])
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, tensors["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(head.lm_head.weight, tensors["lm_head.weight"])

    proposer = build(tmp_path, model)
    assert isinstance(proposer, FeatureDrafterProposer)
    engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=3, adaptive=False)
    batch_prompts = prompts(3)
    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, out in zip(batch_prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_loader_refuses_a_broken_checkpoint(tmp_path):
    model = tiny_llama(0, layers=8)
    tensors = write_eagle3_head(tmp_path, model, draft_vocab=40)
    del tensors["d2t"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_feature_head(tmp_path, model)
    with pytest.raises(FileNotFoundError):
        FeatureDrafterSpec(str(tmp_path / "nowhere")).build(model, target_vocab_size(model), None)


def test_config_names_a_feature_head(head_dir):
    config = load_app_config({"served_model_name": "t", "target": {"kind": "tiny"},
                              "drafter": {"kind": "eagle", "path": str(head_dir)}})
    assert isinstance(config.drafter, FeatureDrafter)
    assert config.drafter.engine_spec() == FeatureDrafterSpec(str(head_dir))
    config = load_app_config({"served_model_name": "t", "target": {"kind": "tiny"},
                              "drafter": {"kind": "eagle", "path": str(head_dir), "lookup_min_n": 3}})
    assert config.drafter.engine_spec() == FeatureDrafterSpec(str(head_dir), None, 3)
    with pytest.raises(ValueError, match="lookup_min_n"):
        load_app_config({"served_model_name": "t", "target": {"kind": "tiny"},
                         "drafter": {"kind": "eagle", "path": str(head_dir), "lookup_min_n": 0}})


def test_target_worker_drafts_with_a_feature_head(tmp_path):
    """The target worker (no Ray here) builds the head from its config, attaches it to its own
    verifier, and the coordinator's propose/verify loop stays lossless."""
    from specserve.config import TinySource
    from specserve.engine.policy import SpeculationPolicy
    from specserve.engine.step import apply_verdict, new_sequence, plan_step
    from specserve.models.loading import load_target
    from specserve.serve.workers import TargetWorker

    source = TinySource(layers=2)
    model = load_target(source)
    save_feature_head(init_head(model, torch.arange(target_vocab_size(model))), tmp_path, store_lm_head=True)
    worker = TargetWorker(source, 256, drafter=FeatureDrafter(path=str(tmp_path)))
    prompt = list(b"speculate")
    seq = new_sequence("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       vocab_size=target_vocab_size(model), max_model_len=256, eos_token_ids=frozenset())
    policy = SpeculationPolicy(3, adaptive=False)
    while seq.finish_reason is None:
        plan = plan_step([seq], policy)
        proposal = worker.propose(plan.draft_rows(), plan.gamma, plan.sampling, plan.draft_uniforms).result
        verdict = worker.verify(plan.target_rows(), proposal.tokens, proposal.probs, plan.num_draft, plan.sampling,
                                plan.accept_uniforms, plan.final_uniforms).result
        apply_verdict(plan, proposal, verdict)
    assert seq.output == hf_greedy(model, prompt, 12)
    assert seq.metrics.num_draft_tokens > 0
    import ray

    assert not ray.is_initialized()  # a worker built outside Ray must not start a cluster


# -- a head on the draft worker: features pulled from the target -----------------------------------
class Pulling(FeatureDrafterProposer):
    """A pulled head as the draft worker drives it, without Ray: before each propose it pulls what
    `features_wanted` names from a FeatureServer on the engine's target runner."""

    def attach_target(self, runner) -> None:
        from specserve.engine.feature_drafter import FeatureServer

        self.server = FeatureServer(runner, self.head.cfg.feature_layers)

    def propose(self, rows, *args):
        self.put_features(self.server.read(self.features_wanted(rows)))
        return super().propose(rows, *args)


def pulled(path, model=None, lookup_min_n=None):
    model = model or target()
    proposer = FeatureDrafterSpec(str(path), None, lookup_min_n).build(model, target_vocab_size(model), None,
                                                                     pulled=True)
    proposer.__class__ = Pulling
    return proposer


@pytest.mark.parametrize("lookup_min_n", [None, 2])
@pytest.mark.parametrize("batch", [1, 3])
def test_pulled_features_draft_exactly_what_the_colocated_head_drafts(head_dir, batch, lookup_min_n):
    """Greedy output is the target's, and every step accepts what the head beside the target
    accepts: the features pulled are the ones the target computed, position for position (with
    lookup rows too: a head that skipped steps catches up from pulled features)."""
    batch_prompts = prompts(batch)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    here = SpeculativeEngine(target(), proposer=build(head_dir, lookup_min_n=lookup_min_n), num_speculative_tokens=3,
                             adaptive=False)
    there = SpeculativeEngine(target(), proposer=pulled(head_dir, lookup_min_n=lookup_min_n),
                              num_speculative_tokens=3, adaptive=False)
    outs_here, outs_there = here.generate(batch_prompts, params), there.generate(batch_prompts, params)
    for prompt, a, b in zip(batch_prompts, outs_here, outs_there):
        assert b.token_ids == reference(tuple(prompt))
        assert b.metrics.accepted_per_position == a.metrics.accepted_per_position
    assert sum(o.metrics.num_accepted_tokens for o in outs_there) > 0


def test_pulled_features_sampling_matches_target_distribution(tmp_path):
    torch.manual_seed(1)
    small = tiny_llama(0, vocab=VOCAB, init_range=0.3, layers=3, hidden=16)
    save_feature_head(init_head(small, torch.arange(VOCAB)), tmp_path, store_lm_head=True)
    assert_proposer_follows_target(small, pulled(tmp_path, small))


def test_a_pulled_head_keeps_only_contiguous_committed_features(head_dir):
    """put_features refuses a block that would leave a hole (a restarted draft worker offered a
    later block): the head asks again from what it holds."""
    proposer = pulled(head_dir)
    width = proposer.head.cfg.feature_size
    assert proposer.features_wanted([RowInput("r", 0, [5, 6, 7])]) == {"r": (0, 2)}
    proposer.put_features({"r": (2, torch.zeros(3, width))})  # a hole at 0..1: refused
    assert proposer.features.written("r") == 0
    proposer.put_features({"r": (0, torch.ones(2, width))})
    assert proposer.features.written("r") == 2
    assert proposer.features_wanted([RowInput("r", 0, [5, 6, 7])]) == {}
    assert proposer.features_wanted([RowInput("r", 3, [8, 9])]) == {"r": (2, 4)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_mode_feature_head_on_gpu(head_dir, temperature):
    """On a GPU: the tapped target and the head's loops as real CUDA graphs give the eager
    engine's tokens (greedy: the target's own)."""
    model = tiny_llama(0, layers=LAYERS).cuda()
    batch_prompts = prompts(4, seed=7)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=temperature, seed=3, min_p=0.05 if temperature else 0.0)
    runs = {}
    for execution in ("eager", "graph"):
        proposer = FeatureDrafterSpec(str(head_dir), execution=execution).build(model, target_vocab_size(model), None)
        engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=4, adaptive=False,
                                   execution=execution)
        runs[execution] = [o.token_ids for o in engine.generate(batch_prompts, params)]
        if execution == "graph":
            assert len(engine.verifier.runner.graphs) > 0
            assert any(key[0] == "head" for key in proposer.runner.graphs._entries)
    assert runs["graph"] == runs["eager"]
    if temperature == 0.0:
        alone = SpeculativeEngine(model, num_speculative_tokens=0, execution="eager")
        assert runs["graph"] == [o.token_ids for o in alone.generate(batch_prompts, params)]
