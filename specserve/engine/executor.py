"""How a step's propose and verify run: the executor interface, and the in-process executor.

The step is written once (docs/architecture.md): the loop (`engine/loop.py`) runs prefill chunks
and steps; a step plans (`plan_step`), has the executor run the plan's propose and verify, and
applies the verdict (`finish`). What differs between running the two models in this process, on
plain Ray actor calls, in one fused call or on a compiled graph is only how `execute` runs a plan,
so that is all an executor writes. An executor may also take over whole steps where it overlaps
them (the served pipelined loop drafts block k+1 while block k is verified: `Executor.step`).

Executors are written with `async def` so that one loop drives them all: the served one awaits
remote calls on its event loop; the in-process one never suspends, and `run_sync` runs its
coroutines to completion in the caller's thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from .model_runner import ModelRunner
from .proposers import Proposal, Proposer
from .policy import SpeculationPolicy
from .step import (
    Sequence, StepOutput, StepPlan, advance_marks, empty_proposal, finish_step, plan_step, prefill_rows, prefilling,
    verified_counts,
)
from .verifier import TargetVerifier, Verdict

@dataclass(frozen=True)
class Ran:
    """A plan's propose and verify as an executor ran them."""

    proposal: Proposal  # tokens [B, G] (q only where the executor holds it)
    verdict: Verdict
    in_workers: float = 0.0  # seconds inside worker methods (remote executors; records only)
    via: str = "in_process"  # how: "in_process" | "calls" | "fused" | "graph"


class Executor(Protocol):
    """What the step loop needs from an executor."""

    @property
    def with_draft(self) -> bool:
        """Whether a new prompt must be prefilled into a draft cache too before its first step."""

    def policy_for(self, policy: SpeculationPolicy, drafting: bool = True) -> SpeculationPolicy:
        """The policy a step plans with: `policy`, or a target-only one while no drafter can run
        (drafting=False: the target-only one, for a step whose draft side just failed)."""

    async def prefill(self, seqs: list[Sequence], budget: int, fold: frozenset[str] = frozenset()) -> None:
        """This step's prompt chunks (`prefill_rows`) into each model's cache, but for the target
        those of `fold`, which its verify takes with the step (`folding`); moves the marks."""

    async def execute(self, plan: StepPlan) -> Ran | None:
        """Run the plan's propose and verify. None: the draft side failed before the verify ran;
        the step is planned again (`policy_for` no longer drafts) and executed again."""

    async def step(self, seqs: list[Sequence], policy: SpeculationPolicy) -> list[StepOutput]:
        """One step over seqs: `run_step` unless the executor overlaps steps itself."""

    def stepped(self, plan: StepPlan, ran: Ran, policy: SpeculationPolicy, began: float) -> None:
        """A step was applied (its records and counters)."""

    def free(self, request_ids: list[str]) -> None:
        """Forget finished or aborted requests' caches."""

    def reserve(self, num_requests: int, longest: int, budget: int | None) -> None:
        """The running batch's sizing changed (`Admission.sizing`: requests joined, or a longer
        one): size the dense caches of graph-mode runners for it now (`ModelRunner.reserve_ahead`)."""


async def run_step(seqs: list[Sequence], policy: SpeculationPolicy, executor: Executor) -> list[StepOutput]:
    """One speculative step: plan, execute, apply. The one composition of a sequential step."""
    began = time.perf_counter()
    used = executor.policy_for(policy)
    plan = plan_step(seqs, used)
    ran = await executor.execute(plan)
    if ran is None:  # the draft side failed: this very step again, without drafts
        used = executor.policy_for(policy, drafting=False)
        plan = plan_step(seqs, used)
        ran = await executor.execute(plan)
        if ran is None:
            raise RuntimeError("the executor ran no step without drafts")
    return finish(plan, ran, used, began, executor)


def finish(plan: StepPlan, ran: Ran, policy: SpeculationPolicy, began: float, executor: Executor) -> list[StepOutput]:
    """Apply what an executor ran (`finish_step`), then let it record the step."""
    outputs = finish_step(plan, ran.proposal, ran.verdict, policy, began)
    executor.stepped(plan, ran, policy, began)
    return outputs


class InProcessExecutor:
    """Both models in this process: propose, then verify, as direct calls."""

    def __init__(self, proposer: Proposer | None, verifier: TargetVerifier) -> None:
        self.proposer, self.verifier = proposer, verifier
        self.target_only = SpeculationPolicy(0, adaptive=False)

    @property
    def with_draft(self) -> bool:
        # a proposer without `prefill` (one written before chunking) catches a prompt up in its first propose
        return self.proposer is not None and hasattr(self.proposer, "prefill")

    def policy_for(self, policy: SpeculationPolicy, drafting: bool = True) -> SpeculationPolicy:
        return policy if drafting else self.target_only

    async def prefill(self, seqs: list[Sequence], budget: int, fold: frozenset[str] = frozenset()) -> None:
        """The target's chunks (less `fold`'s), then the draft's."""
        rows = prefill_rows(seqs, "target_len", budget, fold)
        if rows:
            self.verifier.prefill(rows)
            advance_marks(seqs, "target_len", rows)
            note_cached(seqs, self.verifier.runner.cached_tokens)
        rows = prefill_rows(seqs, "draft_len", budget) if self.with_draft else []
        if rows:
            self.proposer.prefill(rows)
            advance_marks(seqs, "draft_len", rows)

    async def execute(self, plan: StepPlan) -> Ran:
        proposal = empty_proposal(len(plan.seqs))
        if plan.gamma > 0:
            proposal = self.proposer.propose(plan.draft_rows(), plan.gamma, plan.sampling,
                                             plan.draft_uniforms)
        verdict = self.verifier.verify(
            plan.target_rows(), proposal.tokens, proposal.probs, verified_counts(plan.num_draft, proposal),
            plan.sampling, plan.accept_uniforms, plan.final_uniforms)
        return Ran(proposal, verdict)

    async def step(self, seqs: list[Sequence], policy: SpeculationPolicy) -> list[StepOutput]:
        return await run_step(seqs, policy, self)

    def stepped(self, plan: StepPlan, ran: Ran, policy: SpeculationPolicy, began: float) -> None:
        pass

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.verifier.free(rid)
            if self.proposer is not None:
                self.proposer.free(rid)

    def reserve(self, num_requests: int, longest: int, budget: int | None) -> None:
        for runner in (self.verifier.runner, getattr(self.proposer, "runner", None)):
            if isinstance(runner, ModelRunner):
                runner.reserve_ahead(num_requests, longest, budget)


def run_sync(coroutine):
    """Run a coroutine that never suspends (an in-process executor's) to its result, here."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("an in-process step waited on something: it must run to completion at once")


def speculative_step(
    seqs: list[Sequence], proposer: Proposer | None, verifier: TargetVerifier, policy: SpeculationPolicy
) -> list[StepOutput]:
    """Propose, verify and append for every sequence in the batch, in process."""
    return run_sync(run_step(seqs, policy, InProcessExecutor(proposer, verifier)))


def note_cached(seqs: list[Sequence], cached: dict[str, int]) -> None:
    """After the target's prefill: each request's prompt tokens taken from shared blocks so far."""
    for s in seqs:
        if s.request_id in cached:
            s.cached_tokens = cached[s.request_id]


def prefill_step(
    seqs: list[Sequence], proposer: Proposer | None, verifier: TargetVerifier, budget: int
) -> list[Sequence]:
    """Run this step's prefill chunks in process (target, then the draft when there is one) and
    return the requests ready to step, in their order."""
    executor = InProcessExecutor(proposer, verifier)
    run_sync(executor.prefill(seqs, budget))
    return [s for s in seqs if not prefilling(s, executor.with_draft)]

