"""The step loop, written once for the in-process engine and the served coordinator.

    admit (FIFO, batch size and KV budget) -> prefill chunks -> one step over the ready requests
    (a new request's first step carries its target's last prompt chunk) -> publish (the
    caller's) -> retire finished requests

`SpeculativeEngine.step` runs it in process (`run_sync` over an `InProcessExecutor`); the
coordinator (serve/coordinator.py) awaits it on its event loop over a remote executor, and keeps
only request I/O, deadlines and fault policy around it. How a step's propose and verify run is
the executor's (`engine/executor.py`).
"""
from __future__ import annotations

from .admission import Admission
from .executor import Executor
from .history import MAX_MATCH, History, Recall
from .policy import SpeculationPolicy
from .step import Sequence, StepOutput, folding, prefilling


class StepLoop:
    def __init__(self, admission: Admission, executor: Executor, policy: SpeculationPolicy,
                 prefill_chunk_tokens: int | None, history: History | None = None) -> None:
        """prefill_chunk_tokens: the most prompt tokens each model prefills per step, in a
        forward beside the step (`prefill_rows`); None or 0: a new prompt is prefilled whole
        inside its first step. history: finished requests' answers, which admitted requests draft
        from where their latest tokens occurred there (engine/history.py); None: none kept."""
        self.admission, self.executor, self.policy = admission, executor, policy
        self.prefill_chunk_tokens = prefill_chunk_tokens or None
        self.history = history
        self._reserved = (0, 0)  # the sizing (`Admission.sizing`) the executor last sized caches for

    def admit(self, preempt: bool = True) -> list[Sequence]:
        """Preempt what the budget no longer holds (paged caches), admit waiting requests, have
        the caches sized for them (`reserve`); -> the running batch. preempt=False: admit only
        (between steps is the only time a running request may be preempted: one in a step under
        way would have its caches freed under it and come back as a result for no one)."""
        preempted = self.admission.preempt() if preempt else []
        if preempted:
            self.executor.free([s.request_id for s in preempted])
        admitted = self.admission.admit()
        if self.history is not None:  # (never a seeded sampled request: its tokens would depend on others')
            for s in admitted:
                if s.recall is None and s.prediction is None and not s.reproducible:
                    s.recall = Recall(self.history)
        self.reserve()
        return list(self.admission.running.values())

    def reserve(self) -> None:
        """When the running batch's sizing changed, have the executor size the dense caches of
        graph-mode runners for it (the running requests, at the longest one's worst case: what
        admission budgets). So storage grows as requests join, before their first forward, and
        not in the middle of their decoding, where a growth would drop every captured graph and
        each would be captured again as it is next met."""
        size = self.admission.sizing()
        if size != self._reserved:
            self._reserved = size
            self.executor.reserve(*size, self.admission.budget)

    async def iterate(self, seqs: list[Sequence]) -> list[StepOutput]:
        """This step's prompt chunks, then one step over the requests whose prompts every cache
        the step uses holds (the target's alone while no drafter runs)."""
        ready = seqs
        if self.prefill_chunk_tokens is not None:
            fold = folding(seqs, self.prefill_chunk_tokens)  # target chunks that go with the step
            await self.executor.prefill(seqs, self.prefill_chunk_tokens, fold)
            ready = [s for s in seqs if not prefilling(s, self.executor.with_draft, fold)]
        for s in ready:
            s.preempted = False  # (prefilled again: it steps as before)
        return await self.executor.step(ready, self.policy) if ready else []

    def retire(self, request_ids: list[str]) -> None:
        """Forget finished or aborted requests and free their caches (those still running here)."""
        if self.history is not None:  # each answer, after the prompt's last tokens that lead to it
            for rid in request_ids:
                s = self.admission.running.get(rid)
                if s is not None and s.output:
                    self.history.add(s.span(max(len(s.prompt) - MAX_MATCH, 0)))
        gone = [rid for rid in request_ids if self.admission.release(rid)]
        if gone:
            self.executor.free(gone)
