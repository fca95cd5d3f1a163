"""Seeded random scenarios: many engine features mixed at once, greedy output checked against the
target alone.

Each seed draws an engine configuration (γ 0-6, adaptive or fixed, a drafter of every kind the
tests build in process, dense or paged KV with blocks of 1-16, prefix caching, prefill chunks,
a small batch and/or KV budget so requests queue and get preempted, max_model_len, EOS ids; in a
quarter of the seeds, the target with a sliding window of 8-64 positions; in a third, a history of
finished requests drafted from) and a
schedule (3-10 requests, some sharing long prefixes, some near max_model_len, arriving at random
steps, a few aborted at random steps, each with its own greedy SamplingParams: max_tokens down to
1, stop ids, min_tokens, ignore_eos, logit bias, allowed ids, bad words, penalties, logprobs, and
a predicted output made from its reference: exact, edited, cut, extended, doubled or unrelated).

Every finished request's tokens and finish reason must equal those of the same request run alone
through a plain target-only engine (γ 0, dense, no prefix caching, batch of one), and, where its
params do not process the logits, those of HF `generate` cut at its first stop token. An aborted
request's tokens so far must be a prefix of its reference; at the end every cache is empty
(paged pools back to their scratch block only).

By default a few seeds run (CI); SPECSERVE_SCENARIO_SEEDS="0-499" (or "3,17,40-60") runs others.
A failing test's id names its seed: `pytest tests/test_engine_scenarios.py -k "seed_17"`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from transformers import MistralConfig, MistralForCausalLM

from models import ShiftedDraft, hf_greedy, perturbed
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine.admission import Admission, allocation
from specserve.engine.engine import kept_behind
from specserve.engine.feature_drafter import FeatureDrafterProposer, FeatureDrafterSpec
from specserve.engine.history import History
from specserve.engine.model_runner import ModelRunner
from specserve.engine.proposers import DraftModelSpec, LayerSkipSpec, PredictionSpec, PromptLookupSpec
from specserve.engine.step import new_sequence
from specserve.models.tiny import byte_tokenizer
from test_feature_drafter import LAYERS, target  # tiny_llama(0, layers=4): the feature head's target
from test_grammar import GRAMMARS  # constrained requests draw from these

torch.set_num_threads(1)

VOCAB = 96
MODEL_LEN = 256  # the tiny models' max_position_embeddings
# 0-39, and seeds that found bugs (with the generator as it is): 125 (calibration in a small fixed
# pool), 290 (a request accepted under a paged budget that could never fit alone)
DEFAULT_SEEDS = "0-39,125,290"
DRAFTERS = ("none", "draft-ordinary", "draft-equal", "draft-wrong", "layer-skip", "prompt-lookup",
            "feature-head")
# "prediction" (the requests' predictions alone) takes over an eighth of the scenarios with a
# drafter, from a stream of its own (`draw_prediction_drafter`): the other seeds draw as before
ALL_DRAFTERS = DRAFTERS + ("prediction",)


def seeds_from_env(var: str = "SPECSERVE_SCENARIO_SEEDS", default: str = DEFAULT_SEEDS) -> list[int]:
    """The seeds the environment variable `var` names ("a-b" ranges and single seeds, comma
    separated), else `default`'s."""
    spec = os.environ.get(var, default)
    seeds = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


# -- the scenario ------------------------------------------------------------------------------------
@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrive: int  # the step number before which it is added
    abort: int | None = None  # the step number before which it is aborted (None: never)
    priority: int = 0  # add_request's: lower is admitted first, preempted last
    prediction: str | None = None  # a predicted output of this kind, made from its reference (`predicted`)


@dataclass
class Scenario:
    seed: int
    gamma: int
    adaptive: bool
    drafter: str
    drafter_args: dict
    block_size: int | None
    prefix_caching: bool
    chunk: int | None
    max_batch_size: int
    max_model_len: int | None
    eos: list[int]
    budget: int | None = None
    requests: list[Request] = field(default_factory=list)
    window: int | None = None  # the target's sliding window (`windowed`), or none
    forget_slack: int | None = None  # windowed and paged: the runners' rollback slack (None: theirs)
    history: tuple[int, int] | None = None  # (max_tokens, min_match) of a History drafted from (`draw_history`)

    def engine_kwargs(self) -> dict:
        return dict(num_speculative_tokens=self.gamma, adaptive=self.adaptive, kv_block_size=self.block_size,
                    prefix_caching=self.prefix_caching, prefill_chunk_tokens=self.chunk,
                    max_batch_size=self.max_batch_size, max_model_len=self.max_model_len,
                    max_cached_tokens=self.budget, eos_token_ids=self.eos,
                    history=None if self.history is None else History(*self.history))


def draw_prediction_drafter(seed: int) -> bool:
    """Whether scenario `seed` drafts with the requests' predictions alone (a stream of its own)."""
    return random.Random(seed * 4099 + 1).random() < 1 / 8


def draw_window(seed: int) -> int | None:
    """The target's sliding window in scenario `seed` (a stream of its own: the other draws stay
    as they were), or None for the plain target."""
    rng = random.Random(seed * 7919 + 2)
    return rng.choice([8, 24, 64]) if rng.random() < 0.25 else None


def draw_forget_slack(seed: int, sc: "Scenario") -> int | None:
    """A windowed paged scenario's rollback slack (a stream of its own): half of them none at all,
    so that every block the window passed goes back at once (no in-process row rolls back before
    its request's last start), None for the runners' own."""
    if sc.window is None or not sc.block_size:
        return None
    return 0 if random.Random(seed * 3571 + 4).random() < 0.5 else None


def draw_history(seed: int) -> tuple[int, int] | None:
    """(max_tokens, min_match) of the finished requests' history scenario `seed` drafts from (a
    stream of its own), or None; a budget of 48 tokens keeps dropping the oldest."""
    rng = random.Random(seed * 6151 + 3)
    return (rng.choice([48, 4096]), rng.choice([2, 3, 6])) if rng.random() < 1 / 3 else None


def draw_config(rng: random.Random, seed: int) -> Scenario:
    gamma = rng.choice([0, 1, 2, 3, 4, 5, 6])
    drafter = "none" if gamma == 0 else rng.choice(DRAFTERS[1:])
    if drafter != "none" and draw_prediction_drafter(seed):
        drafter = "prediction"
    args = {}
    if drafter == "layer-skip":
        args["skip"] = tuple(rng.sample(range(LAYERS), rng.randint(1, LAYERS - 1)))
    elif drafter == "prompt-lookup":
        lo = rng.randint(1, 3)
        args.update(min_n=lo, max_n=rng.randint(lo, 4))
    elif drafter == "feature-head":
        args.update(min_confidence=rng.choice([None, None, 0.35]), lookup_min_n=rng.choice([None, None, 3]))
    block = rng.choice([None, None, 1, 3, 7, 16])
    return Scenario(
        seed=seed, gamma=gamma, adaptive=rng.random() < 0.4, drafter=drafter, drafter_args=args,
        block_size=block, prefix_caching=bool(block) and rng.random() < 0.6,
        chunk=rng.choice([None, 0, 1, 5, 13, 32, 512]), max_batch_size=rng.choice([1, 2, 3, 4, 64]),
        max_model_len=rng.choice([None, None, 64, 100, 160]), eos=rng.choice([[], [], [rng.randrange(VOCAB)],
                                                                            rng.sample(range(VOCAB), 2)]),
    )


def draw_params(rng: random.Random, room: int, vocab: int = VOCAB) -> SamplingParams:
    """Greedy params with a random mix of stops and logit processing; max_tokens <= room."""
    max_tokens = max(1, min(room, rng.choice([1, rng.randint(2, 12), rng.randint(8, 40), rng.randint(20, 48)])))
    kw: dict = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=rng.random() < 0.3)
    if rng.random() < 0.3:
        kw["stop_token_ids"] = tuple(rng.sample(range(vocab), rng.randint(1, 3)))
    if rng.random() < 0.25:
        kw["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.15:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.5:  # plain: no logit processing (HF generate checks the reference too)
        return SamplingParams(**kw)
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.choice([-1.0, 0.5, 1.5])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.3, 1.0])
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([0.8, 1.3, 1.8])
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, -3.0, 2.5, 8.0]) for _ in range(3)}
    if rng.random() < 0.2:
        kw["allowed_token_ids"] = tuple(rng.sample(range(vocab), rng.randint(2, 30)))
    if rng.random() < 0.15:
        kw["bad_words_ids"] = tuple(tuple(rng.sample(range(vocab), rng.randint(1, 2))) for _ in range(2))
    return SamplingParams(**kw)


def valid(prompt: list[int], params: SamplingParams, eos: list[int]) -> bool:
    """Whether new_sequence accepts it (allowed ids with min_tokens must leave a non-stop token)."""
    try:
        new_sequence("x", prompt, params, vocab_size=VOCAB, max_model_len=MODEL_LEN, eos_token_ids=frozenset(eos))
    except ValueError:
        return False
    return True


def draw_prompt(rng: random.Random, prefixes: list[list[int]], limit: int) -> list[int]:
    """A prompt of at most `limit` tokens: a shared prefix (whole or cut) or not, then its own
    tokens (random, or a repeated pattern that prompt lookup can follow)."""
    head = []
    if prefixes and rng.random() < 0.6:
        head = rng.choice(prefixes)
        head = head[: rng.choice([len(head), rng.randint(1, len(head))])]
    if rng.random() < 0.2:
        pattern = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]
        tail = (pattern * 20)[: rng.randint(4, 40)]
    else:
        tail = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, rng.randint(3, 20), rng.randint(20, 90)]))]
    return (head + tail)[-limit:]


def draw_requests(rng: random.Random, sc: Scenario) -> list[Request]:
    model_len = sc.max_model_len or MODEL_LEN
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(16, 60))] for _ in range(rng.randint(0, 2))]
    requests: list[Request] = []
    while len(requests) < rng.randint(3, 10):
        if rng.random() < 0.15:  # near max_model_len
            params = draw_params(rng, rng.randint(1, 12))
            prompt = draw_prompt(rng, prefixes, model_len)
            prompt = (prompt * model_len)[: model_len - params.max_tokens - rng.randint(0, 2)]
        else:
            prompt = draw_prompt(rng, prefixes, model_len - 2)
            params = draw_params(rng, model_len - len(prompt))
        if not prompt or not valid(prompt, params, sc.eos):
            continue
        arrive = rng.choice([0, 0, rng.randint(0, 6), rng.randint(0, 30)])
        abort = arrive + rng.randint(0, 12) if rng.random() < 0.15 else None
        priority = rng.choice([0, 0, 0, 1, 2])
        params = draw_grammar(sc.seed, len(requests), params)
        requests.append(Request(f"s{sc.seed}-r{len(requests)}", prompt, params, arrive, abort, priority,
                                draw_prediction(sc.seed, len(requests), often=sc.drafter == "prediction")))
    return requests


def draw_grammar(seed: int, index: int, params: SamplingParams) -> SamplingParams:
    """Request `index` of scenario `seed`'s params, constrained or not (a fifth of them), by one of
    test_grammar's grammars (JSON schemas, a regex, a lark grammar over the test models' byte ids);
    a stream of its own, as the predictions'."""
    rng = random.Random(seed * 2003 + index + 7)
    if rng.random() >= 0.2:
        return params
    grammar = rng.choice([g for g in GRAMMARS if g is not None])
    # (SamplingParams refuses a grammar beside these: the grammar decides the tokens)
    return dataclasses.replace(params, grammar=grammar, allowed_token_ids=None, bad_words_ids=(), min_tokens=0)


PREDICTIONS = ("exact", "substituted", "inserted", "deleted", "first-half", "longer", "unrelated", "repeated")


def draw_prediction(seed: int, index: int, often: bool = False) -> str | None:
    """Whether request `index` of scenario `seed` sends a prediction (30% of them; 80% `often`,
    where the drafter drafts nothing else), and of which kind (its own random stream: the
    scenarios' other draws stay what they were before predictions existed)."""
    rng = random.Random(seed * 1009 + index)
    return rng.choice(PREDICTIONS) if rng.random() < (0.8 if often else 0.3) else None


def predicted(kind: str, output: list[int], seed: int, vocab: int = VOCAB) -> tuple[int, ...]:
    """A prediction of `output` (the request's reference): itself, with edits, cut, extended, or
    unrelated tokens."""
    rng = random.Random(seed)
    out = list(output)
    where = rng.randint(0, len(out))
    if kind == "substituted":
        for i in rng.sample(range(len(out)), min(len(out), rng.randint(1, 3))):
            out[i] = (out[i] + rng.randint(1, vocab - 1)) % vocab
    elif kind == "inserted":
        out[where:where] = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    elif kind == "deleted":
        del out[where : where + rng.randint(1, 4)]
    elif kind == "first-half":
        out = out[: len(out) // 2]
    elif kind == "longer":
        out += [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    elif kind == "unrelated":
        out = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    elif kind == "repeated":  # the output twice: the second copy must not pull the alignment back
        out = out + out
    return tuple(out) or (0,)


def with_predictions(sc: Scenario) -> None:
    """Each request that draws a prediction gets it, made from its reference output."""
    for i, r in enumerate(sc.requests):
        if r.prediction is not None:
            tokens = reference(tuple(r.prompt), r.params, tuple(sc.eos), sc.window)[0]
            r.params = dataclasses.replace(r.params, prediction=predicted(r.prediction, tokens, sc.seed * 31 + i))


def draw_budget(rng: random.Random, sc: Scenario) -> int | None:
    """A KV budget between what the largest request alone needs and a little more (so requests
    queue, and paged ones get preempted as they grow), or none."""
    if rng.random() > (0.7 if sc.block_size else 0.4):
        return None
    model_len = sc.max_model_len or MODEL_LEN
    worst = Admission(sc.max_batch_size, None, sc.gamma, sc.block_size).worst
    alone = max(allocation([worst(seq_of(r, model_len))], sc.block_size) for r in sc.requests)
    return int(alone * rng.uniform(1.0, 1.4 if sc.block_size else 2.5))


def seq_of(r: Request, model_len: int):
    return new_sequence(r.rid, r.prompt, r.params, vocab_size=VOCAB, max_model_len=model_len,
                        eos_token_ids=frozenset())


def draw_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    sc = draw_config(rng, seed)
    sc.requests = draw_requests(rng, sc)
    sc.budget = draw_budget(rng, sc)
    sc.window = draw_window(seed)
    sc.history = draw_history(seed)
    sc.forget_slack = draw_forget_slack(seed, sc)
    return sc


# -- engines ---------------------------------------------------------------------------------------
@functools.lru_cache(None)
def windowed(window: int) -> torch.nn.Module:
    """The target's weights as a Mistral (a Llama with a sliding window) attending `window` positions."""
    fields = {k: v for k, v in target().config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version")}
    config = MistralConfig(**fields, sliding_window=window)
    config._attn_implementation = "sdpa"
    model = MistralForCausalLM(config).eval()
    model.load_state_dict(target().state_dict(), strict=True)
    return model


def target_of(window: int | None) -> torch.nn.Module:
    return target() if window is None else windowed(window)


@functools.lru_cache(None)
def draft_model(kind: str, window: int | None) -> torch.nn.Module:
    model = target_of(window)
    if kind == "draft-ordinary":
        return perturbed(model, 0.6, seed=1)
    if kind == "draft-wrong":
        return ShiftedDraft(model)
    return perturbed(model, 0.0, seed=0)  # "draft-equal": an exact copy


def drafter_spec(sc: Scenario, head_dir):
    args = sc.drafter_args
    if sc.drafter == "none":
        return None
    if sc.drafter.startswith("draft-"):
        return DraftModelSpec(draft_model(sc.drafter, sc.window))
    if sc.drafter == "layer-skip":
        return LayerSkipSpec(args["skip"])
    if sc.drafter == "prompt-lookup":
        return PromptLookupSpec(args["min_n"], args["max_n"])
    if sc.drafter == "prediction":
        return PredictionSpec()
    return FeatureDrafterSpec(str(head_dir), args["min_confidence"], args["lookup_min_n"])


@functools.lru_cache(None)
def reference_engine(eos: tuple[int, ...], window: int | None) -> SpeculativeEngine:
    return SpeculativeEngine(target_of(window), None, num_speculative_tokens=0, max_batch_size=1,
                             prefill_chunk_tokens=None, eos_token_ids=list(eos), tokenizer=byte_tokenizer)


@functools.lru_cache(maxsize=4096)
def reference(prompt: tuple[int, ...], params: SamplingParams, eos: tuple[int, ...], window: int | None):
    """(tokens, finish_reason, logprobs) of the request alone through the plain target-only engine."""
    out = reference_engine(eos, window).generate([list(prompt)], params)[0]
    return out.token_ids, out.finish_reason, out.logprobs


@functools.lru_cache(maxsize=4096)
def hf_reference(prompt: tuple[int, ...], params: SamplingParams, eos: tuple[int, ...], window: int | None):
    """HF generate's greedy tokens, cut after the first stop id: (tokens, finish_reason)."""
    return cut_at_stop(hf_greedy(target_of(window), list(prompt), params.max_tokens), params, eos)


def cut_at_stop(tokens: list[int], params: SamplingParams, eos) -> tuple[list[int], str]:
    """Tokens generated past the request's end (HF's) cut after its first stop id -> (tokens, finish_reason)."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def plain(params: SamplingParams, eos: list[int]) -> bool:
    """No logit processing at all (so HF generate is a reference too)."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    return not params.processed and not (params.min_tokens and stops) and params.grammar is None


# -- running a scenario ------------------------------------------------------------------------------
@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False


def run_schedule(engine: SpeculativeEngine, sc: Scenario, max_steps: int = 5000) -> dict[str, Result]:
    """Add, abort and step as the schedule says until every request is done."""
    results = {r.rid: Result() for r in sc.requests}
    last = max(max(r.arrive, r.abort or 0) for r in sc.requests)
    for n in range(max_steps):
        for r in sc.requests:
            if r.arrive == n:
                engine.add_request(r.rid, r.prompt, r.params, priority=r.priority)
            if r.abort == n and results[r.rid].finish is None:
                engine.abort(r.rid)
                results[r.rid].aborted = True
        for out in engine.step():
            res = results[out.request_id]
            assert not res.aborted and res.finish is None, f"tokens after abort / finish for {out.request_id}"
            res.tokens += out.new_token_ids
            res.logprobs += out.logprobs or []
            res.finish = out.finish_reason
        if n >= last and not engine.has_unfinished():
            return results
    waiting = [q.request_id for q in engine.admission.waiting]
    raise AssertionError(f"seed {sc.seed}: the engine did not finish in {max_steps} steps; still waiting: {waiting}, "
                         f"running: {list(engine.admission.running)}")


def assert_resources_free(engine: SpeculativeEngine) -> None:
    """No request holds anything: admission empty, no cache slot, paged pools at their scratch block."""
    assert not engine.admission.running and not engine.admission.waiting
    assert all(n == 0 for n in engine.num_cached().values()), engine.num_cached()
    proposer = engine.proposer
    if proposer is not None:
        assert proposer.num_cached() == 0
    if isinstance(proposer, FeatureDrafterProposer):
        assert not proposer.features._held, list(proposer.features._held)
    for runner in (engine.verifier.runner, getattr(proposer, "runner", None)):
        if isinstance(runner, ModelRunner) and runner.paged:
            assert runner.cache.allocated()[0] == 1, runner.cache.allocated()


def check_request(sc: Scenario, r: Request, res: Result) -> None:
    eos = tuple(sc.eos)
    tokens, finish, logprobs = reference(tuple(r.prompt), dataclasses.replace(r.params, prediction=None), eos,
                                         sc.window)
    where = f"seed {sc.seed} {r.rid} prompt_len={len(r.prompt)} {r.params}"
    if res.aborted:
        assert res.tokens == tokens[: len(res.tokens)], f"{where}: aborted stream not a prefix of the reference"
        return
    assert (res.tokens, res.finish) == (tokens, finish), f"{where}: engine {res.tokens} {res.finish}"
    if r.params.logprobs is not None:
        # [n] float32 each: the chosen tokens' log-probabilities (batch shapes move the last bits)
        assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(logprobs), atol=1e-3), where
    if plain(r.params, sc.eos):
        assert (tokens, finish) == hf_reference(tuple(r.prompt), r.params, eos, sc.window), f"{where}: reference != HF"


def run_scenario(sc: Scenario, head_dir) -> None:
    with_predictions(sc)
    engine = SpeculativeEngine(target_of(sc.window), drafter=drafter_spec(sc, head_dir), tokenizer=byte_tokenizer,
                               **sc.engine_kwargs())
    if sc.forget_slack is not None:  # (admission reads it from the runners: told again)
        for runner in (engine.verifier.runner, getattr(engine.proposer, "runner", None)):
            if isinstance(runner, ModelRunner):
                runner.forget_slack = sc.forget_slack
        engine.admission.kept_behind = kept_behind(engine.verifier, engine.proposer)
    results = run_schedule(engine, sc)
    for r in sc.requests:
        check_request(sc, r, results[r.rid])
    assert_resources_free(engine)


def describe(sc: Scenario) -> str:
    reqs = "\n".join(f"  {r.rid} len={len(r.prompt)} arrive={r.arrive} abort={r.abort} priority={r.priority} "
                     f"prediction={r.prediction} {r.params}"
                     for r in sc.requests)
    return f"{sc}\n{reqs}"


@pytest.mark.parametrize("seed", seeds_from_env(), ids=lambda s: f"seed_{s}")
def test_random_scenario_is_the_target_alone(seed, request):
    sc = draw_scenario(seed)
    head_dir = request.getfixturevalue("head_dir") if sc.drafter == "feature-head" else None
    try:
        run_scenario(sc, head_dir)
    except AssertionError as e:
        raise AssertionError(f"{e}\nscenario:\n{describe(sc)}") from e


def test_the_generator_covers_the_features():
    """Over the default seeds' neighbourhood the draws reach every drafter and most options."""
    scs = [draw_scenario(s) for s in range(200)]
    assert {sc.drafter for sc in scs} == set(ALL_DRAFTERS)
    assert any(sc.prefix_caching for sc in scs) and any(sc.budget and sc.block_size for sc in scs)
    assert any(r.abort is not None for sc in scs for r in sc.requests)
    assert any(r.params.max_tokens == 1 for sc in scs for r in sc.requests)
    assert {r.prediction for sc in scs if sc.drafter != "none" for r in sc.requests} == {None, *PREDICTIONS}
    constrained = [sc for sc in scs if any(r.params.grammar for r in sc.requests)]
    assert {sc.drafter for sc in constrained} == set(ALL_DRAFTERS) and any(sc.block_size for sc in constrained)
    assert any(r.params.grammar and r.prediction for sc in scs for r in sc.requests)
    assert {sc.history for sc in scs if sc.drafter != "none"} >= {(48, 2), (4096, 6), None}
    windowed_ones = [sc for sc in scs if sc.window]
    assert {sc.window for sc in windowed_ones} == {8, 24, 64}
    assert {sc.drafter for sc in windowed_ones} == set(ALL_DRAFTERS)
    assert any(sc.block_size and sc.prefix_caching and sc.budget for sc in windowed_ones)
