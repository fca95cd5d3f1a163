"""Proposers: whatever guesses the next tokens for the target to verify.

A proposer gets, per row, the tokens it has not seen yet (a `RowInput`) and returns `num_tokens`
draft tokens per row in the *target's* vocabulary, plus, when any row samples, the exact
distributions q they were drawn from. Random numbers come from the caller (one uniform per draft
token per row), so a proposer is a deterministic function and the caller owns each request's
random stream.

Three drafters, each chosen by a small frozen spec with `build(target, vocab_size, max_model_len)`:

- `DraftModelSpec`  -> `DraftModelProposer`: a separate, smaller causal LM.
- `LayerSkipSpec`   -> `LayerSkipProposer`: the target itself with some decoder layers skipped
  (self-speculative); a view that shares the target's weights, with its own KV cache.
- `PromptLookupSpec` -> `PromptLookupProposer`: no model; copies what followed the most recent
  earlier occurrence of the sequence's own suffix n-gram (prompt lookup / n-gram decoding).

Every proposer keeps, per request, a prefix of the request's tokens (a KV cache or a token list)
and reports its length through `valid_length`; a row whose `start` is below it rolls it back, one
above it raises `CacheMiss`. After a call with G drafts a row holds its tokens plus its first
G-1 drafts (the step's bookkeeping in `apply_verdict` relies on this).
"""
from __future__ import annotations

import copy
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .grammar import WIDE_SHARE, DraftMasks, GrammarBook
from .lookup import TokenStore, continue_match
from .model_runner import DRAFT_ROW_TOKENS, ForwardTiming, ModelRunner, RowInput, catch_up
from .prediction import apply_forced, forced_runs, pad_run
from .sampling import BatchSampling, SamplingParams, logits_to_probs, q_to_send, sample_with_uniforms


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [B, G] int64 target-vocabulary ids (on the proposer's device)
    # [B, G, V] q of each draft token (float32, or the 16-bit dtype it was rounded to and drawn
    # from: `sampling.q_to_send`); None when every row is greedy
    probs: torch.Tensor | None
    forwards: Sequence[ForwardTiming] = ()  # each model forward it took
    # The drafts are a deterministic function of the tokens (prompt lookup): q is one-hot at each
    # draft, so `probs` stays None and the verifier's rule treats it as such without building it.
    deterministic: bool = False
    # [B] int64 on the host: drafts worth verifying per row, fewer than G where the drafter stopped
    # early (the feature drafter's confidence floor); None: every planned draft
    num_draft: torch.Tensor | None = None
    # [B, G] int64: the drafter's runner-up token at each draft position (its second-likeliest),
    # when asked for and every row is greedy: the likeliest correction if the target rejects that
    # draft (a pipelined step prepares branches from them, specserve.serve.pipeline); else None
    alternates: torch.Tensor | None = None
    # whether the draft side cached the rows' tokens, so that their draft marks move with the
    # verdict; False for drafts made where no draft cache is (a draft outage's predictions)
    draft_cached: bool = True

    @property
    def seconds(self) -> float:
        return sum(f.seconds for f in self.forwards)

    def __reduce__(self):  # across processes (Ray) through the host: another process may lack the device
        # (q may also be a handle to where the draft side left it: passed on as it is)
        probs = self.probs.cpu() if isinstance(self.probs, torch.Tensor) else self.probs
        alternates = None if self.alternates is None else self.alternates.cpu()
        return (Proposal, (self.tokens.cpu(), probs, tuple(self.forwards), self.deterministic, self.num_draft,
                           alternates, self.draft_cached))


_BRANCH = "#branch"


def branch_id(request_id: str, position: int) -> str:
    """The cache name of request_id's branch that drafts past a rejection at block position
    `position` (1-based), see `DraftModelProposer.fork`."""
    return f"{request_id}{_BRANCH}{position}"


def branch_owner(cache_id: str) -> str:
    """The request a cache name belongs to (itself, unless it names a branch)."""
    return cache_id.rsplit(_BRANCH, 1)[0]


class Proposer(Protocol):
    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None
    ) -> Proposal: ...

    def prefill(self, rows: list[RowInput]) -> Sequence[ForwardTiming]: ...

    def free(self, request_id: str) -> None: ...

    def valid_length(self, request_id: str) -> int: ...

    def num_cached(self) -> int: ...


class DraftModelProposer:
    """A smaller causal LM that shares the target's tokenizer, with its own KV cache slots.

    Per call: rows with a long backlog (a new prompt, or a lag after speculation was off) are first
    prefilled up to their last token; then one forward per draft position, each fed the token the
    previous one chose on the device (no host read between drafts). In graph mode the whole
    G-forward loop, with its argmax or sampling from the pre-drawn uniforms, is one CUDA graph.
    After the call a row's cache holds its tokens plus its first G-1 drafts.
    """

    can_branch = True  # `fork` / `adopt`, and runner-ups in `propose` (pipelined branches)

    def __init__(
        self, model: torch.nn.Module, vocab_size: int, max_model_len: int | None = None, execution: str = "auto",
        attention: str = "auto",
    ) -> None:
        self.runner = ModelRunner(model, max_model_len, execution, attention=attention)
        self.vocab_size = vocab_size  # V, the target's
        self._inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (B', G) -> static loop inputs
        self._q_out: dict[tuple[int, int], torch.Tensor] = {}  # (B', G) -> where captured sampled loops leave q
        self.grammar: GrammarBook | None = None  # masks grammar rows' drafts when set (engine/grammar.py)
        self.wide_share: float | None = WIDE_SHARE  # a grammar row this wide drafts unmasked (None: never)
        # the dtype q crosses to the target in (`sampling.q_to_send`): a served draft worker's is
        # its target's where that is 16-bit. Set before the first propose (captured loops round to it).
        self.q_dtype = torch.float32

    def free(self, request_id: str) -> None:
        self.runner.free(request_id)
        if self.grammar is not None:
            self.grammar.free(branch_owner(request_id))

    def fork(self, request_id: str, branch: str, length: int) -> None:
        """A cache `branch` holding request_id's first `length` positions (ModelRunner.fork)."""
        self.runner.fork(request_id, branch, length)

    def adopt(self, branch: str, request_id: str) -> None:
        """request_id continues from its fork `branch` (ModelRunner.adopt)."""
        self.runner.adopt(branch, request_id)

    def valid_length(self, request_id: str) -> int:
        return self.runner.valid_length(request_id)

    def num_cached(self) -> int:
        return self.runner.num_cached()

    @property
    def max_model_len(self) -> int | None:
        return self.runner.max_model_len

    def graph_loops(self) -> bool:
        """Whether its draft loops replay as CUDA graphs (`engine.capture_graphs` then captures
        the usual ones before the first step: `capture_ahead`)."""
        return self.runner.execution == "graph"

    def ahead_loops(self, max_gamma: int, kinds: Sequence[float]) -> int:
        """How many loops `capture_ahead` captures per batch size and context length."""
        return max_gamma * len(self._ahead_widths(max_gamma)) * len(kinds)

    @torch.no_grad()
    def capture_ahead(self, size: int, prefixes: Sequence[int], max_gamma: int, kinds: Sequence[float],
                      tick: Callable[[], None]) -> None:
        """Capture the draft loops of `size` rows (a batch bucket) after each context length of
        `prefixes`: γ in 1..max_gamma, each first width a call starts with (`_ahead_widths`), and
        rows at each temperature of `kinds` (greedy, sampled: `BatchSampling.loop_flags`); tick()
        after each."""
        ids = [f"__capture_{i}__" for i in range(size)]
        loops = [BatchSampling.from_params([SamplingParams(temperature=t)] * size) for t in kinds]
        for prefix in prefixes:
            self._ahead_context(ids, prefix)
            for gamma, width, sampling in itertools.product(range(1, max_gamma + 1), self._ahead_widths(max_gamma),
                                                            loops):
                uniforms = None if sampling.all_greedy else torch.zeros(size, gamma)
                self._ahead_loop([RowInput(i, max(prefix + 1 - width, 0), [0] * width) for i in ids], gamma,
                                 sampling, uniforms)
                tick()
        for i in ids:
            self.free(i)

    def _ahead_widths(self, max_gamma: int) -> Sequence[int]:
        """The widths a call's rows start with: the bonus token, or after a step whose drafts were
        all accepted also the last draft (wider rows first prefill their backlog); where batches
        are padded, one width (`_first_width`)."""
        return (DRAFT_ROW_TOKENS,) if self.runner.pad_batches else (1, DRAFT_ROW_TOKENS)

    def _first_width(self) -> int:
        """The width a call's first forward is padded to (0: none). A runner that pads batches
        (graph mode) pads every row to DRAFT_ROW_TOKENS: a batch of one-token rows then replays
        the same loop as one holding a two-token row, so half the loops are captured. The padding
        lands just past each row's end, where a one-token row in a mixed batch already had it, and
        the loop's first draft overwrites it; on a GPU a second position in a forward that reads
        the whole draft's weights costs next to nothing."""
        return DRAFT_ROW_TOKENS if self.runner.pad_batches else 0

    def _ahead_context(self, ids: list[str], prefix: int) -> None:
        """The capture rows' first `prefix` positions, cached."""
        self.runner.forward([RowInput(i, 0, [0] * prefix) for i in ids], logits="none")

    def _ahead_loop(self, rows: list[RowInput], gamma: int, sampling: BatchSampling,
                    uniforms: torch.Tensor | None) -> None:
        """One call over the capture rows, which captures its loop."""
        self.propose(rows, gamma, sampling, uniforms)

    @torch.no_grad()
    def prefill(self, rows: list[RowInput]) -> Sequence[ForwardTiming]:
        """Cache rows' tokens (prompt chunks) in the draft's slots, computing no logits."""
        return self.runner.prefill(rows)

    @torch.no_grad()
    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None,
        alternates: bool = False,
    ) -> Proposal:
        """rows: B rows; uniforms [B, G] (G = num_tokens) or None when all greedy -> Proposal.
        alternates: also return each position's runner-up token when every row is greedy."""
        runner = self.runner
        runner.check(rows)
        groups = runner.length_groups(rows, extra_positions=num_tokens - 1)
        if len(groups) > 1:  # a paged cache's short rows and long ones, each at its own key length
            return merge_proposals([self.propose([rows[b] for b in g], num_tokens, sampling.select(g),
                                                 None if uniforms is None else uniforms[g], alternates)
                                    for g in groups], groups, len(rows))
        runner.take_forward_log()
        backlog = [RowInput(r.request_id, r.start, r.tokens[:-1]) for r in rows if catch_up(r.tokens, DRAFT_ROW_TOKENS)]
        if backlog:
            runner.forward(backlog, logits="none")
            rows = [RowInput(r.request_id, r.start + len(r.tokens) - 1, r.tokens[-1:])
                    if catch_up(r.tokens, DRAFT_ROW_TOKENS) else r for r in rows]
        staged = runner.stage(rows, extra_positions=num_tokens - 1, min_width=self._first_width())
        flags = sampling.loop_flags()  # host reads of host tensors
        alternates = alternates and flags is None
        inputs = self._static_inputs(staged, num_tokens, sampling, uniforms, flags)
        began = runner.clock()
        masks = self._draft_masks(sampling, lambda: staged.sorted_to_caller.tolist()[: len(rows)], staged.padded)
        alternates = alternates and masks is None
        static = runner.execution == "graph" and runner.fixed_shape(staged)
        forcing = sampling.forced is not None  # (rows with a prediction: their runs' drafts are set)
        if masks is not None:
            try:
                tokens, probs, ups = self._loop(staged, num_tokens, flags, inputs, False, masks=masks, forcing=forcing)
            finally:
                masks.close()
        elif static:
            if flags is not None:
                inputs["probs"] = self._q_buffer(staged.padded, num_tokens)
            key = ("draft", *staged.static_key, num_tokens, flags, alternates, forcing, runner.cache.generation)
            written = (staged.block, runner.advance_block(staged))  # the loop writes the single-token block
            out = runner.graphs.run(key, lambda: self._loop(staged, num_tokens, flags, inputs, True, alternates,
                                                            forcing=forcing), written)
            tokens, probs, ups = (None if t is None else t.clone() for t in out)
        else:
            tokens, probs, ups = self._loop(staged, num_tokens, flags, inputs, False, alternates, forcing=forcing)
        runner.record(staged.rows, began, forwards=num_tokens)
        runner.commit(staged, advanced=num_tokens - 1)
        return Proposal(runner.unsort(staged, tokens), self._sent(runner.unsort(staged, probs)),
                        runner.take_forward_log(), alternates=runner.unsort(staged, ups))

    def _draft_masks(self, sampling: BatchSampling, order: Callable[[], list[int]], padded: int) -> DraftMasks | None:
        """The masks of the grammar rows that draft masked in this step (`GrammarBook.draft_rows`),
        read at each draft position (then the loop is not the captured one); None where none does.
        order(): the caller row of each of the loop's first B rows (B' - B padding rows are free)."""
        if sampling.grammar is None or self.grammar is None:
            return None
        masked = self.grammar.draft_rows(sampling.grammar, self.wide_share)
        if masked is None:
            return None
        rows = order()
        return DraftMasks(self.grammar, masked, rows + [-1] * (padded - len(rows)))

    def _sent(self, probs: torch.Tensor | None) -> torch.Tensor | None:
        """A proposal's q [B, G, V], drawn from values rounded to `q_dtype`, in that dtype."""
        return probs if probs is None or probs.dtype == self.q_dtype else probs.to(self.q_dtype)

    def _q_buffer(self, rows: int, num_tokens: int) -> torch.Tensor:
        """[B', G, V] float32: where the captured sampled loops of a (B', G) leave q, one buffer
        for the shape rather than an output per graph (every key length and loop variant of it
        shares the buffer; each replay's q is cloned out). Allocated before the first capture."""
        if (rows, num_tokens) not in self._q_out:
            self._q_out[rows, num_tokens] = torch.zeros(rows, num_tokens, self.vocab_size, device=self.runner.device)
        return self._q_out[rows, num_tokens]

    def _static_inputs(self, staged, num_tokens, sampling, uniforms, flags) -> dict[str, torch.Tensor]:
        """This call's sampling parameters and uniforms, in sorted row order, in buffers allocated
        once per (B', G) (a captured loop reads them at fixed addresses)."""
        key = (staged.padded, num_tokens)
        device = self.runner.device
        if key not in self._inputs:
            b = staged.padded
            self._inputs[key] = dict(
                temperature=torch.zeros(b, device=device), top_k=torch.zeros(b, dtype=torch.long, device=device),
                top_p=torch.ones(b, device=device), min_p=torch.zeros(b, device=device),
                uniforms=torch.zeros(b, num_tokens, device=device),
                forced=torch.full((b, num_tokens), -1, dtype=torch.long, device=device))
        buffers = self._inputs[key]
        if sampling.forced is not None:  # [B, G] -> [B', G] in sorted order (a padding row copies its source's)
            buffers["forced"].copy_(sampling.forced.to(device, non_blocking=True).index_select(0, staged.sorted_to_caller))
        if flags is not None:
            order = staged.sorted_to_caller  # [B'] caller row of each sorted row
            for name, values in (("temperature", sampling.temperature), ("top_k", sampling.top_k),
                                 ("top_p", sampling.top_p), ("min_p", sampling.min_ps())):
                buffers[name].copy_(values.to(device, non_blocking=True).index_select(0, order))
            buffers["uniforms"].copy_(uniforms.to(device, non_blocking=True).index_select(0, order))
        return buffers

    def _loop(self, staged, num_tokens: int, flags, inputs, captured: bool, alternates: bool = False,
              masks: DraftMasks | None = None, forcing: bool = False):
        """The G draft forwards, device only, sorted row order -> (tokens [B', G], q [B', G, V] or
        None, runner-up tokens [B', G] or None). captured: inside a graph capture (run the forward
        itself, not the runner's dispatch); alternates: every row is greedy and the runner-ups are
        wanted; masks: the grammar rows' masks (then one host read per position); forcing: rows
        take the tokens `inputs["forced"]` sets (predicted runs) where it sets them."""
        runner = self.runner

        def forward(s):
            return runner.forward_in_capture(s, "last") if captured else runner.execute(s, "last")[0]

        sampling = BatchSampling(inputs["temperature"], inputs["top_k"], inputs["top_p"], min_p=inputs["min_p"])
        logits = forward(staged)  # [B', V']
        tokens, probs, ups = [], [], []
        for j in range(num_tokens):
            token, q = self._choose(logits, sampling, flags, inputs, j, masks)
            if forcing:
                token, q = apply_forced(token, q, inputs["forced"][:, j])
            if masks is not None:
                masks.advance(token)
            tokens.append(token)
            probs.append(q)
            if alternates:
                ups.append(self._runner_up(logits, inputs, j))
            if j + 1 < num_tokens:
                staged = runner.advance(staged, token)
                logits = forward(staged)
        draft_probs = None  # [B', G, V]: in the shape's shared buffer when captured (the caller clones it)
        if flags is not None:
            draft_probs = torch.stack(probs, dim=1, out=inputs["probs"]) if captured else torch.stack(probs, dim=1)
        runner_ups = torch.stack(ups, dim=1) if alternates else None  # [B', G]
        return torch.stack(tokens, dim=1), draft_probs, runner_ups  # [B', G]

    def _runner_up(self, logits: torch.Tensor, inputs: dict[str, torch.Tensor], j: int) -> torch.Tensor:
        """logits [B', V'] of draft position j (greedy rows) -> the second-likeliest token [B'] in
        target ids: the likeliest correction when the target rejects the draft's first choice."""
        return self.runner.map_tokens(self._greedy_logits(logits).topk(2, dim=-1).indices[:, 1])

    def _greedy_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B', V'] -> the columns a greedy pick ranks: all of them under a token map (the draft's
        own vocabulary), else the target's vocabulary (a draft head may be padded past it)."""
        return logits if self.runner.token_map is not None else logits[:, : self.vocab_size]

    def _choose(
        self, logits: torch.Tensor, sampling: BatchSampling, flags: tuple[bool, bool] | None,
        inputs: dict[str, torch.Tensor], j: int, masks: DraftMasks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [B', V'] of draft position j -> (target ids [B'], q [B', V] or None when all rows
        are greedy: flags None). inputs: the static loop inputs (uniforms [B', G]); masks: grammar
        rows' masks, applied before the choice (q is then the masked distribution)."""
        if masks is not None:
            return self._pick(masks.apply(self._to_target_vocab(logits)), sampling, flags, inputs, j, True)
        return self._pick(logits, sampling, flags, inputs, j, False)

    def _pick(self, logits: torch.Tensor, sampling: BatchSampling, flags: tuple[bool, bool] | None,
              inputs: dict[str, torch.Tensor], j: int, target_ids: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `_choose`, from logits already over the target's vocabulary [B', V] when target_ids
        (masked ones), else in the draft's output space [B', V']."""
        if flags is None:
            if target_ids:
                return logits.argmax(-1), None
            return self.runner.map_tokens(self._greedy_logits(logits).argmax(-1)), None
        q = logits_to_probs(logits if target_ids else self._to_target_vocab(logits), sampling, flags)  # [B', V]
        q = q_to_send(q, self.q_dtype)  # what the target will read
        token = sample_with_uniforms(q, inputs["uniforms"][:, j])
        greedy = sampling.temperature == 0
        token = torch.where(greedy, q.argmax(-1), token)
        return token, q

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V'] in the draft's output space -> [B, V] over the target's vocabulary (-inf elsewhere)."""
        vocab = self.vocab_size
        if self.runner.token_map is not None:
            full = logits.new_full((logits.shape[0], vocab), float("-inf"))
            return full.index_copy_(1, self.runner.token_map.to(logits.device), logits)
        if logits.shape[-1] >= vocab:
            return logits[:, :vocab]
        pad = logits.new_full((logits.shape[0], vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def merge_proposals(parts: list[Proposal], groups: list[list[int]], batch: int) -> Proposal:
    """Proposals over groups of rows (caller indices) -> one over all B rows, in caller order."""
    def merged(name: str) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if all(t is None for t in tensors):
            return None
        first = next(t for t in tensors if t is not None)
        out = first.new_zeros(batch, *first.shape[1:])
        for t, group in zip(tensors, groups):
            out[torch.tensor(group, device=out.device)] = t
        return out

    forwards = tuple(f for p in parts for f in p.forwards)
    return Proposal(merged("tokens"), merged("probs"), forwards, alternates=merged("alternates"))


# -- layer skip (self-speculative) ----------------------------------------------------------------
class LayerSkipProposer(DraftModelProposer):
    """The target itself, minus `skip_layers`, as a draft (Draft & Verify / LayerSkip style).

    No weight is copied: the draft is a view that shares the target's modules and runs only the
    kept decoder layers, then the final norm and head. It has its own KV cache (the target's keys
    come from different hidden states); each kept layer keeps its original index, and the slot
    cache allocates storage lazily per index, so it holds keys for the kept layers only.
    """

    def __init__(
        self, target: torch.nn.Module, skip_layers, vocab_size: int, max_model_len: int | None = None
    ) -> None:
        view = layer_skip_view(target, skip_layers)
        self.skip_layers: tuple[int, ...] = view.skip_layers
        super().__init__(view, vocab_size, max_model_len)


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(dotted path, module list) of a HF causal LM's decoder layers (`model.layers`, `transformer.h`, ...)."""
    count = model.config.num_hidden_layers
    for name, module in model.named_modules():
        if name and isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return name, module
    raise ValueError(f"cannot find the {count} decoder layers of {type(model).__name__}")


def layer_skip_view(model: torch.nn.Module, skip_layers) -> torch.nn.Module:
    """A module that runs `model` without the decoder layers in `skip_layers`; shares every weight.

    The modules on the path from the root to the layer list are shallow copies (their own child
    dicts, the same parameters and config); the layer list holds the kept layers themselves. The
    model's own forward then runs unchanged over the shorter list, so an empty skip set computes
    exactly what the target computes.
    """
    path, layers = decoder_layers(model)
    skip = sorted({int(i) for i in skip_layers})
    if any(not 0 <= i < len(layers) for i in skip):
        raise ValueError(f"skip_layers must lie in [0, {len(layers)}), got {skip}")
    keep = [i for i in range(len(layers)) if i not in set(skip)]
    if not keep:
        raise ValueError("a layer-skip draft must keep at least one layer")
    # The config stays the target's: layer indices keep their meaning, and a HF cache built from it
    # (e.g. a DynamicCache when the view runs outside the engine) has room for every index.
    view = _shallow_module(model)
    parent, names = view, path.split(".")
    for name in names[:-1]:
        child = _shallow_module(parent._modules[name])
        parent._modules[name] = child
        parent = child
    parent._modules[names[-1]] = torch.nn.ModuleList([layers[i] for i in keep])
    view.skip_layers = tuple(skip)
    return view


def _shallow_module(module: torch.nn.Module) -> torch.nn.Module:
    clone = copy.copy(module)  # a new __dict__; the containers inside it are still shared
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone.__dict__.pop("forward", None)  # an instance-level forward (an accelerate hook) is bound to the original
    return clone


# -- prompt lookup (n-gram) -----------------------------------------------------------------------
class PromptLookupProposer:
    """Proposes what followed the most recent earlier occurrence of the sequence's suffix n-gram.

    The longest suffix of n tokens (min_n <= n <= max_n) that also occurs earlier in the request's
    own tokens (prompt + output so far) wins; among its occurrences, the most recent (searched
    among the 64 most recent occurrences of its last min_n tokens, through an index kept per
    request: engine/lookup.py). The drafts are the tokens that followed it, continued periodically
    when they run into the end of the sequence (a repeating pattern keeps repeating). No model runs.

    Without a match the row still gets `num_tokens` drafts (the protocol is rectangular): copies of
    its last token, which cost nothing to make and which the engine's adaptive γ sees as low
    acceptance. A deterministic proposal is a valid q: one-hot at the proposed token, so the
    rejection rule accepts it with probability p(x) and otherwise samples from p with x removed;
    the proposal says `deterministic=True` and carries no q (the verifier never builds one).
    """

    def __init__(self, vocab_size: int, min_n: int = 1, max_n: int = 3, max_model_len: int | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.vocab_size = vocab_size  # V
        self.min_n = min_n
        self.max_n = max_n
        self.max_model_len = max_model_len
        self._tokens = TokenStore(min_n, max_n)  # request id -> the prefix it holds (+ its last drafts)
        self.num_lookups = 0  # rows proposed for, and how many of them found a match
        self.num_matches = 0

    def free(self, request_id: str) -> None:
        self._tokens.free(request_id)

    def valid_length(self, request_id: str) -> int:
        return self._tokens.length(request_id)

    def num_cached(self) -> int:
        return len(self._tokens)

    def prefill(self, rows: list[RowInput]) -> Sequence[ForwardTiming]:
        """Hold rows' tokens (prompt chunks): no model, nothing to compute."""
        self._tokens.hold(rows)
        return ()

    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None
    ) -> Proposal:
        """rows: B rows; uniforms unused (the proposal is deterministic) -> Proposal with G = num_tokens."""
        began = time.perf_counter()
        self._tokens.check(rows)  # every row before touching any
        runs = forced_runs(sampling.forced)  # row -> its predicted run, drafted first
        drafts = []
        for b, row in enumerate(rows):  # rolled back to what the caller says is still valid
            seq = self._tokens.rewrite(row.request_id, row.start, row.tokens)
            draft = pad_run(runs[b], num_tokens) if b in runs else self.continuation(row.request_id, num_tokens)
            # held like a draft model's cache: tokens + G-1 drafts
            self._tokens.rewrite(row.request_id, len(seq), draft[: num_tokens - 1])
            drafts.append(draft)
        tokens = torch.tensor(drafts, dtype=torch.long).view(len(rows), num_tokens)  # [B, G]
        counts = None  # [B]: a predicted run shorter than G is verified up to its end
        if runs:
            counts = torch.tensor([min(len(runs[b]), num_tokens) if b in runs else num_tokens for b in range(len(rows))])
        # One entry so the policy's draft cost becomes known (and near zero): no model, no tokens.
        return Proposal(tokens, None, (ForwardTiming(0, time.perf_counter() - began),), deterministic=True,
                        num_draft=counts)

    def continuation(self, request_id: str, num_tokens: int) -> list[int]:
        """num_tokens drafts following the request's tokens (its last token repeated when nothing
        matches: `TokenStore.find`)."""
        self.num_lookups += 1
        seq = self._tokens[request_id]
        start = self._tokens.find(request_id) if num_tokens > 0 else None
        if start is None:
            return seq[-1:] * num_tokens
        self.num_matches += 1
        return continue_match(seq, start, num_tokens)


# -- predictions alone ----------------------------------------------------------------------------
class PredictionProposer:
    """Drafts the requests' own predictions (OpenAI's `prediction`, engine/prediction.py) and
    nothing else: a row's predicted run where `plan_step` found one (`sampling.forced`), no draft
    for any other row. No model runs and nothing is held, so it costs a target with no draft model
    nothing but the wider verifies of the rows whose predictions it drafts. The policy plans no
    drafts of its own beside it (`own_drafts`: γ 0 for the batch, a predicted run up to γ).
    Deterministic, as prompt lookup is: q one-hot at each draft."""

    own_drafts = False

    def __init__(self, max_model_len: int | None = None) -> None:
        self.max_model_len = max_model_len

    def free(self, request_id: str) -> None:
        pass

    def valid_length(self, request_id: str) -> int:
        return sys.maxsize  # (it holds nothing: no call can start past what it holds)

    def num_cached(self) -> int:
        return 0

    def prefill(self, rows: list[RowInput]) -> Sequence[ForwardTiming]:
        return ()

    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None
    ) -> Proposal:
        """rows: B rows -> Proposal [B, G = num_tokens], each row's count its run's length (0 without one)."""
        began = time.perf_counter()
        runs = forced_runs(sampling.forced)  # row -> its predicted run
        drafts = [pad_run(runs[b], num_tokens) if b in runs else [0] * num_tokens for b in range(len(rows))]
        counts = [min(len(runs.get(b, ())), num_tokens) for b in range(len(rows))]
        tokens = torch.tensor(drafts, dtype=torch.long).view(len(rows), num_tokens)  # [B, G]
        return Proposal(tokens, None, (ForwardTiming(0, time.perf_counter() - began),), deterministic=True,
                        num_draft=torch.tensor(counts, dtype=torch.long))


# -- drafter specs: what a configuration names, and how it becomes a proposer --------------------
class DrafterSpec(Protocol):
    """A drafter as configured: frozen, comparable, printable; `build` makes its proposer."""

    def build(self, target_model: torch.nn.Module, vocab_size: int, max_model_len: int | None) -> Proposer: ...


@dataclass(frozen=True)
class DraftModelSpec:
    """A separate draft model (already loaded; sharing the target's tokenizer)."""

    model: torch.nn.Module
    execution: str = "auto"  # see ModelRunner
    attention: str = "auto"  # see ModelRunner

    def build(self, target_model: torch.nn.Module, vocab_size: int, max_model_len: int | None) -> Proposer:
        return DraftModelProposer(self.model, vocab_size, max_model_len, self.execution, self.attention)


@dataclass(frozen=True)
class LayerSkipSpec:
    """The target with these decoder layers skipped (indices into its layer list)."""

    skip_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip_layers", tuple(sorted({int(i) for i in self.skip_layers})))

    @staticmethod
    def every_other(num_layers: int) -> "LayerSkipSpec":
        """The untuned baseline: skip layers 1, 3, 5, ... (keeps the first layer, about half the cost)."""
        return LayerSkipSpec(tuple(range(1, num_layers, 2)))

    def build(self, target_model: torch.nn.Module, vocab_size: int, max_model_len: int | None) -> Proposer:
        return LayerSkipProposer(target_model, self.skip_layers, vocab_size, max_model_len)


@dataclass(frozen=True)
class PromptLookupSpec:
    """Prompt lookup: match suffix n-grams of min_n..max_n tokens in the request's own tokens."""

    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def build(self, target_model: torch.nn.Module, vocab_size: int, max_model_len: int | None) -> Proposer:
        return PromptLookupProposer(vocab_size, self.min_n, self.max_n, max_model_len)


@dataclass(frozen=True)
class PredictionSpec:
    """Drafts the requests' predictions alone (`PredictionProposer`)."""

    def build(self, target_model: torch.nn.Module, vocab_size: int, max_model_len: int | None) -> Proposer:
        return PredictionProposer(max_model_len)


def target_vocab_size(model: torch.nn.Module) -> int:
    """V: the size of the target's output head (what the verifier uses)."""
    return int(model.get_output_embeddings().weight.shape[0])
