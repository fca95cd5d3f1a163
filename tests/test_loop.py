"""The step loop and the executor interface (engine/loop.py, engine/executor.py): one composition of
a step for every executor, and the protocol for an executor that loses its draft side mid-step."""
from __future__ import annotations

import asyncio

import pytest

from models import hf_greedy, perturbed, tiny_llama
from specserve import SamplingParams
from specserve.engine import DraftModelProposer, TargetVerifier
from specserve.engine.admission import Admission
from specserve.engine.executor import InProcessExecutor, run_sync
from specserve.engine.loop import StepLoop
from specserve.engine.policy import SpeculationPolicy
from specserve.engine.step import new_sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_run_sync_returns_what_a_coroutine_that_never_waits_returns():
    async def never_waits(x):
        return x + 1

    assert run_sync(never_waits(1)) == 2


def test_run_sync_refuses_a_coroutine_that_waits():
    async def waits():
        await asyncio.sleep(0)
        return 1

    with pytest.raises(RuntimeError, match="must run to completion"):
        run_sync(waits())


class LosesItsDraftOnce(InProcessExecutor):
    """An in-process executor whose draft side fails in the first step that drafts: it answers None
    there, as a remote executor does when its draft worker dies before the verify."""

    def __init__(self, proposer, verifier) -> None:
        super().__init__(proposer, verifier)
        self.planned: list[int] = []  # γ of every plan executed
        self.failed = False

    async def execute(self, plan):
        self.planned.append(plan.gamma)
        if plan.gamma > 0 and not self.failed:
            self.failed = True
            return None
        return await super().execute(plan)


def test_a_step_whose_draft_side_fails_is_planned_again_without_drafts_and_stays_lossless():
    target = tiny_llama(0)
    verifier = TargetVerifier(target, None, "eager")
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=1), verifier.vocab_size, None, "eager")
    executor = LosesItsDraftOnce(proposer, verifier)
    admission = Admission(4, None, 3)
    loop = StepLoop(admission, executor, SpeculationPolicy(3, adaptive=False), prefill_chunk_tokens=8)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 1, 4]]
    seqs = [new_sequence(f"r{i}", p, GREEDY, vocab_size=verifier.vocab_size, max_model_len=256,
                         eos_token_ids=frozenset()) for i, p in enumerate(prompts)]
    for seq in seqs:
        admission.enqueue(seq)
    while admission.has_unfinished():
        outputs = run_sync(loop.iterate(loop.admit()))
        loop.retire([o.request_id for o in outputs if o.finish_reason is not None])
    first = executor.planned.index(3)
    assert executor.planned[first + 1] == 0  # the failed step, re-planned without drafts
    assert executor.planned.count(3) > 1  # and the next steps draft again
    assert [s.output for s in seqs] == [hf_greedy(target, p, 16) for p in prompts]
    assert verifier.runner.num_cached() == 0 and proposer.runner.num_cached() == 0  # retired: caches freed


def test_a_span_of_a_sequence_is_that_slice_of_its_tokens():
    """`Sequence.span` (the rows' tokens, read every step) is tokens[start:end] without the copy
    of the whole context that `tokens` makes."""
    from specserve.engine import SamplingParams
    from specserve.engine.step import Sequence

    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(), frozenset(), 64, output=[5, 6, 7])
    for start in range(9):
        for end in [None, *range(10)]:
            assert seq.span(start, end) == seq.tokens[start:end], (start, end)
    assert Sequence("e", [1, 2], SamplingParams(), frozenset(), 64).span(1) == [2]
