"""The fixed-shape forward (docs/architecture.md §7): compiles whole, matches eager, keeps rows in slot order,
pads to buckets through the scratch slot; and on a GPU, CUDA graphs give the eager path's tokens."""
import pytest
import torch

from models import hf_greedy, perturbed, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import ModelRunner, RowInput
from specserve.engine.model_runner import BATCH_BUCKETS, batch_bucket


@pytest.fixture
def quick_compile(monkeypatch):
    """Dynamo traces the whole graph (a graph break or a host read fails it) and AOT autograd
    functionalises it; the backend runs it as ATen ops rather than generating C++ (minutes cold)."""
    monkeypatch.setattr(ModelRunner, "compile_backend", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def decode(runner: ModelRunner, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """Greedy decoding through runner.forward alone, all rows every step (the static shapes)."""
    out = {rid: [] for rid in prompts}
    runner.forward([RowInput(rid, 0, p[:-1]) for rid, p in prompts.items()], logits="none")
    rows = [RowInput(rid, len(p) - 1, p[-1:]) for rid, p in prompts.items()]
    for _ in range(steps):
        tokens = runner.forward(rows, logits="last").argmax(-1).tolist()
        rows = [RowInput(r.request_id, r.start + 1, [t]) for r, t in zip(rows, tokens)]
        for r, t in zip(rows, tokens):
            out[r.request_id].append(t)
    return out


def test_static_forward_compiles_whole_and_matches_eager(quick_compile):
    """torch.compile(fullgraph=True, dynamic=False) fails on any graph break, host read included."""
    model = tiny_llama(0)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": [9, 10, 11]}
    compiled = ModelRunner(model, execution="compile")
    got = decode(compiled, prompts, 6)
    assert compiled._compiled is not None  # the decode steps really ran compiled
    assert got == decode(ModelRunner(model, execution="eager"), prompts, 6)
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(model, p, 6)


def test_compiled_forwards_take_more_shapes_than_dynamos_default(quick_compile):
    """execution="compile" compiles one graph per shape bucket: past dynamo's default of 8 per code
    object a fullgraph compile would fail outright, so the runner raises that limit."""
    runner = ModelRunner(tiny_llama(0, layers=1), execution="compile")
    runner.forward([RowInput("a", 0, [1, 2, 3])], logits="none")
    for width in range(1, 11):  # ten widths: ten shapes, each compiled
        runner.forward([RowInput("a", runner.valid_length("a"), [5] * width)], logits="last")
    assert runner._compiled is not None


def test_compiled_engine_is_lossless(quick_compile):
    """Target verify and the draft's loop (device-fed, no host read between drafts), compiled."""
    target = tiny_llama(0)
    draft = perturbed(target, 0.6, seed=1)
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, execution="compile")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 12) for p in prompts]
    assert engine.verifier.runner._compiled is not None and engine.proposer.runner._compiled is not None


def test_rows_run_in_slot_order_after_an_out_of_order_finish(target):
    """After a free moves the last slot into a hole, rows still read a view of the first slots
    (no gather) and each row gets its own logits back in the caller's order."""
    runner = ModelRunner(target, execution="eager")
    runner.forward([RowInput(r, 0, [i + 1, i + 2, i + 3]) for i, r in enumerate("abcd")], logits="none")
    runner.free("b")  # "d" moves into b's slot: slots a=0, d=1, c=2
    rows = [RowInput("a", 3, [9]), RowInput("c", 3, [9]), RowInput("d", 3, [9])]
    staged = runner.stage(rows)
    assert not staged.gather and staged.order == [0, 2, 1] and staged.padded == 3  # eager: no padding
    out = runner.forward(rows)
    fresh = ModelRunner(target).forward([RowInput("x", 0, [1, 2, 3, 9]), RowInput("y", 0, [3, 4, 5, 9]),
                                         RowInput("z", 0, [4, 5, 6, 9])])
    assert torch.allclose(out, fresh, atol=1e-5)


def test_padded_rows_write_only_the_scratch_slot(target):
    runner = ModelRunner(target, execution="eager")
    runner.pad_batches = True  # as compiled and captured runs do
    runner.forward([RowInput(r, 0, [1, 2, 3]) for r in "abc"], logits="none")  # 3 rows -> bucket 4
    runner.cache._keys[0][4].zero_()  # (the prefill's padded row wrote there already)
    keys = runner.cache._keys[0].clone()
    runner.forward([RowInput(r, 3, [5]) for r in "abc"])  # slot 3 is nobody's, the scratch slot is 4
    after = runner.cache._keys[0]
    assert runner.cache.scratch_slot == 4
    assert torch.equal(after[3], keys[3])  # the unowned slot the padded row reads is not written
    assert not torch.equal(after[4], keys[4])  # the padded row wrote to scratch
    assert torch.equal(after[:3, :, :3], keys[:3, :, :3])  # rows wrote past their prefixes only


def test_batch_buckets():
    assert BATCH_BUCKETS[:5] == (1, 2, 4, 8, 16) and [batch_bucket(n) for n in (1, 3, 5, 9, 17, 300)] == [
        1, 4, 8, 16, 24, 304]


def test_execution_switch(target):
    assert ModelRunner(target).execution == "eager"  # auto on a CPU
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(target, execution="graph")
    with pytest.raises(ValueError, match="execution"):
        ModelRunner(target, execution="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_mode_matches_eager_on_gpu(temperature):
    target = tiny_llama(0).cuda()
    draft = perturbed(target, 0.6, seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3]]
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=5)
    runs = {}
    for execution in ("eager", "graph"):
        engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, execution=execution)
        runs[execution] = [o.token_ids for o in engine.generate(prompts, params)]
        if execution == "graph":
            assert len(engine.verifier.runner.graphs) > 0 and len(engine.proposer.runner.graphs) > 0
    assert runs["graph"] == runs["eager"]
    if temperature == 0.0:
        assert runs["graph"] == [hf_greedy(target, p, 20) for p in prompts]


class ReplayOnCpu:
    """Stands in for a CUDA graph on a CPU: `replay` runs the captured function again and copies
    its results into the outputs of the 'capture', as a replay refills its static outputs."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        for static, fresh in zip(_flat(self.out), _flat(self.fn())):
            static.copy_(fresh)


def _flat(x):
    return [t for t in (x if isinstance(x, tuple) else (x,)) if t is not None]


def emulate_graphs(runner: ModelRunner) -> None:
    """Put a CPU runner in graph mode with CPU stand-ins for the graphs (the GraphSet's own
    warm-up / input restore / keying / replay logic runs as it is)."""
    from specserve.engine.model_runner import GraphSet

    graphs = GraphSet.__new__(GraphSet)
    graphs.device, graphs._entries, graphs.capture_seconds = runner.device, {}, 0.0

    def capture(fn, inputs):
        saved = [t.clone() for t in inputs]
        fn()  # the warm-up
        for t, s in zip(inputs, saved):
            t.copy_(s)
        out = fn()  # what capture would record (on a GPU it runs nothing: overwrite it, and the
        for t in _flat(out):  # inputs it wrote go back as they were)
            t.fill_(-7)
        for t, s in zip(inputs, saved):
            t.copy_(s)
        return ReplayOnCpu(fn, out), out

    graphs._capture = capture
    runner.execution, runner.graphs = "graph", graphs
    # as a runner made in graph mode: batches padded to their buckets, keys in steps of 256
    runner.pad_batches = True
    runner.cache.key_step = runner._key_step()


def test_graphs_take_a_new_pool_once_every_graph_of_the_old_one_is_gone(monkeypatch):
    """Capturing into a pool whose graphs were all destroyed fails CUDA's allocator (an internal
    assert: served workers on a GPU hit it when the cache grew between two concurrency levels).
    Graphs of one cache generation share a pool; a generation that drops them all starts a new one."""
    from specserve.engine.model_runner import GraphSet

    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))
    graphs = GraphSet.__new__(GraphSet)
    graphs.device, graphs.pool, graphs._entries, graphs.capture_seconds = torch.device("cpu"), None, {}, 0.0
    pools = []

    def capture(fn, inputs):
        pools.append(graphs._pool_for_capture())
        return ReplayOnCpu(fn, fn()), None

    graphs._capture = capture
    fn = lambda: torch.zeros(1)  # noqa: E731
    for key in (("a", 0), ("b", 0), ("a", 0), ("c", 1), ("d", 1), ("e", 2)):
        graphs.run(key, fn)
    assert pools == [(0, 0), (0, 0), (1, 0), (1, 0), (2, 0)]  # a new pool at each generation that left none alive
    assert len(graphs) == 1


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_graph_mode_logic_on_cpu(target, temperature, fused):
    """Graph mode's dispatch, keys, start-up capture and the draft loop's restore of the inputs it
    overwrites, with graphs emulated on the CPU: same tokens as eager. Fused: the same over both
    models' fused blocks (engine/fusion.py; dynamo's AOT backend, whose ops are eager's)."""
    draft = perturbed(target, 0.6, seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3], [5, 1, 5]]
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=5)
    eager = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, execution="eager")
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, max_batch_size=8,
                               execution="eager")
    for runner in (engine.verifier.runner, engine.proposer.runner):
        if fused:
            runner.fuse("aot_eager")
        emulate_graphs(runner)
    engine.capture_graphs(progress=False)
    captured = len(engine.verifier.runner.graphs), len(engine.proposer.runner.graphs)
    # buckets 8, 4, 2, 1 x (widths 1..4 | γ 1..3 x greedy, sampled: first widths 1 and 2 padded to one)
    assert captured == (4 * 4, 4 * 3 * 2)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == expected
    # greedy or sampled, every step's graphs were there before the first request
    assert (len(engine.verifier.runner.graphs), len(engine.proposer.runner.graphs)) == captured
    if temperature == 0.0:
        assert got == [hf_greedy(target, p, 16) for p in prompts]


def test_padded_draft_loops_draft_what_unpadded_ones_do():
    """Graph mode pads a draft model's first forward to two tokens a row (one loop per γ, batch
    bucket and key length instead of two): one-token rows, alone or beside a two-token row, draft
    the tokens and q an eager proposer drafts, call for call; every loop replayed starts two wide."""
    from specserve.engine.proposers import DraftModelProposer
    from specserve.engine.sampling import BatchSampling

    draft = tiny_llama(3)
    vocab = draft.config.vocab_size
    eager = DraftModelProposer(draft, vocab, execution="eager")
    padded = DraftModelProposer(draft, vocab, execution="eager")
    emulate_graphs(padded.runner)
    contexts = {"a": [1, 2, 3, 4, 5], "b": [7, 8, 9], "c": [4, 4, 2, 6, 1, 3, 3]}
    for proposer in (eager, padded):
        proposer.prefill([RowInput(rid, 0, c[:-1]) for rid, c in contexts.items()])
    sampling = BatchSampling.from_params([SamplingParams(temperature=t) for t in (0.0, 1.0, 0.7)])
    generator = torch.Generator().manual_seed(0)
    rows = [RowInput(rid, len(c) - 1, c[-1:]) for rid, c in contexts.items()]
    for call in range(6):
        uniforms = torch.rand(3, 3, generator=generator)
        want = eager.propose(rows, 3, sampling, uniforms)
        got = padded.propose(rows, 3, sampling, uniforms)
        assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.probs, want.probs)
        # the next call's rows: after an even call one row took all three drafts (it sends the last
        # one and the bonus token) and the others rejected their first (one token each); after an
        # odd call every row rejected its first
        drafts = want.tokens.tolist()
        rows = [RowInput(r.request_id, r.start + 3, [d[2], (d[2] + 1) % vocab]) if call % 2 == 0 and i == call % 3
                else RowInput(r.request_id, r.start + 1, [(d[0] + 1) % vocab]) for i, (r, d) in enumerate(zip(rows, drafts))]
    widths = {key[2] for key in padded.runner.graphs._entries}
    assert widths == {2} and len(padded.runner.graphs) >= 1


@pytest.mark.parametrize("fits", [True, False])
def test_graphs_survive_long_contexts_where_the_cache_was_sized_up_front(monkeypatch, fits):
    """Graph mode (emulated): capturing first sizes a dense cache for the batch at max_model_len
    where that fits the device, so a request whose context passes the first 256 positions moves
    no storage and drops no graph. Where it does not fit, the cache grows as before (the graphs
    are dropped and captured again). Tokens are the target's either way."""
    import specserve.engine.model_runner as model_runner
    from specserve.engine.kv_cache import capacity_for
    from specserve.models.tiny import tiny_llama as byte_llama

    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: (1 << 40) if fits else 1)
    target = byte_llama(0, max_position_embeddings=600)
    draft = perturbed(target, 0.6, seed=1)
    prompt = [(7 * i) % 200 + 1 for i in range(250)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, max_batch_size=4,
                               execution="eager", max_model_len=400)
    runners = (engine.verifier.runner, engine.proposer.runner)
    for runner in runners:
        emulate_graphs(runner)
    engine.capture_graphs(progress=False)
    sized = [r.cache.allocated() for r in runners]
    generations = [r.cache.generation for r in runners]
    captured = [len(r.graphs) for r in runners]
    got = engine.generate([prompt], params)[0].token_ids
    assert got == hf_greedy(target, prompt, 20)
    if fits:
        assert sized == [(5, capacity_for(400, 400))] * 2  # buckets up to 4 and the scratch slot, at 400 positions
        assert [r.cache.generation for r in runners] == generations  # nothing moved: no graph dropped
        # captured ahead at both key lengths the cache holds (256, then 400): none captured while decoding
        assert [len(r.graphs) for r in runners] == captured
        assert {key[3] for key in runners[0].graphs._entries} == {256, 400}
        # the verify graphs of one (B', Q, logits) at both key lengths leave their outputs in one place
        outputs = {}
        for key, (_, out) in runners[0].graphs._entries.items():
            outputs.setdefault((key[1], key[2], key[4]), []).append(out)
        assert all(len(outs) == 2 and outs[0] is outs[1] for outs in outputs.values())
    else:
        assert sized == [(5, 256)] * 2
        assert all(r.cache.generation > g for r, g in zip(runners, generations))


@pytest.mark.parametrize("fits", [True, False])
def test_without_a_stated_length_the_cache_grows_when_requests_join_not_mid_decode(monkeypatch, fits):
    """Graph mode (emulated), no max_model_len: the engine sizes each dense cache for the running
    requests' worst case (prompt + max_tokens + γ) when they are admitted, so storage moves before
    their first forward and never while they decode (a move drops every captured graph, and each
    is captured again, mid-request, as it is next met); a second batch like the first captures
    nothing. Where that size does not fit the device, the cache grows as requests need, as before.
    Tokens are the target's either way."""
    import specserve.engine.model_runner as model_runner
    from specserve.models.tiny import tiny_llama as byte_llama

    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: (1 << 40) if fits else 1)
    target = byte_llama(0, max_position_embeddings=1024)
    draft = perturbed(target, 0.6, seed=1)
    prompts = [[(7 * i + k) % 200 + 1 for i in range(240 + 5 * k)] for k in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, max_batch_size=4,
                               execution="eager")
    runners = (engine.verifier.runner, engine.proposer.runner)
    for runner in runners:
        emulate_graphs(runner)
    expected = [hf_greedy(target, p, 24) for p in prompts]
    for run in range(2):
        ids = [f"r{run}-{k}" for k in range(len(prompts))]
        seqs = []
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
            seqs.append(engine.sequence(rid))
        engine.step()  # admitted, caches sized (where it fits), graphs captured ahead, prompts prefilled
        generations = [r.cache.generation for r in runners]
        captured = [len(r.graphs) for r in runners]
        while engine.has_unfinished():
            engine.step()
        assert [s.output for s in seqs] == expected
        moved = [r.cache.generation != g for r, g in zip(runners, generations)]
        if fits:
            assert moved == [False, False]  # contexts passed 256 positions with no storage moved
            assert [r.cache.allocated()[1] for r in runners] == [512, 512]  # 264 + 24 + 3 positions, rounded
            if run:
                assert [len(r.graphs) for r in runners] == captured  # every shape met was captured before
        elif not run:
            assert moved == [True, True]  # grown as contexts passed 256


@pytest.mark.parametrize("paged", [False, True])
def test_an_eager_forward_attends_over_its_rows_not_the_growth_step(paged):
    """Eager forwards attend over the longest row rounded up to EAGER_KEY_STEP (a whole number
    of blocks when paged); compiled ones keep the 256-position step their shapes are fixed by."""
    from specserve.engine.model_runner import EAGER_KEY_STEP
    from specserve.models.tiny import tiny_llama as byte_llama

    target = byte_llama(0, max_position_embeddings=1024)
    for execution, expected in (("eager", -(-301 // EAGER_KEY_STEP) * EAGER_KEY_STEP), ("compile", 512)):
        runner = ModelRunner(target, execution=execution)
        if paged:
            runner.page(block_size=7)
            expected = -(-expected // 7) * 7
        # 300 tokens, their padding position just past them: 301 positions
        staged = runner.stage([RowInput("a", 0, list(range(1, 301)))])
        assert staged.key_length == expected, execution


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["flex", "mask"])
def test_graphs_over_a_pool_read_in_place_are_captured_once_for_every_length(attention):
    """A fixed paged pool in graph mode (emulated): read in place (flex), the graphs captured at
    start-up serve rows from a few tokens to past 300 without one more capture, and the tokens are
    the target's; the gathering path (mask) captures again as its key length grows."""
    from specserve.models.tiny import tiny_llama as byte_llama

    target = byte_llama(0, layers=2, max_position_embeddings=1024)
    draft = byte_llama(0, layers=2, max_position_embeddings=1024, noise=0.3)
    prompts = [[(5 * i) % 250 + 1 for i in range(290)], [7, 8, 9]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, max_batch_size=2,
                               execution="eager", attention=attention, kv_block_size=16, max_cached_tokens=1024)
    runners = (engine.verifier.runner, engine.proposer.runner)
    for runner in runners:
        emulate_graphs(runner)
    engine.capture_graphs(progress=False)
    captured = [len(r.graphs) for r in runners]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 24) for p in prompts]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    if attention == "flex":
        assert [len(r.graphs) for r in runners] == captured
    else:
        assert [len(r.graphs) for r in runners] > captured


def test_sizing_ahead_counts_the_storage_the_cache_comes_to(monkeypatch):
    """A reservation keeps the slots the cache already has (capture gave it every batch bucket's):
    its memory check counts those slots at the new capacity, not only the rows asked for, and a
    reservation that does not fit leaves the cache as it was. The budget counts what admission does."""
    import specserve.engine.model_runner as model_runner
    from specserve.engine.sharding import kv_cache_bytes_per_token
    from specserve.models.tiny import tiny_llama as byte_llama

    model = byte_llama(0, max_position_embeddings=1024)
    per_position = kv_cache_bytes_per_token(model.config, torch.float32)
    runner = ModelRunner(model)
    emulate_graphs(runner)
    runner.forward([RowInput(f"r{i}", 0, [1, 2, 3]) for i in range(16)], logits="none")  # 17 slots x 256
    for i in range(16):
        runner.free(f"r{i}")
    assert runner.cache.allocated() == (17, 256)
    held = runner.cache.memory_bytes()
    # room for 5 slots x 512 positions (what 3 rows ask), not for the 17 x 512 the cache would come to
    monkeypatch.setattr(model_runner, "free_memory_bytes",
                        lambda device: int(5 * 512 * per_position / model_runner.PREALLOCATE_SHARE) - held)
    assert not runner.reserve_ahead(3, 400) and runner.cache.allocated() == (17, 256)
    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: 1 << 40)
    assert not runner.reserve_ahead(3, 400, budget=5 * 512 - 1)  # admission's count: (4 + 1) x 512
    assert runner.reserve_ahead(3, 400, budget=5 * 512) and runner.cache.allocated() == (17, 512)
    assert runner.reserve_ahead(2, 300)  # already that large: nothing to do


def test_a_replayed_forward_runs_no_model_code_on_the_host(monkeypatch):
    """A replay hit skips `running()`: entering it swaps every fused block in and out (~0.17 ms a
    forward at 32 layers), host time a GPU would spend idle between a step's graphs. A capture,
    an eager forward and a prefill still run within it."""
    from contextlib import contextmanager

    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    runner = ModelRunner(tiny_llama(0), execution="eager")
    emulate_graphs(runner)
    entered = []
    running = runner.running

    @contextmanager
    def counted():
        entered.append(True)
        with running():
            yield

    monkeypatch.setattr(runner, "running", counted)
    runner.forward([RowInput("a", 0, [1, 2, 3])], logits="none")  # (a prefill: eager)
    assert len(entered) == 1
    expected = runner.forward([RowInput("a", 3, [4])], logits="last")
    assert len(entered) == 4 and len(runner.graphs) == 1  # captured: warm-up, capture, the emulated replay
    for graph, _ in runner.graphs._entries.values():
        monkeypatch.setattr(graph, "replay", lambda: None)  # as a CUDA graph replays: no Python
    runner.free("a")
    runner.forward([RowInput("a", 0, [1, 2, 3])], logits="none")
    again = runner.forward([RowInput("a", 3, [4])], logits="last")
    assert len(entered) == 5  # the prefill only
    assert torch.equal(again, expected)  # (the static outputs the emulated capture left)
