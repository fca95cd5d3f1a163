"""Sliding-window attention (Mistral, Phi-3, Gemma 2 and 3, gpt-oss, Qwen2 and Qwen3 with
use_sliding_window): every layout the engine attends through hides what the model's own window
hides, so greedy output past the window equals HF `generate` of the model itself, target alone and
speculative."""
from __future__ import annotations

import functools
import random

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig,
                          GptOssForCausalLM, LlamaConfig, MistralConfig, MistralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from models import hf_greedy, perturbed
from specserve import SamplingParams, SpeculativeEngine
from specserve.distill.train import init_head
from specserve.engine import attention, cpu_attention
from specserve.engine.attention import Windows, windows_of
from specserve.engine.model_runner import FORGET_SLACK
from specserve.engine.feature_drafter import FeatureDrafterSpec, save_feature_head
from specserve.engine.proposers import target_vocab_size
from test_engine_static import emulate_graphs

# eager FlexAttention warns that it is the unfused reference: here that is the point
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

WINDOW = 8
VOCAB = 96
NEW = 20
COMMON = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.2)


def _model(cls, config):
    config._attn_implementation = "sdpa"
    return cls(config).eval()


def tiny_mistral(seed: int, head_dim: int = 12):
    """Every layer windowed, one mask for all (no layer_types)."""
    torch.manual_seed(seed)
    return _model(MistralForCausalLM, MistralConfig(hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
                                                    head_dim=head_dim, sliding_window=WINDOW, **COMMON))


def tiny_gemma3(seed: int):
    """Windowed and full layers, a mask per layer type (and a rotary per type)."""
    torch.manual_seed(seed)
    return _model(Gemma3ForCausalLM, Gemma3TextConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"], **COMMON))


def tiny_gemma2(seed: int):
    """Gemma 2: windowed and full layers, logits soft-capped in attention (eager attention only)."""
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(Gemma2Config(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, **{**COMMON, "initializer_range": 0.02}, attn_implementation="eager"))
    return model.eval()


def tiny_phi3(seed: int):
    """Phi-3: every layer windowed, one mask for all."""
    torch.manual_seed(seed)
    return _model(Phi3ForCausalLM, Phi3Config(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                              sliding_window=WINDOW, **COMMON))


def tiny_gpt_oss(seed: int):
    """gpt-oss: windowed and full layers, attention sinks, experts (eager attention only)."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(
        hidden_size=48, intermediate_size=48, num_hidden_layers=2, head_dim=12, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, **COMMON, attn_implementation="eager")).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1)  # (they start at zero)
    return model


def tiny_qwen2_windowed(seed: int):
    torch.manual_seed(seed)
    return _model(Qwen2ForCausalLM, Qwen2Config(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, **COMMON))


def tiny_qwen3_windowed(seed: int):
    torch.manual_seed(seed)
    return _model(Qwen3ForCausalLM, Qwen3Config(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, head_dim=12, use_sliding_window=True,
        sliding_window=WINDOW, max_window_layers=1, **COMMON))


MODELS = {
    "mistral": functools.lru_cache(None)(lambda: tiny_mistral(0)),
    "mistral-d32": functools.lru_cache(None)(lambda: tiny_mistral(0, head_dim=32)),  # the CPU kernel's head size
    "gemma2": functools.lru_cache(None)(lambda: tiny_gemma2(0)),
    "gemma3": functools.lru_cache(None)(lambda: tiny_gemma3(0)),
    "gpt-oss": functools.lru_cache(None)(lambda: tiny_gpt_oss(0)),
    "phi3": functools.lru_cache(None)(lambda: tiny_phi3(0)),
    "qwen2": functools.lru_cache(None)(lambda: tiny_qwen2_windowed(0)),
    "qwen3": functools.lru_cache(None)(lambda: tiny_qwen3_windowed(0)),
}


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (3, 14, 23)]


@functools.lru_cache(maxsize=None)
def reference(key: str) -> list[list[int]]:
    return [hf_greedy(MODELS[key](), p, NEW) for p in prompts()]


def unwindowed_reference(key: str) -> list[list[int]]:
    """The same model with every layer attending its whole context (what the engine served
    before: its masks ignored the window)."""
    model = MODELS[key]()
    before, model.config.sliding_window = model.config.sliding_window, 10_000
    try:
        return [hf_greedy(model, p, NEW) for p in prompts()]
    finally:
        model.config.sliding_window = before


def test_the_window_changes_these_outputs():
    """What makes the tests below able to fail: on these prompts each model's output past its
    window differs from the same model attending everything."""
    for key in MODELS:
        assert reference(key) != unwindowed_reference(key), key


def test_windows_are_read_from_the_config():
    assert windows_of(MODELS["mistral"]().config, 256) == Windows(WINDOW, by_type=False)
    assert windows_of(MODELS["gemma3"]().config, 256) == Windows(WINDOW, by_type=True, every_layer=False,
                                                                  sliding=frozenset({0, 2}))
    assert windows_of(MODELS["qwen2"]().config, 256) == Windows(WINDOW, by_type=True, every_layer=False,
                                                                 sliding=frozenset({1}))  # (max_window_layers=1)
    assert windows_of(MODELS["mistral"]().config, 256).horizon == WINDOW
    assert windows_of(MODELS["gemma3"]().config, 256).horizon is None  # (its full layers read everything)
    assert windows_of(MODELS["mistral"]().config, WINDOW) == Windows()  # no context reaches past it
    assert windows_of(LlamaConfig(), 4096) == Windows()
    # Qwen2.5's configs name a window and switch it off
    assert windows_of(Qwen2Config(sliding_window=4096, use_sliding_window=False), 32768) == Windows()
    with pytest.raises(ValueError, match="linear_attention"):
        windows_of(Qwen2Config(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2), 256)

    class PerLayer:  # (how transformers' heterogeneous configs answer a global read)
        @property
        def sliding_window(self):
            raise RuntimeError("'sliding_window' is a per-layer attribute")
    with pytest.raises(ValueError, match="layers differ"):
        windows_of(PerLayer(), 256)


def test_a_windowed_mask_hides_what_falls_out_of_the_window():
    positions = torch.tensor([[3, 4], [20, 21]])  # [B', Q]
    keys = torch.arange(32)
    block = attention.block_mask(positions, 32, WINDOW)
    for b in range(2):
        for q in range(2):
            p = positions[b, q]
            want = (keys <= p) & (keys > p - WINDOW)
            assert torch.equal(block.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), keys), want)
    # the same rule over a paged pool: row 0 holds blocks 3 and 1 (block size 16), row 1 block 2 then 0
    tables = torch.tensor([[3, 1], [2, 0]])
    pool = attention.pool_block_mask(positions, tables, 16, 4, scratch=0, window=WINDOW)
    for b, q, p in ((0, 1, 4), (1, 0, 20)):
        for k in range(64):
            j = tables[b].tolist().index(k // 16) if k // 16 in tables[b].tolist() else -1
            logical = j * 16 + k % 16
            want = j >= 0 and not (b == 1 and k // 16 == 0) and p - WINDOW < logical <= p
            got = pool.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.tensor(k))
            assert bool(got) == want, (b, q, k)


def test_a_pool_mask_lists_a_row_s_own_blocks_first_behind_blocks_given_back():
    """A row whose oldest blocks went back to the pool (`PagedKVCache.forget`: scratch entries
    before its own) still lists exactly its own blocks for a compiled kernel to visit (the eager
    reference reads the mask densely and would not notice)."""
    positions = torch.tensor([[13], [2]])
    tables = torch.tensor([[0, 0, 5, 7], [3, 0, 0, 0]])  # row 0 gave back its first two blocks
    pool = attention.pool_block_mask(positions, tables, 4, 8, scratch=0, window=WINDOW)
    listed = [pool.kv_indices[b, 0, 0, : pool.kv_num_blocks[b, 0, 0]].tolist() for b in range(2)]
    assert listed == [[5, 7], [3]]


@pytest.mark.skipif(not cpu_attention.available(32, torch.float32), reason="the CPU kernel is not built here")
@pytest.mark.parametrize("width", [1, 4])
def test_the_cpu_kernel_reads_only_the_window(width):
    """The paged kernel under a window equals SDPA over the dense keys under the windowed mask,
    rows shorter and longer than the window, tiles that start mid-block."""
    torch.manual_seed(0)
    block_size, lengths, heads, kv_heads, dim = 16, [5, 40, 67], 4, 2, 32
    tables = torch.tensor([[0, 9, 9, 9, 9], [1, 2, 3, 9, 9], [4, 5, 6, 7, 8]])
    keys = torch.randn(10, block_size, kv_heads, dim)
    values = torch.randn(10, block_size, kv_heads, dim)
    positions = torch.tensor([[n - width + i for i in range(width)] for n in lengths])  # [B, Q]
    query = torch.randn(len(lengths), heads, width, dim)
    got = cpu_attention.attend(query, keys, values, cpu_attention.reads(positions, tables, WINDOW), scale=0.3)
    for b, n in enumerate(lengths):
        dense_k = keys[tables[b]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)  # [Hkv, n, D]
        dense_v = values[tables[b]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        k_at = torch.arange(n)
        p = positions[b][:, None]  # [Q, 1]
        mask = (k_at <= p) & (k_at > p - WINDOW)  # [Q, n]
        want = torch.nn.functional.scaled_dot_product_attention(
            query[b], dense_k.repeat_interleave(2, 0), dense_v.repeat_interleave(2, 0), attn_mask=mask, scale=0.3)
        torch.testing.assert_close(got[b], want.transpose(0, 1), atol=1e-5, rtol=1e-5)


LAYOUTS = {
    "dense": dict(),
    "paged": dict(kv_block_size=4),  # gathered (heads narrower than the CPU kernel's) or read by the kernel
    "flex": dict(attention="flex"),
    "flex-paged": dict(attention="flex", kv_block_size=16),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("key", sorted(MODELS))
def test_greedy_past_the_window_is_the_models_own(key, layout):
    """Target alone and with a draft of the same family (windowed too), in every layout: the
    tokens HF's generate gives the model, contexts running to three windows and more."""
    target = MODELS[key]()
    options = LAYOUTS[layout]
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    plain = SpeculativeEngine(target, None, num_speculative_tokens=0, **options)
    if key == "gpt-oss" and "flex" in layout:  # FlexAttention here takes no attention sinks: refused
        with pytest.raises(ValueError, match="sinks"):
            plain.generate(prompts(), params)
        return
    assert plain.verifier.runner.windows.window == WINDOW
    assert [o.token_ids for o in plain.generate(prompts(), params)] == reference(key)
    engine = SpeculativeEngine(target, perturbed(target, 0.3, seed=1), num_speculative_tokens=3, adaptive=False,
                               **options)
    outs = engine.generate(prompts(), params)
    assert [o.token_ids for o in outs] == reference(key)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def held_blocks(cache) -> int:
    """The most blocks any slot of a paged cache holds now (entries given back not counted)."""
    return max((len(t) - cache.forgotten(s) // cache.block_size for s, t in enumerate(cache._tables) if t), default=0)


FORGETTING = {"mistral": dict(kv_block_size=4), "phi3": dict(kv_block_size=4),
              "mistral-d32": dict(kv_block_size=4),  # (read by the CPU kernel where it is built)
              "mistral-flex": dict(attention="flex", kv_block_size=4)}


@pytest.mark.parametrize("name", sorted(FORGETTING))
def test_a_paged_cache_gives_back_what_every_window_has_passed(name):
    """Every layer windowed, paged: the blocks wholly a window behind each row go back to the pool
    as the requests run (here with no slack: these engines never roll a row back before its last
    start), so a request holds about a window however long it runs; the tokens are still HF's,
    target alone and with a windowed draft. (Models with full layers too: test_hybrid_cache.py.)"""
    key = name.replace("-flex", "")
    target = MODELS[key]()
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    for engine in (SpeculativeEngine(target, None, num_speculative_tokens=0, **FORGETTING[name]),
                   SpeculativeEngine(target, perturbed(target, 0.3, seed=1), num_speculative_tokens=3, adaptive=False,
                                     **FORGETTING[name])):
        runners = [engine.verifier.runner] + ([engine.proposer.runner] if hasattr(engine.proposer, "runner") else [])
        for runner in runners:
            runner.forget_slack = 0
        for i, prompt in enumerate(prompts()):
            engine.add_request(str(i), prompt, params)
        held, outs = {r: 0 for r in range(len(runners))}, {}
        while engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            for r, runner in enumerate(runners):
                held[r] = max(held[r], held_blocks(runner.cache))
        assert [outs[str(i)] for i in range(3)] == reference(key)
        # a row holds its window (8 positions: 2-3 blocks of 4) plus a step's positions, never its 43
        assert all(blocks <= 6 for blocks in held.values()), held
        assert engine.verifier.runner.cache.forgotten(2) == 0  # (every request ended: its slot released)


@pytest.mark.parametrize("windowed", [True, False])
def test_admission_counts_only_what_windowed_requests_still_hold(windowed):
    """A budget of 16 blocks of 4 (each request fits alone at its 45 positions): counting what
    every window has passed as given back, the three requests run side by side with no
    preemption; counting every position (as for a model that keeps them all), they preempt each
    other. The tokens are HF's either way."""
    from specserve.engine.engine import kept_behind

    engine = SpeculativeEngine(MODELS["mistral"](), None, num_speculative_tokens=0, kv_block_size=4,
                               max_cached_tokens=64)
    assert engine.admission.kept_behind == {"target_len": WINDOW + FORGET_SLACK + 4 - 2}  # (the runner's)
    engine.verifier.runner.forget_slack = 0  # (read by admission from the runner: set again below)
    engine.admission.kept_behind = kept_behind(engine.verifier, engine.proposer) if windowed else {}
    preempt, moved = engine.admission.preempt, []

    def counted() -> list:
        now = preempt()
        moved.extend(now)
        return now
    engine.admission.preempt = counted
    for i, prompt in enumerate(prompts()):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=NEW, temperature=0.0))
    peak, outs = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        peak = max(peak, len(engine.admission.running))
    assert [outs[str(i)] for i in range(3)] == reference("mistral")
    assert peak == 3 and (len(moved) == 0) == windowed, (peak, len(moved))


@pytest.mark.parametrize("attending", ["mask", "flex"])
@pytest.mark.parametrize("key", ["gemma3", "mistral"])
def test_a_gathered_windowed_layer_reads_only_its_window(key, attending):
    """Paged, keys gathered (under a mask; under flex, rows wider than it reads in place): a
    windowed layer gathers only the blocks from where its rows' windows start (for Q queries,
    8 + Q + 4 - 2 positions rounded up to blocks of 4: 16 for 3, 32 for 20), a full layer every
    block up to K; rows of other lengths in one forward, blocks already given back (Mistral, no
    slack) behind them. The logits are a dense runner's."""
    from specserve.engine import ModelRunner, RowInput
    from specserve.engine.model_runner import IN_PLACE_WIDTH

    model = MODELS[key]()
    options = dict(attention="flex") if attending == "flex" else {}
    paged, dense = ModelRunner(model, max_model_len=256, **options), ModelRunner(model, max_model_len=256, **options)
    paged.page(4)
    paged.forget_slack = 0
    reads = []
    update = paged.cache.update

    def recorded(keys, values, layer_idx, *args, **kwargs):
        out = update(keys, values, layer_idx, *args, **kwargs)
        reads.append((layer_idx, out[0].shape[2]))
        return out
    paged.cache.update = recorded
    width = 3 if attending == "mask" else IN_PLACE_WIDTH + 4  # (flex reads narrower rows in place)
    rng = random.Random(5)
    contexts = {"a": [rng.randrange(1, VOCAB) for _ in range(34 + width)],
                "b": [rng.randrange(1, VOCAB) for _ in range(18 + width)]}
    for runner in (paged, dense):
        for request_id, context in contexts.items():
            runner.forward([RowInput(request_id, 0, context[:-width])], logits="none")
    reads.clear()
    rows = [RowInput(request_id, len(c) - width, c[-width:]) for request_id, c in contexts.items()]
    torch.testing.assert_close(paged.forward(rows, logits="all"), dense.forward(rows, logits="all"))
    windowed = [layer for layer in range(model.config.num_hidden_layers) if paged.windows.windowed(layer)]
    assert windowed == ([0, 2] if key == "gemma3" else [0, 1])
    assert {n for layer, n in reads if layer in windowed} == {16 if width == 3 else 32}
    full = {-(-(34 + width) // 16) * 16} if key == "gemma3" else set()  # (K rounded up to a multiple of 16)
    assert {n for layer, n in reads if layer not in windowed} == full
    assert key == "gemma3" or paged.cache.forgotten(0) == 24  # (blocks before 34 - 8 + 1: read as scratch)


@pytest.mark.parametrize("chunked", [True, False])
def test_admission_counts_a_windowed_prompt_by_the_chunk_it_takes_next(chunked):
    """Three 60-token prompts, prefilled 8 tokens a step, under a budget of 24 blocks of 4 (one
    request's 80 positions and a step's headroom fit alone): counted by the most a cache holds
    at any mark of the prefill (what it keeps behind its mark and a chunk) all three prefill side
    by side; counted by their whole prompts, no more than two run at once. No preemption either
    way; HF's tokens."""
    from specserve.engine.engine import kept_behind

    rng = random.Random(11)
    batch = [[rng.randrange(1, VOCAB) for _ in range(60)] for _ in range(3)]
    engine = SpeculativeEngine(MODELS["mistral"](), None, num_speculative_tokens=0, kv_block_size=4,
                               max_cached_tokens=96, prefill_chunk_tokens=8)
    engine.verifier.runner.forget_slack = 0
    engine.admission.kept_behind = kept_behind(engine.verifier, engine.proposer)
    assert engine.admission.chunk == 8
    engine.admission.chunk = 8 if chunked else None
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=NEW, temperature=0.0))
    peak, outs, moved = 0, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        peak = max(peak, len(engine.admission.running))
        moved += sum(s.preempted for s in engine.admission.waiting)
    assert [outs[str(i)] for i in range(3)] == [hf_greedy(MODELS["mistral"](), p, NEW) for p in batch]
    assert moved == 0 and peak == (3 if chunked else 2), peak


def test_a_row_starting_behind_what_was_given_back_loses_its_cache():
    """A rollback past the slack (none here): the runner drops the request's cache and answers
    a CacheMiss from position 0, so a worker's caller sends its tokens again; nothing is read from
    a block given back."""
    from specserve.engine import CacheMiss, ModelRunner, RowInput

    runner = ModelRunner(MODELS["mistral"](), max_model_len=256)
    runner.page(4)
    runner.forget_slack = 0
    context = prompts()[2]  # 23 tokens
    runner.forward([RowInput("a", 0, context)], logits="none")
    runner.forward([RowInput("a", 23, [5])], logits="last")
    assert runner.cache.forgotten(0) == 16  # (blocks wholly before position 23 - 8 + 1 = 16)
    with pytest.raises(CacheMiss) as miss:
        runner.forward([RowInput("a", 18, [5])], logits="last")  # its window reaches back to 11
    assert miss.value.valid_length == 0 and runner.valid_length("a") == 0 and runner.cache.forgotten(0) == 0
    again = runner.forward([RowInput("a", 0, context + [5])], logits="last")
    alone = ModelRunner(MODELS["mistral"](), max_model_len=256).forward([RowInput("b", 0, context + [5])])
    torch.testing.assert_close(again, alone)


def test_the_paged_kernel_serves_a_windowed_model():
    """Head size 32: a paged eager runner reads its pool through the CPU kernel, windowed."""
    if not cpu_attention.available(32, torch.float32):
        pytest.skip("the CPU kernel is not built here")
    engine = SpeculativeEngine(MODELS["mistral-d32"](), None, num_speculative_tokens=0, kv_block_size=4)
    assert engine.verifier.runner.in_place == "blocks"


@pytest.mark.parametrize("layout", [{}, dict(kv_block_size=4)], ids=["dense", "paged"])
def test_a_compiled_forward_takes_a_mask_per_layer_type(layout):
    """execution="compile" (torch.compile, fullgraph): the windowed and full masks are built inside
    the compiled forward, with no graph break, and the tokens are the model's own. Paged, the
    windowed layers gather only their windows' blocks (`_window_reads`) inside it too."""
    engine = SpeculativeEngine(MODELS["gemma3"](), None, num_speculative_tokens=0, execution="compile", **layout)
    outs = engine.generate(prompts(), SamplingParams(max_tokens=NEW, temperature=0.0))
    assert engine.verifier.runner._compiled is not None
    assert [o.token_ids for o in outs] == reference("gemma3")


@pytest.mark.parametrize("layout", [{}, dict(kv_block_size=4)], ids=["dense", "paged"])
@pytest.mark.parametrize("key", ["gemma3", "mistral"])
def test_captured_steps_past_the_window_are_the_models_own(key, layout):
    """Graph mode (graphs emulated on the CPU, captured before the first request, batches padded
    to buckets, keys in steps of 256): the masks of each layer type are built inside the captured
    forwards and draft loops, and the tokens are HF's. Paged, a windowed layer reads 12 or 16
    positions of the 256 (`_window_reads`), its blocks looked up inside the graphs."""
    target = MODELS[key]()
    engine = SpeculativeEngine(target, perturbed(target, 0.3, seed=1), num_speculative_tokens=3, adaptive=False,
                               max_batch_size=4, **layout)
    for runner in (engine.verifier.runner, engine.proposer.runner):
        emulate_graphs(runner)
    engine.capture_graphs(progress=False)
    captured = len(engine.verifier.runner.graphs), len(engine.proposer.runner.graphs)
    outs = engine.generate(prompts(), SamplingParams(max_tokens=NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == reference(key)
    assert (len(engine.verifier.runner.graphs), len(engine.proposer.runner.graphs)) == captured > (0, 0)


def test_a_feature_head_drafts_for_a_windowed_target(tmp_path):
    """A feature head (its own one layer attends everything) over a target whose layers are
    windowed: the head reads the target's features, the target verifies, the output is HF's."""
    target = MODELS["gemma3"]()
    torch.manual_seed(0)
    head = init_head(target, torch.arange(VOCAB))
    save_feature_head(head, tmp_path, store_lm_head=False)
    proposer = FeatureDrafterSpec(str(tmp_path)).build(target, target_vocab_size(target), None)
    engine = SpeculativeEngine(target, proposer=proposer, num_speculative_tokens=3, adaptive=False)
    outs = engine.generate(prompts(), SamplingParams(max_tokens=NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == reference("gemma3")
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_flex_caps_attention_logits_as_the_models_eager_attention_does():
    """Gemma 2 soft-caps its attention scores (softcap * tanh(score / softcap)); FlexAttention
    applies the same cap. Scores here reach well past the cap, where ignoring it would show."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(0)
    model = tiny_gemma2(0)
    module = model.model.layers[0].self_attn
    query, key, value = torch.randn(2, 4, 5, 16) * 4, torch.randn(2, 2, 12, 16) * 4, torch.randn(2, 2, 12, 16)
    positions = torch.tensor([[7, 8, 9, 10, 11], [3, 4, 5, 6, 7]])
    flex, _ = attention.flex_sdpa(module, query, key, value, attention.block_mask(positions, 12, WINDOW),
                                  scaling=1.0, softcap=2.0)
    keys = torch.arange(12)
    visible = (keys <= positions[:, :, None]) & (keys > positions[:, :, None] - WINDOW)  # [B, Q, K]
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]  # [B, 1, Q, K]
    module.training = False
    want, _ = eager_attention_forward(module, query, key, value, mask, scaling=1.0, softcap=2.0)
    torch.testing.assert_close(flex, want, atol=1e-5, rtol=1e-5)
    uncapped, _ = eager_attention_forward(module, query, key, value, mask, scaling=1.0, softcap=None)
    assert (uncapped - want).abs().max() > 0.1


@pytest.mark.parametrize("key", ["gemma3", "mistral"])
def test_fused_blocks_attend_through_the_window(key, monkeypatch):
    """Fused blocks (one compile for every layer) over windowed and full layers, paged: the logits
    of contexts past the window are the plain runner's (a windowed layer's gathered keys are its
    window's blocks, handed over between the block's compiled halves)."""
    from test_fusion import forwards_beside, fused_and_plain

    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")  # (each linear's dispatcher would compile per layer)
    torch._dynamo.reset()
    fused, plain = fused_and_plain(MODELS[key](), "aot_eager", 4)
    contexts = {"a": [i % 90 + 1 for i in range(29)], "b": [i % 90 + 5 for i in range(11)]}
    assert forwards_beside(fused, plain, contexts, [1, 3, 1, 4, 1]) < 1e-4
