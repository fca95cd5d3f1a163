"""The step on a compiled graph (speculation.transport: compiled_graph, specserve.serve.graph) is
lossless and falls back to plain calls when it breaks.

No Ray here: the Coordinator runs in this process with the real workers behind stand-in actors
(test_pipeline's `local_coordinator`), and `InProcessGraph` executes the graph's worker nodes
(`graph_solo`, `graph_propose` -> `graph_verify` [-> `graph_join`], or `graph_step`) on those very objects, with the messages
packed and unpacked as the channels carry them. That a real compiled graph runs, breaks with a
killed worker and is rebuilt is for the Serve tests (tests/test_serve.py) and `bench overlap`.
"""
from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from models import hf_greedy
from specserve.config import AppConfig
from specserve.engine import Proposal, RowInput, SamplingParams
from specserve.engine.sampling import BatchSampling
from specserve.serve.graph import DraftLate, StepCall, pack, step_reply, unpack
from specserve.serve.pipeline import branch_points
from test_pipeline import PROMPTS, TINY, config, generate


class InProcessGraph:
    """StepGraph's interface, running the graph's worker nodes in this process; executions listed
    in `fail_at` (1-based) break it as a dead channel would."""

    def __init__(self, coordinator, fail_at=(), before=None, late_at=(), fail_blocks: int = 0) -> None:
        self.target = coordinator.target._obj
        self.draft = None if coordinator.draft_worker is None else coordinator.draft_worker._obj
        self.fail_at = set(fail_at)
        self.before = before or {}  # execution number -> a callable run just before it
        self.late_at = set(late_at)  # executions whose draft side is late
        self.fail_blocks = fail_blocks  # break the first this many executions that carry a prepared block
        self.ready, self.executions, self.builds, self.breaks = True, 0, 1, 0
        self.solo_answers = 0  # executions that graph_solo answered (target-only steps)
        self.target_only_calls = 0  # executions that carried a target-only step
        self.ahead_forwards = []  # (expected seconds, the ahead call's draft forwards or 0) per execution
        self.waits = []  # (expected, deadline) seconds per execution
        self.ahead = coordinator.executor.pipeline is not None and self.draft is not None  # as StepGraph builds it
        self.nap_share = 0.0  # nap(expected) = nap_share * expected (StepGraph: learned from executions)
        self.calls: list[StepCall] = []
        self._pair, self.reshapes, self.reshaping = (self.draft, self.ahead), 0, False

    @property
    def solo(self) -> bool:
        return self._pair[0] is not None and self.draft is None

    def reshape(self, solo: bool) -> None:
        if solo != self.solo:
            self.draft, self.ahead = (None, False) if solo else self._pair
            self.reshapes, self.reshaping, self.ready = self.reshapes + 1, True, False

    def nap(self, expected: float) -> float:
        return self.nap_share * expected

    async def run(self, call: StepCall, draft_timeout: float, target_timeout: float, draft_busy=None,
                  ahead_timeout: float = 0.0, expected: float = 0.0):
        self.executions += 1
        self.calls.append(call)
        self.waits.append((expected, draft_timeout + max(target_timeout, ahead_timeout)))
        self.ahead_forwards.append((expected, call.ahead.num_tokens if call.ahead is not None else 0))
        if self.executions in self.before:
            self.before[self.executions]()
        if self.executions in self.fail_at or (call.block is not None and self.fail_blocks > 0):
            self.fail_blocks -= call.block is not None
            self.discard("injected")
            raise RuntimeError("channel closed")
        if self.executions in self.late_at:
            self.discard("late")
            raise DraftLate("the draft side missed its deadline")
        packed = pack(call)
        self.target_only_calls += call.gamma == 0 and call.block is None and bool(call.target_rows)
        if self.draft is None:
            return step_reply(self.target.graph_step(packed))
        solo = self.target.graph_solo(packed)
        self.solo_answers += solo[1] is not None
        drafted = self.draft.graph_propose(packed)
        verified = self.target.graph_verify(drafted, solo)
        if not self.ahead:
            return step_reply(verified)
        # the ahead node runs after the propose, the join after both
        return step_reply(self.target.graph_join(verified, self.draft.graph_ahead(drafted)), joined=True)

    def discard(self, why) -> None:
        if self.ready:
            self.ready, self.breaks = False, self.breaks + 1

    def may_rebuild(self) -> bool:
        return not self.ready

    async def rebuild(self) -> None:
        self.ready, self.builds, self.reshaping = True, self.builds + 1, False


def on_graph(coordinator, **kw) -> InProcessGraph:
    coordinator.executor.graph = InProcessGraph(coordinator, **kw)
    return coordinator.executor.graph


def test_messages_keep_every_tensor_exactly():
    base = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    for t in [torch.arange(6), base, base[:, 1:4], base.bfloat16(), base.half(), torch.zeros(()),
              torch.tensor([True, False]), base.clone().requires_grad_()]:
        back = unpack(pack({"t": t}))["t"]
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t.detach())
    call = StepCall([RowInput("a", 3, [1, 2])], 2, BatchSampling.from_params([SamplingParams(temperature=0.7)]),
                    torch.rand(1, 2), [RowInput("a", 2, [5])], torch.tensor([2]), torch.rand(1, 2), torch.rand(1))
    back = unpack(pack(call))
    assert back.draft_rows == call.draft_rows and torch.equal(back.draft_uniforms, call.draft_uniforms)
    assert torch.equal(back.sampling.temperature, call.sampling.temperature)


def test_greedy_on_the_graph_is_the_targets_greedy(local_coordinator):
    coordinator = local_coordinator(config(pipelined=False))
    graph = on_graph(coordinator)
    lengths = [24, 17, 30, 9]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = generate(coordinator, PROMPTS, params)
    target = coordinator.target._obj.model.runner.model
    assert outs == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, lengths)]
    totals = coordinator._totals
    assert totals["graph_steps"] == totals["steps"] > 0 and graph.executions >= totals["steps"]
    assert totals["spec_decode_num_accepted_tokens"] > 0  # the drafts crossed draft -> target
    assert asyncio.run(coordinator.num_cached()) == {"target": 0, "draft": 0}
    # each execution comes with the seconds its forwards should take (which size the nap before
    # its result is read), from the measured costs: well inside its deadline, never more
    assert all(0 < expected < deadline for expected, deadline in graph.waits)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.5, top_k=3, top_p=0.9)])
def test_seeded_sampling_on_the_graph_draws_the_plain_calls_numbers(local_coordinator, sampling):
    """q goes draft -> target inside the graph: the same seeds give the same tokens as plain calls
    (whose sampling distribution tests/test_sampling_distribution.py checks)."""
    params = [SamplingParams(max_tokens=30, seed=20 + i, ignore_eos=True, **sampling) for i in range(len(PROMPTS))]
    plain = generate(local_coordinator(config(pipelined=False, gamma=3)), PROMPTS, params)
    coordinator = local_coordinator(config(pipelined=False, gamma=3))
    on_graph(coordinator)
    assert generate(coordinator, PROMPTS, params) == plain
    assert coordinator._totals["graph_steps"] == coordinator._totals["steps"]


def _crossing_q(graph: InProcessGraph) -> list:
    """Record the q each execution's draft side sends the target (as the channel carries it)."""
    seen, propose = [], graph.draft.graph_propose

    def recorded(packed):
        drafted = propose(packed)
        reply = unpack(drafted)
        seen.append(None if reply.result is None else reply.result.probs)
        return drafted
    graph.draft.graph_propose = recorded
    return seen


@pytest.mark.parametrize("place_q", [False, True])
@pytest.mark.parametrize("pipelined", [False, True])
def test_only_the_sampling_rows_q_crosses_the_graph(local_coordinator, pipelined, place_q):
    """Greedy and seeded sampled rows together: the draft side sends the target q for the sampled
    rows only (a greedy row's is one-hot at its draft, rebuilt there), and the tokens are those of
    plain calls, whose q crosses whole. With placement (the stand-in workers share this process's
    host), a dense part crosses as the handle of the draft's buffer, never as q."""
    from specserve.serve.placed_q import PlacedQ
    from specserve.serve.wire import RowsProbs

    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=60, **SEEDED_TOP_K),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=30, ignore_eos=True, seed=63, temperature=1.0)]
    plain = generate(local_coordinator(config(pipelined=False, gamma=3, place_q=False)), PROMPTS, params)
    coordinator = local_coordinator(config(pipelined=pipelined, gamma=3, place_q=place_q))
    seen = _crossing_q(on_graph(coordinator))
    if pipelined:
        _alternate_preparing(coordinator)
    assert generate(coordinator, PROMPTS, params) == plain
    cut = [q for q in seen if isinstance(q, RowsProbs)]
    assert cut and all(q.probs.shape[0] == len(q.rows) < 4 for q in cut)
    assert not any(isinstance(q, torch.Tensor) and q.shape[0] == 4 for q in seen)  # never the whole batch's
    dense = [q for q in cut if q.probs.shape[0] and isinstance(q.probs, (torch.Tensor, PlacedQ))]
    assert dense and all(isinstance(q.probs, PlacedQ) == place_q for q in dense)
    assert coordinator.executor.q_placed == place_q


def test_the_q_that_crosses_resolves_to_what_the_rule_reads():
    """RowsProbs: the sampling rows' q at the positions they verify, through the codec, then one-hot
    at the drafts elsewhere (a sampling row that verifies no draft sends nothing); q itself where
    every row samples every position."""
    from specserve.serve.wire import RowsProbs

    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, 3, 11, generator=generator), dim=-1)  # [B, G, V]
    tokens = torch.randint(0, 11, (4, 3), generator=generator)
    sampling = BatchSampling.from_params([SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0, 0.7)])
    cut = RowsProbs.of(probs, sampling, torch.tensor([3, 2, 3, 1]))
    assert isinstance(cut, RowsProbs) and cut.rows == (1, 3) and cut.probs.shape == (2, 2, 11)
    back = unpack(pack(Proposal(tokens, cut, [])))
    full = back.probs.resolve(tokens)  # [B, G, V]
    assert torch.equal(full[[1, 3], :2], probs[[1, 3], :2])  # the rows' verified positions, exactly
    assert torch.equal(full[[0, 2]], torch.nn.functional.one_hot(tokens[[0, 2]], 11).float())
    assert torch.equal(full[:, 2], torch.nn.functional.one_hot(tokens[:, 2], 11).float())  # none verifies it
    every = BatchSampling.from_params([SamplingParams(temperature=1.0)] * 4)
    assert RowsProbs.of(probs, every, torch.tensor([3, 3, 1, 3])) is probs
    prefilling = RowsProbs.of(probs, sampling, torch.tensor([3, 0, 3, 1]))  # row 1 verifies no draft
    assert prefilling.rows == (3,) and prefilling.probs.shape == (1, 1, 11)
    assert torch.equal(prefilling.resolve(tokens)[1], torch.nn.functional.one_hot(tokens[1], 11).float())


def test_rows_that_all_filter_send_only_q_s_nonzero_entries():
    """Every sampling row filters (top-k, top-p): only q's nonzero entries cross (`SparseQ`, K the
    widest position's count), through the codec, and resolve to q exactly; one row that does
    not filter, or a position wider than a quarter of the vocabulary, sends q dense."""
    from specserve.engine.sampling import logits_to_probs
    from specserve.serve.wire import RowsProbs, SparseQ

    generator = torch.Generator().manual_seed(4)
    params = [SamplingParams(temperature=0.9, top_k=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=1.0, top_k=5)]
    sampling = BatchSampling.from_params(params)
    logits = 3.0 * torch.randn(4 * 3, 64, generator=generator)  # [B * G, V]
    probs = logits_to_probs(logits, sampling.repeat_rows(3)).view(4, 3, 64).bfloat16()  # [B, G, V]
    tokens = torch.randint(0, 64, (4, 3), generator=generator)
    cut = RowsProbs.of(probs, sampling, torch.tensor([3, 3, 2, 3]))
    widest = int((probs[[0, 2, 3]] != 0).sum(-1).max())
    assert isinstance(cut.probs, SparseQ) and cut.rows == (0, 2, 3) and 5 <= widest <= 64 // 4
    assert cut.probs.values.shape == (3, 3, widest) and cut.probs.values.dtype == torch.bfloat16
    assert cut.probs.shape == (3, 3, 64)
    back = unpack(pack(Proposal(tokens, cut, [])))
    assert isinstance(back.probs.probs, SparseQ)
    full = back.probs.resolve(tokens)  # [B, G, V]
    assert torch.equal(full[[0, 2, 3]], probs[[0, 2, 3]])
    assert torch.equal(full[1], torch.nn.functional.one_hot(tokens[1], 64).bfloat16())
    everyone = BatchSampling.from_params([params[0], params[2], params[3]])
    whole = RowsProbs.of(probs[[0, 2, 3]], everyone, torch.tensor([3, 3, 3]))  # every row, every position
    assert isinstance(whole.probs, SparseQ) and torch.equal(whole.resolve(tokens[[0, 2, 3]]), probs[[0, 2, 3]])
    dense_row = BatchSampling.from_params([params[0], params[1], SamplingParams(temperature=0.7), params[3]])
    assert isinstance(RowsProbs.of(probs, dense_row, torch.tensor([3, 3, 3, 3])).probs, torch.Tensor)
    wide = BatchSampling.from_params([SamplingParams(temperature=1.0, top_k=20)] * 4)
    wide_probs = logits_to_probs(logits, wide.repeat_rows(3)).view(4, 3, 64)  # 20 of 64 tokens: over a quarter
    assert RowsProbs.of(wide_probs, wide, torch.tensor([3, 3, 3, 3])) is wide_probs


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_16_bit_targets_q_crosses_in_its_dtype(local_coordinator, pipelined):
    """A bfloat16 target: its draft worker draws from q rounded to bfloat16 and sends it so (half
    the bytes of float32), on plain calls and through the graph; the target's rule reads it in
    float32, and seeded rows get the same tokens both ways."""
    from specserve.serve.wire import RowsProbs
    from test_random_source import SHAPE

    def bf16_config(pipelined: bool) -> AppConfig:
        random = {"kind": "random", "shape": SHAPE, "dtype": "bfloat16"}
        return AppConfig.model_validate(dict(
            served_model_name="random", target={**random, "seed": 0}, draft={**random, "seed": 1},
            speculation=dict(num_speculative_tokens=3, adaptive=False, pipelined=pipelined, execution="eager",
                             transport="actor_calls"), max_model_len=256))

    def reading_q(coordinator) -> list:
        """The dtype of q each verify's rule reads (a plain call's; the graph's resolves to it)."""
        target, read = coordinator.target._obj, []
        verify = target.model.verify

        def recorded(rows, drafts, probs, *rest):
            read.append(None if probs is None else probs.dtype)
            return verify(rows, drafts, probs, *rest)
        target.model.verify = recorded
        return read

    params = [SamplingParams(max_tokens=24, ignore_eos=True, seed=70, temperature=1.0),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=24, ignore_eos=True, seed=72, **SEEDED_TOP_K),
              SamplingParams(max_tokens=24, ignore_eos=True, seed=73, temperature=0.8)]
    plain_side = local_coordinator(bf16_config(pipelined=False))
    plain_read = reading_q(plain_side)
    plain = generate(plain_side, PROMPTS, params)
    assert plain_side.draft_worker._obj.model.q_dtype == torch.bfloat16
    assert plain_read and set(plain_read) - {None} == {torch.bfloat16}
    coordinator = local_coordinator(bf16_config(pipelined=pipelined))
    seen = _crossing_q(on_graph(coordinator))
    assert generate(coordinator, PROMPTS, params) == plain
    crossed = [q.probs if isinstance(q, RowsProbs) else q for q in seen if q is not None]
    assert crossed and {q.dtype for q in crossed} == {torch.bfloat16}
    assert coordinator._totals["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_filtering_rows_q_crosses_the_graph_sparse(local_coordinator, pipelined):
    """Greedy rows and seeded rows that all filter (top-k, top-p): only q's nonzero entries cross
    to the target, and the tokens are those of plain calls, whose q crosses dense."""
    from specserve.serve.wire import RowsProbs, SparseQ

    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=80, **SEEDED_TOP_K),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=30, ignore_eos=True, seed=82, temperature=1.0, top_k=8),
              SamplingParams(max_tokens=30, ignore_eos=True, seed=83, temperature=0.8, top_k=6, top_p=0.6)]
    plain = generate(local_coordinator(config(pipelined=False, gamma=3)), PROMPTS, params)
    coordinator = local_coordinator(config(pipelined=pipelined, gamma=3))
    seen = _crossing_q(on_graph(coordinator))
    assert generate(coordinator, PROMPTS, params) == plain
    crossed = [q for q in seen if q is not None]
    assert crossed and all(isinstance(q, RowsProbs) and isinstance(q.probs, SparseQ) for q in crossed)
    assert max(q.probs.values.shape[-1] for q in crossed) <= 8 < coordinator.vocab_size // 4


def _alternate_preparing(coordinator) -> None:
    """Make the pipelined loop prepare the next block in two steps of every three (the cost test
    `overlap_pays` decides it; a step that prepares none is a sequential one)."""
    turns = itertools.cycle([True, True, False])
    coordinator.policy.overlap_pays = lambda alphas, gamma: gamma > 0 and next(turns)


SEEDED_TOP_K = dict(temperature=0.5, top_k=3, top_p=0.9)  # peaked: many bonus guesses right, many blocks used


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SEEDED_TOP_K])
def test_pipelined_on_the_graph_draws_the_sequential_numbers(local_coordinator, sampling):
    """Pipelined on the graph: the draft side assembles block k from its prepared drafts (q kept
    there) and fresh ones, and drafts the ahead call beside the verify; steps that prepare nothing
    are sequential graph steps. The same tokens as the sequential loop on plain calls (greedy: the
    target's own greedy), one request at a time and all together."""
    params = [SamplingParams(max_tokens=30, seed=40 + i, ignore_eos=True, **sampling) for i in range(len(PROMPTS))]
    sequential = generate(local_coordinator(config(pipelined=False, gamma=2)), PROMPTS, params)
    coordinator = local_coordinator(config(pipelined=True, gamma=2))
    graph = on_graph(coordinator)
    assert graph.ahead
    _alternate_preparing(coordinator)
    alone = [generate(coordinator, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    together = generate(coordinator, PROMPTS, params)
    assert alone == sequential and together == sequential
    if not sampling["temperature"]:
        target = coordinator.target._obj.model.runner.model
        assert sequential == [hf_greedy(target, p, 30) for p in PROMPTS]
    totals = coordinator._totals
    assert totals["graph_steps"] == totals["steps"] == graph.executions
    assert totals["pipelined_prepared"] > 0 and totals["pipelined_hits"] > 0, totals
    assert totals["pipelined_steps"] < totals["steps"]  # some steps prepared nothing: sequential ones
    assert len(coordinator.draft_worker._obj._aheads) <= 2


def test_branch_points_are_each_rows_first_drafts():
    assert branch_points([3, 0, 1], 2) == [(0, 1), (0, 2), (2, 1)]
    assert branch_points([3, 2], 0) == []


@pytest.mark.parametrize("branches", [1, 3])
def test_pipelined_branches_on_the_graph_are_the_targets_greedy(local_coordinator, branches):
    """With rejection-point branches, the draft side forks a row's cache at each of its first
    drafts, feeds the fork its runner-up there and drafts block k+1 after it, beside the
    full-acceptance block; the verdict picks which block, if any, the next step verifies (the
    fork becomes the row's cache). Greedy output is the target's own, one request at a time and
    all together; some steps verify a branch's block; no fork outlives its step."""
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True) for _ in PROMPTS]
    coordinator = local_coordinator(config(pipelined=True, gamma=3))
    coordinator.policy.max_branches = branches
    graph = on_graph(coordinator)
    _alternate_preparing(coordinator)
    verified = []  # (each row's committed tokens, its drafts, g_b) of every verified row
    run = graph.run

    async def recording(call, *args, **kwargs):
        contexts = [list(coordinator.admission.get(r.request_id).tokens) for r in call.target_rows]
        reply = await run(call, *args, **kwargs)
        if reply is not None and reply.proposal is not None and reply.verdict is not None:
            verified.extend(zip(contexts, reply.proposal.tokens.tolist(), call.num_draft.tolist()))
        return reply

    graph.run = recording
    alone = [generate(coordinator, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    together = generate(coordinator, PROMPTS, params)
    target = coordinator.target._obj.model.runner.model
    expected = [hf_greedy(target, p, 30) for p in PROMPTS]
    assert alone == expected and together == expected
    # every verified block, a branch's included, is the draft's own greedy from the row's context:
    # a fork that held a wrong copy, or an adoption of the wrong fork, would draft something else
    draft_model = coordinator.draft_worker._obj.model.runner.model
    drafted = [(context, own[:g]) for context, own, g in verified if g]
    assert len(drafted) > 20
    assert all(own == hf_greedy(draft_model, context, len(own)) for context, own in drafted)
    totals = coordinator._totals
    assert graph.breaks == 0 and totals["graph_steps"] == totals["steps"]
    assert totals["pipelined_branch_hits"] > 0 and totals["pipelined_hits"] > totals["pipelined_branch_hits"], totals
    assert any(c.ahead is not None and c.ahead.branches == min(branches, 3) for c in graph.calls)
    draft = coordinator.draft_worker._obj
    assert not draft._branches and draft.model.num_cached() == 0
    assert asyncio.run(coordinator.num_cached()) == {"target": 0, "draft": 0}


def test_branches_stay_within_the_kv_budget(local_coordinator):
    """A fork is one more draft cache slot: with max_cached_tokens set, a step prepares only the
    branches whose slots fit beside the running batch (here one request to the context limit fits,
    its fork does not: (1 + 1) x 512 positions against (2 + 1) x 512)."""
    params = [SamplingParams(temperature=0.0, max_tokens=251, ignore_eos=True)]
    outs = {}
    for budget in (None, 1024):
        coordinator = local_coordinator(config(pipelined=True, gamma=3, max_cached_tokens=budget))
        coordinator.policy.max_branches = 2
        graph = on_graph(coordinator)
        _alternate_preparing(coordinator)
        outs[budget] = generate(coordinator, PROMPTS[:1], params)
        aheads = [c.ahead for c in graph.calls if c.ahead is not None]
        assert aheads and all(a.branches == (0 if budget else 2) for a in aheads if min(a.num_draft) >= 2)
    target = coordinator.target._obj.model.runner.model
    assert outs[None] == outs[1024] == [hf_greedy(target, PROMPTS[0], 251)]


def test_branches_skip_a_batch_with_sampled_rows(local_coordinator):
    """A step whose batch samples prepares only the full-acceptance block (a sampled row's
    correction is random): seeded rows draw the sequential loop's numbers beside greedy ones."""
    params = [SamplingParams(max_tokens=24, seed=80 + i, ignore_eos=True,
                             **(SEEDED_TOP_K if i % 2 else dict(temperature=0.0))) for i in range(len(PROMPTS))]
    sequential = generate(local_coordinator(config(pipelined=False, gamma=2)), PROMPTS, params)
    coordinator = local_coordinator(config(pipelined=True, gamma=2))
    coordinator.policy.max_branches = 2
    graph = on_graph(coordinator)
    _alternate_preparing(coordinator)
    assert generate(coordinator, PROMPTS, params) == sequential
    sampled = [c.ahead for c in graph.calls if c.ahead is not None and not c.ahead.sampling.all_greedy]
    assert sampled and all(ahead.branches == 0 for ahead in sampled)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_pair_graph_that_stops_drafting_becomes_the_targets_alone_and_comes_back(local_coordinator, monkeypatch,
                                                                                 pipelined):
    """Once the last steps drafted next to nothing, the graph is rebuilt as the target's alone (an
    idle draft actor in the pair's graph still spins a core between naps): target-only steps run
    on it, steps with drafts on plain calls, tokens unchanged. Once steps draft again it goes back
    to the pair's graph. Each change waits out the interval since the last."""
    import specserve.serve.executor as module

    monkeypatch.setattr(module, "_GRAPH_KEEPER_PERIOD_S", 3600.0)  # only the explicit checks below
    coordinator = local_coordinator(config(pipelined=pipelined, gamma=2))
    graph = on_graph(coordinator)
    target = coordinator.target._obj.model.runner.model
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    expected = [hf_greedy(target, PROMPTS[1], 20)]
    coordinator.executor._drafted.extend([False] * (module._SOLO_WINDOW - 1))
    coordinator.executor.maybe_reshape()
    assert not graph.solo  # the window is not full yet
    coordinator.executor._drafted.extend([True] * 4)  # full, but 4 drafting steps of 64 are over the share
    coordinator.executor.maybe_reshape()
    assert not graph.solo
    coordinator.executor._drafted.extend([False] * module._SOLO_WINDOW)
    coordinator.executor.maybe_reshape()
    assert graph.solo and not graph.ready and graph.reshaping and graph.breaks == 0
    asyncio.run(graph.rebuild())
    executions = graph.executions
    # every step drafts (γ 2 fixed) but the first, the prompt's forward, a target-only step
    assert generate(coordinator, PROMPTS[1:2], params) == expected
    assert graph.executions == executions + 1 == graph.target_only_calls  # the others all on plain calls
    assert coordinator._totals["graph_steps"] == 1
    coordinator.executor.draft_ok = False  # the draft out: target-only steps, which the target's graph runs
    assert generate(coordinator, PROMPTS[1:2], params) == expected
    assert graph.executions - executions == 1 + 20 == graph.target_only_calls  # one token a step
    coordinator.executor.draft_ok = True
    coordinator.executor.maybe_reshape()
    assert graph.solo  # within the interval since the last change
    monkeypatch.setattr(coordinator.executor, "_reshaped_at", -module._RESHAPE_EVERY_S)
    coordinator.executor._drafted.extend([True] * module._PAIR_WINDOW)
    coordinator.executor.maybe_reshape()
    assert not graph.solo and graph.reshapes == 2
    asyncio.run(graph.rebuild())
    drafting = graph.executions
    assert generate(coordinator, PROMPTS[1:2], params) == expected
    assert any(c.gamma for c in graph.calls[drafting:])  # drafting steps on the pair's graph again


@pytest.mark.parametrize("pipelined", [False, True])
def test_steps_while_the_draft_is_out_do_not_reshape_the_graph(local_coordinator, monkeypatch, pipelined):
    """A draft worker that was out (killed, restarting) for more steps than the window holds comes
    back to the pair's graph: its target-only steps meanwhile were not the policy's choice. Counted,
    they reshaped the rebuilt graph to the target's alone and kept the pair's steps off it for the
    interval between changes."""
    import specserve.serve.executor as module

    monkeypatch.setattr(module, "_GRAPH_KEEPER_PERIOD_S", 3600.0)  # only the explicit checks below
    coordinator = local_coordinator(config(pipelined=pipelined, gamma=2))
    graph = on_graph(coordinator)
    target = coordinator.target._obj.model.runner.model
    tokens = module._SOLO_WINDOW + 8
    params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)]
    coordinator.executor.draft_ok = False  # the draft out: target-only steps, one token each
    assert generate(coordinator, PROMPTS[1:2], params) == [hf_greedy(target, PROMPTS[1], tokens)]
    assert coordinator._totals["steps"] >= module._SOLO_WINDOW
    coordinator.executor.draft_ok = True
    coordinator.executor.maybe_reshape()
    assert not graph.solo and graph.reshapes == 0
    executions = graph.executions
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    assert generate(coordinator, PROMPTS[1:2], params) == [hf_greedy(target, PROMPTS[1], 20)]
    assert any(c.gamma for c in graph.calls[executions:])  # drafting steps on the pair's graph


def test_a_pipelined_execution_is_expected_to_last_as_long_as_its_ahead_call(local_coordinator, monkeypatch):
    """The seconds an execution should take size the nap before its result is read. In a
    pipelined step that is the fresh drafts, then the longer of the verify and the ahead call
    beside it: counting the verify alone, a draft slower than the verify had the coordinator
    looking for the result long before it could be there."""
    coordinator = local_coordinator(config(pipelined=True, gamma=2))
    graph = on_graph(coordinator)
    per_forward = 0.01  # predicted seconds of one forward, either model, any batch
    monkeypatch.setattr(coordinator.executor, "predicted", lambda side, rows, extra=None: per_forward * (
        1 if side == "target" or extra is None else int(extra)))
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    out = generate(coordinator, PROMPTS[:1], params)
    assert out == [hf_greedy(coordinator.target._obj.model.runner.model, PROMPTS[0], 30)]
    with_ahead = [(expected, n) for expected, n in graph.ahead_forwards if n]
    assert with_ahead and coordinator._totals["pipelined_hits"] > 0
    assert all(expected >= per_forward * n - 1e-9 for expected, n in with_ahead)  # n > 1: longer than the verify


def test_a_broken_pipelined_graph_step_gives_its_numbers_back(local_coordinator, monkeypatch):
    """A pipelined graph step that breaks (a prepared block in hand) reruns on plain calls with the
    very numbers it had drawn: seeded tokens stay the sequential loop's, and the graph is rebuilt."""
    import specserve.serve.executor as module

    monkeypatch.setattr(module, "_GRAPH_KEEPER_PERIOD_S", 0.0)
    monkeypatch.setattr(module, "_GRAPH_REBUILD_BUSY_S", 0.0)
    sampling = dict(temperature=1.0, top_k=3)  # flat enough that other numbers give other tokens
    params = [SamplingParams(max_tokens=30, seed=60 + i, ignore_eos=True, **sampling) for i in range(len(PROMPTS))]
    sequential = generate(local_coordinator(config(pipelined=False, gamma=2)), PROMPTS, params)
    coordinator = local_coordinator(config(pipelined=True, gamma=2))
    graph = on_graph(coordinator, fail_at=(4,), fail_blocks=2)  # (of the run's executions, 2 carry a block)
    assert generate(coordinator, PROMPTS, params) == sequential
    assert graph.breaks == 3 and graph.builds == 4 and graph.fail_blocks == 0  # each break rebuilt
    totals = coordinator._totals
    assert totals["steps"] > totals["graph_steps"] > totals["steps"] // 2, totals  # broken steps reran on plain calls


def test_a_broken_graph_reruns_the_step_on_plain_calls_and_is_rebuilt(local_coordinator, monkeypatch):
    import specserve.serve.executor as module

    monkeypatch.setattr(module, "_GRAPH_KEEPER_PERIOD_S", 0.0)  # check for a rebuild at every turn of the loop
    monkeypatch.setattr(module, "_GRAPH_REBUILD_BUSY_S", 0.0)  # even under traffic
    coordinator = local_coordinator(config(pipelined=False))
    graph = on_graph(coordinator, fail_at=(3, 9))
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True) for _ in PROMPTS]
    outs = generate(coordinator, PROMPTS, params)
    target = coordinator.target._obj.model.runner.model
    assert outs == [hf_greedy(target, p, 20) for p in PROMPTS]
    assert graph.breaks == 2 and graph.builds == 3  # each break rebuilt
    totals = coordinator._totals
    plain = totals["steps"] - totals["graph_steps"]
    assert plain >= 2 and totals["graph_steps"] >= totals["steps"] // 2, totals  # a failed step reran on plain calls


def test_a_late_draft_in_the_graph_makes_that_step_target_only(local_coordinator):
    coordinator = local_coordinator(config(pipelined=False))
    on_graph(coordinator, late_at=(4,))
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True) for _ in PROMPTS]
    outs = generate(coordinator, PROMPTS, params)
    target = coordinator.target._obj.model.runner.model
    assert outs == [hf_greedy(target, p, 20) for p in PROMPTS]
    assert coordinator._totals["target_only_steps"] >= 1


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_target_answers_a_target_only_step_without_waiting_for_the_draft_side(local_coordinator, pipelined):
    """In a worker pair's graph, graph_solo answers every target-only step as soon as the call
    arrives and no step that verifies drafts; either way the tokens are the target's own."""
    lengths = [21, 13]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    for gamma in (0, 3):
        coordinator = local_coordinator(config(pipelined=pipelined, gamma=gamma))
        graph = on_graph(coordinator)
        outs = generate(coordinator, PROMPTS[:2], params)
        target = coordinator.target._obj.model.runner.model
        assert outs == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, lengths)]
        steps = coordinator._totals["graph_steps"]
        assert steps == coordinator._totals["steps"] > 0 and graph.solo_answers == graph.target_only_calls
        if gamma == 0:
            assert graph.solo_answers == steps
        else:
            assert graph.solo_answers < steps // 2 and coordinator._totals["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_draft_side_with_nothing_to_draft_is_told_to_sleep_through_the_targets_forward(local_coordinator,
                                                                                         monkeypatch, pipelined):
    """A graph loop's read spins a core while it waits: in a step without drafts the draft side
    is told to sleep for the coordinator's nap over the target's predicted forward; a step that
    drafts or verifies a prepared block has no nap, and the tokens stay the target's own."""
    coordinator = local_coordinator(config(pipelined=pipelined, gamma=2))
    graph = on_graph(coordinator)
    graph.nap_share = 0.5
    per_forward = 0.002  # predicted seconds of one forward, either model, any batch
    monkeypatch.setattr(coordinator.executor, "predicted", lambda side, rows, extra=None: per_forward * (
        1 if side == "target" or extra is None else int(extra)))
    monkeypatch.setattr(coordinator.policy, "choose", lambda *a, **k: next(gammas))
    gammas = itertools.cycle([0, 0, 2, 2, 2, 2])
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    assert generate(coordinator, PROMPTS[:1], params) == [
        hf_greedy(coordinator.target._obj.model.runner.model, PROMPTS[0], 40)]
    steps = [c for c in graph.calls if c.target_rows]
    idle = [c for c in steps if not c.gamma and c.block is None]
    busy = [c for c in steps if c.gamma or c.block is not None]
    assert idle and busy and (not pipelined or any(c.block is not None for c in busy))
    assert all(c.draft_nap_s == pytest.approx(0.5 * per_forward) for c in idle)
    assert all(c.draft_nap_s == 0 for c in busy)
    # never more than half the target's allowance, whatever the executions taught the nap
    assert coordinator.executor._with_draft_nap(idle[0], 1.0, 0.4).draft_nap_s == pytest.approx(0.2)
    assert coordinator.executor._with_draft_nap(idle[0], 1.0, 5.0).draft_nap_s == pytest.approx(0.5)


def test_a_draft_side_naps_outside_its_lock_and_only_when_told():
    """The nap happens before the draft worker takes its lock (probes and `free` reach it
    meanwhile), and only in a step that drafts nothing."""
    import threading
    import time

    from specserve.serve.workers import DraftWorker

    class Stub:
        def __init__(self) -> None:
            self._lock, self._proposing, self._step = threading.RLock(), False, None

        def _threads_here(self) -> None:
            pass

        def _adopt(self, block):
            return None

        def _branching(self, ahead) -> bool:
            return False

        def _propose_step(self, call, alternates=False):
            from specserve.serve.wire import Reply
            return Reply(None, 0.0)

        def _placed_to(self):
            return None

    sampling = BatchSampling.from_params([SamplingParams(temperature=0.0)])
    rows = [RowInput("a", 0, [1])]
    idle = StepCall([], 0, sampling, None, rows, torch.tensor([0]), None, None, draft_nap_s=1.0)
    drafting = StepCall(rows, 2, sampling, None, rows, torch.tensor([2]), None, None, draft_nap_s=1.0)
    stub = Stub()
    began = time.monotonic()
    worker = threading.Thread(target=DraftWorker.graph_propose, args=(stub, pack(idle)))
    worker.start()
    time.sleep(0.1)
    assert stub._lock.acquire(timeout=0.05)  # free during the nap
    stub._lock.release()
    worker.join()
    assert time.monotonic() - began >= 1.0
    began = time.monotonic()
    DraftWorker.graph_propose(stub, pack(drafting))
    assert time.monotonic() - began < 0.5  # drafts to make: no nap


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_draft_miss_on_the_graph_skips_the_target_and_resends(local_coordinator, pipelined):
    """A restarted draft (empty caches) answers its graph node with misses: the target does not
    verify that execution, the marks move back and the next execution rebuilds the draft's cache."""
    coordinator = local_coordinator(config(pipelined=pipelined, gamma=3))
    draft, target = coordinator.draft_worker._obj, coordinator.target._obj
    verifies = []
    verify = target.verify
    target.verify = lambda *args: verifies.append(1) or verify(*args)

    def restart_draft() -> None:
        draft.model = type(draft.model)(draft.model.runner.model, coordinator.vocab_size, None, "eager")

    graph = on_graph(coordinator, before={6: restart_draft})
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    out = generate(coordinator, PROMPTS[:1], params)
    assert out == [hf_greedy(target.model.runner.model, PROMPTS[0], 30)]
    steps = coordinator._totals["steps"]
    assert graph.executions == steps + 1 and len(verifies) == steps  # one execution missed, unverified


def test_a_colocated_drafter_runs_as_one_graph_node(local_coordinator):
    cfg = AppConfig.model_validate(dict(
        served_model_name="tiny", target=TINY, drafter={"kind": "prompt_lookup"},
        speculation=dict(num_speculative_tokens=4, adaptive=False, execution="eager", transport="actor_calls"),
        max_model_len=256))
    coordinator = local_coordinator(cfg)
    graph = on_graph(coordinator)
    assert graph.draft is None
    prompt = [5, 6, 7, 8, 9] * 6  # repetitive: prompt lookup proposes, the target accepts some
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    out = generate(coordinator, [prompt], params)
    target = coordinator.target._obj.model.runner.model
    assert out == [hf_greedy(target, prompt, 24)]
    assert coordinator._totals["graph_steps"] == coordinator._totals["steps"] > 0


class _Ref:
    def __init__(self, value) -> None:
        self.value = value
        self.read_at = None  # time.monotonic() of the read

    def get(self, timeout=None):
        import time

        self.read_at, self.timeout = time.monotonic(), timeout
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class _FakeDag:
    """A compiled graph's execute/teardown, in process: execute records the thread it was called
    on and answers with `reply` (or raises `fails`)."""

    def __init__(self, reply: bytes, fails: BaseException | None = None) -> None:
        self.reply, self.fails, self.threads, self.torn_down = reply, fails, [], False

    def execute(self, packed: bytes):
        import threading

        self.threads.append(threading.get_ident())
        if self.fails is not None:
            raise self.fails
        assert unpack(packed).gamma == 2
        return _Ref(self.reply)

    def teardown(self) -> None:
        self.torn_down = True


def test_an_execution_writes_on_the_loop_and_a_failed_write_breaks_the_graph():
    """StepGraph.run writes the execution's input on the event loop's own thread (only the wait
    goes to the graph's thread) and returns the target's reply; a write that raises (a dead
    worker's channel) tears the graph down and re-raises, so the caller reruns the step on calls."""
    import threading

    from specserve.engine import Proposal, Verdict
    from specserve.serve.graph import StepGraph, StepReply

    call = StepCall([RowInput("a", 0, [1])], 2, BatchSampling.from_params([SamplingParams(temperature=0.0)]), None,
                    [RowInput("a", 0, [1])], torch.tensor([2]), None, None)
    reply = StepReply(Proposal(torch.tensor([[3, 4]]), None), Verdict([1], [9]), {}, {}, 0.01, 0.02)

    async def run(dag):
        graph = StepGraph(target=None)
        graph._dag = dag
        try:
            return await graph.run(call, 1.0, 1.0), graph
        except RuntimeError as err:
            await asyncio.sleep(0.05)  # the teardown runs on the graph's thread
            return err, graph

    good = _FakeDag(pack(reply))
    back, graph = asyncio.run(run(good))
    assert back.verdict.next_token == [9] and torch.equal(back.proposal.tokens, reply.proposal.tokens)
    assert good.threads == [threading.get_ident()] and graph.ready
    broken = _FakeDag(b"", fails=RuntimeError("channel closed"))
    err, graph = asyncio.run(run(broken))
    assert isinstance(err, RuntimeError) and not graph.ready and graph.breaks == 1 and broken.torn_down


def test_the_wait_naps_before_it_reads_and_the_nap_follows_what_executions_took():
    """A compiled graph's reader spins a core while it waits, so `_wait` first sleeps (never past
    the deadline) and reads with what is left. The nap is a share of the execution's expected
    seconds, scaled by the lower quartile of what recent executions took in the workers against
    what was expected of them (none before the first; answers of cache misses do not count)."""
    import time

    from specserve.engine import Proposal, Verdict
    from specserve.serve.graph import _EXPECTED_SHARE, StepGraph, StepReply, _wait

    for nap, timeout in [(0.2, 5.0), (0.2, 0.05), (0.0, 5.0)]:
        ref = _Ref(b"x")
        start = time.monotonic()
        assert _wait(ref, timeout, nap) == b"x"
        slept = min(nap, timeout)
        assert slept <= ref.read_at - start < slept + 0.1, (nap, timeout)
        assert timeout - slept - 0.1 < ref.timeout <= timeout - slept

    call = StepCall([RowInput("a", 0, [1])], 2, BatchSampling.from_params([SamplingParams(temperature=0.0)]), None,
                    [RowInput("a", 0, [1])], torch.tensor([2]), None, None)
    graph = StepGraph(target=None)
    assert graph.nap(0.1) == 0.0  # nothing measured yet: no nap

    async def execute(seconds, verdict=True):
        graph._dag = _FakeDag(pack(StepReply(Proposal(torch.tensor([[3]]), None),
                                             Verdict([1], [9]) if verdict else None, {}, {}, 0.0, seconds)))
        await graph.run(call, 1.0, 1.0, expected=0.1)

    for seconds in (0.05, 0.09, 0.1, 0.12):  # took 0.5, 0.9, 1.0 and 1.2 of what was expected
        asyncio.run(execute(seconds))
    asyncio.run(execute(0.0, verdict=False))  # cache misses: no forward ran, not counted
    assert graph.nap(0.2) == pytest.approx(_EXPECTED_SHARE * 0.9 * 0.2)
    graph.spins = True  # cores to spare (SPIN_CORES): readers spin, nobody naps
    assert graph.nap(0.2) == 0.0


def test_readers_spin_where_the_coordinator_has_cores_to_spare(monkeypatch):
    """Napping keeps a spinning reader off the forwards' cores on a small machine; with SPIN_CORES
    or more (a GPU node) it only delays the step, so there the graph spins."""
    import specserve.serve.graph as graph_module

    for cores, spins in ((2, False), (graph_module.SPIN_CORES - 1, False), (graph_module.SPIN_CORES, True), (16, True)):
        monkeypatch.setattr(graph_module, "usable_cores", lambda: cores)
        assert graph_module.StepGraph(target=None).spins == spins
    assert graph_module.usable_cores() >= 1


def test_after_its_nap_the_wait_looks_for_the_output_until_it_is_there():
    """Past the expected time, the graph's one output is looked for without blocking (Ray's
    blocking read spins) until a look finds it; only then is it read, within the deadline."""
    from ray.exceptions import RayChannelTimeoutError

    from specserve.serve.graph import _wait

    class Dag:
        looks = 0

        def _execute_until(self, execution_index, channel_index, timeout):
            assert (execution_index, channel_index, timeout) == (7, None, 0)
            Dag.looks += 1
            if Dag.looks < 5:
                raise RayChannelTimeoutError("not yet")

    ref = _Ref(b"x")
    ref._dag, ref._execution_index, ref._channel_index = Dag(), 7, None
    assert _wait(ref, 5.0, 0.01) == b"x" and Dag.looks == 5 and ref.timeout > 4.0
    Dag.looks = -10**9  # never there: the looks stop at the deadline and the read gets what is left
    assert _wait(ref, 0.05, 0.01) == b"x" and ref.timeout == 0.0


def test_a_worker_gives_torch_its_threads_on_every_thread_that_calls_it(monkeypatch):
    """Ray runs a compiled graph's loop on a thread of its own, where the BLAS kernels would keep
    Ray's OMP_NUM_THREADS (1) whatever the worker's torch_threads: a worker method sets the
    worker's thread count once on each thread that calls it."""
    import threading

    from specserve.serve import workers

    calls = []
    monkeypatch.setattr(workers.torch, "set_num_threads", lambda n: calls.append((threading.get_ident(), n)))

    class Probe(workers._Worker):
        @workers._serialised
        def step(self) -> None:
            pass

    probe = Probe(torch_threads=3)
    probe.step()
    probe.step()
    graph_thread = threading.Thread(target=lambda: (probe.step(), probe.step()))
    graph_thread.start()
    graph_thread.join()
    assert [n for _, n in calls] == [3, 3] and calls[0][0] == threading.get_ident() != calls[1][0]
    calls.clear()
    Probe(torch_threads=None).step()  # no setting: torch keeps its own
    assert calls == []


def test_a_reshape_tears_the_graph_down_without_counting_a_break():
    """StepGraph.reshape: the target's graph alone (no draft node, no ahead node) and back to the
    pair's as it was built; the graph in hand is torn down, not counted as broken, and the keeper
    is told to rebuild at once (`reshaping`, cleared by a build)."""
    from specserve.serve.graph import StepGraph

    async def run():
        graph = StepGraph(target="target", draft="draft", ahead=True)
        graph._dag = dag = _FakeDag(b"")
        graph.reshape(True)
        await asyncio.sleep(0.05)  # the teardown runs on the graph's thread
        return graph, dag

    graph, dag = asyncio.run(run())
    assert graph.solo and graph.draft is None and not graph.ahead and graph.reshaping
    assert not graph.ready and dag.torn_down and graph.breaks == 0 and graph.reshapes == 1
    graph.reshape(True)  # already that shape: nothing
    assert graph.reshapes == 1
    graph.reshape(False)
    assert not graph.solo and graph.draft == "draft" and graph.ahead and graph.reshapes == 2
    assert not StepGraph(target="target").solo  # nothing to reshape without a draft worker
