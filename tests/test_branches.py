"""The engine's side of a pipelined step's rejection-point branches (speculation.branches,
specserve.serve.pipeline): the draft's runner-up tokens, forks of a request's draft cache and
their adoption, and the policy's price of branches. Through the coordinator's pipelined graph
step: tests/test_graph.py."""
from __future__ import annotations

import pytest
import torch

from models import tiny_llama
from specserve.engine import DraftModelProposer, RowInput, SamplingParams
from specserve.engine.model_runner import ForwardTiming
from specserve.engine.proposers import branch_id, branch_owner
from specserve.engine.sampling import BatchSampling
from specserve.engine.policy import OverlappedPolicy

GREEDY = BatchSampling.from_params([SamplingParams(temperature=0.0)])
CONTEXT = [5, 17, 3, 42, 8, 8, 61, 2, 30, 11, 7, 19]


def logits_after(model, tokens: list[int]) -> torch.Tensor:
    """[V] the model's logits after these tokens (HF, no cache)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_runner_ups_are_the_drafts_second_choices():
    model = tiny_llama(3)
    proposer = DraftModelProposer(model, model.config.vocab_size, execution="eager")
    proposal = proposer.propose([RowInput("a", 0, CONTEXT)], 4, GREEDY, None, alternates=True)
    drafts, ups = proposal.tokens[0].tolist(), proposal.alternates[0].tolist()
    for j in range(4):
        top = logits_after(model, CONTEXT + drafts[:j]).topk(2).indices.tolist()
        assert [drafts[j], ups[j]] == top
    assert proposer.propose([RowInput("a", 12, [drafts[0]])], 2, GREEDY, None).alternates is None  # not asked
    sampled = BatchSampling.from_params([SamplingParams(temperature=0.8)])
    assert proposer.propose([RowInput("a", 12, [drafts[0]])], 2, sampled, torch.rand(1, 2),
                            alternates=True).alternates is None  # greedy rows only


@pytest.mark.parametrize("graphs", [False, True])
def test_a_fork_drafts_what_its_own_context_gives_and_adoption_keeps_it(graphs):
    """A fork holds a copy of the request's first positions; fed another token there it drafts
    exactly what a cache built from that context drafts; the request then adopts it (the
    other cache is gone) and goes on from it; another fork is freed. Live slots stay dense."""
    from test_engine_static import emulate_graphs

    model = tiny_llama(4)
    vocab = model.config.vocab_size
    proposer = DraftModelProposer(model, vocab, execution="eager")
    if graphs:
        emulate_graphs(proposer.runner)
    proposer.prefill([RowInput("other", 0, [9, 9, 9])])
    first = proposer.propose([RowInput("a", 0, CONTEXT)], 3, GREEDY, None, alternates=True)  # holds 14
    at = 9
    proposer.fork("a", branch_id("a", 1), at)
    proposer.fork("a", branch_id("a", 2), at + 1)
    corrected = (CONTEXT[at] + 1) % vocab
    got = proposer.propose([RowInput(branch_id("a", 1), at, [corrected])], 3, GREEDY, None, alternates=True)
    fresh = DraftModelProposer(model, vocab, execution="eager")
    want = fresh.propose([RowInput("x", 0, CONTEXT[:at] + [corrected])], 3, GREEDY, None, alternates=True)
    assert got.tokens.tolist() == want.tokens.tolist() and got.alternates.tolist() == want.alternates.tolist()
    assert proposer.num_cached() == 4 and first.tokens.shape == (1, 3)
    proposer.adopt(branch_id("a", 1), "a")
    proposer.free(branch_id("a", 2))
    assert proposer.num_cached() == 2 and proposer.valid_length("a") == at + 3
    assert sorted(proposer.runner._slot_of.values()) == [0, 1]
    nxt = got.tokens[0, -1].item()
    on = proposer.propose([RowInput("a", at + 3, [nxt])], 2, GREEDY, None)
    ref = fresh.propose([RowInput("x", at + 3, [nxt])], 2, GREEDY, None)
    assert on.tokens.tolist() == ref.tokens.tolist()


def test_a_fork_past_what_the_request_holds_is_a_cache_miss():
    from specserve.engine import CacheMiss

    proposer = DraftModelProposer(tiny_llama(0), 96, execution="eager")
    proposer.prefill([RowInput("a", 0, [1, 2, 3])])
    with pytest.raises(CacheMiss):
        proposer.fork("a", branch_id("a", 1), 4)
    assert proposer.num_cached() == 1
    with pytest.raises(KeyError):
        proposer.adopt(branch_id("a", 1), "a")


def test_branch_names():
    assert branch_owner(branch_id("req-7", 2)) == "req-7" and branch_owner("req-7") == "req-7"


def _measured(policy: OverlappedPolicy, draft_per_row: float) -> OverlappedPolicy:
    """Costs: a target forward 10 ms whatever its width; a draft forward 5 ms + draft_per_row per row."""
    policy.calibrate_costs("target", [ForwardTiming(n, 0.010) for n in (1, 2, 4, 8, 16)])
    policy.calibrate_costs("draft", [ForwardTiming(n, 0.005 + draft_per_row * n) for n in (1, 2, 4, 8, 16)])
    return policy


def test_branches_pay_where_extra_draft_rows_are_cheap_and_runner_ups_right():
    """At α 0.8 with γ 1 a row misses its single prepared block 36% of the time; a branch at the
    first draft covers the rejections its runner-up gets right. With free extra rows (a GPU) and
    runner-ups that were right, the policy prepares it; with runner-ups never right, or extra rows
    that make the ahead call outlast the verify by much, it does not."""
    cheap = _measured(OverlappedPolicy(4, max_branches=2), 0.0)
    assert cheap.ready
    cheap.observe_alternates(40, 50)
    alphas = [0.8]
    assert cheap.branches_for(alphas, 1) == 1 and cheap.branches_for(alphas, 3) >= 1
    assert cheap.overlapped_time(1, 1, alphas, branches=1) < cheap.overlapped_time(1, 1, alphas)
    wrong = _measured(OverlappedPolicy(4, max_branches=2), 0.0)
    wrong.observe_alternates(0, 200)
    assert wrong.branches_for(alphas, 1) == 0
    costly = _measured(OverlappedPolicy(4, max_branches=2), 0.004)
    costly.observe_alternates(40, 50)
    assert costly.branches_for(alphas, 2) == 0
    assert OverlappedPolicy(4, max_branches=0).branches_for(alphas, 3) == 0
    assert OverlappedPolicy(4, adaptive=False, max_branches=2).branches_for(alphas, 1) == 1  # at most γ
