"""Requests waiting and running: the waiting queue and the running batch, with admission into it
FIFO within a priority (a request's `priority`, vLLM's: lower first, 0 by default), bounded in
count and in memory. The step loop (`engine/loop.py`) admits from here for the
in-process engine and the server's coordinator alike, so both admit, order continuations and
budget KV memory by the same rules.

The workers' KV caches are dense (`engine/kv_cache.py`): a slot per row of the batch padded to its
capture bucket, plus one scratch slot, every slot allocated for the same number of positions,
`capacity_for(longest row)`. So what a batch really allocates on each worker is

    (batch_bucket(running) + 1) x capacity_for(max over running of (prompt + max_tokens + γ))

(γ: a step writes up to γ draft positions past a row's last real token; the worker trims dead
slots and capacity before it grows, see `ModelRunner._fit`). With a budget (`max_cached_tokens`)
a request joins only while that product, counting it, fits; a request that could not fit even
alone is refused before anything is allocated.

A paged cache (`engine/paged_cache.py`, `kv_block_size`) allocates by the block instead, each
request for its own length, so a long request no longer sizes everyone's slot. Admission then
counts what the running requests hold *now*, plus one step's headroom each (γ drafts, the γ + 1
a pipelined ahead call drafts past them, a padding position), and the scratch block:

    (1 + sum over running of blocks_for(tokens so far + 2γ + 3)) x block_size

A model whose every layer attends a sliding window gives back the blocks its window has passed
(`ModelRunner.kept_behind`): for such caches the count leaves out the positions a request no longer
holds, those more than `kept_behind` before the cache's mark (`target_len`, `draft_len`), where
every paged cache of the request gives them back (the most any of them still holds counts). Nor
does it count, while such a request's prompt goes in by chunks (`chunk`: the step loop's
`prefill_chunk_tokens`), the prompt past what such a cache can hold at any mark of the prefill:
its `kept_behind` and one chunk, so a prompt many windows long counts about a window and a
chunk, not its length. (Its worst case, which decides whether it fits at all, stays
its whole length: a cache that loses it is sent every token again in one forward.)
A model with full layers too gives back only in its windowed layers' own pool
(engine/hybrid_cache.py), sized apart for `max_batch_size` requests at their widest forward
(`widest_forward`): the budget and this count are its full layers' pool, which holds everything.

That admits by what requests use, not by what they might (a chat without max_tokens may reach the
whole context). As requests grow the sum may pass the budget: then running requests are preempted
(`preempt`), the highest priority value first and the newest of it first, until it fits again:
their caches are freed, and they wait at the head of the queue with every token they have, to be
prefilled again (prompt + output, chunked; prefix caching may take part of it) when they fit.
Nothing is lost, the stream just pauses; a seeded request's random stream is untouched. A request
that could not fit alone at its worst is refused at once, so a request alone always fits: dense,
prompt + max_tokens + γ; paged, its need when it holds prompt + max_tokens tokens (never less than
its need at any step, so it also holds for a request whose max_tokens is below that headroom).
"""
from __future__ import annotations

from collections import deque

from . import model_runner
from .paged_cache import blocks_for
from .step import Sequence, decoding


def final_tokens(seq: Sequence) -> int:
    """The most tokens a request may come to hold: prompt + max_tokens, capped at the context."""
    return min(len(seq.prompt) + seq.params.max_tokens, seq.max_model_len)


def positions_needed(seq: Sequence, max_gamma: int) -> int:
    """Cache positions a request's slot may come to hold: its `final_tokens` + γ draft positions
    written past its last real token."""
    return final_tokens(seq) + max_gamma


def worst_positions(tokens: int, max_gamma: int, block_size: int | None = None) -> int:
    """The most positions the budget counts for a request that may come to hold `tokens` tokens:
    dense, its slot's (γ drafts past them); paged, its `Admission.need` then (a step's headroom
    past them, 2γ + 2, which a request near its end still writes: its verify row is as wide as
    the batch's)."""
    return tokens + (2 * max_gamma + 2 if block_size else max_gamma)


def widest_forward(prefill_chunk_tokens: int | None, max_gamma: int) -> int | None:
    """The most positions one forward of a request writes: a prompt chunk, or a step's verify and
    the drafts a pipelined ahead call writes past it (2γ + 3); None where prompts go in whole
    (as wide as the longest prompt)."""
    return max(prefill_chunk_tokens, 2 * max_gamma + 3) if prefill_chunk_tokens else None


def allocation(needs: list[int], block_size: int | None = None) -> int:
    """Token positions a cache allocates for requests needing these positions: a dense one
    (block_size None), or a paged one with blocks of block_size positions."""
    if block_size:
        return (1 + sum(blocks_for(n + 1, block_size) for n in needs)) * block_size if needs else 0
    return model_runner.allocation(len(needs), max(needs, default=0))


class Admission:
    """The waiting queue and the running batch of one engine or coordinator (request id -> Sequence)."""

    def __init__(self, max_batch_size: int, budget: int | None, max_gamma: int, block_size: int | None = None,
                 kept_behind: dict[str, int | None] | None = None, chunk: int | None = None) -> None:
        """kept_behind: per paged cache, by its mark ("target_len", "draft_len"), what it holds
        behind the mark at most (`ModelRunner.kept_behind`; None: everything); chunk: the most
        prompt tokens a cache takes in one forward (None: a whole prompt at once)."""
        self.max_batch_size = max_batch_size
        self.block_size = block_size  # the workers' paged caches' block (None: dense caches)
        self.kept_behind = dict(kept_behind or {})
        self.chunk = chunk or None
        self.budget = budget
        self.max_gamma = max_gamma
        self.waiting: deque[Sequence] = deque()
        self._waiting_ids: dict[str, Sequence] = {}  # the waiting requests by id (a lookup is O(1))
        self.running: dict[str, Sequence] = {}
        self._needs: dict[str, int] = {}  # running request id -> positions_needed

    def get(self, request_id: str) -> Sequence | None:
        """The request, running or waiting."""
        seq = self.running.get(request_id)
        return seq if seq is not None else self._waiting_ids.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def enqueue(self, seq: Sequence) -> None:
        """New requests wait FIFO within a priority, a lower one ahead of a higher; a continuation
        that already has output (its client is mid-stream) goes ahead of them, behind the ones
        like it that already wait. (Equal priorities append at once: no walk of the queue.)"""
        self._waiting_ids[seq.request_id] = seq
        if not seq.output:
            behind = len(self.waiting)  # before the new requests of a higher value, walking from the back
            while behind and not (last := self.waiting[behind - 1]).output and last.priority > seq.priority:
                behind -= 1
            self.waiting.insert(behind, seq)
            return
        ahead = 0
        while ahead < len(self.waiting) and self.waiting[ahead].output:
            ahead += 1
        self.waiting.insert(ahead, seq)

    def need(self, seq: Sequence) -> int:
        """Positions the budget counts for a request: dense, its worst case (the slot is sized
        for it); paged, what it holds now plus one step's headroom."""
        if self.block_size:  # (a pipelined step's ahead call drafts γ + 1 more past the verify's γ)
            return self.held(seq) + 2 * self.max_gamma + 2
        return positions_needed(seq, self.max_gamma)

    def held(self, seq: Sequence) -> int:
        """Paged: the most positions any cache of the request holds through its next forward. A
        cache that keeps everything holds all its tokens; one that gives back (`kept_behind`) holds
        those from `kept_behind` before its mark on (it has given back the rest, or will at its
        next forward), and while the prompt goes in by chunks, never more than `kept_behind` and a
        chunk (what it holds at any mark of the prefill: counted from the start, so that the
        count does not grow as the prefill goes on and preempt others)."""
        if not self.kept_behind or None in self.kept_behind.values():
            return seq.num_tokens
        chunked = self.chunk is not None and not decoding(seq)
        most = 0
        for mark, kept in self.kept_behind.items():
            held = seq.num_tokens - max(getattr(seq, mark) - kept, 0)
            most = max(most, min(held, kept + self.chunk) if chunked else held)
        return most

    def worst(self, seq: Sequence) -> int:
        """The most positions the budget may count for a request (`worst_positions`): never less
        than its `need` at any step."""
        return worst_positions(final_tokens(seq), self.max_gamma, self.block_size)

    def too_big(self, seq: Sequence) -> bool:
        """Whether the request could not fit the budget even alone, at its longest."""
        return self.budget is not None and allocation([self.worst(seq)], self.block_size) > self.budget

    def allocated(self) -> int:
        """Token positions the running batch may allocate on each worker (what the budget bounds)."""
        return allocation(list(self._needs.values()), self.block_size)

    def sizing(self) -> tuple[int, int]:
        """(running requests, the longest one's need): what a dense cache is sized by."""
        return len(self._needs), max(self._needs.values(), default=0)

    def fits_extra_slots(self, extra: int) -> bool:
        """Whether the running batch plus `extra` more cache slots, each as long as the longest
        running request's (a pipelined step's branch forks on the draft worker), stays within
        the budget."""
        if self.budget is None or extra <= 0:
            return True
        needs = list(self._needs.values())
        return allocation(needs + [max(needs, default=0)] * extra, self.block_size) <= self.budget

    def _fits(self, seq: Sequence) -> bool:
        if len(self.running) >= self.max_batch_size:
            return False
        return self.budget is None or allocation([*self._needs.values(), self.need(seq)], self.block_size) <= self.budget

    def fits_now(self, seq: Sequence) -> bool:
        """Whether the request would join the running batch at once (nobody waits ahead of it)."""
        return not self.waiting and self._fits(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the running batch, FIFO (no overtaking: a large request at the
        head waits rather than starve); returns those admitted."""
        self._refresh()
        admitted = []
        while self.waiting and self._fits(self.waiting[0]):
            seq = self.waiting.popleft()
            del self._waiting_ids[seq.request_id]
            self.running[seq.request_id] = seq
            self._needs[seq.request_id] = self.need(seq)
            admitted.append(seq)
        return admitted

    def preempt(self) -> list[Sequence]:
        """Paged caches: while the running requests' current needs pass the budget, move the least
        urgent (the highest priority value, the newest admitted of those) back to the head of the
        queue (the first moved last there, so they return in turn) -> those moved (the caller frees
        their caches). Nothing to do for dense caches (their needs never grow)."""
        if not self.block_size or self.budget is None:
            return []
        self._refresh()
        moved: list[Sequence] = []
        while len(self.running) > 1 and self.allocated() > self.budget:
            order = {r: i for i, r in enumerate(self.running)}  # admission order
            request_id = max(self.running, key=lambda r: (self.running[r].priority, order[r]))
            seq = self.running.pop(request_id)
            del self._needs[request_id]
            seq.target_len = seq.draft_len = 0
            seq.preempted = True
            moved.append(seq)
        for seq in moved:  # ahead of everything waiting: they were running before any of it arrived
            self.waiting.appendleft(seq)
            self._waiting_ids[seq.request_id] = seq
        return moved

    def _refresh(self) -> None:
        """Paged caches: the running requests' needs as of their tokens now."""
        if self.block_size:
            for request_id, seq in self.running.items():
                self._needs[request_id] = self.need(seq)

    def release(self, request_id: str) -> bool:
        """Forget a running request (finished or aborted); whether it was running (and so holds caches)."""
        self._needs.pop(request_id, None)
        return self.running.pop(request_id, None) is not None

    def drop_waiting(self, request_ids: set[str]) -> None:
        dropped = [r for r in request_ids if self._waiting_ids.pop(r, None) is not None]
        if dropped:  # (the queue is walked only when one of them waits)
            self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)
