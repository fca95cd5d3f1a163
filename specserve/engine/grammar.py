"""Structured output: a grammar's token mask on the target at every verified position, and on the
draft's proposals, with the matcher advanced and rolled back as the verdict says.

A request with `SamplingParams.grammar` (a JSON schema, any JSON object, a regex or a Lark grammar)
may only emit tokens its grammar allows after the tokens before them. Inside a verified block the
tokens before position j are the row's committed output plus drafts 0..j-1, so the target's mask at
j is the grammar's after those drafts: `GrammarBook.verify_masks` computes all of them from the
committed state without consuming anything (llguidance's masks-along-drafts call), and `-inf` goes
on every disallowed logit after penalties and bias. The rejection rule then needs only p exact: a
draft the grammar forbids has p = 0 and is rejected there, and the next token comes from the masked
residual. Positions after a forbidden draft are never used (they are left unmasked, so no row is
ever all `-inf`).

The draft masks its own proposals too (`DraftMasks`, used by `DraftModelProposer`, layer skip and
the feature head):
at each draft position it fills the mask from the row's matcher, drafts from the masked
distribution (its q is that masked distribution, which is what the rule divides by), and
consumes the token it drafted; at the end it rolls the matcher back to the committed state. That
costs a host read per draft position, only in steps with a grammar row, and keeps the drafts valid
so that acceptance stays high. A drafter that does not mask (prompt lookup) loses acceptance,
never correctness.

State: each process that verifies or drafts keeps a matcher per request (`GrammarBook`), synced at
every call to the committed tokens the step sends (`GrammarRows.outputs`): consumed forward when
the request has advanced, rolled back when it is behind (a rejected step), rebuilt from the tokens
on a miss (a new process after a failover). So the truth stays with the caller, as for the caches.

The grammar library is llguidance (the one vLLM and SGLang also offer): its tokenizer view is built
lazily from the model's tokenizer the first time a grammar row is met.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "lark")
# JSON without free whitespace: compact output, and a small model cannot loop on blank lines
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_GRAMMARS = 64  # compiled grammars a process keeps (least recently used dropped)
MAX_MATCHERS = 4096  # requests' matchers a process keeps (a freed or dropped one is rebuilt on demand)
# A grammar row whose mask at its committed output allows at least this share of the vocabulary
# (free text inside a JSON string, a reasoning model's thinking before its grammar) drafts unmasked
# in that step (`GrammarBook.draft_rows`): no host read per draft position, and where every
# grammar row is so, the step's draft loop is the captured one.
WIDE_SHARE = 0.9
# whitespace allowed between a reasoning's end and the grammar (Qwen3 writes "\n\n"): bounded, so
# that a small model cannot loop on blank lines there either
MAX_SEPARATOR = 4


@dataclass(frozen=True)
class Reasoning:
    """Free text a reasoning model writes before its grammar applies: the grammar holds from the
    first `end` on (a little whitespace after it allowed). open: the prompt already opened the reasoning,
    so the output starts inside it; otherwise the output either opens it with `start` first or
    does not reason at all."""

    start: str
    end: str
    open: bool

    def around(self, answer: dict) -> str:
        """llguidance's text of the whole output: the reasoning, then `answer` (one grammar entry
        of llguidance's top-level form) as a subgrammar. The reasoning is a lazy lexeme, so it
        ends at the first `end`; up to MAX_SEPARATOR whitespace characters may follow it."""
        head = "reasoning" if self.open else f"{_literal(self.start)} reasoning"
        rules = [f"start: {head} SEP? @answer" + ("" if self.open else " | @answer"),
                 f"reasoning[suffix={_literal(self.end)}]: /(?s:.*)/",
                 r"SEP: /[ \t\r\n]{1,%d}/" % MAX_SEPARATOR]
        return json.dumps({"grammars": [{"lark_grammar": "\n".join(rules)}, {**answer, "name": "answer"}]})


def _literal(text: str) -> str:
    """A Lark string literal of `text` (JSON's string escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. kind: "json_object" (any JSON object), "json_schema"
    (source: the schema as JSON text), "regex" (source: the pattern, matched in full) or "lark"
    (source: a Lark grammar, llguidance's dialect). reasoning: the output may reason first, and
    the grammar applies after its reasoning (a reasoning model's chat)."""

    kind: str
    source: str = ""
    reasoning: Reasoning | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} grammar needs its source text")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be a JSON object")

    @staticmethod
    def json_schema(schema: dict | bool) -> "Grammar":
        return Grammar("json_schema", json.dumps(schema, sort_keys=True))

    def after_reasoning(self, reasoning: Reasoning | None) -> "Grammar":
        """This grammar, applying only after the output's reasoning (None: from its first token)."""
        return dataclasses.replace(self, reasoning=reasoning)

    def text(self) -> str:
        """The grammar in llguidance's own form."""
        from llguidance import LLMatcher

        if self.reasoning is not None:
            own = {"lark_grammar": self.source} if self.kind == "lark" else \
                json.loads(dataclasses.replace(self, reasoning=None).text())["grammars"][0]
            return self.reasoning.around(own)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(self.source)


@dataclass(frozen=True)
class GrammarRows:
    """The grammar rows of one step's B rows (pickled with the step's sampling)."""

    request_ids: list[str]  # [B]
    grammars: list[Grammar | None]  # [B]; None: the row is free
    outputs: list[list[int] | None]  # [B] each grammar row's committed output tokens (None: free rows)
    # [B, V/32] int32 bit words (host), where `GrammarBook.draft_rows` made these rows: each masked
    # row's mask after its committed output, which a draft loop's first position then reuses
    first_masks: torch.Tensor | None = field(default=None, compare=False)

    @staticmethod
    def of(seqs: Sequence) -> "GrammarRows | None":
        """For these sequences (anything with `.request_id`, `.params`, `.output`); None when no
        row has a grammar."""
        grammars = [s.params.grammar for s in seqs]
        if all(g is None for g in grammars):
            return None
        return GrammarRows([s.request_id for s in seqs], grammars,
                           [list(s.output) if g is not None else None for s, g in zip(seqs, grammars)])

    def __iter__(self):
        return iter(zip(self.request_ids, self.grammars, self.outputs))

    def select(self, rows: list[int]) -> "GrammarRows | None":
        """These rows only (caller indices); None when none of them has a grammar."""
        grammars = [self.grammars[b] for b in rows]
        if all(g is None for g in grammars):
            return None
        return GrammarRows([self.request_ids[b] for b in rows], grammars, [self.outputs[b] for b in rows])


def grammar_ends(tokenizer, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids a complete grammar allows: the model's EOS ids, the tokenizer's own when the model
    declares none."""
    return sorted(eos_token_ids) or [tokenizer.eos_token_id]


def tokenizer_view(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """llguidance's view of a HF fast tokenizer over max(V, its own size) ids (a model head may be
    padded past the tokenizer, or, in tests, cover only part of it); the grammar's end allows
    `grammar_ends`."""
    import llguidance.hf

    eos = grammar_ends(tokenizer, eos_token_ids)
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos)


@functools.lru_cache(maxsize=MAX_GRAMMARS)
def check_grammar(grammar: Grammar, view) -> str:
    """'' when the grammar compiles against this tokenizer view, else why not (for a 400). Kept
    for the MAX_GRAMMARS latest (grammar, view) pairs: a schema sent with every request (and
    checked by the ingress, then the engine) is compiled for the check once."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(grammar.text(), view)
    except Exception as err:  # (whatever the library raises for a text it cannot read is the client's error)
        return str(err) or type(err).__name__


class _Entry:
    """A request's matcher and the tokens it has consumed."""

    def __init__(self, grammar: Grammar, matcher) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self.tokens: list[int] = []


class GrammarBook:
    """The matchers of one process's requests, synced to each call's committed tokens.

    tokenizer: a callable returning the model's HF fast tokenizer (called once, at the first
    grammar row); vocab_size: V, the target's output size; eos_token_ids: the model's EOS ids."""

    def __init__(self, tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._ends: list[int] = list(self.eos_token_ids)  # (the tokenizer's EOS too, once `view` was built)
        self._view = None
        self._executor = None
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()  # grammar -> a fresh matcher to copy
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    @property
    def view(self):
        if self._view is None:
            tokenizer = self._tokenizer()
            self._ends = grammar_ends(tokenizer, self.eos_token_ids)
            self._view = tokenizer_view(tokenizer, self.vocab_size, self.eos_token_ids)
        return self._view

    def free(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._entries)

    def matcher(self, request_id: str, grammar: Grammar, tokens: list[int]):
        """request_id's matcher, having consumed exactly `tokens` (its committed output)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.grammar != grammar or entry.matcher.is_error():
            entry = self._entries[request_id] = _Entry(grammar, self._fresh(grammar))
        self._entries.move_to_end(request_id)
        while len(self._entries) > MAX_MATCHERS:
            self._entries.popitem(last=False)
        held = entry.tokens
        common = _common_prefix(held, tokens)
        if common < len(held):
            if entry.matcher.rollback(len(held) - common):
                del held[common:]
            else:  # (a rollback the matcher refuses: start over)
                entry.matcher, held[:] = self._fresh(grammar), []
                common = 0
        for token in tokens[common:]:
            if not entry.matcher.consume_token(token):
                break  # a token its grammar forbids: an error state, whose masks allow EOS only (`_allowed`)
            held.append(token)
        return entry.matcher

    def verify_masks(self, rows: GrammarRows, drafts: list[list[int]], num_draft: list[int], width: int,
                     device) -> torch.Tensor:
        """The target's masks for one verify: [B, W, V] bool, True where position j of row b may
        take the token (after its committed output and drafts 0..j-1); free rows and positions
        past a row's first forbidden draft allow everything."""
        import llguidance.torch as lt

        batch = len(rows.request_ids)
        bitmask = torch.zeros(batch * width, _words(self.view.vocab_size), dtype=torch.int32)  # [B*W, V/32]
        entries, filled = [], torch.zeros(batch, width, dtype=torch.bool)
        for b, (request_id, grammar, output) in enumerate(rows):
            if grammar is None:
                continue
            matcher = self.matcher(request_id, grammar, output)
            entries.append((matcher, b * width, drafts[b][: min(num_draft[b], width - 1)]))
            filled[b, : len(entries[-1][2]) + 1] = True
        drafting = [e for e in entries if e[2]]
        if drafting:
            lt.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafting, bitmask)
        if len(drafting) < len(entries):  # rows without drafts (the call refuses an empty draft list)
            lt.fill_next_token_bitmask_par(self.executor, [(m, i) for m, i, d in entries if not d], bitmask)
        return self._allowed(bitmask, filled.view(-1), device).view(batch, width, self.vocab_size)

    def draft_rows(self, rows: GrammarRows, wide: float | None = WIDE_SHARE) -> GrammarRows | None:
        """The rows whose drafts are masked in this step: those whose grammar, after the row's
        committed output, allows less than `wide` of the vocabulary (None: every grammar row).
        The others draft unmasked, which is lossless: the target is masked at every position, so a
        draft the grammar forbids is rejected where it stands. Host work only (one mask per row)."""
        if wide is None:
            return rows
        import llguidance.torch as lt

        held = [b for b, g in enumerate(rows.grammars) if g is not None]
        matchers = [self.matcher(rows.request_ids[b], rows.grammars[b], rows.outputs[b]) for b in held]
        bitmask = torch.zeros(len(held), _words(self.view.vocab_size), dtype=torch.int32)  # [N, V/32]
        lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        share = (_unpack(bitmask, self.vocab_size).sum(dim=-1) / self.vocab_size).tolist()  # [N] (host)
        narrow = {b for b, part in zip(held, share) if part < wide}
        if not narrow:
            return None
        first = torch.zeros(len(rows.request_ids), bitmask.shape[1], dtype=torch.int32)  # [B, V/32]
        first[held] = bitmask
        return GrammarRows(rows.request_ids, [g if b in narrow else None for b, g in enumerate(rows.grammars)],
                           [o if b in narrow else None for b, o in enumerate(rows.outputs)], first)

    def draft_masks(self, matchers: list, device) -> torch.Tensor:
        """[N, V] bool: each matcher's next-token mask now (None entries allow everything)."""
        import llguidance.torch as lt

        bitmask = torch.zeros(len(matchers), _words(self.view.vocab_size), dtype=torch.int32)
        entries = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if entries:
            lt.fill_next_token_bitmask_par(self.executor, entries, bitmask)
        filled = torch.tensor([m is not None for m in matchers], dtype=torch.bool)
        return self._allowed(bitmask, filled, device)

    @property
    def executor(self):
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor

    def _fresh(self, grammar: Grammar):
        """A matcher at the grammar's start (compiled once per grammar, then copied)."""
        from llguidance import LLMatcher

        proto = self._compiled.get(grammar)
        if proto is None:
            proto = self._compiled[grammar] = LLMatcher(self.view, grammar.text(), log_level=0)
            while len(self._compiled) > MAX_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return proto.deep_copy()

    def _allowed(self, bitmask: torch.Tensor, filled: torch.Tensor, device) -> torch.Tensor:
        """bitmask [N, V/32] int32 (host), filled [N] (rows whose mask was computed) -> [N, V]
        bool on the device. A filled row that allows no token of the model's (a matcher in an error
        state, or past its end, which the library leaves empty at a draft position after the
        end) allows the ids a complete grammar allows (`grammar_ends`), as a matcher's own mask at
        its end does, so that the request ends there (all tokens where none of those is the
        model's); an unfilled row allows all."""
        allowed = _unpack(bitmask.to(device), self.vocab_size)  # [N, V]
        allowed[~filled.to(device)] = True
        empty = ~allowed.any(dim=-1)  # [N]
        if bool(empty.any()):
            eos = [t for t in self._ends if t < self.vocab_size]
            fallback = torch.zeros(self.vocab_size, dtype=torch.bool, device=device) if eos else \
                torch.ones(self.vocab_size, dtype=torch.bool, device=device)
            fallback[eos] = True
            allowed[empty] = fallback
        return allowed


class DraftMasks:
    """The grammar rows of one draft loop: `apply` masks draft position j's logits [B', V] by each
    row's grammar after its drafts so far, `advance` consumes the tokens drafted there, `close`
    rolls every matcher back to the committed state. order: the caller row of each of the loop's
    B' rows (-1: a padding row, free)."""

    def __init__(self, book: GrammarBook, rows: GrammarRows, order: list[int]) -> None:
        self.book = book
        by_caller = [book.matcher(r, g, o) if g is not None else None for r, g, o in rows]
        self.matchers = [by_caller[i] if 0 <= i < len(by_caller) else None for i in order]  # [B']
        self.active = [m is not None for m in self.matchers]  # [B'] rows still masked
        self.consumed = [0] * len(order)  # [B'] tokens each matcher consumed in this loop
        self.first = None if rows.first_masks is None else \
            rows.first_masks[[max(i, 0) for i in order]]  # [B', V/32]: position 0's masks, already made

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[B', V] target-vocabulary logits -> the same with each grammar row's forbidden tokens at -inf."""
        live = [m if a else None for m, a in zip(self.matchers, self.active)]
        if self.first is not None:  # (the first position: every row's matcher still at its committed output)
            filled = torch.tensor([m is not None for m in live], dtype=torch.bool)
            allowed = self.book._allowed(self.first, filled, logits.device)
            self.first = None
        else:
            allowed = self.book.draft_masks(live, logits.device)  # [B', V]
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, tokens: torch.Tensor) -> None:
        """tokens [B'] drafted at this position (target ids): each grammar row's matcher consumes
        its own; a row past its grammar's end (an EOS drafted) drafts on unmasked."""
        for i, token in enumerate(tokens.tolist()):
            matcher = self.matchers[i]
            if not self.active[i]:
                continue
            if matcher.is_stopped() or matcher.validate_tokens([token]) != 1:
                self.active[i] = False  # (never consumed: an invalid token would leave an error state)
                continue
            matcher.consume_token(token)
            self.consumed[i] += 1

    def close(self) -> None:
        """Every matcher back to the committed state it started from."""
        for matcher, count in zip(self.matchers, self.consumed):
            if count:
                matcher.rollback(count)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bit words -> [N, V] bool (bit k of word w is token 32w + k)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    unpacked = (bitmask[:, :, None] >> bits) & 1  # [N, W, 32]
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
