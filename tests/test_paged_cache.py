"""The paged KV cache (engine/paged_cache.py, `kv_block_size`): greedy output identical to the
target alone through every drafter with blocks of 1, 7 and 16 positions; seeded sampling the same
tokens as with the dense cache; the pool back to full after every run; the forward compiles as
one graph; forks for pipelined branches; and admission by blocks admits what a dense cache cannot."""
from __future__ import annotations

import functools

import pytest
import torch

from models import hf_greedy, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import RowInput
from specserve.engine.admission import Admission, allocation, positions_needed
from specserve.engine.model_runner import ModelRunner
from specserve.engine.step import new_sequence
from test_drafters import prompts
from test_feature_drafter import kept_features, target
from test_processing import drafter

MAX_NEW = 24


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(target(), list(prompt), MAX_NEW)


def runners(engine: SpeculativeEngine) -> list[ModelRunner]:
    found = [engine.verifier.runner, getattr(engine.proposer, "runner", None)]
    return [r for r in found if isinstance(r, ModelRunner)]


def assert_pool_full(engine: SpeculativeEngine) -> None:
    """Every block back in its pool: only the scratch block is in use."""
    for runner in runners(engine):
        assert runner.paged and runner.cache.allocated()[0] == 1, runner.cache.allocated()


@pytest.mark.parametrize("name", ["draft-model", "feature-head", "layer-skip", "prompt-lookup"])
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_greedy_identical_to_the_target_alone(name, block_size, head_dir):
    batch = prompts(5, seed=13) + [list(range(1, 60))]  # ragged, one row past several blocks
    engine = SpeculativeEngine(target(), proposer=drafter(name, head_dir), num_speculative_tokens=4,
                               adaptive=False, kv_block_size=block_size)
    outs = engine.generate(batch, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == reference(tuple(prompt)), (name, block_size)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert_pool_full(engine)


def test_gamma_one_chunked_prefill_and_requests_that_come_and_go():
    """γ 1, prompts prefilled in chunks of 5, a request aborted mid-way and new ones joining a
    running batch: every survivor's tokens are the target's, and the pool comes back full."""
    model = target()
    engine = SpeculativeEngine(model, tiny_llama(0, layers=4), num_speculative_tokens=1, adaptive=False,
                               kv_block_size=7, prefill_chunk_tokens=5, max_batch_size=4)
    batch = prompts(6, seed=21)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    done: dict[str, list[int]] = {}
    for i, prompt in enumerate(batch[:3]):
        engine.add_request(f"r{i}", prompt, params)
    for step in range(200):
        if step == 3:
            engine.abort("r1")
            for i, prompt in enumerate(batch[3:], start=3):
                engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished():
            break
    for i, prompt in enumerate(batch):
        if i != 1:
            assert done[f"r{i}"] == reference(tuple(prompt)), i
    assert_pool_full(engine)


def test_seeded_sampling_is_the_dense_caches():
    batch = prompts(4, seed=5)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=40 + i, ignore_eos=True)
              for i in range(len(batch))]

    def run(block_size):
        engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=3, adaptive=False,
                                   kv_block_size=block_size)
        return [o.token_ids for o in engine.generate(batch, params)]

    assert run(16) == run(None) == run(3)


def test_a_fixed_pool_never_moves():
    """With a budget the pool is allocated once: storage never moves (captured graphs stay valid)
    however requests come and go, and admission keeps within it."""
    engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=3, adaptive=False,
                               kv_block_size=8, max_cached_tokens=640, max_batch_size=16)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine.generate(prompts(2, seed=1), params)
    generations = [r.cache.generation for r in runners(engine)]
    batch = prompts(12, seed=2)
    outs = engine.generate(batch, params)
    assert [o.token_ids for o in outs] == [reference(tuple(p)) for p in batch]
    assert [r.cache.generation for r in runners(engine)] == generations
    assert all(r.cache.num_blocks == 640 // 8 for r in runners(engine))
    assert_pool_full(engine)


def test_the_paged_forward_compiles_as_one_graph():
    """torch.compile(fullgraph=True) of the fixed-shape forward over block tables: no graph break,
    and the same logits as eager."""
    model = target()
    eager, compiled = ModelRunner(model, execution="eager"), ModelRunner(model, execution="compile")
    for runner in (eager, compiled):
        runner.page(5, 40)
    rows = [RowInput("a", 0, [3, 4, 5, 6, 7, 8, 9]), RowInput("b", 0, [11, 12])]
    outs = []
    for runner in (eager, compiled):
        runner.forward(rows, logits="none")
        first = runner.forward([RowInput("a", 7, [1, 2]), RowInput("b", 2, [9, 8])], logits="all")
        second = runner.forward([RowInput("a", 9, [4, 4]), RowInput("b", 4, [5, 1])], logits="all")
        outs.append((first, second))
    assert compiled._compiled is not None
    for x, y in zip(*outs):
        assert torch.allclose(x, y, atol=1e-4)


def test_forks_copy_their_prefix_into_blocks_of_their_own():
    """A pipelined step's branch: fork, write past the fork point, adopt; the request reads what
    the fork wrote, and the fork's blocks go back to the pool."""
    model = target()
    runner, dense = ModelRunner(model, execution="eager"), ModelRunner(model, execution="eager")
    runner.page(4)
    tokens = [5, 9, 13, 2, 7, 30, 31, 4, 8]
    for r in (runner, dense):
        r.forward([RowInput("a", 0, tokens)], logits="none")
        r.fork("a", "a#1", 6)
        r.forward([RowInput("a#1", 6, [40, 41, 42])], logits="none")
        r.adopt("a#1", "a")
        assert r.valid_length("a") == 9
    got = runner.forward([RowInput("a", 9, [3])], logits="last")
    want = dense.forward([RowInput("a", 9, [3])], logits="last")
    assert torch.allclose(got, want, atol=1e-5)
    runner.free("a")
    assert runner.cache.allocated()[0] == 1


def test_admission_by_blocks_takes_in_what_a_dense_cache_cannot():
    """One long request among many short ones, one budget: the dense cache sizes every slot by the
    long one; blocks hold each request's own length."""
    def admitted(block_size):
        admission = Admission(64, 4096, 4, block_size)
        lengths = [430] + [30] * 40
        for i, n in enumerate(lengths):
            admission.enqueue(new_sequence(f"r{i}", [1] * n, SamplingParams(max_tokens=48), vocab_size=96,
                                           max_model_len=1024, eos_token_ids=frozenset()))
        return len(admission.admit())

    dense, paged = admitted(None), admitted(16)
    assert dense <= 8 and paged >= 32 and paged >= 4 * dense, (dense, paged)


# -- prefix caching ---------------------------------------------------------------------------------
SYSTEM = list(range(1, 70))  # a shared "system prompt" of 69 tokens


@pytest.mark.parametrize("name", ["draft-model", "feature-head", "layer-skip", "prompt-lookup"])
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_shared_prefixes_are_taken_not_computed_and_change_no_token(name, block_size, head_dir):
    """Requests that share a prefix, one after another and together (chunked prefill in chunks of
    two blocks): every later one takes the shared blocks (cached tokens reported), diverging
    inside a block where its prompt does, and every output is the target's own."""
    engine = SpeculativeEngine(target(), proposer=drafter(name, head_dir), num_speculative_tokens=4,
                               adaptive=False, kv_block_size=block_size, prefix_caching=True,
                               prefill_chunk_tokens=2 * block_size)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    first = SYSTEM + [80, 81]
    later = [SYSTEM + [90, 91, 92], SYSTEM[:50] + [7] * 9, SYSTEM + [80, 81]]
    cached = {}
    for rid, prompt in [("first", first)] + [(f"later{i}", p) for i, p in enumerate(later)]:
        engine.add_request(rid, prompt, params)
        seq, tokens = engine.sequence(rid), []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        cached[rid] = seq.cached_tokens
        assert tokens == reference(tuple(prompt)), (rid, name, block_size)
    aligned = lambda n: n // block_size * block_size  # noqa: E731 (whole blocks of a shared prefix)
    assert cached["first"] == 0
    assert cached["later0"] == aligned(len(SYSTEM)) and cached["later1"] == aligned(50)
    assert cached["later2"] == aligned(len(first) - 1)  # (the last prompt token is the first step's)
    outs = engine.generate(later, params)  # together
    assert [o.token_ids for o in outs] == [reference(tuple(p)) for p in later]
    assert_pool_full(engine)


def test_chunks_that_end_inside_a_block_still_share_the_rest():
    """Chunks of 24 over blocks of 7: a chunk that ends inside a block leaves a private copy of
    it; the next chunk swaps that for the cached block and goes on sharing. What is reported is
    what was not computed: the shared positions less those private starts."""
    engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=3, adaptive=False,
                               kv_block_size=7, prefix_caching=True, prefill_chunk_tokens=24)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine.generate([SYSTEM + [80, 81]], params)
    engine.add_request("later", SYSTEM + [90, 91, 92], params)
    seq, tokens = engine.sequence("later"), []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == reference(tuple(SYSTEM + [90, 91, 92]))
    # chunks [0, 24) [24, 48) [48, 71): 21 taken + 3 computed; 4 + 14 taken + 6 computed; 1 + 14 taken
    assert seq.cached_tokens == 21 + 18 + 15
    assert_pool_full(engine)


def test_a_write_into_a_shared_block_copies_it_first():
    """Two requests share a block; one rolls back into it and writes other tokens: the other's
    keys are untouched (copy on write), and both read what a dense cache would hold."""
    model = target()
    paged, dense = ModelRunner(model, execution="eager"), ModelRunner(model, execution="eager")
    paged.page(8, None, True)
    tokens = list(range(3, 27))
    for r in (paged, dense):
        r.forward([RowInput("a", 0, tokens)], logits="none")
        r.forward([RowInput("b", 0, tokens)], logits="none")
    assert paged.cached_tokens == {"b": 24}
    for r in (paged, dense):
        r.forward([RowInput("b", 5, [60, 61, 62])], logits="none")  # b rewrites positions 5..7
    for rid, start in (("a", 24), ("b", 8)):
        got = paged.forward([RowInput(rid, start, [9])], logits="last")
        want = dense.forward([RowInput(rid, start, [9])], logits="last")
        assert torch.allclose(got, want, atol=1e-5), rid
    for rid in ("a", "b"):
        paged.free(rid)
    assert paged.cache.allocated()[0] == 1


def test_a_full_pool_evicts_the_least_recently_used_cached_blocks():
    """A pool just big enough for the running requests: cached prefixes make room as needed
    (least recently used first), and a prefix still cached is still taken."""
    engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=2, adaptive=False,
                               kv_block_size=8, max_cached_tokens=256, prefix_caching=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompts_ = [[k] * 40 for k in range(1, 9)]
    for prompt in prompts_ + prompts_[-1:]:
        (out,) = engine.generate([prompt], params)
        assert out.token_ids == reference(tuple(prompt))
    cache = engine.verifier.runner.cache
    assert cache.num_cached_blocks > 0 and cache.num_free_blocks == cache.num_blocks - 1
    assert_pool_full(engine)


def test_prefix_caching_needs_blocks():
    with pytest.raises(ValueError, match="kv_block_size"):
        SpeculativeEngine(target(), num_speculative_tokens=0, prefix_caching=True)


def test_a_tapped_runner_hands_out_the_features_kept_with_a_shared_prefix():
    """A feature tap under prefix caching: a prefill that takes cached blocks hands its sink the
    features the first request's prefill kept with them. Every position's features equal what a
    runner computing each position itself hands out (blocks of 7, a chunk ending inside a block,
    whose private copy is then swapped for the cached one), and a tap once prefixes are cached is
    refused (their features were never kept)."""
    from specserve.engine.feature_drafter import feature_modules

    def tapped(sharing: bool) -> tuple[ModelRunner, dict[str, dict[int, torch.Tensor]]]:
        runner, seen = ModelRunner(target(), execution="eager"), {}

        def sink(request_id: str, start: int, features: torch.Tensor) -> None:  # features [n, F]
            seen.setdefault(request_id, {}).update({start + i: f.clone() for i, f in enumerate(features)})
        runner.tap(feature_modules(runner.model, (0, 1)), "test", sink)
        runner.page(7, None, sharing)
        return runner, seen

    (shared, kept), (plain, computed) = tapped(True), tapped(False)
    prompts_ = {"a": SYSTEM + [80, 81], "b": SYSTEM + [90, 91, 92]}
    for runner in (shared, plain):
        for rid, cut in (("a", 30), ("b", 40)):  # two chunks each; b's first ends inside a block
            runner.forward([RowInput(rid, 0, prompts_[rid][:cut])], logits="none")
            runner.forward([RowInput(rid, cut, prompts_[rid][cut:])], logits="none")
    # b: [0, 35) taken, [35, 40) computed; then the rest of block 5 and blocks 6-8 taken: 2 + 21
    assert shared.cached_tokens == {"b": 35 + 23} and plain.cached_tokens == {}
    for rid, prompt in prompts_.items():
        assert sorted(kept[rid]) == sorted(computed[rid]) == list(range(len(prompt)))
        for p in range(len(prompt)):
            assert torch.allclose(kept[rid][p], computed[rid][p], atol=1e-5), (rid, p)
    shared.free("a")
    shared.free("b")
    with pytest.raises(RuntimeError, match="no prefix"):
        shared.tap(feature_modules(shared.model, (0, 1)), "test", lambda *args: None)


def test_a_hash_chain_from_another_root_matches_nothing():
    """Blocks registered under one root (a feature head's: the token before its first pair) are
    not taken by a prefix of the same tokens under another root, and are under the same one."""
    from specserve.engine.paged_cache import PagedKVCache

    cache = PagedKVCache(4, max_model_len=64, prefix_caching=True)
    tokens = list(range(1, 14))
    cache.place(0, len(tokens))
    cache.register(0, 0, tokens, root=5)
    assert cache.match(1, 0, tokens, root=6) == 0
    assert cache.match(2, 0, tokens) == 0
    assert cache.match(3, 0, tokens, root=5) == 12  # whole blocks


def test_a_feature_head_drafts_from_the_features_kept_with_a_cached_prefix(head_dir):
    """The feature head behind a prefix cache: a later request that takes the shared blocks gets
    the features kept with them, the ones an engine without the cache computes; the head takes its
    own cached blocks of the prefix too; it drafts as often accepted, and the target's tokens."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    first, later = SYSTEM + [80, 81], SYSTEM + [90, 91, 92]
    runs = {}
    for sharing in (True, False):
        engine = SpeculativeEngine(target(), proposer=drafter("feature-head", head_dir), num_speculative_tokens=3,
                                   adaptive=False, kv_block_size=16, prefix_caching=sharing)
        kept = kept_features(engine)  # every feature the head's store was given (it releases what it consumed)
        engine.generate([first], params)
        store, seen, free = engine.proposer.features, {}, engine.proposer.features.free

        def keep_and_free(rid: str) -> None:  # what the store was given for the request, when it goes
            if kept.written(rid):
                seen[rid] = kept.read(rid, 0, kept.written(rid)).clone()  # [positions, F]
            free(rid)
        store.free = keep_and_free
        head, head_took = engine.proposer.runner, []
        take = head.take_cached_prefix

        def counted(row, root=None, spare_last=False) -> int:  # what the head's own cache takes
            head_took.append(take(row, root, spare_last))
            return head_took[-1]
        head.take_cached_prefix = counted
        engine.add_request("later", later, params)
        seq, outs = engine.sequence("later"), []
        while engine.has_unfinished():
            outs += engine.step()
        assert [t for out in outs for t in out.new_token_ids] == reference(tuple(later))
        assert seq.cached_tokens == sum(head_took) == (64 if sharing else 0)  # the system prompt's whole blocks
        runs[sharing] = seq.metrics, seen["later"]
        assert_pool_full(engine)
    (metrics, kept), (plain_metrics, computed) = runs[True], runs[False]
    assert kept.shape == computed.shape and torch.allclose(kept, computed, atol=1e-5)
    assert metrics.num_accepted_tokens == plain_metrics.num_accepted_tokens > 0
    assert metrics.num_draft_tokens == plain_metrics.num_draft_tokens


def test_requests_that_outgrow_the_budget_are_preempted_and_lose_nothing():
    """Admission by what requests hold now: more start than their full lengths would allow, and
    as they grow the newest are preempted (caches freed, back to the head of the queue with their
    tokens) and prefilled again later. Every output is the target's own; seeded sampling too."""
    budget = 320
    engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=3, adaptive=False,
                               kv_block_size=8, max_cached_tokens=budget, max_batch_size=16, prefill_chunk_tokens=16)
    batch = prompts(8, seed=31)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    seqs = {f"r{i}": engine.sequence(f"r{i}") for i in range(len(batch))}
    peak, preempted, tokens = 0, set(), {rid: [] for rid in seqs}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        peak = max(peak, len(engine.admission.running))
        preempted |= {s.request_id for s in engine.admission.waiting if s.output}
        assert engine.admission.allocated() <= budget
    full = [positions_needed(seqs[f"r{i}"], 3) for i in range(len(batch))]  # each request at its longest
    reserving = max(k for k in range(len(full) + 1) if allocation(full[:k], 8) <= budget)
    assert peak > reserving and preempted, (peak, reserving, preempted)
    for i, prompt in enumerate(batch):
        assert tokens[f"r{i}"] == hf_greedy(target(), prompt, 48), i
    assert_pool_full(engine)


def test_a_request_accepted_alone_always_fits_even_below_a_step_s_headroom():
    """Paged admission counts a step's headroom past a request's tokens (2γ + 2), which a request
    whose max_tokens is below it still needs: the worst case checked at `add_request` counts it
    too, so a request either is refused at once or is admitted (found by the random scenarios:
    a 40-token prompt with max_tokens 1 under a 64-position budget was accepted and then never
    fit, and every request behind it waited for ever)."""
    from specserve.engine.step import ContextLengthExceeded

    engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=4, adaptive=False,
                               kv_block_size=16, max_cached_tokens=64)
    with pytest.raises(ContextLengthExceeded, match="budget of 64"):
        engine.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=1, temperature=0.0))
    admission = Admission(1, None, 4, 16)
    for max_tokens in (1, 2, 5, 30):
        seq = new_sequence("s", list(range(1, 41)), SamplingParams(max_tokens=max_tokens), vocab_size=96,
                           max_model_len=256, eos_token_ids=frozenset())
        for _ in range(max_tokens):  # its need as it grows never passes what add_request checked
            assert admission.need(seq) <= admission.worst(seq)
            seq.output.append(5)
    engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=4, adaptive=False,
                               kv_block_size=16, max_cached_tokens=80)
    engine.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=1, temperature=0.0))
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=3, temperature=0.0))
    done = {}
    for _ in range(50):
        done.update({out.request_id: out.finish_reason for out in engine.step() if out.finish_reason})
    assert done == {"a": "length", "b": "length"}


def test_calibration_times_only_what_a_small_fixed_pool_holds():
    """An adaptive engine times forwards of up to 64 tokens after a 16-token context before its
    first step: in a fixed pool smaller than that it raised MemoryError (found by the random
    scenarios). It times the sizes that fit, and decodes the target's tokens."""
    prompt = [5, 6, 7]
    # (64: 3 free blocks hold 16 + 16 + 1 positions, not 16 + 32 + 1, with prefix caching too: the
    # context is forwarded once, its registered block never rewritten; 48: 2 blocks, 16 + 15 + 1)
    for gamma, budget, prefix, sizes in [(1, 64, False, {1, 2, 3, 4, 5, 6, 7, 8, 16}),
                                         (3, 64, False, {1, 2, 3, 4, 5, 6, 7, 8, 16}),
                                         (1, 64, True, {1, 2, 3, 4, 5, 6, 7, 8, 16}),
                                         (1, 48, True, {1, 2, 3, 4, 5, 6, 7, 8})]:
        engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=gamma, adaptive=True,
                                   kv_block_size=16, max_cached_tokens=budget, prefix_caching=prefix)
        out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
        assert out.token_ids == hf_greedy(target(), prompt, 4)
        timed = set(engine.policy.target_cost._calibrated)  # the sizes calibration timed
        assert timed == sizes, (budget, prefix, timed)
        assert_pool_full(engine)


def test_short_rows_attend_over_their_own_length_not_the_longest(monkeypatch):
    """One long row among short ones: the paged runner splits the batch into a short forward and a
    long one where that saves more key positions than a second pass over the weights costs (the
    target's verify and the draft's loop alike), and every token stays the target's own."""
    from specserve.models.tiny import tiny_llama as byte_llama

    model = byte_llama(0, layers=2, max_position_embeddings=1024)
    draft = byte_llama(0, layers=2, max_position_embeddings=1024, noise=0.2)
    batch = [[(7 * i) % 250 + 1 for i in range(600)]] + prompts(4, seed=8)
    engine = SpeculativeEngine(model, draft, num_speculative_tokens=3, adaptive=False, kv_block_size=16)
    splits = []
    real = ModelRunner.length_groups

    def spy(self, rows, *args, **kwargs):
        groups = real(self, rows, *args, **kwargs)
        splits.append([len(g) for g in groups])
        return groups
    monkeypatch.setattr(ModelRunner, "length_groups", spy)
    outs = engine.generate(batch, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert [4, 1] in splits, splits  # the four short rows apart from the long one
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, MAX_NEW) for p in batch]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert_pool_full(engine)
    dense = ModelRunner(model, execution="eager")
    assert dense.length_groups([RowInput("a", 0, [1] * 600), RowInput("b", 0, [1])]) == [[0, 1]]


def test_choices_of_one_prompt_prefilled_together_share_it():
    """n choices of one prompt (and a batch with a common head) arrive in the same prefill forward:
    the first computes the shared blocks, the others take them (reported), same tokens."""
    engine = SpeculativeEngine(target(), tiny_llama(0, layers=4), num_speculative_tokens=3, adaptive=False,
                               kv_block_size=8, prefix_caching=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    batch = [SYSTEM + [5], SYSTEM + [5], SYSTEM + [6], [3] * 30]
    for i, prompt in enumerate(batch):
        engine.add_request(f"c{i}", prompt, params)
    seqs = [engine.sequence(f"c{i}") for i in range(len(batch))]
    tokens = {f"c{i}": [] for i in range(len(batch))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[f"c{i}"] for i in range(len(batch))] == [reference(tuple(p)) for p in batch]
    shared = len(SYSTEM) // 8 * 8
    assert [s.cached_tokens for s in seqs] == [0, shared, shared, 0]
    assert_pool_full(engine)


def assert_device_tables_are_the_host_tables(cache) -> None:
    """Each slot's device row holds its host table, scratch past it; the last row is all scratch."""
    from specserve.engine.paged_cache import SCRATCH

    tables = cache._device_tables
    width = tables.shape[1]
    for slot, table in enumerate(cache._tables):
        assert tables[slot].tolist() == table + [SCRATCH] * (width - len(table)), slot
    assert tables[-1].eq(SCRATCH).all()


def test_the_device_tables_follow_the_host_tables_entry_by_entry():
    """Blocks taken, copies on write, cached prefixes taken, slots freed and moved: after each
    upload the device tables equal the host's, and an upload sends exactly the entries changed
    (none when nothing changed)."""
    import random

    from specserve.engine.paged_cache import PagedKVCache

    cpu = torch.device("cpu")
    rng = random.Random(3)
    cache = PagedKVCache(4, max_model_len=64, prefix_caching=True)
    prompt = list(range(1, 14))
    cache.place(0, len(prompt))
    cache.register(0, 0, prompt)
    assert cache.upload(cpu, 16) == 4  # 13 positions: 4 blocks
    assert cache.upload(cpu, 16) == 0
    assert_device_tables_are_the_host_tables(cache)
    live = 1
    for _ in range(300):
        op = rng.choice(["grow", "grow", "share", "rewrite", "free", "new"])
        slot = rng.randrange(live)
        if op == "grow":
            cache.place(slot, min(64, (len(cache._tables[slot]) + rng.randint(0, 2)) * 4))
        elif op == "share" and not cache._tables[slot]:
            cache.match(slot, 0, prompt)
        elif op == "rewrite" and cache._tables[slot]:
            cache.writable(slot, 0, 4)
        elif op == "free" and live > 1:
            cache.release(slot)
            cache.move_slot(live - 1, slot)
            live -= 1
        elif op == "new" and live < 6:
            cache.place(live, 4 * rng.randint(1, 3))
            live += 1
        before = cache._device_tables.clone()
        sent = cache.upload(cpu, 4)
        assert_device_tables_are_the_host_tables(cache)
        if before.shape == cache._device_tables.shape:
            assert sent >= int((before != cache._device_tables).sum())
    assert cache.upload(cpu, 4) == 0


def test_decode_steps_send_no_tables_but_where_a_block_is_taken():
    """A request decoding one token a step sends its table entries once each: one entry on the
    step that takes a block, nothing on the others."""
    runner = ModelRunner(target(), execution="eager")
    runner.page(8, 64)
    sent = []
    real = type(runner.cache).upload

    def spy(cache, device, key_length):
        sent.append(real(cache, device, key_length))
        return sent[-1]
    runner.cache.upload = spy.__get__(runner.cache)
    runner.forward([RowInput("a", 0, [3, 4, 5])], logits="none")
    for i in range(3, 40):
        runner.forward([RowInput("a", i, [7])], logits="last")
    table = runner.cache._tables[runner._slot_of["a"]]
    assert sum(sent) == len(table) == 6  # 40 positions and the padding one after: 41 -> 6 blocks of 8
    assert sorted(sent, reverse=True)[: len(table) - 1] == [1] * (len(table) - 1) and sent.count(0) >= 30
