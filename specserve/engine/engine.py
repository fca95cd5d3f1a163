"""SpeculativeEngine: the in-process API used by tests, benchmarks and the serving workers.

It knows token ids only (no tokenizer, no HTTP, no Ray). `generate` runs prompts to completion;
`add_request` / `step` / `abort` let a server join and leave requests between steps.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from .admission import Admission, widest_forward
from .model_runner import BATCH_BUCKETS, CALIBRATION_SIZES, ModelRunner, RowInput, batch_bucket
from .proposers import DrafterSpec, DraftModelProposer, DraftModelSpec, Proposer
from .sampling import SamplingParams
from .policy import SpeculationPolicy
from .executor import InProcessExecutor, run_sync
from .grammar import GrammarBook, check_grammar
from .history import History
from .loop import StepLoop
from .step import ContextLengthExceeded, RequestMetrics, Sequence, StepOutput, new_sequence
from .verifier import TargetVerifier

# The draft loops captured ahead, by the temperature of their rows: greedy (no q) and sampled
# without top-k / top-p (`BatchSampling.loop_flags`; a batch of greedy and sampled rows runs the
# sampled loop). Loops that filter are captured when first met.
LOOP_KINDS = (0.0, 1.0)


# Prompt tokens each model prefills per step by default: a bounded forward beside the step (a
# 2,000-token prompt takes four steps) that is still long enough to run near full efficiency.
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "length" | "stop"
    metrics: RequestMetrics
    logprobs: list[float] | None = None  # per generated token, when SamplingParams.logprobs was set
    top_logprobs: list[list[tuple[int, float]]] | None = None  # [(token, logprob)] k alternatives each


class SpeculativeEngine:
    def __init__(
        self,
        target_model: torch.nn.Module,
        draft_model: torch.nn.Module | None = None,
        num_speculative_tokens: int = 4,
        *,
        adaptive: bool = True,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        eos_token_ids: list[int] | None = None,
        drafter: DrafterSpec | None = None,
        proposer: Proposer | None = None,
        execution: str = "auto",
        attention: str = "auto",
        prefill_chunk_tokens: int | None = DEFAULT_PREFILL_CHUNK,
        max_cached_tokens: int | None = None,
        tokenizer=None,
        kv_block_size: int | None = None,
        prefix_caching: bool = False,
        history: History | None = None,
    ) -> None:
        """What drafts, at most one of: draft_model, a separate draft model (shorthand for
        drafter=DraftModelSpec(draft_model)); drafter, any drafter spec (layer skip, prompt
        lookup, ...); proposer, a ready-made Proposer. execution: how the target and a draft
        model run their fixed-shape forwards, "eager", "compile", "graph" (CUDA graphs),
        "fused-graph" (CUDA graphs of the models' layers compiled first) or "auto" (graph on one
        CUDA device, else eager); see ModelRunner. attention: how they attend, "mask", "flex"
        (FlexAttention, no materialised mask) or "auto" (mask); see ModelRunner.
        prefill_chunk_tokens: the most prompt tokens each model prefills per step, in a forward
        beside the step (chunked prefill; see `prefill_rows`); None or 0: a new prompt is prefilled
        whole inside its first step.
        max_cached_tokens: the KV budget in allocated token positions per model that admission
        keeps to (see `engine/admission.py`; the server's `max_cached_tokens`), None: no budget.
        tokenizer: the target's HF fast tokenizer, or a callable returning it (called at the first
        request with a grammar): needed for structured output only (`SamplingParams.grammar`).
        kv_block_size: keep each model's KV cache by blocks of this many positions (a paged cache,
        `engine/paged_cache.py`; with max_cached_tokens, a pool of that many positions), None: dense.
        prefix_caching (paged only): a prompt prefix already computed is shared, not computed again.
        history: finished requests' answers to draft from, where a request's latest tokens occurred
        there (`engine/history.py`; greedy and unseeded sampled requests), None: none kept."""
        if prefix_caching and not kv_block_size:
            raise ValueError("prefix_caching needs a paged cache (kv_block_size)")
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0 (0 or None: no chunking)")
        if sum(x is not None for x in (draft_model, drafter, proposer)) > 1:
            raise ValueError("give at most one of draft_model, drafter and proposer")
        if draft_model is not None:
            drafter = DraftModelSpec(draft_model, execution, attention)
        if drafter is None and proposer is None and num_speculative_tokens > 0:
            raise ValueError("num_speculative_tokens > 0 needs a draft model, a drafter or a proposer")
        self.verifier = TargetVerifier(target_model, max_model_len, execution, attention=attention)
        if drafter is not None:
            proposer = drafter.build(target_model, self.verifier.vocab_size, max_model_len)
        if hasattr(proposer, "attach_target"):  # a drafter that reads the target's hidden states
            proposer.attach_target(self.verifier.runner)
        limits = [self.verifier.runner.max_model_len, getattr(proposer, "max_model_len", None)]
        self.proposer = proposer
        self.max_model_len = min(x for x in limits if x) if any(limits) else 1 << 30
        self.policy = SpeculationPolicy(num_speculative_tokens, adaptive=adaptive,
                                        own_drafts=getattr(proposer, "own_drafts", True))
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else model_eos_ids(target_model))
        self.grammar = None if tokenizer is None else attach_grammar(
            _loader(tokenizer), self.verifier, proposer, self.eos_token_ids)
        page_runners([self.verifier.runner, getattr(proposer, "runner", None)], kv_block_size, max_cached_tokens,
                     prefix_caching, max_batch_size, widest_forward(prefill_chunk_tokens, num_speculative_tokens))
        self.admission = Admission(max_batch_size, max_cached_tokens, num_speculative_tokens, kv_block_size,
                                   kept_behind(self.verifier, proposer), prefill_chunk_tokens)
        self.loop = StepLoop(self.admission, InProcessExecutor(proposer, self.verifier), self.policy,
                             prefill_chunk_tokens, history)
        self._ids = itertools.count()
        self._calibrated = not (self.policy.adaptive and num_speculative_tokens > 0)
        self._captured = False

    # -- incremental API ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Queue a request; a lower priority is admitted ahead of a higher one (FIFO within one)."""
        if self.admission.get(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = new_sequence(request_id, prompt_token_ids, params, vocab_size=self.verifier.vocab_size,
                           max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, priority=priority)
        if params.grammar is not None:
            self._check_grammar(params.grammar)
        if self.admission.too_big(seq):
            raise ContextLengthExceeded(
                f"prompt ({len(seq.prompt)} tokens) + max_tokens ({params.max_tokens}) needs more KV cache than "
                f"the budget of {self.admission.budget} token positions")
        self.admission.enqueue(seq)

    def _check_grammar(self, grammar) -> None:
        if self.grammar is None:
            raise ValueError("structured output needs the engine to have the tokenizer (SpeculativeEngine(tokenizer=...))")
        error = check_grammar(grammar, self.grammar.view)
        if error:
            raise ValueError(f"invalid {grammar.kind} grammar: {error}")

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its caches."""
        self.admission.drop_waiting({request_id})
        self.loop.retire([request_id])

    def has_unfinished(self) -> bool:
        return self.admission.has_unfinished()

    def num_cached(self) -> dict[str, int]:
        """Requests holding a cache slot, per model."""
        counts = {"target": self.verifier.runner.num_cached()}
        if isinstance(getattr(self.proposer, "runner", None), ModelRunner):
            counts["draft"] = self.proposer.runner.num_cached()
        return counts

    def step(self) -> list[StepOutput]:
        """Admit waiting requests (FIFO, up to max_batch_size and the KV budget), run this step's
        prefill chunks (when chunking), then one speculative step over every request whose prompt
        is cached."""
        seqs = self.loop.admit()
        if not seqs:
            return []
        if not self._captured:
            self.capture_graphs()
        if not self._calibrated:
            self.calibrate()
        outputs = run_sync(self.loop.iterate(seqs))
        self.loop.retire([out.request_id for out in outputs if out.finish_reason is not None])
        return outputs

    def sequence(self, request_id: str) -> Sequence | None:
        return self.admission.get(request_id)

    # -- batch API ----------------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        params = params if params is not None else SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(per_prompt) != len(prompt_token_ids):
            raise ValueError("give one SamplingParams for all prompts or one per prompt")
        ids = [f"gen-{next(self._ids)}" for _ in prompt_token_ids]
        seqs = {}
        try:  # (a prompt refused half-way leaves none of the batch behind)
            for rid, prompt, p in zip(ids, prompt_token_ids, per_prompt):
                self.add_request(rid, prompt, p)
                seqs[rid] = self.sequence(rid)
            while any(seqs[r].finish_reason is None for r in ids):
                self.step()
        finally:
            for rid in ids:
                self.abort(rid)
        return [_output(seqs[r]) for r in ids]

    # -- internals ----------------------------------------------------------------------------
    def capture_graphs(self, progress: bool = True, key_buckets: int | None = None,
                       kinds: tuple[float, ...] = LOOP_KINDS) -> float:
        """Capture the CUDA graphs of the usual step shapes now (see `capture_graphs`); done
        before the first step. Nothing to do unless a runner is in graph mode. key_buckets: at
        most this many key-length buckets ahead (None: AHEAD_KEY_BUCKETS); kinds: the draft loops
        ahead, by their rows' temperature (a caller whose rows are all greedy may say (0.0,))."""
        self._captured = True
        return capture_graphs(self.verifier, self.proposer, self.admission.max_batch_size, self.policy.max_gamma,
                              progress, self.admission.budget, self.verifier.runner.stated_max_model_len, key_buckets,
                              kinds)

    def calibrate(self, sizes: tuple[int, ...] = CALIBRATION_SIZES) -> None:
        """Time each model on dummy rows of a few sizes so the policy starts from measurements
        (done before the first step when γ is adaptive; a drafter with no model learns as it goes)."""
        self._calibrated = True
        self.policy.calibrate_costs("target", self.verifier.runner.time_forwards(sizes))
        if isinstance(getattr(self.proposer, "runner", None), ModelRunner):
            self.policy.calibrate_costs("draft", self.proposer.runner.time_forwards(sizes))


# Key-length buckets `capture_graphs` captures ahead, at most: a cache sized for longer contexts
# has the rest captured as contexts first reach them.
AHEAD_KEY_BUCKETS = 4


def capture_graphs(verifier, proposer, max_batch_size: int, max_gamma: int, progress: bool = True,
                   budget: int | None = None, max_model_len: int | None = None, key_buckets: int | None = None,
                   kinds: tuple[float, ...] = LOOP_KINDS) -> float:
    """Capture, for every batch bucket up to max_batch_size (largest first, so that the cache's
    slots are allocated once), the target's verify forward at widths 1..γ+1 and the drafter's
    whole γ-forward loop (a draft model's or a feature head's: `capture_ahead`; greedy and
    sampled: `kinds`) for γ in 1..max_gamma, at each key-length bucket the cache is already sized
    for, at most `key_buckets` of them (None: AHEAD_KEY_BUCKETS; `key_prefixes`); longer contexts
    and loops that filter (top-k / top-p) are captured when first met. Only runners in graph mode
    take part (verifier or proposer None: that side is another process's). A dense cache is first
    sized for the whole batch at max_model_len (given here, or stated to the runner) where that
    fits `budget` positions and the device (`ModelRunner.preallocate`): then it never grows and no
    graph is dropped. Returns the seconds spent."""
    target = verifier.runner if verifier is not None and verifier.runner.execution == "graph" else None
    draft = proposer if isinstance(proposer, DraftModelProposer) and proposer.graph_loops() else None
    if target is None and draft is None:
        return 0.0
    from tqdm import tqdm

    sizes = [b for b in BATCH_BUCKETS if b <= batch_bucket(max_batch_size)][::-1]
    for runner in (target, draft and draft.runner):
        if runner is not None:
            runner.preallocate(sizes[0], budget, max_model_len)
    limit = key_buckets or AHEAD_KEY_BUCKETS
    target_keys = key_prefixes(target, max_gamma, limit) if target else []
    draft_keys = key_prefixes(draft.runner, max_gamma, limit) if draft else []
    per_size = len(target_keys) * (max_gamma + 1) + (len(draft_keys) * draft.ahead_loops(max_gamma, kinds)
                                                     if draft else 0)
    began = time.perf_counter()
    with tqdm(total=len(sizes) * per_size, desc="capturing CUDA graphs", unit="graph", disable=not progress) as bar:
        for b in sizes:
            ids = [f"__capture_{i}__" for i in range(b)]
            if target is not None:
                for prefix in target_keys:
                    target.forward([RowInput(i, 0, [0] * prefix) for i in ids], logits="none")
                    for width in range(1, max_gamma + 2):
                        target.forward([RowInput(i, prefix, [0] * width) for i in ids], logits="all")
                        bar.update(1)
                for i in ids:
                    target.free(i)
            if draft is not None:
                draft.capture_ahead(b, draft_keys, max_gamma, kinds, lambda: bar.update(1))
    seconds = time.perf_counter() - began
    runners = [r for r in (target, draft and draft.runner) if r is not None]
    graphs = sum(len(r.graphs) for r in runners)
    fused = [r.fusion.variants() for r in runners if r.fusion is not None]
    logging.getLogger(__name__).info("captured %d CUDA graphs for batch buckets %s in %.1f s%s", graphs, sizes,
                                     seconds, f"; fused blocks compiled as {fused} variants" if fused else "")
    return seconds


def key_prefixes(runner: ModelRunner, max_gamma: int, limit: int = AHEAD_KEY_BUCKETS) -> list[int]:
    """Context lengths whose step forwards (up to γ + 1 tokens wide, or a γ-forward draft loop)
    attend over each key-length bucket a dense cache is already sized for, up to `limit` of
    them: 4, then 4 past each key step while such a step still fits the capacity. A cache not
    sized yet (or paged) has the first bucket only."""
    step = runner.cache.key_step
    capacity = 0 if runner.paged else runner.cache.allocated()[1]
    prefixes = [4]
    while len(prefixes) < limit and len(prefixes) * step + 4 + max_gamma + 2 <= capacity:
        prefixes.append(len(prefixes) * step + 4)
    return prefixes


def attach_grammar(tokenizer, verifier: TargetVerifier, proposer, eos_token_ids) -> GrammarBook:
    """One book of grammar matchers for a process's verifier and (when it masks drafts) proposer:
    each syncs a request's matcher to the tokens it is given, so sharing one costs nothing."""
    book = GrammarBook(tokenizer, verifier.vocab_size, eos_token_ids)
    verifier.grammar = book
    if hasattr(proposer, "grammar"):
        proposer.grammar = book
    return book


def page_runners(runners, block_size: int | None, max_cached_tokens: int | None, prefix_caching: bool = False,
                 rows: int | None = None, widest: int | None = None) -> None:
    """Give these runners (None entries skipped) paged caches of `block_size` positions per block,
    each a pool of max_cached_tokens positions (None: pools that grow), sharing computed prefixes
    when prefix_caching; nothing when block_size is None. rows, widest: the most requests at once
    and the widest forward (`widest_forward`), which size a windowed layers' own pool
    (`ModelRunner.page`)."""
    if not block_size:
        return
    blocks = None if max_cached_tokens is None else max(max_cached_tokens // block_size, 2)
    for runner in runners:
        if isinstance(runner, ModelRunner):
            runner.page(block_size, blocks, prefix_caching, rows, widest)


def kept_behind(verifier, proposer) -> dict[str, int | None]:
    """Per paged cache of these sides, by the mark admission reads it at ("target_len",
    "draft_len"), the most positions it holds behind that mark (`ModelRunner.kept_behind`)."""
    out = {}
    for mark, side in (("target_len", verifier), ("draft_len", proposer)):
        runner = getattr(side, "runner", None)
        if isinstance(runner, ModelRunner) and runner.paged:
            out[mark] = runner.kept_behind()
    return out


def _loader(tokenizer):
    """A tokenizer (it has a `backend_tokenizer`: a HF fast one) or a function returning one -> the function."""
    return (lambda: tokenizer) if hasattr(tokenizer, "backend_tokenizer") else tokenizer


def model_eos_ids(model: torch.nn.Module) -> list[int]:
    """The EOS ids a model's generation config (else its config) declares."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def _output(seq: Sequence) -> CompletionOutput:
    asked = seq.params.logprobs is not None
    return CompletionOutput(seq.request_id, seq.prompt, seq.output, seq.finish_reason, seq.metrics,
                            seq.logprobs if asked else None, seq.top_logprobs if asked else None)
