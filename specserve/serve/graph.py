"""The step's worker calls on a Ray Compiled Graph (`speculation.transport: compiled_graph`).

A plain actor call costs a task submission, a scheduling round and an object-store round trip
each way (~1 ms on one node, far more on a loaded machine), and a speculative step makes two in
a row. A compiled graph is built once per worker pair:

    StepCall ─┬─► target.graph_solo ──(the call; a target-only step's StepReply)──┐  (in process)
              └─► draft.graph_propose ──(Reply: tokens [B, G], q of the rows that sample)──► target.graph_verify ──► StepReply
    (pipelined:)        └──► draft.graph_ahead ──(Reply without q)──► target.graph_join ◄──┘
                                                              (StepReply and the ahead's Reply, one output)

A step that verifies drafts runs in graph_verify, once the draft side's block has arrived. A
target-only step (the policy drafts nothing, no prepared block) is answered by graph_solo as soon
as the call arrives: the draft side's empty answer passes by off its critical path, so a replica
whose policy turned drafting off no longer waits for a draft process's wake-up in front of each
target forward. graph_verify then hands graph_solo's answer on. A graph loop's read spins a core
while it waits, so in a target-only step the draft side sleeps first, for the nap the coordinator
takes itself over the target's forward (`StepGraph.nap`, sent as StepCall.draft_nap_s;
docs/serving.md: an idle draft's spinning read cost a target-only graph ~9% on 2 cores). Where
the coordinator has SPIN_CORES cores or more, nobody naps: a spinning reader takes no core a
forward needs there, and sees its result sooner.

A replica whose steps keep drafting off changes its graph to the target's one-node graph
(`StepGraph.reshape`, decided by the coordinator's keeper): no draft actor then spins in a graph
read at all; a step with drafts (the policy's probe) goes on plain calls until the steps draft
again and the pair's graph is rebuilt.

The pipelined loop's graph has the ahead node: right after block k went to the target, the draft
drafts the step's AheadCall (block k+1) while the target verifies, keeps it with its q for the next
step's `Block`, and returns its token ids (serve/pipeline.py). graph_join puts both replies in one
output, so the coordinator reads one channel (and can look for it without taking it, `_wait`).

Each execution writes the step's inputs once into a shared-memory channel both workers read, the
draft's proposal goes to the target through a channel of its own (q never reaches the
coordinator), and the coordinator reads back the verdict with the drafts' token ids and timings
only. Every message crosses as one `bytes` written by serve/wire.py's lean codec (`pack` /
`unpack`): measured on one node, a StepCall holding a few small tensors cost ~3.5 ms more per
execution through the channels' own serialiser than pickled bytes, and torch's own pickling of a
tensor ~0.5 ms a message more than numpy's. A drafter that lives in the target worker (layer
skip, prompt lookup, feature head), or no drafter at all, makes a one-node graph
(`target.graph_step`).

What the graph does not change: the coordinator plans every step (`plan_step`) and applies every
verdict; the workers answer cache misses instead of results, and the coordinator moves its marks
back and executes again (the draft's and the target's writes are positional, so a repeated
execution rewrites what the first wrote). Prefill chunks, `free` and probes keep plain actor calls
(they are not the per-step hot path).

Failures: an exception raised inside a worker method comes back as the execution's result and
leaves the graph usable. Anything else (a dead or restarted worker, a missed deadline: an
execution cannot be cancelled, and the next one would read its late result) breaks the graph: it
is torn down in the background, the step is rerun on plain actor calls (whose recovery kills,
restarts and re-prefills as before), and the coordinator rebuilds the graph once both workers
answer again. When an execution passes the draft's share of its deadline, the coordinator asks
whether the draft is still in graph_propose (`DraftWorker.proposing`, which takes no lock: an
ahead call may rightly outlast that share); if so the draft is late, and the step goes
target-only as with plain calls. The workers serialise their methods with a lock, since a
compiled graph's loop runs beside the actor's ordinary calls (and a probe then tells a busy
worker from an idle one).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import time

from .wire import StepCall, StepReply, pack, unpack, unpack_pair

logger = logging.getLogger("specserve.graph")
_REBUILD_BACKOFF_S = (0.5, 2.0, 5.0, 15.0, 30.0)  # after the n-th failed build in a row
_GRACE_S = 1.0
_EXPECTED_SHARE = 0.9  # of an execution's expected seconds, slept before its result is read (StepGraph.nap)
_NAP_WINDOW = 32  # recent executions whose time in the workers sizes the nap
_POLL_S = 0.0003  # then between looks for the result (a look that finds nothing costs ~0.17 ms)
_WARM_UP_TIMEOUT_S = 60.0
# A reader spinning on its channel holds a core. With at least this many cores where it runs, that
# core is not one a forward needs, and a spinning reader sees its result sooner than one that naps
# and then looks every _POLL_S: there no one naps (`StepGraph.nap` is 0).
SPIN_CORES = 8


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        return os.cpu_count() or 1


class DraftLate(TimeoutError):
    """The draft side of an execution is still at work past its deadline."""


class StepGraph:
    """The compiled graph of one worker pair. `draft` is the DraftWorker actor, or None when the
    target worker drafts for itself (or nothing drafts).

    Every graph operation (compile, execute + wait, teardown) runs on one thread of its own, with
    Ray's synchronous API: a compile blocks for a second or more (it sets the workers' loops up
    with blocking calls), and on the coordinator's event loop that would stall every stream and
    make pending deadlines fire late; one thread also keeps the graph's non-thread-safe calls in
    order. An execution's write is the exception: it cannot block (see `run`), so it is made on the
    event loop, and a step pays one hand-off, the thread's wake-up of the loop with the result."""

    def __init__(self, target, draft=None, ahead: bool = False) -> None:
        self.target, self.draft = target, draft
        self.ahead = ahead and draft is not None  # a third node, draft.graph_ahead (the pipelined loop)
        self._pair = (draft, self.ahead)  # the pair's shape, which `reshape` goes back to
        self.reshapes = 0  # changes between the pair's graph and the target's alone
        self.reshaping = False  # torn down by `reshape`: rebuild without waiting (the keeper)
        self._dag = None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-graph")
        self._teardown: asyncio.Future | None = None
        self._failures = 0  # failed builds in a row
        self._next_try = 0.0  # time.monotonic() before which no rebuild is tried
        self.builds = 0
        self.breaks = 0
        self._took: collections.deque[float] = collections.deque(maxlen=_NAP_WINDOW)  # seconds in the workers / expected
        self.spins = usable_cores() >= SPIN_CORES  # readers spin rather than nap (SPIN_CORES)

    def nap(self, expected: float) -> float:
        """Seconds to sleep before looking for an execution's result (or, for the draft side of a
        target-only step, before answering: StepCall.draft_nap_s): `_EXPECTED_SHARE` of what the
        forwards waited for should take, scaled by how the recent executions' time in the workers
        compared to what was expected of them (the lower quartile of those ratios: predictions
        come from costs that may be stale or high, and a nap that ends after the result costs the
        step its overshoot). 0 before any execution was measured, and on a machine with cores to
        spare (`spins`)."""
        if expected <= 0 or not self._took or self.spins:
            return 0.0
        return _EXPECTED_SHARE * sorted(self._took)[len(self._took) // 4] * expected

    @property
    def ready(self) -> bool:
        return self._dag is not None

    @property
    def solo(self) -> bool:
        """Built (or to be built) as the target's one-node graph although a draft worker exists:
        it runs target-only steps; a step with drafts goes on plain calls."""
        return self._pair[0] is not None and self.draft is None

    def reshape(self, solo: bool) -> None:
        """Change to the target's one-node graph (solo) or back to the pair's: the graph in hand is
        torn down and the keeper builds the new shape at once (`reshaping`). An actor runs one
        compiled graph at a time, so this costs a teardown and a build (the workers' ordinary
        calls stall ~1-2 s). A replica whose policy keeps drafting off is worth one: an idle draft
        actor in the pair's graph still spins a core in its reads between naps."""
        if solo == self.solo:
            return
        self.draft, self.ahead = (None, False) if solo else self._pair
        self.reshapes += 1
        self.reshaping = True
        self.discard("reshaped to the target's graph alone" if solo else "reshaped to the pair's graph", broke=False)

    def build(self) -> None:
        """Compile the graph and run one empty execution through it (blocking: at start-up, or
        through `rebuild`). Right after a compile the first calls to the workers wait ~1-2 s
        (measured on one node): that is paid here, not in a request's deadline."""
        import ray
        from ray.dag import InputNode

        with InputNode() as call:
            if self.draft is None:
                out = self.target.graph_step.bind(call)
            else:
                solo = self.target.graph_solo.bind(call)  # a target-only step is answered here
                drafted = self.draft.graph_propose.bind(call)
                out = self.target.graph_verify.bind(drafted, solo)
                if self.ahead:  # bound to block k, so the draft runs it after graph_propose, beside the verify
                    out = self.target.graph_join.bind(out, self.draft.graph_ahead.bind(drafted))
        dag = None
        try:
            dag = out.experimental_compile()
            _execute(dag, pack(StepCall([], 0, None, None, [], None, None, None)), _WARM_UP_TIMEOUT_S)
            ray.get([self.target.ready.remote()] + ([self.draft.ready.remote()] if self.draft is not None else []),
                    timeout=_WARM_UP_TIMEOUT_S)
        except Exception:
            if dag is not None:
                _teardown(dag)
            self._failures += 1
            self._next_try = time.monotonic() + _REBUILD_BACKOFF_S[min(self._failures, len(_REBUILD_BACKOFF_S)) - 1]
            raise
        self._dag = dag
        self._failures = 0
        self.builds += 1
        self.reshaping = False

    async def rebuild(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.build)

    def may_rebuild(self) -> bool:
        """Whether a rebuild may be tried now (not while the old graph is still being torn down,
        and not before the back-off after a failed build)."""
        done = self._teardown is None or self._teardown.done()
        return self._dag is None and done and time.monotonic() >= self._next_try

    async def run(self, call: StepCall, draft_timeout: float, target_timeout: float, draft_busy=None,
                  ahead_timeout: float = 0.0, expected: float = 0.0) -> StepReply:
        """One execution within draft_timeout + max(target_timeout, ahead_timeout) seconds (the
        ahead call runs beside the verify); `expected`: the seconds its forwards should take by the
        measured costs (the ahead call's included), which size the nap before the result is read
        (`nap`). When `draft_busy` is given and the draft's share has passed, it is asked whether
        the draft side is still proposing: then the draft is late (DraftLate). An exception raised by a worker method is re-raised with the
        graph kept; any other failure breaks the graph, then re-raises."""
        from ray.exceptions import RayTaskError

        total = draft_timeout + max(target_timeout, ahead_timeout)
        try:
            # The write happens here, on the event loop: it returns at once, because the workers
            # read every execution's input before answering it, and the last execution was answered
            # (or the graph was discarded). Only the wait goes to the graph's thread.
            nap = self.nap(expected)
            work = asyncio.get_running_loop().run_in_executor(self._thread, _wait, self._dag.execute(pack(call)), total,
                                                              nap)
            if draft_busy is not None:
                done, _ = await asyncio.wait({work}, timeout=draft_timeout)
                if not done and await draft_busy():
                    raise DraftLate(f"the draft side missed its {draft_timeout:.1f} s deadline")
            if not work.done():  # the thread's own wait ends at `total`; this guards against a stuck thread
                await asyncio.wait_for(asyncio.shield(work), timeout=total + _GRACE_S)
            reply = step_reply(work.result(), self.ahead)
            if expected > 0 and reply.verdict is not None:  # (an answer of cache misses ran no forward)
                self._took.append(_in_workers(reply) / expected)
            return reply
        except RayTaskError:
            raise
        except BaseException as err:
            self.discard(err)
            raise

    def discard(self, why: BaseException | str, broke: bool = True) -> None:
        """Tear the graph down in the background, on the graph's thread (after the wait in
        progress there, if any, has ended). broke=False: a `reshape`, not a failure."""
        if self._dag is None:
            return
        dag, self._dag = self._dag, None
        self.breaks += broke
        logger.log(logging.WARNING if broke else logging.INFO,
                   "compiled graph %s (%s): plain actor calls until it is rebuilt", "broken" if broke else "torn down",
                   why if isinstance(why, str) else type(why).__name__)
        self._teardown = asyncio.get_running_loop().run_in_executor(self._thread, _teardown, dag)


def _in_workers(reply: StepReply) -> float:
    """An execution's seconds in the worker methods on its critical path: the draft side's
    propose, then the longer of the verify and the ahead call beside it."""
    ahead = getattr(reply.ahead, "seconds", 0.0) if reply.ahead is not None else 0.0
    return reply.draft_seconds + max(reply.target_seconds, ahead)


def step_reply(out: bytes, joined: bool = False) -> StepReply:
    """An execution's output: the target's StepReply, with the ahead node's Reply when the graph
    has one (`joined`: the pipelined graph's `graph_join`)."""
    if not joined:
        return unpack(out)
    reply, ahead = unpack_pair(out)
    return dataclasses.replace(reply, ahead=ahead)


def _execute(dag, packed: bytes, timeout: float) -> bytes:
    return _wait(dag.execute(packed), timeout)


def _wait(ref, timeout: float, nap: float = 0.0) -> bytes:
    """An execution's output within `timeout` seconds. A compiled graph's reader spins on its
    channel while it waits, a whole core that a machine with few cores takes from the workers'
    forwards (measured on 2 cores: a worker's 2-thread matmul loop took twice as long while the
    driver blocked in get()). So the wait first sleeps `nap` seconds (StepGraph.nap), then looks
    for the result every `_POLL_S` (a look that finds nothing reads nothing: the graph has one
    output channel, see `build`)."""
    ends = time.monotonic() + timeout
    if nap > 0:
        time.sleep(min(nap, timeout))
    poll = getattr(getattr(ref, "_dag", None), "_execute_until", None)
    if poll is not None and nap > 0:
        from ray.exceptions import RayChannelTimeoutError

        while time.monotonic() < ends:
            try:
                poll(ref._execution_index, ref._channel_index, 0)  # the result is cached for get()
                break
            except RayChannelTimeoutError:
                time.sleep(_POLL_S)
    return ref.get(timeout=max(ends - time.monotonic(), 0.0))


def _teardown(dag) -> None:
    try:
        dag.teardown()
    except Exception as err:  # its actors may be dead already
        logger.info("compiled graph teardown: %s", err)
