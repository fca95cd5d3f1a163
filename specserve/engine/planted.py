"""A drafter whose acceptance rate is planted: for benchmarks and load tests, never for users.

`PlantedProposer` runs a real draft model exactly as `DraftModelProposer` does (the same device
loop, the same CUDA graph in graph mode), so every draft forward costs what it costs; only the
token it proposes is replaced. For a greedy row whose context holds a *reference* (the target's
own greedy continuation of that prompt, measured beforehand), draft position j proposes the
reference's token with probability α and a certainly wrong token otherwise, so a row accepts k
drafts with probability α^k (1-α): the i.i.d. model of Leviathan et al., with α set rather than
hoped for. Verification is untouched, so outputs stay the target's whatever is proposed.

References are matched by content, not by request id: a request is matched to every reference
whose tokens its own (prompt chunks, then committed tokens) equal so far, so it works behind any
server that assigns ids of its own (`speculation.planted` in a served config). Per cache (a
request's, or a pipelined branch's fork of it) the proposer tracks how many leading positions
equal the reference; a call drafting from a context that left it (a wrong speculative token)
gets wrong drafts, as a real drafter's would be useless there.

Rows with no matching reference, and sampled rows, get the draft model's own choice (and its q):
planting is only ever exact for greedy verification, so a sampled row must be proposed from the
distribution the rejection rule is told about.

Runner-ups (the pipelined step's branch starts): the reference's token with probability `second`
where the planted draft is wrong, a wrong token otherwise.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .model_runner import RowInput
from .proposers import DraftModelProposer, Proposal
from .sampling import BatchSampling

OWN = -1  # in a planted-token buffer: use the draft model's own choice at this position


def read_references(path: str | Path) -> list[list[int]]:
    """A JSON-lines file, one {"tokens": [prompt + target greedy output]} per line."""
    lines = Path(path).read_text().splitlines()
    return [list(map(int, json.loads(line)["tokens"])) for line in lines if line.strip()]


def write_references(path: str | Path, references: Sequence[Sequence[int]]) -> None:
    Path(path).write_text("".join(json.dumps({"tokens": list(map(int, r))}) + "\n" for r in references))


@dataclass
class _Held:
    """What one cache holds relative to the references: `good` leading positions equal to each of
    `candidates` (indices of the references still consistent with it)."""

    good: int = 0
    candidates: tuple[int, ...] | None = None  # None: not yet matched against any (an empty cache)


@dataclass
class PlantedCounts:
    proposed: int = 0  # draft positions proposed for greedy rows holding a reference
    planted: int = 0  # of those, given the reference's token
    off_reference: int = 0  # of those, in a context that had left its reference
    own: int = 0  # draft positions given the draft model's own choice (no reference, or sampled)


class PlantedProposer(DraftModelProposer):
    """A DraftModelProposer with planted acceptance α (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, alpha: float,
                 references: Sequence[Sequence[int]] = (), seed: int = 0, second: float = 0.0,
                 max_model_len: int | None = None, execution: str = "auto", attention: str = "auto") -> None:
        if not (0.0 <= alpha <= 1.0 and 0.0 <= second <= 1.0):
            raise ValueError("planted alpha and second must lie in [0, 1]")
        super().__init__(model, vocab_size, max_model_len, execution, attention)
        self.alpha, self.second = alpha, second
        self.rng = random.Random(seed)
        self.counts = PlantedCounts()
        self.references: list[list[int]] = []
        self._held: dict[str, _Held] = {}  # cache name -> its standing against the references
        self._chosen: torch.Tensor | None = None  # [B, G] this call's planted drafts (OWN: own choice)
        self._runner_ups: torch.Tensor | None = None  # [B, G]
        self.set_references(references)

    def set_references(self, references: Sequence[Sequence[int]]) -> None:
        self.references = [list(r) for r in references]
        self._held.clear()

    # -- caches --------------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._held.pop(request_id, None)

    def fork(self, request_id: str, branch: str, length: int) -> None:
        super().fork(request_id, branch, length)
        held = self._held.get(request_id, _Held())
        self._held[branch] = _Held(min(held.good, length), held.candidates)

    def adopt(self, branch: str, request_id: str) -> None:
        super().adopt(branch, request_id)
        self._held[request_id] = self._held.pop(branch, _Held())

    def prefill(self, rows: list[RowInput]):
        """Prompt chunks (chunked prefill) extend the reference-holding prefix like any row."""
        for row in rows:
            self._held[row.request_id] = self._extend(row)
        return super().prefill(rows)

    # -- proposing -----------------------------------------------------------------------------
    def propose(self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling,
                uniforms: torch.Tensor | None, alternates: bool = False) -> Proposal:
        self.runner.check(rows)
        greedy = [True] * len(rows) if sampling.all_greedy else (sampling.temperature == 0).tolist()
        planted = [self._plant(r, num_tokens) if g else ([OWN] * num_tokens, [OWN] * num_tokens)
                   for r, g in zip(rows, greedy)]
        self.counts.own += num_tokens * sum(chosen[0] == OWN for chosen, _ in planted)
        self._chosen = torch.tensor([chosen for chosen, _ in planted], dtype=torch.long)  # [B, G]
        self._runner_ups = torch.tensor([ups for _, ups in planted], dtype=torch.long)  # [B, G]
        return super().propose(rows, num_tokens, sampling, uniforms, alternates=alternates)

    def _extend(self, row: RowInput) -> _Held:
        """This row's cache's standing once `row` is cached: still on its references (good = the
        row's end), left them (good stays below; candidates kept), or matching none (candidates ())."""
        held = _Held() if row.start == 0 else self._held.get(row.request_id, _Held())
        if held.good < row.start or held.candidates == ():
            return held
        end = row.start + len(row.tokens)
        pool = range(len(self.references)) if held.candidates is None else held.candidates
        alive = tuple(i for i in pool if self.references[i][row.start:end] == row.tokens)
        if alive:
            return _Held(end, alive)
        return _Held(row.start, () if held.candidates is None else held.candidates)

    def _plant(self, row: RowInput, num_tokens: int) -> tuple[list[int], list[int]]:
        """-> (this greedy row's G drafts, their runner-ups); OWN where no reference applies."""
        held = self._extend(row)
        if not held.candidates:
            self._held[row.request_id] = held
            return [OWN] * num_tokens, [OWN] * num_tokens
        reference = self.references[held.candidates[0]]
        end = row.start + len(row.tokens)
        chosen, ups = [], []
        for j in range(num_tokens):
            true = reference[end + j] if held.good == end and end + j < len(reference) else None
            right = true is not None and self.rng.random() < self.alpha
            chosen.append(true if right else self._wrong(true))
            covered = not right and true is not None and self.rng.random() < self.second
            ups.append(true if covered else self._wrong(true, chosen[-1]))
            self.counts.proposed += 1
            self.counts.planted += right
            self.counts.off_reference += held.good != end
        good = held.good
        for j, token in enumerate(chosen[: num_tokens - 1]):  # the cache holds the first G-1 drafts
            if good == end + j and end + j < len(reference) and token == reference[end + j]:
                good += 1
        self._held[row.request_id] = _Held(good, held.candidates)
        return chosen, ups

    def _wrong(self, *avoid: int | None) -> int:
        """A random token other than those given."""
        token = self.rng.randrange(self.vocab_size)
        while token in avoid:
            token = (token + 1) % self.vocab_size
        return token

    # -- inside the device loop (static buffers: a captured loop reads them at fixed addresses) --
    def _static_inputs(self, staged, num_tokens, sampling, uniforms, flags):
        buffers = super()._static_inputs(staged, num_tokens, sampling, uniforms, flags)
        if "chosen" not in buffers:
            shape, device = (staged.padded, num_tokens), self.runner.device
            buffers["chosen"] = torch.full(shape, OWN, dtype=torch.long, device=device)
            buffers["runner_ups"] = torch.full(shape, OWN, dtype=torch.long, device=device)
        order = staged.sorted_to_caller  # [B'] caller row of each sorted row
        for name, host in (("chosen", self._chosen), ("runner_ups", self._runner_ups)):
            buffers[name].copy_(host.to(self.runner.device, non_blocking=True).index_select(0, order))
        return buffers

    def _choose(self, logits, sampling, flags, inputs, j, masks=None):
        token, q = super()._choose(logits, sampling, flags, inputs, j, masks)  # the draft's own (its cost is real)
        planted = inputs["chosen"][:, j]  # [B']
        return torch.where(planted == OWN, token, planted), q

    def _runner_up(self, logits, inputs, j):
        own = super()._runner_up(logits, inputs, j)
        planted = inputs["runner_ups"][:, j]  # [B']
        return torch.where(planted == OWN, own, planted)
