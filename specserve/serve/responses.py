"""One generation's OpenAI response bodies: whole, or as server-sent events (chunks, the usage
chunk, [DONE]), with log-probabilities rendered in the completions or the chat shape."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

from .continuation import Continuation
from .front_door import OpenAIError
from .reasoning import ReasoningSpec, ThoughtCount
from .tools import ToolPlan, without_index

# an alternative a grammar, allowed_token_ids or min_tokens forbids has logprob -inf, which JSON
# cannot carry: it is sent as this (as vLLM does), below any real token's
MIN_LOGPROB = -9999.0


# -- one generation, as events -------------------------------------------------------------------
@dataclass
class Piece:
    text: str
    finish_reason: str | None
    completion_tokens: int
    speculation: dict
    token_ids: list[int]  # generated so far
    logprobs: list[float] | None = None  # per token of token_ids, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_tokens: int = 0  # prompt tokens taken from shared KV blocks (usage.prompt_tokens_details)
    reasoning_tokens: int | None = None  # the final piece of a reasoning model's chat: its thinking's tokens
    stop_string: str | None = None  # the final piece of one a stop string ended: that string


class StreamFailed(RuntimeError):
    """A request that ended in failure after it was accepted: `error` is what the client is told."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class ResponseFormat:
    """OpenAI response bodies for one request (completion or chat; whole or SSE chunks)."""

    rid: str
    model: str
    chat: bool
    prompt_tokens: int
    gen: Continuation
    tokenizer: object = None  # renders tokens of log-probabilities
    logprobs: int | None = None  # asked: alternatives per token
    index: int = 0  # the choice's index (several prompts and/or n > 1)
    prompt_index: int = 0  # which prompt it answers (usage counts each prompt once)
    echo: "Echo | None" = None  # completions' echo: the prompt before the output (and its logprobs)
    tools: ToolPlan | None = None  # chat with tools: the output is read back as content and tool calls
    reasoning: ReasoningSpec | None = None  # a reasoning model's chat: its thinking split out of the content
    thoughts: ThoughtCount | None = None  # (with reasoning) counts the output's reasoning tokens

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self._split = None if self.reasoning is None else self.reasoning.split()
        self._texts: dict[int, str] = {}
        self._offset = 0  # characters of text before the next token whose log-probability goes out
        self.last: Piece | None = None  # the latest piece of this choice (its totals)

    def _token(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token])
        return self._texts[token]

    def _logprobs_body(self, piece: Piece, start: int) -> dict | None:
        """OpenAI's logprobs object for the tokens piece.token_ids[start:] (None when not asked)."""
        if self.logprobs is None or piece.logprobs is None:
            return None
        ids, values = piece.token_ids[start:], piece.logprobs[start:]
        tops = [[(a, max(av, MIN_LOGPROB)) for a, av in top] for top in piece.top_logprobs[start:]]
        if self.chat:
            def entry(token: int, value: float) -> dict:
                text = self._token(token)
                return {"token": text, "logprob": value, "bytes": list(text.encode())}
            return {"content": [{**entry(t, v), "top_logprobs": [entry(a, av) for a, av in top]}
                                for t, v, top in zip(ids, values, tops)], "refusal": None}
        return self._completion_logprobs(ids, values, tops)

    def _echo_logprobs(self) -> dict | None:
        """The prompt's part of a completion's logprobs (the first token has none)."""
        if self.logprobs is None or self.echo is None or self.echo.logprobs is None:
            return None
        entries = self.echo.logprobs
        return self._completion_logprobs(self.echo.token_ids, [None if e is None else e[0] for e in entries],
                                         [None if e is None else e[1] for e in entries])

    def _completion_logprobs(self, ids: list[int], values: list, tops: list) -> dict:
        """A completion's logprobs object for these tokens (a value and its alternatives may be
        None: an echoed prompt's first token); text offsets run on from the previous call's."""
        offsets = []
        for token in ids:
            offsets.append(self._offset)
            self._offset += len(self._token(token))
        return {"tokens": [self._token(t) for t in ids], "token_logprobs": values,
                "top_logprobs": [None if top is None else {self._token(a): av for a, av in top} for top in tops],
                "text_offset": offsets}

    def _choice(self, text: str | None, finish: str | None, first: bool = False, delta: bool = False,
                logprobs: dict | None = None, calls: list[dict] | None = None, thinking: str | None = None) -> dict:
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        shown = self.reasoning is not None and self.reasoning.include
        if delta:
            content = {"role": "assistant", "content": text or (None if calls else "")} if first \
                else ({"content": text} if text else {})
            if thinking and shown:
                content.update(dict.fromkeys(self.reasoning.fields, thinking))
            if calls:
                content["tool_calls"] = calls
            return {"index": self.index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message.update(dict.fromkeys(self.reasoning.fields, thinking if shown else None))
        if calls:
            message["tool_calls"] = without_index(calls)
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def _parts(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """Text that came -> (reasoning, content) to send: the reasoning None when the choice has
        not reasoned, the content None while it has not begun (a whole answer cut while thinking)."""
        if self._split is None:
            return None, text
        thinking, content = self._split.feed(text, final)
        return thinking if self._split.reasoned else None, content if self._split.answering else None

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    async def whole(self, pieces: AsyncIterator[Piece], return_token_ids: bool = False) -> dict:
        """This choice's whole body (raises StreamFailed)."""
        texts = []
        try:
            async for piece in pieces:
                texts.append(piece.text)
                self.last = piece
        finally:
            await pieces.aclose()  # runs _pieces' cleanup now, not at garbage collection
            self.gen.close()
        last = self.last
        prefix = self._echo_logprobs()
        text = ("" if self.echo is None else self.echo.text) + "".join(texts)
        thinking, content = self._parts(text, True)
        content, calls = (content, []) if self.tools is None or content is None else self.tools.read(content)
        body = self._envelope([self._choice(content, _finish(last.finish_reason, bool(calls)), calls=calls,
                                            logprobs=_joined(prefix, self._logprobs_body(last, 0)),
                                            thinking=thinking)], chunk=False)
        if return_token_ids:
            body["choices"][0]["token_ids"] = list(last.token_ids)
        return body

    async def chunks(self, pieces: AsyncIterator[Piece], return_token_ids: bool = False) -> AsyncIterator[dict]:
        """This choice's stream chunks (raises StreamFailed); no usage chunk, no [DONE]."""
        first, sent_ids = True, 0
        calls_from = self.tools.stream() if self.tools is not None else None
        try:
            if self.echo is not None:  # the prompt first, as its own chunk
                yield self._envelope([self._choice(self.echo.text, None, True, True, self._echo_logprobs())], True)
            async for piece in pieces:
                self.last = piece
                calls, finish = [], piece.finish_reason
                thinking, text = self._parts(piece.text, finish is not None)
                text = text or ""
                if calls_from is not None and (self._split is None or self._split.answering):
                    text, calls = calls_from.feed(text, finish is not None)  # (the content only)
                    finish = _finish(finish, calls_from.called)
                thinking = thinking if self.reasoning is not None and self.reasoning.include else None
                new_ids = (return_token_ids or self.logprobs is not None) and len(piece.token_ids) > sent_ids
                if text or thinking or calls or finish or first or new_ids:
                    logprobs = self._logprobs_body(piece, sent_ids)
                    chunk = self._envelope([self._choice(text, finish, first, True, logprobs, calls, thinking)],
                                           True)
                    if return_token_ids:
                        chunk["choices"][0]["token_ids"] = piece.token_ids[sent_ids:]
                    sent_ids = len(piece.token_ids)
                    if piece.finish_reason is not None:
                        chunk["speculation"] = piece.speculation
                    yield chunk
                    first = False
        finally:
            await pieces.aclose()
            self.gen.close()


Choice = tuple[ResponseFormat, AsyncIterator[Piece]]  # one generation's format and its pieces


@dataclass(frozen=True)
class Echo:
    """A completion's prompt as echoed: its text, its token ids and, when logprobs were asked, each
    token's (logprob, [(token, logprob)] alternatives), None for the first."""

    text: str
    token_ids: list[int]
    logprobs: list | None = None


class NoGeneration:
    """The generation of a `max_tokens: 0` echo: nothing to run, nothing to close."""

    def close(self) -> None:
        pass


async def nothing_generated() -> AsyncIterator[Piece]:
    yield Piece("", "length", 0, {}, [], [], [])


def _finish(reason: str | None, called: bool) -> str | None:
    """A choice that ended by itself with tool calls finished for them (one cut short stays "length")."""
    return "tool_calls" if called and reason == "stop" else reason


def _joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completion logprobs objects as one (lists concatenated); either may be None."""
    if first is None or second is None:
        return first if second is None else second
    return {key: first[key] + second[key] for key in first}


def usage(formats: list[ResponseFormat]) -> tuple[dict, dict]:
    """(usage, speculation) over every choice: each prompt's tokens once, every choice's output."""
    prompts = {f.prompt_index: f.prompt_tokens for f in formats}
    done = [f.last for f in formats if f.last is not None]
    completion = sum(p.completion_tokens for p in done)
    cached: dict[int, int] = {}  # per prompt: the most any of its choices took from shared blocks
    for f in formats:
        if f.last is not None:
            cached[f.prompt_index] = max(cached.get(f.prompt_index, 0), f.last.cached_tokens)
    speculation: dict = {}
    for p in done:
        for name, value in p.speculation.items():
            speculation[name] = speculation.get(name, 0) + value
    out = {"prompt_tokens": sum(prompts.values()), "completion_tokens": completion,
           "total_tokens": sum(prompts.values()) + completion,
           "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
    details = {}
    if any(f.reasoning is not None for f in formats) and len(done) == len(formats) and \
            all(p.reasoning_tokens is not None for p in done):  # (known once every choice has finished)
        details["reasoning_tokens"] = sum(p.reasoning_tokens for p in done)
    if "num_prediction_tokens" in speculation:  # a prediction was sent: what became of its drafts
        accepted = speculation["num_accepted_prediction_tokens"]
        details.update(accepted_prediction_tokens=accepted,
                       rejected_prediction_tokens=speculation["num_prediction_tokens"] - accepted)
    if details:
        out["completion_tokens_details"] = details
    return out, speculation


async def whole_body(choices: list[Choice], return_token_ids: bool = False, keep: int | None = None) -> dict:
    """One response body for every choice; raises the error the client gets (OpenAIError) of the
    first that fails, the other generations cancelled. keep: per prompt, only the `keep` choices
    with the highest log-probability per token (`best_of`; usage still counts every one)."""
    tasks = [asyncio.ensure_future(fmt.whole(pieces, return_token_ids)) for fmt, pieces in choices]
    try:
        bodies = await asyncio.gather(*tasks)
    except StreamFailed as err:
        raise err.error from err
    finally:
        for task in tasks:
            task.cancel()
    formats = [fmt for fmt, _ in choices]
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies] if keep is None else best_of(bodies, formats, keep)
    body["usage"], body["speculation"] = usage(formats)
    return body


def best_of(bodies: list[dict], formats: list[ResponseFormat], keep: int) -> list[dict]:
    """Per prompt, its `keep` choices of the highest mean log-probability per generated token
    (the generation's own logprobs, asked for or not; ties: the earlier candidate; a choice with no
    token last), best first, indexed prompt by prompt as n choices are."""
    ranked: dict[int, list[tuple[float, int]]] = {}
    for k, fmt in enumerate(formats):
        values = fmt.last.logprobs or []
        score = sum(values) / len(values) if values else float("-inf")
        ranked.setdefault(fmt.prompt_index, []).append((-score, k))
    choices = []
    for prompt in sorted(ranked):
        for rank, (_, k) in enumerate(sorted(ranked[prompt])[:keep]):
            choices.append({**bodies[k]["choices"][0], "index": prompt * keep + rank})
    return choices


async def sse_stream(choices: list[Choice], include_usage: bool, return_token_ids: bool = False,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
    """Every choice's chunks as they come (interleaved, each with its index; `continuous_usage`:
    each with the usage of every choice so far), then the usage chunk and [DONE]; a choice that
    fails ends the stream with its error event (the others cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(fmt: ResponseFormat, pieces) -> None:
        try:
            async for chunk in fmt.chunks(pieces, return_token_ids):
                await queue.put(chunk)
        except StreamFailed as err:
            await queue.put(err)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(fmt, pieces)) for fmt, pieces in choices]
    formats = [fmt for fmt, _ in choices]
    failed = False
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, StreamFailed):
                failed = True
                yield sse_event(item.error.body())
                break
            else:
                if continuous_usage:
                    item["usage"] = usage(formats)[0]
                yield sse_event(item)
    finally:
        for task in tasks:
            task.cancel()
    if include_usage and not failed and any(f.last is not None for f in formats):
        chunk = formats[0]._envelope([], True)
        chunk["usage"], chunk["speculation"] = usage(formats)
        yield sse_event(chunk)
    yield "data: [DONE]\n\n"


# Characters that JSON leaves raw but some line splitters (Python's str.splitlines, used by
# several SSE clients) treat as line breaks: escaped, so that one event is always one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029",
                              "\x1c": "\\u001c", "\x1d": "\\u001d", "\x1e": "\\u001e"})


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"
