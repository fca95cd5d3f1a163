"""DraftWorker / TargetWorker: Ray actors holding one model and its KV caches, keyed by request id.

Thin adapters around `DraftModelProposer` / `TargetVerifier`. A call whose rows start past what a
worker's cache holds (a new worker, a restarted one) is answered with `Reply.misses` (every such
request and its valid length) instead of a result: the coordinator resends those rows from there,
which rebuilds the caches from the tokens it holds. (A raised `CacheMiss` is caught and reported
the same way: its constructor signature does not survive Ray's exception pickling.)

Test-only fault injection: with the environment variable SPECSERVE_FAULTS_DIR set (the tests set it
before Ray starts; nothing else does), a file `<dir>/<app>.<method>` holding "hang N", "raise N" or "slow N"
makes the next N `verify` / `propose` / `prefill` calls of that Serve application's workers hang (until the
coordinator kills the worker) or raise; "slow N" delays them 2 s. The count lives in the file, so it survives a restart.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from specserve.config import ColocatedDrafter, FeatureDrafter, ModelSource, PlantedAcceptance
from specserve.engine import CacheMiss, DraftModelProposer, Proposal, RowInput, TargetVerifier
from specserve.engine.planted import PlantedProposer, read_references
from specserve.engine.proposers import branch_id
from specserve.engine.engine import capture_graphs, kept_behind, model_eos_ids, page_runners
from specserve.engine.grammar import WIDE_SHARE, GrammarBook
from specserve.engine.step import empty_proposal, verified_counts
from specserve.engine.verifier import prompt_logprobs
from specserve.engine.sampling import BatchSampling

from .wire import (AheadCall, Block, Reply, RowsProbs, SharedProbs, StepCall, StepReply, fast_tensor_pickling, light,
                   pack, pack_pair, q_needed, shared_q, unpack)
from . import placed_q
from .pipeline import branch_points, branch_sampling, combine_drafts, with_corrections
from .placed_q import Outbox


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_model_len: int | None
    eos_token_ids: frozenset[int]
    dtype: str = "float32"  # of the model's weights: a draft worker sends q in it where it is 16-bit


@dataclass(frozen=True)
class TokenizerSource:
    """Where a worker finds the model's tokenizer, for structured output (grammar masks): loaded
    at the first request with a grammar (`models.loading.load_tokenizer`)."""

    source: ModelSource  # the target's
    directory: str | None = None  # the app's `tokenizer` setting

    def book(self, vocab_size: int, eos_token_ids) -> GrammarBook:
        def load():
            from specserve.models.loading import load_tokenizer

            return load_tokenizer(self.source, self.directory)
        return GrammarBook(load, vocab_size, eos_token_ids)


logger = logging.getLogger(__name__)
_FAULTS_DIR = os.environ.get("SPECSERVE_FAULTS_DIR")
_PULL_TIMEOUT_S = 10.0  # a feature head's pull of target features (the target is idle then: a fresh propose)


def _serialised(method):
    """Run the method under the worker's lock: a compiled graph's loop (serve/graph.py) runs
    beside the actor's ordinary calls, and both touch the same model and caches."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            self._threads_here()
            return method(self, *args, **kwargs)
    return locked


class _Worker:
    def __init__(self, torch_threads: int | None) -> None:
        fast_tensor_pickling()  # replies carry tensors (draft tokens, features)
        self._lock = threading.RLock()
        # the draft side of a compiled step graph (DraftWorker.graph_propose / graph_ahead)
        self._proposing = False  # inside graph_propose (waiting for the lock included)
        self._step: tuple[StepCall, Proposal | None] | None = None  # the last graph_propose: call, block k
        self._aheads: dict[int, _Held] = {}  # ahead id -> what its call drafted (q included); the last two
        self._branches: dict[str, str] = {}  # branch cache name -> its request (a branch lives one step)
        self._torch_threads = torch_threads
        self._thread_state = threading.local()
        self._threads_here()

    def _threads_here(self) -> None:
        """Give torch `torch_threads` threads in the calling thread, once per thread. Ray runs a
        compiled graph's loop on a thread of its own, where the BLAS kernels otherwise keep the
        process's OMP_NUM_THREADS (1 under Ray) although torch.get_num_threads() reports the
        setting: measured on 2 cores, a 1024² matmul took twice as long on the graph's thread."""
        if self._torch_threads and not getattr(self._thread_state, "done", False):
            torch.set_num_threads(self._torch_threads)
            self._thread_state.done = True

    @staticmethod
    def _injected_fault(method: str) -> None:
        """Test-only (see the module docstring): hang or raise if a fault file says so."""
        if not _FAULTS_DIR:
            return
        name = ray.get_runtime_context().get_actor_name() or ""
        path = Path(_FAULTS_DIR) / f"{name.split(':')[0]}.{method}"
        try:
            kind, count = path.read_text().split()
        except (FileNotFoundError, ValueError):
            return
        if int(count) <= 0:
            return
        path.write_text(f"{kind} {int(count) - 1}")
        if kind == "slow":  # late, then answers as usual
            time.sleep(2.0)
            return
        if kind == "hang":
            time.sleep(3600)
        raise RuntimeError(f"injected fault in {method}")

    @staticmethod
    def _misses(rows: list[RowInput], holder) -> dict[str, int]:
        valid = {r.request_id: holder.valid_length(r.request_id) for r in rows}
        return {r.request_id: valid[r.request_id] for r in rows if r.start > valid[r.request_id]}

    @_serialised
    def _run(self, rows: list[RowInput], call, holder=None) -> Reply:
        """Run call() unless a row starts past what `holder` (default: this worker's model) caches."""
        began = time.perf_counter()
        misses = self._misses(rows, self.model if holder is None else holder)
        if misses:
            return Reply(None, time.perf_counter() - began, misses)
        try:
            result = call()
        except CacheMiss as miss:
            return Reply(None, time.perf_counter() - began, {miss.request_id: miss.valid_length})
        _device_done()
        return Reply(result, time.perf_counter() - began)

    @_serialised
    def free(self, request_ids: list[str]) -> None:
        _free(self.model, request_ids)

    @_serialised
    def num_cached(self) -> int:
        return self.model.runner.num_cached()

    @_serialised
    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def memory(self) -> dict[str, int]:
        """This process's resident memory, the bytes its KV-cache storage holds and, on a GPU, what
        its CUDA allocator holds now and at most (for stats / soak / bench serve-gpu)."""
        cache = self.model.runner.cache
        out = {"rss_bytes": _rss_bytes(), "kv_cache_bytes": cache.memory_bytes()}
        if getattr(cache, "paged", False):  # blocks of the pool in use (the scratch block included) and in all
            out.update(kv_blocks_used=cache.allocated()[0], kv_blocks_total=cache.num_blocks)
        if getattr(cache, "hybrid", False):  # (the windowed layers' own pool: engine/hybrid_cache.py)
            out.update(kv_window_blocks_used=cache.window_allocated()[0], kv_window_blocks_total=cache.num_window_blocks)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out.update(cuda_allocated_bytes=torch.cuda.memory_allocated(),
                       cuda_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                       cuda_reserved_bytes=torch.cuda.memory_reserved())
        return out

    @_serialised
    def time_forwards(self) -> list:
        """ForwardTimings of a few dummy forwards, so the coordinator's γ policy starts measured."""
        return self.model.runner.time_forwards()

    @_serialised
    def capture_graphs(self, max_batch_size: int, max_gamma: int, budget: int | None = None) -> float:
        """Capture this worker's CUDA graphs of the usual step shapes now, before any request, a
        dense cache first sized up front where it fits `budget` positions and the device
        (`engine.capture_graphs`; nothing unless a runner is in graph mode) -> seconds spent.
        Shapes met later (longer contexts, draft loops that filter, a cache that grew) are captured then."""
        verifier, proposer = self._graph_sides()
        seconds = capture_graphs(verifier, proposer, max_batch_size, max_gamma, progress=False, budget=budget)
        for runner in self._growing():
            logger.warning(
                "CUDA graphs over a dense KV cache that was not sized up front (%s): it grows as requests join "
                "(to the longest one's worst case), and every growth drops the captured graphs, which are captured "
                "again inside requests. State max_model_len (it must fit max_cached_tokens and half the free "
                "GPU memory), or page the cache (kv_block_size).",
                "max_model_len not stated" if runner.stated_max_model_len is None else "it did not fit")
        return seconds

    def caches(self) -> tuple[bool, dict[str, int | None]]:
        """Whether a runner here replays CUDA graphs over a dense cache not sized for the whole
        context up front (the coordinator then has it sized as requests join: `reserve`), and per
        paged cache, by the mark admission reads it at, what it keeps behind it (`engine.kept_behind`)."""
        return bool(self._growing()), kept_behind(*self._graph_sides())

    @_serialised
    def reserve(self, num_requests: int, longest: int, budget: int | None) -> None:
        """The coordinator's running batch changed its sizing: size the growing dense caches for
        `num_requests` requests of at most `longest` positions now (`ModelRunner.reserve_ahead`),
        so that they grow as requests join, not in the middle of their decoding."""
        for runner in self._growing():
            runner.reserve_ahead(num_requests, longest, budget)

    def _growing(self) -> list:
        """This worker's graph-mode runners over dense caches not sized up front."""
        runners = [getattr(side, "runner", None) for side in self._graph_sides()]
        return [r for r in runners if r is not None and r.graphs is not None and not r.paged and not r.sized_up_front]

    def _graph_sides(self) -> tuple:
        """(the verifier, the proposer) this worker holds, None for a side it does not."""
        raise NotImplementedError

    def _propose_step(self, call: StepCall, alternates: bool = False) -> Reply:
        if call.gamma == 0:
            return Reply(empty_proposal(len(call.draft_rows)), 0.0)
        sampling = call.sampling if call.draft_sampling is None else call.draft_sampling
        if alternates:  # runner-ups for the ahead call's branches (DraftWorker only)
            return self.propose(call.draft_rows, call.gamma, sampling, call.draft_uniforms, alternates=True)
        return self.propose(call.draft_rows, call.gamma, sampling, call.draft_uniforms)

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex id), for placement checks."""
        return ray.get_runtime_context().get_node_id()


class TargetWorker(_Worker):
    """The target's verifier, and optionally a drafter that lives beside it (layer skip shares the
    target's weights; prompt lookup needs no model): the `proposer_*` methods serve that drafter."""

    def __init__(self, source: ModelSource, max_model_len: int | None, torch_threads: int | None = None,
                 drafter: ColocatedDrafter | None = None, execution: str = "auto",
                 tokenizer: TokenizerSource | None = None, kv: tuple = (None, None, False),
                 wide_share: float | None = WIDE_SHARE) -> None:
        super().__init__(torch_threads)
        from specserve.models.loading import load_target

        self.model = TargetVerifier(load_target(source, _assigned_gpus()), max_model_len, execution)
        eos = model_eos_ids(self.model.runner.model)
        dtype = str(next(self.model.runner.model.parameters()).dtype).removeprefix("torch.")
        self.info_ = ModelInfo(self.model.vocab_size, self.model.runner.max_model_len, frozenset(eos), dtype)
        here = drafter is not None and getattr(drafter, "worker", "target") == "target"
        self.proposer = drafter.engine_spec().build(
            self.model.runner.model, self.model.vocab_size, max_model_len) if here else None
        if hasattr(self.proposer, "attach_target"):  # a feature drafter reads the target's hidden states
            self.proposer.attach_target(self.model.runner)
        # a feature head on the draft worker pulls this target's features from here (`features`)
        self.feature_server = drafter.engine_spec().server(self.model.runner) if drafter and not here else None
        # kv: `AppConfig.worker_kv`: paged caches for the target and a colocated drafter's model (else dense)
        page_runners([self.model.runner, getattr(self.proposer, "runner", None)], *kv)
        if tokenizer is not None:  # one book for the verifier and a colocated drafter that masks
            book = self.model.grammar = tokenizer.book(self.model.vocab_size, eos)
            if hasattr(self.proposer, "grammar"):
                self.proposer.grammar = book
        if hasattr(self.proposer, "wide_share"):  # (speculation.grammar_wide_share)
            self.proposer.wide_share = wide_share

    @_serialised
    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None,
        share_probs: bool = False, num_draft: torch.Tensor | None = None,
    ) -> Reply:
        """share_probs: q goes to the object store (`SharedProbs`), not into the reply; only the
        part the rule reads, given num_draft [B], the drafts each row will verify."""
        self._injected_fault("propose")
        return self._run(rows, lambda: shared_q(self.proposer.propose(rows, num_tokens, sampling, uniforms),
                                               sampling, share_probs, num_draft), self.proposer)

    @_serialised
    def proposer_prefill(self, rows: list[RowInput]) -> Reply:
        return self._run(rows, lambda: self.proposer.prefill(rows), self.proposer)

    @_serialised
    def proposer_free(self, request_ids: list[str]) -> None:
        _free(self.proposer, request_ids)

    @_serialised
    def proposer_num_cached(self) -> int:
        return self.proposer.num_cached()

    def proposer_max_positions(self) -> int | None:
        return self.proposer.max_model_len

    @_serialised
    def proposer_time_forwards(self) -> list:
        runner = getattr(self.proposer, "runner", None)
        return runner.time_forwards() if runner is not None else []

    def _graph_sides(self) -> tuple:
        return self.model, self.proposer  # (a colocated drafter, or None)

    def info(self) -> ModelInfo:
        return self.info_

    @_serialised
    def features(self, wants: dict[str, tuple[int, int]]) -> dict[str, tuple[int, torch.Tensor]]:
        """For a feature head on the draft worker: {request id: (start, end)} -> {request id:
        (start, features [n, F])} of the committed positions held (FeatureServer.read)."""
        return self.feature_server.read(wants) if self.feature_server is not None else {}

    @_serialised
    def prompt_logprobs(self, tokens: list[int], k: int) -> list:
        """Each prompt token's log-probability and k alternatives (engine.verifier.prompt_logprobs),
        for `echo` with `logprobs`: one forward of its own, between steps; no cache touched."""
        return prompt_logprobs(self.model.runner.model, tokens, k, self.model.vocab_size)

    @_serialised
    def prefill(self, rows: list[RowInput]) -> Reply:
        """Cache a step's prompt chunks (no logits); misses as for verify. Result: {request id:
        prompt tokens taken from shared blocks so far} for the rows that took any."""
        self._injected_fault("prefill")

        def prefill() -> dict[str, int]:
            self.model.prefill(rows)
            cached = self.model.runner.cached_tokens
            return {r.request_id: cached[r.request_id] for r in rows if r.request_id in cached}
        return self._run(rows, prefill)

    @_serialised
    def verify(
        self,
        rows: list[RowInput],
        draft_tokens: torch.Tensor,  # [B, G]
        draft_probs: torch.Tensor | None,  # [B, G, V]
        num_draft: torch.Tensor,  # [B]
        sampling: BatchSampling,
        accept_uniforms: torch.Tensor | None,  # [B, G]
        final_uniforms: torch.Tensor | None,  # [B]
    ) -> Reply:
        self._injected_fault("verify")
        if isinstance(draft_probs, (SharedProbs, RowsProbs)):  # the rows that sample, from the store or the graph
            draft_probs = draft_probs.resolve(draft_tokens, device=self.model.runner.device)
        return self._run(rows, lambda: self.model.verify(
            rows, draft_tokens, draft_probs, num_draft, sampling, accept_uniforms, final_uniforms))

    def q_accept(self, probe: tuple) -> bool:
        """The placement handshake: whether this worker reads the draft worker's probe exactly
        (`placed_q.accept`: the same GPU or host, its buffer opened here). Takes no lock."""
        return placed_q.accept(probe, self.model.runner.device)

    @_serialised
    def graph_solo(self, packed: bytes) -> tuple[StepCall, bytes | None]:
        """The target's first node of a worker pair's step graph: StepCall -> (the call, the
        packed StepReply of a target-only step, or None for a step that verifies drafts). A
        target-only step (no drafts, no prepared block) runs here at once, so it does not wait
        for the draft side's empty answer, which meanwhile passes by off its critical path. The
        output stays in this process (an intra-process channel: never serialised)."""
        call = unpack(packed)
        if call.gamma or call.block is not None:
            return call, None
        return call, pack(self._verify_step(self._propose_step(call), call))

    @_serialised
    def graph_verify(self, drafted: bytes, solo: tuple[StepCall, bytes | None]) -> bytes:
        """The target's node after the draft side's: (draft side's Reply, graph_solo's output) ->
        StepReply, pickled. Verifies the proposal the draft side sent here directly (q included)
        unless the draft side missed or graph_solo already answered the step; the coordinator
        gets it back without q."""
        call, answered = solo
        if answered is not None:
            return answered
        return pack(self._verify_step(unpack(drafted), call))

    def graph_join(self, verified: bytes, ahead: bytes) -> bytes:
        """The last node of a pipelined step graph: the verdict and the ahead call's reply as one
        output, so the coordinator reads one channel (`wire.pack_pair`)."""
        return pack_pair(verified, ahead)

    @_serialised
    def graph_step(self, packed: bytes) -> bytes:
        """The one node of the step graph of a target worker that drafts for itself (colocated
        drafter) or has no drafter: propose, then verify."""
        call = unpack(packed)
        return pack(self._verify_step(self._propose_step(call), call))

    @_serialised
    def fused_step(self, call: StepCall) -> Reply:
        """A colocated drafter's whole step as one plain actor call: propose, then verify what was
        proposed (two calls would pay the round trip twice). Result: a StepReply without q; the
        proposer's misses come back as `draft_misses`, the target's as `misses`."""
        began = time.perf_counter()
        step = self._verify_step(self._propose_step(call), call)
        if step.draft_misses or step.target_misses:
            return Reply(None, time.perf_counter() - began, step.target_misses, step.draft_misses)
        return Reply(step, time.perf_counter() - began)

    def _verify_step(self, drafted: Reply, call: StepCall) -> StepReply:
        if not call.target_rows:  # the graph's warm-up execution
            return StepReply(None, None, {}, {}, 0.0, 0.0)
        if drafted.misses:
            return StepReply(None, None, drafted.misses, {}, drafted.seconds, 0.0)
        proposal = drafted.result
        reply = self.verify(call.target_rows, proposal.tokens, proposal.probs,
                            verified_counts(call.num_draft, proposal), call.sampling, call.accept_uniforms,
                            call.final_uniforms)
        return StepReply(light(proposal), reply.result, {}, reply.misses, drafted.seconds, reply.seconds)


class DraftWorker(_Worker):
    """A draft model, or (`feature_head`, with `source` the target's) a feature head that pulls
    the target's features from `target` (its TargetWorker) before each fresh propose."""

    target = None  # the TargetWorker a feature head pulls from (None: a draft model)

    def __init__(self, source: ModelSource, vocab_size: int, max_model_len: int | None,
                 torch_threads: int | None = None, execution: str = "auto",
                 feature_head: FeatureDrafter | None = None, target=None,
                 planted: PlantedAcceptance | None = None, tokenizer: TokenizerSource | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), kv: tuple = (None, None, False),
                 q_dtype: str = "float32", wide_share: float | None = WIDE_SHARE) -> None:
        """q_dtype: what q crosses to the target in (its weights' dtype where that is 16-bit:
        half the bytes; the drafts are drawn from q so rounded, `sampling.q_to_send`)."""
        super().__init__(torch_threads)
        from specserve.models.loading import load_draft, load_target_io

        self.target = target
        if planted is not None:  # benchmarks: acceptance planted in the draft model's proposals
            self.model = PlantedProposer(load_draft(source, _assigned_gpus()), vocab_size, planted.alpha,
                                         read_references(planted.references), planted.seed, planted.second,
                                         max_model_len, execution)
        elif feature_head is None:
            self.model = DraftModelProposer(load_draft(source, _assigned_gpus()), vocab_size, max_model_len,
                                            execution)
        else:
            self.model = feature_head.engine_spec().build(load_target_io(source, _assigned_gpus()), vocab_size,
                                                          max_model_len, pulled=True)
        page_runners([getattr(self.model, "runner", None)], *kv)
        self.model.q_dtype = getattr(torch, q_dtype)  # (before any loop is captured)
        if tokenizer is not None and hasattr(self.model, "grammar"):  # a draft model masks grammar rows' drafts
            self.model.grammar = tokenizer.book(vocab_size, eos_token_ids)
        self.model.wide_share = wide_share  # (speculation.grammar_wide_share; every draft model proposer has it)
        self._outbox = Outbox()  # q placed for the target to read in place (`placed_q`) ...
        self._placing = False  # ... once the handshake said it can (`q_placed`)
        self._probe = Outbox()  # the handshake's probe (not the ring: only proposes write that)

    @_serialised
    def q_offer(self) -> tuple | None:
        """The placement handshake's probe (`placed_q.offer`); None where q cannot be placed
        from this worker's device."""
        try:
            return placed_q.offer(self._probe, self.model.runner.device)
        except Exception as err:
            logger.info("q is not placed for the target (%s: %s)", type(err).__name__, err)
            return None

    @_serialised
    def q_placed(self, placing: bool) -> None:
        """Whether q goes to the target placed (the target read the probe) or through the host."""
        self._placing = placing
        self._probe.close()
        if not placing:
            self._outbox.close()

    def _placed_to(self) -> Outbox | None:
        return self._outbox if self._placing else None

    def _graph_sides(self) -> tuple:
        return None, self.model

    def _pull_features(self, rows: list[RowInput]) -> None:
        """A feature head's missing target features for these rows' committed tokens, from the
        target worker (one call; nothing when none is missing or this drafts from a model). A
        failed pull leaves them missing: those rows draft copies, which are rejected (lossless)."""
        wants = self.model.features_wanted(rows) if self.target is not None else None
        if not wants:
            return
        try:
            self.model.put_features(ray.get(self.target.features.remote(wants), timeout=_PULL_TIMEOUT_S))
        except Exception as err:  # the target restarting or gone: its recovery is the coordinator's
            logger.warning("feature pull failed (%s): drafting without them this step", type(err).__name__)

    def free(self, request_ids: list[str]) -> None:
        with self._lock:
            gone = set(request_ids)
            self._drop_branches([b for b, rid in self._branches.items() if rid in gone])
            super().free(request_ids)

    def num_cached(self) -> int:
        with self._lock:
            return self.model.runner.num_cached() - len(self._branches)

    def proposing(self) -> bool:
        """Whether graph_propose is running (the coordinator's late-draft probe; takes no lock, so
        it answers while an ahead call, which may rightly outlast the draft's deadline, runs)."""
        return self._proposing

    def graph_propose(self, packed: bytes) -> bytes:
        """The draft side's first node of the compiled step graph: StepCall -> Reply with block k
        (none, at once, for a target-only step), both pickled (serve/graph.py). A pipelined step's
        block is assembled from the rows' prepared drafts and this call's fresh ones. A step
        that drafts nothing sleeps `draft_nap_s` first, through the target's forward: after
        answering, the graph's loop would spin in its read of the next step (on few cores, a
        core taken from the target)."""
        call = unpack(packed)
        if call.draft_nap_s > 0 and not call.gamma and call.block is None:
            time.sleep(call.draft_nap_s)
        self._proposing = True
        try:
            with self._lock:
                self._threads_here()
                held = self._adopt(call.block)
                reply = self._propose_step(call, alternates=self._branching(call.ahead))
                if reply.result is not None and held is not None:
                    reply = Reply(self._assemble(call.block, held, reply.result), reply.seconds)
                self._step = (call, reply.result)
                return pack(q_needed(reply, call, self._placed_to()))
        finally:
            self._proposing = False

    def _branching(self, ahead: AheadCall | None) -> bool:
        """Whether this step's ahead call drafts branches (then block k needs its runner-ups)."""
        return ahead is not None and ahead.branches > 0 and self.model.can_branch and ahead.sampling.all_greedy

    def _adopt(self, block: Block | None) -> _Held | None:
        """Before a step: the prepared block it uses (None: none). What each used branch drafted
        is copied into its request's cache, and every branch (a branch lives one step) is freed."""
        held = None if block is None else self._aheads.get(block.prepared_id)
        if block is not None and held is None:
            raise RuntimeError(f"prepared block {block.prepared_id} is not held here")
        used = ({held.branches[row] for row in block.rows if row is not None} - {None}) if block else set()
        if used - set(self._branches):
            raise RuntimeError(f"branches {sorted(used - set(self._branches))} of block {block.prepared_id} "
                               "are not held here")
        for name in reversed(list(self._branches)):  # newest first: each is the last live slot
            owner = self._branches.pop(name)
            if name in used:
                self.model.adopt(name, owner)
            else:
                self.model.free(name)
        return held

    def _drop_branches(self, names: list[str]) -> None:
        for name in reversed(names):  # newest first: each is the last live slot
            self._branches.pop(name, None)
            self.model.free(name)

    @staticmethod
    def _assemble(block: Block, held: _Held, fresh: Proposal) -> Proposal:
        """Block k from the held rows block.rows names and this step's fresh drafts."""
        prepared = held.proposal
        probs = None if prepared.probs is None else prepared.probs[:, 1:]
        tokens, probs = combine_drafts(block.rows, block.width, (prepared.tokens[:, 1:], probs),
                                       (fresh.tokens, fresh.probs))
        alternates = None  # runner-ups: when every row has them (the fresh part only if it has rows)
        if prepared.alternates is not None and (fresh.alternates is not None or None not in block.rows):
            alternates = combine_drafts(block.rows, block.width, (prepared.alternates[:, 1:], None),
                                        (fresh.alternates, None))[0]
        return Proposal(tokens, probs, fresh.forwards, alternates=alternates)

    @_serialised
    def graph_ahead(self, drafted: bytes) -> bytes:
        """The draft side's second node (pipelined graphs): after block k went to the target, draft
        the step's AheadCall from block k's last drafts, keep it (q included) for the next step's
        block, and return it without q. `drafted` (graph_propose's output) only orders this node
        after it; block k and its call are the ones graph_propose kept, not unpickled again. With
        branches (greedy rows, a draft model) the same forwards draft from forks of the rows'
        caches at their first rejection points too, appended after the B rows (`_fork`); every
        drafted row comes back as [the token before its block k+1, block k+1]. None when there is
        no ahead call (or block k missed); a Reply without result or misses when a row's block k
        holds a stop token (no ahead then)."""
        call, block = self._step or (None, None)
        self._step = None
        if call is None or call.ahead is None or block is None:
            return pack(None)
        ahead, drafts = call.ahead, block.tokens.tolist()  # [B][G]
        rows = []
        for row, g, stops, own in zip(ahead.rows, ahead.num_draft, ahead.stop_ids, drafts):
            if any(t in stops for t in own[:g]):
                return pack(Reply(None, 0.0))
            rows.append(row if g == 0 else RowInput(row.request_id, row.start, [own[g - 1]]))
        branching = self._branching(ahead)
        forks = self._fork(ahead, block) if branching and block.alternates is not None else []
        reply = self.propose(rows + [row for _, row in forks], ahead.num_tokens, branch_sampling(ahead, forks),
                             ahead.uniforms, pull_features=False, alternates=branching)
        if reply.result is None:
            self._drop_branches([name for name, _ in forks])
            return pack(reply)
        drafted = with_corrections(reply.result, len(rows), [row.tokens[0] for _, row in forks])
        self._aheads[ahead.ahead_id] = _Held(drafted, [None] * len(rows) + [name for name, _ in forks])
        for old in sorted(self._aheads)[:-2]:
            del self._aheads[old]
        return pack(Reply(light(drafted), reply.seconds))

    def _fork(self, ahead: AheadCall, block: Proposal) -> list[tuple[str, RowInput]]:
        """The ahead call's branch rows (`branch_points`, in order): each a fork of its request's
        cache up to its rejection point, fed the draft's runner-up there. -> [(cache name, row)]."""
        runner_ups = block.alternates.tolist()  # [B][G]
        forks = []
        try:
            for b, i in branch_points(ahead.num_draft, ahead.branches):
                row = ahead.rows[b]
                name = branch_id(row.request_id, i)
                at = row.start - ahead.num_draft[b] + i  # the row's tokens and its first i - 1 drafts
                self.model.fork(row.request_id, name, at)
                self._branches[name] = row.request_id
                forks.append((name, RowInput(name, at, [runner_ups[b][i - 1]])))
        except CacheMiss:  # the request's cache lags (not expected): no branches this step, all or none
            self._drop_branches([name for name, _ in forks])
            return []
        return forks

    def max_model_len(self) -> int | None:
        return self.model.runner.max_model_len

    @_serialised
    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None,
        share_probs: bool = False, num_draft: torch.Tensor | None = None, pull_features: bool = True,
        alternates: bool = False,
    ) -> Reply:
        """share_probs: q goes to the object store (`SharedProbs`), not into the reply; only the
        part the rule reads, given num_draft [B], the drafts each row will verify.
        pull_features=False: an ahead block (pipelined), drafted while the target verifies: its
        rows run past the committed tokens, so the target has nothing more to give yet.
        alternates: each draft's runner-up too (a draft model's greedy rows; pipelined branches)."""
        self._injected_fault("propose")

        def call() -> Proposal:
            if pull_features:
                self._pull_features(rows)
            if alternates:
                return self.model.propose(rows, num_tokens, sampling, uniforms, alternates=True)
            return shared_q(self.model.propose(rows, num_tokens, sampling, uniforms), sampling, share_probs,
                           num_draft, self._placed_to())
        return self._run(rows, call)

    @_serialised
    def prefill(self, rows: list[RowInput]) -> Reply:
        """Cache a step's prompt chunks in the draft's slots (no logits); misses as for propose."""
        self._injected_fault("prefill")
        return self._run(rows, lambda: self.model.prefill(rows))


@dataclass
class _Held:
    """What an ahead call drafted, kept on the draft side for the next step's block."""

    proposal: Proposal  # tokens [R, G'+1]: the token before block k+1 (guess or correction), then block k+1
    branches: list[str | None]  # [R] the cache each row drafted in: None (its request's own) or a branch


def _device_done() -> None:
    """Wait for this process's queued GPU work. A method's result can still be computing when it
    returns (a draft's tokens are on the device until its reply is pickled): its seconds must
    include that work, or the coordinator books it as coordination (`rpc_overhead`). The reply
    would wait for it anyway, so this costs no wall time."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _free(holder, request_ids: list[str]) -> None:
    """Free these requests' caches in a model holder (verifier, proposer)."""
    for rid in request_ids:
        holder.free(rid)


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _assigned_gpus() -> list[int]:
    """The CUDA ordinals of the GPUs Ray gave this actor (Ray narrows CUDA_VISIBLE_DEVICES to them).
    A worker built outside Ray (tests, scripts) has none; asking Ray there would start a cluster."""
    from specserve.engine.sharding import cuda_ordinals

    if not ray.is_initialized():
        return cuda_ordinals([])
    return cuda_ordinals(ray.get_gpu_ids())
