"""A paged cache for models with windowed and full layers (Gemma 2 and 3, gpt-oss, Qwen2/3 with
max_window_layers): the windowed layers keep their keys in a pool of their own that gives back
what their window has passed (engine/hybrid_cache.py), the full layers keep everything; the
tokens stay the model's own in every layout."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from models import hf_greedy, perturbed
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import CacheMiss, ModelRunner, RowInput, cpu_attention
from specserve.engine.hybrid_cache import HybridPagedKVCache, window_pool_blocks
from specserve.engine.paged_cache import PagedKVCache, blocks_for
from test_sliding_window import COMMON, MODELS, NEW, WINDOW, held_blocks, prompts, reference

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

HYBRID = ("gemma2", "gemma3", "gpt-oss", "qwen2")


@functools.lru_cache(None)
def gemma3_d32():
    """Gemma 3 with the CPU kernel's head size: its full layers read their pool in place."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, head_dim=32,
                              query_pre_attn_scalar=32, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"], **COMMON)
    config._attn_implementation = "sdpa"
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("key", HYBRID)
def test_windowed_layers_keep_about_a_window_in_their_own_pool(key):
    """Target alone and with a windowed draft of the family: the windowed layers' pool holds a
    window and a step per request (2-3 blocks of 4 for a window of 8, never the 43 positions a
    request comes to), the full layers' pool every position; the tokens are HF's, and every
    block is back in both pools once the requests end."""
    target = MODELS[key]()
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    for draft in (None, perturbed(target, 0.3, seed=1)):
        engine = SpeculativeEngine(target, draft, num_speculative_tokens=0 if draft is None else 3,
                                   adaptive=False, kv_block_size=4)
        runners = [engine.verifier.runner] + ([engine.proposer.runner] if draft is not None else [])
        assert all(isinstance(r.cache, HybridPagedKVCache) for r in runners)
        for runner in runners:
            runner.forget_slack = 0
        for i, prompt in enumerate(prompts()):
            engine.add_request(str(i), prompt, params)
        window_held, full_held, outs = 0, 0, {}
        while engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            for runner in runners:
                window_held = max(window_held, held_blocks(runner.cache.window))
                full_held = max(full_held, held_blocks(runner.cache.full))
                assert runner.cache.full.forgotten(0) == 0
        assert [outs[str(i)] for i in range(3)] == reference(key)
        # (the full pool: the 40-odd positions the longest request comes to before its last step)
        assert window_held <= 6 and full_held >= blocks_for(23 + NEW - 3, 4), (window_held, full_held)
        for runner in runners:
            assert runner.cache.full.allocated()[0] == runner.cache.window.allocated()[0] == 1  # (scratch)


@pytest.mark.parametrize("layout", ["mask", "flex", "kernel"])
def test_full_layers_read_in_place_while_windowed_ones_gather(layout):
    """Under flex (a pool BlockMask) and the CPU kernel (its reads), the full layers read their
    pool where it lies and the windowed layers gather their windows from their own: the
    tokens are still HF's, and the full layers' reads are the in-place kind."""
    model = gemma3_d32() if layout == "kernel" else MODELS["gemma3"]()
    if layout == "kernel" and not cpu_attention.available(32, torch.float32):
        pytest.skip("the CPU kernel is not built here")
    engine = SpeculativeEngine(model, None, num_speculative_tokens=0, kv_block_size=4,
                               attention="flex" if layout == "flex" else "auto")
    runner = engine.verifier.runner
    assert runner.hybrid and runner.in_place == {"mask": None, "flex": "flat", "kernel": "blocks"}[layout]
    want = reference("gemma3") if layout != "kernel" else None
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    got = [out.token_ids for out in engine.generate(prompts(), params)]
    if want is None:
        want = [hf_greedy(model, p, NEW) for p in prompts()]
    assert got == want


def test_the_window_pool_is_sized_for_the_batch_and_the_chunk():
    """With a budget, the full layers' pool is the budget and the windowed layers' is what
    `max_batch_size` requests need at once, each its window, slack and widest forward (a prefill
    chunk): it does not grow while they run, and it is far smaller."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    engine = SpeculativeEngine(MODELS["gemma3"](), None, num_speculative_tokens=0, kv_block_size=4,
                               max_cached_tokens=4096, max_batch_size=3, prefill_chunk_tokens=8)
    cache = engine.verifier.runner.cache
    kept = engine.verifier.runner._kept_behind(WINDOW, 4)
    sized = window_pool_blocks(3, kept, 8, 4)
    assert cache.full.num_blocks == 1024 and cache.window.num_blocks == sized < 1024 / 10
    got = [out.token_ids for out in engine.generate(prompts(), params)]
    assert got == reference("gemma3") and cache.window.num_blocks == sized
    # bytes: the windowed layers (2 of 3) hold the small pool, the full layer the budget
    full, window = cache.full.memory_bytes(), cache.window.memory_bytes()
    assert window == full * 2 * sized // 1024 and cache.memory_bytes() == full + window


def test_a_window_pool_short_of_blocks_grows_up_to_the_full_pool():
    """A windowed layers' pool sized for fewer requests than come (forks, a prompt not chunked)
    grows as the full pool would, never past the full pool's blocks, which always suffice."""
    cache = HybridPagedKVCache(lambda layer: layer != 1, 4, 256, num_blocks=32, window_blocks=4)
    cache.place(0, 40)  # 10 blocks: more than the 3 the window pool has besides scratch
    assert cache.window.num_blocks == 11 and cache.full.num_blocks == 32
    cache.place(1, 84)  # 21 more: 31 in all, as many as the full pool holds besides scratch
    assert cache.window.num_blocks == 32
    with pytest.raises(MemoryError):
        cache.place(2, 4)


def evict(cache: PagedKVCache, tokens: list[int], blocks: list[int]) -> None:
    """Evict from the cache the cached blocks holding these blocks of a prompt of `tokens`, as
    `PagedKVCache._take` evicts its least recently used (`_evict`)."""
    key, size = None, cache.block_size
    for i in range(max(blocks, default=-1) + 1):
        key = hash((key, tuple(tokens[i * size : (i + 1) * size])))
        if i in blocks:
            cache._evict(cache._index[key])


def test_a_prompt_takes_the_cached_blocks_both_pools_still_hold():
    """Prefix caching: a prompt seen before takes cached blocks from both pools: the windowed
    layers' pool needs only the blocks a forward right after the match reads (its window back
    from there), so its leading blocks, given back and evicted first, may be gone; where it lost
    one it needs, it matches less than the full layers' pool, which copies its extra shared
    blocks before the prefill rewrites them. The tokens are HF's every time."""
    model = MODELS["gemma3"]()
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    engine = SpeculativeEngine(model, None, num_speculative_tokens=0, kv_block_size=4, prefix_caching=True,
                               max_batch_size=1)
    cache = engine.verifier.runner.cache
    matched, taken = [], []  # what the full pool matched, what both did (the request took)
    for spied, log in ((cache.full, matched), (cache, taken)):
        spied.match = functools.partial(lambda match, log, *a: log.append(match(*a)) or log[-1], spied.match, log)
    prompt = prompts()[2]  # 23 tokens: 5 whole blocks (0-4) before its last token; a window of 8
    for evicted in ([], [0, 1], [4]):
        evict(cache.window, prompt, evicted)
        (out,) = engine.generate([prompt], params)
        assert out.token_ids == reference("gemma3")[2]
    # the second prompt: blocks 3 and 4 hold what a forward from 20 reads (13 on); the third lost
    # block 4, so takes 16 (blocks 2 and 3 hold 9 on) and the full pool's block 4 is copied
    assert matched == [0, 20, 20] and taken == [0, 20, 16], (matched, taken)
    assert cache.full.allocated()[0] == cache.window.allocated()[0] == 1


def test_a_fork_copies_both_pools():
    """A pipelined step's fork (`ModelRunner.fork`) copies the request's positions in both pools;
    the branch then attends as the request would (its logits equal a copy-free runner's)."""
    model = MODELS["gemma3"]()
    context = prompts()[2]  # 23 tokens
    runner = ModelRunner(model, max_model_len=256)
    runner.page(4)
    runner.forward([RowInput("a", 0, context)], logits="none")
    runner.fork("a", "b", 23)
    forked = runner.forward([RowInput("b", 23, [5, 6])], logits="all")
    alone = ModelRunner(model, max_model_len=256).forward([RowInput("c", 0, context + [5, 6])], logits="all")
    torch.testing.assert_close(forked, alone[:, -2:])


def test_a_rollback_behind_the_window_pool_loses_the_cache():
    """A row starting where its window reaches into blocks the windowed pool gave back: a
    CacheMiss from 0 (both pools let go), then the tokens sent again give the model's logits."""
    model = MODELS["gemma3"]()
    runner = ModelRunner(model, max_model_len=256)
    runner.page(4)
    runner.forget_slack = 0
    context = prompts()[2]
    runner.forward([RowInput("a", 0, context)], logits="none")
    runner.forward([RowInput("a", 23, [5])], logits="last")
    assert runner.cache.forgotten(0) == 16 and runner.cache.full.forgotten(0) == 0
    with pytest.raises(CacheMiss):
        runner.forward([RowInput("a", 18, [5])], logits="last")
    assert runner.valid_length("a") == 0
    again = runner.forward([RowInput("a", 0, context + [5])], logits="last")
    alone = ModelRunner(model, max_model_len=256).forward([RowInput("b", 0, context + [5])])
    torch.testing.assert_close(again, alone)


def test_a_switch_keeps_one_pool_for_every_layer():
    """`window_pool = False` before paging: one pool for every layer, as before (for comparison)."""
    runner = ModelRunner(MODELS["gemma3"](), max_model_len=256)
    runner.window_pool = False
    runner.page(4)
    assert isinstance(runner.cache, PagedKVCache) and not runner.hybrid


def test_pipelined_speculation_over_a_pool_per_kind(local_coordinator):
    """The server's pipelined loop (its real coordinator and workers in this process) with a
    Gemma-3-shaped target and draft paged a pool per kind, the windowed pools sized from the
    config (`AppConfig.worker_kv`): the target's greedy tokens, blocks drafted ahead taken, and
    every block back once the requests end."""
    from specserve.config import AppConfig
    from test_pipeline import generate

    shape = dict(model_type="gemma3_text", vocab_size=259, tie_word_embeddings=False, hidden_size=96,
                 intermediate_size=192, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=24, query_pre_attn_scalar=24, max_position_embeddings=1024, sliding_window=16,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = dict(kind="random", shape=shape, dtype="float32", seed=0)
    config = AppConfig.model_validate(dict(
        served_model_name="hybrid", target=model, draft=model,  # (the draft is the target: every draft accepted)
        speculation=dict(num_speculative_tokens=3, adaptive=False, pipelined=True, execution="eager",
                         transport="actor_calls"),
        max_model_len=512, kv_block_size=16, max_cached_tokens=8192, prefill_chunk_tokens=64, max_batch_size=4))
    coordinator = local_coordinator(config)
    prompts = [[(i * 7 + j) % 250 + 1 for j in range(100 + 30 * i)] for i in range(3)]
    got = generate(coordinator, prompts, [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 3)
    workers = [coordinator.target._obj.model.runner, coordinator.draft_worker._obj.model.runner]
    assert got == [hf_greedy(workers[0].model, p, 60) for p in prompts]
    assert coordinator._totals["pipelined_hits"] > 0
    for runner in workers:
        cache = runner.cache
        assert isinstance(cache, HybridPagedKVCache) and cache.num_window_blocks < cache.num_blocks
        assert cache.full.allocated()[0] == cache.window.allocated()[0] == 1


def test_the_server_sizes_the_window_pool_for_its_batch_chunk_and_forks():
    """`AppConfig.worker_kv`: the windowed pools are sized for max_batch_size requests at a
    prefill chunk (or a step's 2γ + 3, if wider), and for a pipelined draft side's branch forks."""
    from specserve.config import AppConfig

    def kv(**speculation):
        return AppConfig.model_validate(dict(
            served_model_name="t", target={"kind": "tiny"}, draft={"kind": "tiny", "noise": 0.1},
            speculation=dict(num_speculative_tokens=3, **speculation), max_batch_size=4, kv_block_size=16,
            max_cached_tokens=8192, prefill_chunk_tokens=64)).worker_kv

    assert kv() == (16, 8192, False, 4, 64)
    assert kv(pipelined=True, branches=2) == (16, 8192, False, 12, 64)
    assert kv(pipelined=True, branches=8) == (16, 8192, False, 16, 64)  # (at most γ branches a row)


def test_a_windowed_prefix_match_needs_only_the_blocks_its_window_reads():
    """`PagedKVCache.match(reach=)`: a prompt whose leading cached blocks were evicted still
    takes its last ones where they hold what a forward right after the match reads (positions
    from P - reach + 1); the blocks before are given back at once (scratch, `forgotten`). A
    reach into an evicted block takes less, down to nothing; without a reach, a gap at the
    start takes nothing."""
    from specserve.engine.paged_cache import SCRATCH

    cache = PagedKVCache(4, 256, prefix_caching=True)
    tokens = list(range(1, 41))  # 10 blocks
    cache.place(0, 40)
    cache.register(0, 0, tokens)
    cache.release(0)  # every block cached
    evict(cache, tokens, [0, 1, 2])
    assert cache.match(1, 0, tokens) == 0
    assert cache.match(2, 0, tokens, reach=8) == 40  # blocks 8 and 9 hold 33 on
    assert cache._tables[2][:8] == [SCRATCH] * 8 and cache.forgotten(2) == 32
    assert cache.match(3, 0, tokens, reach=24) == 40  # blocks 4-9 hold 17 on (in use by slot 2 too)
    assert cache.match(4, 0, tokens[:24], reach=24) == 0  # it would read from 1: blocks 0-2 are gone
    for slot in range(5):
        cache.release(slot)
    assert cache.allocated()[0] == 1 and cache.num_cached_blocks == 7


def test_a_model_windowed_everywhere_takes_a_prefix_past_evicted_blocks():
    """A Mistral-style model (every layer windowed, one pool) with prefix caching: a prompt whose
    first cached blocks were evicted takes the blocks its window reads; HF's tokens."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    engine = SpeculativeEngine(MODELS["mistral"](), None, num_speculative_tokens=0, kv_block_size=4,
                               prefix_caching=True, max_batch_size=1)
    cache, taken = engine.verifier.runner.cache, []
    cache.match = functools.partial(lambda match, *a: taken.append(match(*a)) or taken[-1], cache.match)
    prompt = prompts()[2]
    for evicted in ([], [0, 1]):
        evict(cache, prompt, evicted)
        (out,) = engine.generate([prompt], params)
        assert out.token_ids == reference("mistral")[2]
    assert taken == [0, 20]
