"""What every route of the ingress (openai_api.py) stands on: the tokenizer and its thread pool,
the chat template, the checks a request passes before anything runs (its model, limits, prompt
size, grammar), the generations it starts on a coordinator replica (continued on another if one is
lost) and the text pieces they stream back (incremental detokenization, stop strings). Routes
differ only in how they read a request and write its answer (responses.py, responses_api.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, NamedTuple

from fastapi import Request
from fastapi.responses import StreamingResponse
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from specserve.config import AppConfig
from specserve.engine.grammar import Grammar, check_grammar, tokenizer_view

from .background import BackgroundRuns
from .checks import check_limits, kept_tokens, prediction_ids, refuse, sampling_params
from .continuation import Continuation, EngineLost
from .conversation_store import ConversationClient
from .coordinator import Accepted, Delta, Failed, GenerateRequest, Rejected
from .front_door import (Door, FrontDoor, KeyLimits, OpenAIError, check_unicode, parse_keys, token_floor,
                         warn_if_public)
from .reasoning import ReasoningSpec, ThoughtCount, check_tags
from .response_store import StoreClient
from .responses import (Echo, NoGeneration, Piece, ResponseFormat, StreamFailed, nothing_generated, sse_stream,
                        whole_body)
from .schema import ChatCompletionRequest, Conversation, SamplingRequest, format_grammar
from .templates import ChatTemplate
from .text import IncrementalDetokenizer, StopStrings, TextRules, shown_ids
from .tools import ToolPlan, prompt_messages

logger = logging.getLogger("specserve.ingress")

RETRY_AFTER_S = 1  # what a 429 (full queue) or 503 (engine lost / unavailable) tells clients to wait
SHED_WINDOW_S = 0.2  # after a coordinator's queue_full, new requests are refused here for this long


def overloaded(message: str) -> OpenAIError:
    return OpenAIError(429, message, None, "queue_full", "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)})


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, None, "engine_unavailable", "server_error", {"Retry-After": str(RETRY_AFTER_S)})


class Rendered(NamedTuple):
    """A chat as its template renders it, its tool plan, and its text's token ids."""

    text: str
    plan: ToolPlan | None
    ids: list[int]


class ChatPrompt(NamedTuple):
    ids: list[int]
    max_tokens: int
    length_param: str  # the parameter a prompt too long for its max tokens is refused under
    tools: ToolPlan | None
    reasoning: ReasoningSpec | None


MODEL_CARD_WAIT_S = 2.0  # /v1/models: how long the engine's context is asked for before the card goes without it


class Ingress:
    """One ingress replica's state (tokenizer, pools, limits, the store's client) and the steps
    its routes share; the routes themselves are OpenAIServer's (openai_api.py)."""

    def __init__(self, coordinator: DeploymentHandle, config: AppConfig, store: DeploymentHandle | None = None,
                 conversations: DeploymentHandle | None = None) -> None:
        from specserve.models.loading import load_tokenizer

        self.coordinator = coordinator
        self.config = config
        # the Responses API's store: the app's deployment, else (in process) one of this process
        self._store = StoreClient(store, config.responses)
        self._conversations = ConversationClient(conversations, config.responses)  # (the Conversations API's)
        self.tokenizer = load_tokenizer(config.target, config.tokenizer)
        self._info: dict | None = None
        self._grammar_view = None  # llguidance's view of the tokenizer, built at the first response_format
        self._chat = ChatTemplate(self.tokenizer, config.chat_template, config.default_chat_template_kwargs)
        if config.reasoning is not None:  # (a tag the detokenizer hides could never be split at)
            check_tags(self.tokenizer, config.reasoning.start, config.reasoning.end)
        self._shed_until = 0.0  # after a full coordinator queue: refuse at once until then (monotonic s)
        # requests continued on another coordinator replica after losing theirs, and given up on
        self.continuations = {"continuations": 0, "given_up": 0}
        self._engine_answered = float("-inf")  # when a coordinator last answered a request (monotonic s)
        self._readiness_asked = float("-inf")  # when traffic last made us ask the controller (monotonic s)
        self._ready_pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-ready")  # never starved by others
        front = config.front_door
        keys = parse_keys(config.api_key, os.environ.get("SPECSERVE_API_KEY"))
        if front.require_api_key and not keys:
            raise RuntimeError("front_door.require_api_key is set but no API key is configured: set "
                               "SPECSERVE_API_KEY in the ingress replicas' environment (or api_key)")
        self.door = Door(keys, KeyLimits(front.per_key.max_concurrent_requests, front.per_key.tokens_per_minute),
                         front.max_request_bytes)
        self._background = BackgroundRuns(self._store, self.door.limits)  # (the Responses API's background responses)
        self._pool = ThreadPoolExecutor(front.threads, thread_name_prefix="specserve-tokenize")
        # the fewest tokens a text can become, without tokenizing (None: no proven bound, no pre-check)
        self._token_floor = token_floor(self.tokenizer)
        if self._token_floor is None:
            logger.warning("this tokenizer can map unboundedly many characters to one token: prompts are "
                           "tokenized without a length pre-check (the body limit still applies)")
        if not keys:
            threading.Thread(target=warn_if_public, daemon=True).start()

    @property
    def reasoning_field(self) -> str | None:
        """The field a chat answer carries a reasoning model's thinking in (None: not one)."""
        return self.config.reasoning.fields[0] if self.config.reasoning is not None else None

    async def info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self.coordinator.info.remote()
                self._engine_answered = time.monotonic()
            except Exception as err:  # no coordinator replica reachable (yet)
                raise unavailable(f"the engine is unavailable: {type(err).__name__}") from err
        return self._info

    @staticmethod
    async def _call(method):
        """method.remote() awaited, cancelled if the caller gives up (a timeout)."""
        response = method.remote()
        try:
            return await response
        except asyncio.CancelledError:
            if hasattr(response, "cancel"):  # a DeploymentResponse (a plain coroutine in tests)
                response.cancel()
            raise

    async def _model_card(self) -> dict:
        """The served model, at once: its context as the engine said it (asked for up to
        MODEL_CARD_WAIT_S; while no engine replica answers, as configured, or left out), so that
        a client listing models while the engine starts is not held until it is ready."""
        card = {"id": self.config.served_model_name, "object": "model", "created": 0, "owned_by": "specserve"}
        try:
            info = await asyncio.wait_for(self.info(), MODEL_CARD_WAIT_S)
            return {**card, "max_model_len": info["max_model_len"]}
        except (asyncio.TimeoutError, OpenAIError):
            known = self.config.max_model_len
            return card if known is None else {**card, "max_model_len": known}

    async def _echo(self, prompt: str | list[int], ids: list[int], logprobs: int | None) -> Echo:
        """A prompt as `echo` shows it, scored by the target when logprobs are asked."""
        text = prompt if isinstance(prompt, str) else await self._offload(self.tokenizer.decode, ids)
        if logprobs is None:
            return Echo(text, ids)
        try:
            scored = await self.coordinator.prompt_logprobs.remote(ids, logprobs)
        except ValueError as err:
            raise OpenAIError(400, str(err), "prompt") from err
        except Exception as err:
            raise unavailable(f"the engine is unavailable: {type(err).__name__}") from err
        return Echo(text, ids, scored)

    async def _chat_prompt(self, body: ChatCompletionRequest, length_param: str = "max_tokens",
                           rendered: "Rendered | None" = None) -> "ChatPrompt":
        """A chat request checked and rendered: its prompt's ids, its max_tokens (by default all
        that fits), its tool plan and its reasoning. `rendered`: this very chat as `_rendered`
        gave it (not rendered and tokenized again)."""
        self._check(body)
        text, plan = (rendered.text, rendered.plan) if rendered is not None else await self._render(body)
        sent = body.max_completion_tokens or body.max_tokens
        keep = kept_tokens(body, (await self.info())["max_model_len"])
        if keep is None:
            await self._precheck(text, None, sent or 1, "messages", length_param)
        ids = rendered.ids if rendered is not None else await self._offload(self._encode, text, "messages", False)
        ids = ids if keep is None else ids[-keep:]
        max_tokens = sent if sent is not None else await self._room(len(ids))
        self._check_choices(body.n)
        return ChatPrompt(ids, max_tokens, length_param if sent is not None else "messages", plan,
                          ReasoningSpec.of(self.config.reasoning, text, body.include_reasoning))

    async def _rendered(self, body: ChatCompletionRequest, param: str = "messages") -> "Rendered":
        """A chat checked, rendered and tokenized, whether or not it fits the context (`param`:
        what a text that cannot be tokenized is a 400 about)."""
        self._check(body)
        text, plan = await self._render(body)
        return Rendered(text, plan, await self._offload(self._encode, text, param, False))

    async def _render(self, body: Conversation) -> tuple[str, ToolPlan | None]:
        """A conversation as the chat template renders it, within the ingress's limits, and its tool plan."""
        front = self.config.front_door
        if len(body.messages) > front.max_messages:
            raise OpenAIError(400, f"at most {front.max_messages} messages per request", "messages",
                              "too_many_messages")
        for m in body.messages:
            if isinstance(m.content, list) and len(m.content) > front.max_content_parts:
                raise OpenAIError(400, f"at most {front.max_content_parts} content parts per message", "messages",
                                  "too_many_content_parts")
        if len(body.tools or []) > front.max_tools:
            raise OpenAIError(400, f"at most {front.max_tools} tools per request", "tools", "too_many_tools")
        plan = ToolPlan.of(body)
        native = self._chat.renders_tools
        messages = prompt_messages(body.messages, plan, native)
        text = await self._offload(self._chat.render, messages, plan.specs() if native and plan else None,
                                   body.template_options())
        return text, plan

    async def _offload(self, fn, *args):
        """fn(*args) on the tokenizer pool: the event loop keeps serving other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        check_unicode(text, param)
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """bad_words as token sequences, each word as the text's first word and after a space (vLLM's rule)."""
        variants = {text for word in words for text in (word.lstrip(), " " + word.lstrip())}
        return tuple(tuple(self.tokenizer(text, add_special_tokens=False).input_ids) for text in sorted(variants))

    async def _precheck(self, text: str | None, tokens: int | None, max_tokens: int, param: str,
                        length_param: str = "max_tokens") -> None:
        """Refuse, before tokenizing, a prompt whose size alone shows it cannot fit the context:
        `text` is at least token_floor(text) tokens (`tokens`: a token-id prompt's exact count)."""
        if text is not None:
            if self._token_floor is None:
                return
            tokens = self._token_floor(text) if len(text) < 1 << 16 else await self._offload(self._token_floor, text)
        context = (await self.info())["max_model_len"]
        what = f"{len(text)} characters, so at least {tokens} tokens" if text is not None else f"{tokens} tokens"
        if tokens >= context:
            raise OpenAIError(400, f"{param}: {what}: exceeds the model's context of {context} tokens", param,
                              "context_length_exceeded")
        if tokens + max_tokens > context:
            raise OpenAIError(400, f"prompt ({what}) + {length_param} ({max_tokens}) exceeds the model's context of "
                                   f"{context} tokens", length_param, "context_length_exceeded")

    async def _room(self, prompt_tokens: int) -> int:
        """The chat default for max_tokens: all that fits the context. (AppConfig refuses a KV-cache
        budget that cannot hold one request of the whole context, so that always fits the budget.)"""
        room = (await self.info())["max_model_len"] - prompt_tokens
        if room < 1:
            raise OpenAIError(400, f"the messages ({prompt_tokens} tokens) leave no room for a reply within the "
                                   "model's context and the server's KV-cache budget", "messages",
                              "context_length_exceeded")
        return room

    def _check(self, body: SamplingRequest) -> None:
        self._refresh_readiness()
        self._check_model(body.model)
        check_limits(body, self.config.front_door)
        refuse(body.unsupported())
        cap = body.num_speculative_tokens
        if cap is not None and cap > self.config.speculation.num_speculative_tokens:
            raise OpenAIError(400, f"num_speculative_tokens must be <= "
                                   f"{self.config.speculation.num_speculative_tokens}", "num_speculative_tokens")

    def _check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (None: the served one, where the route allows it)."""
        if model is not None and model != self.config.served_model_name:
            raise OpenAIError(404, f"model {model!r} does not exist; this server serves "
                                   f"{self.config.served_model_name!r}", "model", "model_not_found")

    async def _respond(self, body: SamplingRequest, prompts: list[list[int]], max_tokens: int, chat: bool,
                       key: int, length_param: str = "max_tokens", echoes: list[Echo] | None = None,
                       tools: ToolPlan | None = None, reasoning: ReasoningSpec | None = None):
        """Generate body.n choices for each prompt (each a request of its own), whole or streamed
        (a completion's best_of: that many generations, the n best returned: `whole_body`);
        `echoes`: each prompt as a completion's echo shows it (max_tokens 0: that alone); `tools`: a
        chat request's tool calling (its grammar, and its output read back as calls); `reasoning`:
        a reasoning model's chat (its thinking split out, any grammar applied after it)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        runs = [(i, prompt) for i, prompt in enumerate(prompts) for _ in range(body.candidates())]
        if max_tokens == 0:  # echo alone: each prompt (and its logprobs), nothing generated
            choices = [(ResponseFormat(rid, self.config.served_model_name, chat, len(prompt), NoGeneration(),
                                       self.tokenizer, body.logprobs_wanted(), k, i, echoes[i]), nothing_generated())
                       for k, (i, prompt) in enumerate(runs)]
        else:
            choices = await self._generations(body, rid, runs, max_tokens, chat, key, length_param, echoes, tools,
                                              reasoning)
        if body.stream:
            options = body.stream_options
            return StreamingResponse(sse_stream(choices, options is not None and options.include_usage,
                                                body.return_token_ids,
                                                options is not None and options.continuous_usage_stats),
                                     media_type="text/event-stream")
        return await whole_body(choices, body.return_token_ids, body.n if body.ranked() else None)

    async def _chat_generation(self, body: ChatCompletionRequest, prompt: ChatPrompt, rid: str,
                               key: int) -> tuple[ResponseFormat, AsyncIterator[Piece]]:
        """The one generation of a chat that another API translated (its format and its pieces)."""
        ((fmt, pieces),) = await self._generations(body, rid, [(0, prompt.ids)], prompt.max_tokens, True, key,
                                                   prompt.length_param, None, prompt.tools, prompt.reasoning)
        return fmt, pieces

    async def _generations(self, body: SamplingRequest, rid: str, runs: list[tuple[int, list[int]]],
                           max_tokens: int, chat: bool, key: int, length_param: str,
                           echoes: list[Echo] | None, tools: ToolPlan | None, reasoning: ReasoningSpec | None) -> list:
        """Start one generation per (prompt index, prompt) of `runs`; seeded ones draw from seed + k."""
        grammar = await self._grammar(body, tools, reasoning)
        bad_words = await self._offload(self._bad_words, body.bad_words or [])
        info = await self.info()
        prediction = None if body.prediction is None else \
            await self._offload(prediction_ids, self.tokenizer, body, info["max_model_len"], info["vocab_size"])
        params = sampling_params(body, max_tokens, info["vocab_size"], grammar, bad_words, prediction)
        shown = params.logprobs  # (best_of ranks by every token's log-probability, asked for or not)
        if body.ranked() and shown is None:
            params = dataclasses.replace(params, logprobs=0)
        if time.monotonic() < self._shed_until:  # a burst: the surplus gets its 429 without a round trip
            raise overloaded("the server is overloaded; retry later")
        choices: list = []
        try:
            for k, (i, prompt) in enumerate(runs):
                seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + k)
                request = GenerateRequest(rid if len(runs) == 1 else f"{rid}-{k}", prompt, seeded,
                                          body.num_speculative_tokens, priority=body.priority)
                gen, first = await self._start(request, length_param)
                self.door.limits.charge(key, first.num_prompt_tokens)
                thoughts = None if reasoning is None else ThoughtCount(self.tokenizer, reasoning, self._offload)
                fmt = ResponseFormat(rid, self.config.served_model_name, chat, first.num_prompt_tokens, gen,
                                     self.tokenizer, shown, k, i, echoes[i] if echoes else None, tools,
                                     reasoning, thoughts)
                choices.append((fmt, self._pieces(gen, prompt, body.text_rules(), key, thoughts,
                                                  body.prediction is not None)))
        except BaseException:
            for fmt, _ in choices:
                fmt.gen.close()
            raise
        return choices

    async def _grammar(self, body: SamplingRequest, tools: ToolPlan | None,
                       reasoning: ReasoningSpec | None) -> Grammar | None:
        """The output's grammar (tool_choice's, else response_format's; a reasoning model thinks
        first, then follows it), compiled here once against the tokenizer (off the event loop) so
        that a bad schema, regex or grammar is a 400 before anything runs."""
        fmt, param = body.output_format() if tools is None else (None, "tools")
        try:
            grammar = format_grammar(fmt) if tools is None else tools.grammar()
        except ValueError as err:
            raise OpenAIError(400, f"{param}: {err}", param) from err
        except RecursionError as err:
            raise OpenAIError(400, f"{param}: the schema is nested too deeply", param) from err
        if grammar is None:
            return None
        if reasoning is not None:
            grammar = grammar.after_reasoning(reasoning.grammar_reasoning())
        limit = self.config.front_door.max_grammar_chars
        if len(grammar.source) > limit:
            raise OpenAIError(400, f"{param}: at most {limit} characters of schema or grammar", param)
        if self._grammar_view is None:
            vocab = (await self.info())["vocab_size"]
            self._grammar_view = await self._offload(tokenizer_view, self.tokenizer, vocab, ())
        error = await self._offload(check_grammar, grammar, self._grammar_view)
        if error:
            what = "function parameters" if tools is not None else grammar.kind
            raise OpenAIError(400, f"{param}: invalid {what}: {error.strip()}", param, f"invalid_{param}")
        return grammar

    async def _start(self, request: GenerateRequest, length_param: str) -> tuple[Continuation, Accepted]:
        """Submit one generation; its Continuation once a coordinator accepted it, or the error the
        client gets (429, 503, 400)."""
        gen = Continuation(self._submit, request, self.config.max_resumes,
                           time.monotonic() + self.config.request_timeout_s, self.continuations)
        try:
            first = await gen.start()  # Accepted | Rejected: validation errors before any SSE
            self._engine_answered = time.monotonic()
        except BackPressureError as err:  # Serve's own queue in front of the coordinators is full
            gen.close()
            raise overloaded("the server is overloaded; retry later") from err
        except EngineLost as err:
            gen.close()
            raise unavailable(f"{err}; retry it") from err
        except Exception as err:
            gen.close()
            raise unavailable(f"the engine is unavailable: {type(err).__name__}") from err
        except BaseException:
            gen.close()
            raise
        if isinstance(first, Rejected):
            raise self._refused(first, len(request.prompt_token_ids), length_param)
        assert isinstance(first, Accepted)
        return gen, first

    def _refused(self, first: Rejected, prompt_tokens: int, length_param: str) -> OpenAIError:
        if first.code == "queue_full":
            self._shed_until = time.monotonic() + SHED_WINDOW_S
            return overloaded(first.message)
        if first.code == "context_length_exceeded" and length_param == "messages":
            return OpenAIError(400, f"the messages ({prompt_tokens} tokens) leave no room for a reply within "
                                    "the server's limits", "messages", first.code)
        param = length_param if first.code == "context_length_exceeded" else "prompt"
        return OpenAIError(400, first.message, param, first.code)

    def _check_choices(self, count: int) -> None:
        limit = self.config.front_door.max_choices
        if count > limit:
            raise OpenAIError(400, f"at most {limit} choices per request (prompts x n), got {count}", "n",
                              "too_many_choices")

    def _submit(self, request: GenerateRequest):
        """Send a request (or its continuation) to a coordinator replica: a stream of its messages."""
        return self.coordinator.options(stream=True).generate.remote(request)

    async def _pieces(self, gen: Continuation, prompt_ids: list[int], rules: TextRules,
                      key: int, thoughts: ThoughtCount | None = None, predicted: bool = False) -> AsyncIterator[Piece]:
        """Coordinator Deltas -> text pieces. Cancels the coordinator stream if it ends early
        (stop string, client gone), which aborts the request and frees its caches. The detokenizer
        decodes a window of a few tokens per delta (text.py), cheap enough for the event loop; it
        and the stop-string state live here, so a continuation on another replica (`gen`) goes on
        with them as if nothing happened. The stop token (EOS, stop_token_ids) that ends a
        generation leaves its text out, unless `include_stop` (vLLM's rule); no stop string may end
        in the first min_tokens - 1 tokens' text, and one that ends the text ends the token ids
        (logprobs, usage) at the token that completes it (`by_token`). A reasoning model's last
        piece counts its thinking's tokens (decoded on the tokenizer pool)."""
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, rules.skip_special)
        stopper = StopStrings(rules.stops, rules.include_stop)
        token_ids: list[int] = []
        logprobs: list[float] | None = None  # (when the request asked: the Deltas carry them)
        tops: list | None = None
        stream = _guarded(gen)
        try:
            async for item in stream:
                self._engine_answered = time.monotonic()
                if isinstance(item, Failed):
                    gen.finished = True
                    status = 504 if item.code == "request_timeout" else 500
                    raise StreamFailed(OpenAIError(status, item.message, None, item.code, "server_error"))
                assert isinstance(item, Delta)
                spec = {"num_draft_tokens": item.num_draft_tokens, "num_accepted_tokens": item.num_accepted_tokens,
                        "num_steps": item.num_steps}
                if predicted:  # (usage's accepted / rejected prediction tokens)
                    spec.update(num_prediction_tokens=item.num_prediction_tokens,
                                num_accepted_prediction_tokens=item.num_accepted_prediction_tokens)
                if item.num_recalled_tokens:  # (drafts recalled from earlier answers: speculation.history)
                    spec.update(num_recalled_tokens=item.num_recalled_tokens,
                                num_accepted_recalled_tokens=item.num_accepted_recalled_tokens)
                out = ""
                for part in by_token(item) if stopper.stops else (item,):
                    token_ids.extend(part.token_ids)
                    if part.logprobs is not None:
                        logprobs, tops = (logprobs, tops) if logprobs is not None else ([], [])
                        logprobs.extend(part.logprobs)
                        tops.extend(part.top_logprobs or [[] for _ in part.logprobs])
                    final = part.finish_reason is not None
                    shown = part.token_ids if rules.include_stop else shown_ids(part.token_ids, part.finish_reason)
                    shielded = max(min(rules.min_tokens - 1 - (len(token_ids) - len(part.token_ids)), len(shown)), 0)
                    if shielded:
                        stopper.shield(detok.push(shown[:shielded]))
                    text = detok.push(shown[shielded:]) + (detok.flush() if final else "")
                    piece, stopped = stopper.feed(text, final)
                    out += piece
                    if stopped or final:
                        gen.finished = final
                        thought = None if thoughts is None else await thoughts(token_ids)
                        yield Piece(out, "stop" if stopped else part.finish_reason, len(token_ids), spec, token_ids,
                                    logprobs, tops, item.cached_tokens, thought, stopper.hit)
                        return
                if out or item.token_ids:  # tokens whose text is held back still show as token_ids
                    yield Piece(out, None, len(token_ids), spec, token_ids, logprobs, tops, item.cached_tokens)
        finally:
            self.door.limits.charge(key, len(token_ids))
            await stream.aclose()
            gen.close()


def by_token(delta: Delta) -> list[Delta]:
    """A Delta of several tokens as one Delta per token (the last one ends it where it ends), so
    that a stop string ends the output at the token that completes it, as it would where the
    target alone makes one token a step: the tokens a speculative step made past it are neither
    shown, counted nor scored."""
    if len(delta.token_ids) <= 1:
        return [delta]
    last = len(delta.token_ids) - 1
    return [dataclasses.replace(
        delta, token_ids=[token], finish_reason=delta.finish_reason if j == last else None,
        logprobs=None if delta.logprobs is None else delta.logprobs[j : j + 1],
        top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[j : j + 1])
        for j, token in enumerate(delta.token_ids)]


def request_key(request: Request) -> int:
    """The index of the API key the FrontDoor accepted (-1: no keys configured)."""
    return request.scope.get(FrontDoor.KEY_SCOPE, -1)


async def _guarded(gen: Continuation) -> AsyncIterator:
    """The request's Deltas (a lost replica is continued on another one inside `gen`), with what
    cannot be continued turned into a clear, retryable 503 error."""
    try:
        async for item in gen.items():
            yield item
    except EngineLost as err:
        raise StreamFailed(unavailable(f"{err}; the request did not complete, retry it")) from err
    except Exception as err:
        raise StreamFailed(unavailable(
            f"the engine failed while serving this request ({type(err).__name__}); the request did not "
            "complete, retry it")) from err
