"""The ingress deployment: OpenAI-compatible HTTP (completions, chat, models, health, stats).

It tokenizes, applies the chat template, validates, and forwards token ids to the coordinator
through a streaming DeploymentHandle; it detokenizes the stream incrementally and cuts stop strings.
Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}} with a 4xx status.

The event loop only parses, routes and streams: tokenization and chat templating run on a thread
pool (`front_door.threads`). Before any of that, the `FrontDoor` middleware (front_door.py) checks
the API key, the per-key limits and the body size (413) without reading or parsing the body; a
text that cannot fit the context by its character count alone is refused before it is tokenized;
every list a client controls has a limit (`front_door.*`).

Besides OpenAI's own fields (penalties, logit_bias, logprobs, n, batched prompts, prediction:
docs/serving.md),
extensions: `repetition_penalty`, `top_k` (0 or -1 = off), vLLM's `min_p`, `min_tokens`,
`stop_token_ids`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`,
`include_stop_str_in_output`, `skip_special_tokens`, `priority` and chat template options,
`ignore_eos`, `include_reasoning` and `reasoning_effort` (a reasoning model's thinking is split
out of chat answers when the config has `reasoning`: serve/reasoning.py), `return_token_ids`
(the generated ids in the choice; streaming: each chunk's choice carries the ids new since the previous
chunk), and `num_speculative_tokens` (a per-request cap on γ, 0 = no speculation; at most
the configured γ).
Responses carry a `speculation` object (draft tokens, accepted tokens, steps) next to `usage`.

OpenAI's Responses API (`/v1/responses`) runs as the chat its request translates to
(responses_schema.py), its output and events in responses_api.py, its store in response_store.py;
its Conversations API (`/v1/conversations`) keeps conversations in conversation_store.py.

Operations: an optional Bearer key (config `api_key`, else env SPECSERVE_API_KEY) guards every route
but /health and /live, /openapi.json included (401 without it); a full coordinator queue is a 429 with Retry-After; a
coordinator replica lost mid-request is continued on another one from the tokens already delivered
(continuation.py, at most `max_resumes` times; then a 503, or once a stream has started, an SSE
error event then [DONE]). /health is readiness (200 once a coordinator replica, warm, answers);
/live is liveness (this process answers).
Prompts and outputs are never logged.

`OpenAIServer` is the plain class (routes on the module-level FastAPI `app`, over the machinery
they share in ingress.py's `Ingress`); `OpenAIIngress` is that class as a Serve deployment. Tests
may run the routes in process with another coordinator.
"""
import asyncio
import time
from typing import AsyncIterator, Callable, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from .checks import fill_in_the_middle, kept_tokens, refuse, token_ids
from .conversations_schema import ConversationCreate, ConversationUpdate, ItemsCreate
from .front_door import FrontDoor, OpenAIError, anthropic_route
from .ingress import RETRY_AFTER_S, ChatPrompt, Ingress, Rendered, request_key
from .messages_api import MessageEvents, MessageShape, message_id, whole_message
from .messages_schema import CountTokensRequest, MessagesRequest
from .responses import whole_body
from .responses_api import (ResponseEvents, ResponseShape, compacted, compaction_item, input_page, item_id,
                            whole_response, with_id)
from .responses_schema import ITEM, ITEMS, CompactRequest, InputTokensRequest, ResponsesRequest, summary_request
from .schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest, TokenizeRequest


# -- errors --------------------------------------------------------------------------------------
class ClosingStream(StreamingResponse):
    """An event stream that calls `closed()` once it has ended, however it ended (read to its end,
    its client gone, or cancelled), before the front door counts its request as done."""

    def __init__(self, events: AsyncIterator[str], closed: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._closed = closed

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._closed()


def _error_response(request: Request, err: OpenAIError) -> JSONResponse:
    """OpenAI's error shape; Anthropic's on the Messages API's routes."""
    return err.response(anthropic_route(request.scope))


READY_TIMEOUT_S = 2.0  # /health: a coordinator replica must answer within this
READY_FRESH_S = 5.0  # ... unless one answered a request within this (a busy engine is a ready one)
READY_CONTROLLER_TIMEOUT_S = 10.0  # ... or Serve's controller (never behind a burst) counts one RUNNING


app = FastAPI(title="specserve", docs_url=None, redoc_url=None)
# the replica's `OpenAIServer` (the routes' `self`) holds the key(s) and limits the middleware applies
app.add_middleware(FrontDoor, door=lambda: serve.get_replica_context().servable_object.door)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, err: OpenAIError) -> JSONResponse:
    return _error_response(request, err)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(x) for x in first.get("loc", ())][1:]  # drop "body" / "query"
    while loc and loc[0].endswith("Request"):  # (which kind of a body that may be one of several)
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return _error_response(request, OpenAIError(400, f"malformed JSON body: {first.get('msg', '')}", None,
                                                    "json_invalid"))
    param = loc[0] if loc else None
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
    return _error_response(request, OpenAIError(400, message, param, first.get("type")))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if err.status_code == 404 else None
    return _error_response(request, OpenAIError(err.status_code, str(err.detail), None, code))


class OpenAIServer(Ingress):
    # -- routes (the FrontDoor middleware has checked the key, the per-key limits and the body size) --
    @app.get("/health")
    async def health(self) -> dict:
        """Readiness: 200 only when a request sent now would be served at once, i.e. a coordinator
        replica's constructor (which loads both models and runs forwards) has returned. Evidence,
        cheapest first: a coordinator answered within READY_FRESH_S; Serve's controller counts a
        coordinator replica RUNNING; a coordinator answers a probe within READY_TIMEOUT_S. Else a
        503 `not_ready` with Retry-After (the ingress itself is up: see /live). Neither of the
        first two queues behind a burst of requests."""
        if time.monotonic() - self._engine_answered < READY_FRESH_S:
            return {"status": "ok"}
        try:
            if await self._serve_reports_running():
                return {"status": "ok"}
            if self._info is None:
                self._info = await asyncio.wait_for(self._call(self.coordinator.info), READY_TIMEOUT_S)
            else:
                await asyncio.wait_for(self._call(self.coordinator.ready), READY_TIMEOUT_S)
            self._engine_answered = time.monotonic()
        except Exception as err:  # no coordinator replica yet (or none left), or a timeout
            raise OpenAIError(503, f"not ready: no engine replica answered within {READY_TIMEOUT_S:g} s "
                                   f"({type(err).__name__})", None, "not_ready", "server_error",
                              {"Retry-After": str(RETRY_AFTER_S)}) from err
        return {"status": "ok"}

    def _refresh_readiness(self) -> None:
        """On traffic, at most every READY_FRESH_S: ask Serve's controller in the background, so that
        /health during a burst finds fresh evidence instead of waiting behind the burst."""
        now = time.monotonic()
        if now - self._readiness_asked < READY_FRESH_S:
            return
        self._readiness_asked = now

        async def ask() -> None:
            if await self._serve_reports_running():
                self._engine_answered = max(self._engine_answered, time.monotonic())

        asyncio.get_running_loop().create_task(ask())

    async def _serve_reports_running(self) -> bool:
        """Whether Serve's controller counts a coordinator replica RUNNING (its constructor, which
        loads both models and runs forwards, returned): asked of the controller, so it never
        queues behind generation requests. False where there is no controller (in process)."""
        def ask() -> bool:
            import ray

            if not ray.is_initialized():
                return False
            app = serve.status().applications[self.coordinator.app_name]
            return app.deployments[self.coordinator.deployment_name].replica_states.get("RUNNING", 0) > 0

        try:
            running = asyncio.get_running_loop().run_in_executor(self._ready_pool, ask)
            return await asyncio.wait_for(running, READY_CONTROLLER_TIMEOUT_S)
        except Exception:  # no controller, an unknown app, a slow answer: the probe decides
            return False

    @app.get("/live")
    async def live(self) -> dict:
        """Liveness: this ingress process answers (cheap: no call to the engine)."""
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [await self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict:
        """One model (the openai client's `models.retrieve`); 404 for any other id."""
        if model_id != self.config.served_model_name:
            raise OpenAIError(404, f"model {model_id!r} does not exist; this server serves "
                                   f"{self.config.served_model_name!r}", "model", "model_not_found")
        return await self._model_card()

    @app.get("/v1/stats")
    async def stats(self) -> dict:
        """Step timings of the coordinator replica the router picks (one replica: the whole picture),
        and this ingress replica's continuations (`ingress`)."""
        stats = await self.coordinator.stats.remote()
        return {**stats, "ingress": dict(self.continuations)}

    @app.post("/v1/stats/reset")
    async def reset_stats(self) -> dict:
        await self.coordinator.reset_stats.remote()
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check(body)
        # an explicit null means the default, as OpenAI's API treats it
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        prompts = body.prompts()
        if body.suffix:  # a code model fills in the middle: the text after the cursor
            prompts = fill_in_the_middle(self.config.fim, prompts, body.suffix)
        self._check_choices(len(prompts) * body.candidates())
        info = await self.info()
        keep = kept_tokens(body, info["max_model_len"])
        batch = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if keep is None:
                    await self._precheck(prompt, None, max(max_tokens, 1), "prompt")
                batch.append(await self._offload(self._encode, prompt, "prompt", True))
            else:
                if keep is None:
                    await self._precheck(None, len(prompt), max(max_tokens, 1), "prompt")
                token_ids(prompt, "prompt", info["vocab_size"])  # (before `echo` decodes them)
                batch.append(list(prompt))
        if keep is not None:  # left truncation; an echo shows what was kept
            prompts = [p if len(ids) <= keep else ids[-keep:] for p, ids in zip(prompts, batch)]
            batch = [ids[-keep:] for ids in batch]
        echoes = await asyncio.gather(*(self._echo(p, ids, body.logprobs) for p, ids in zip(prompts, batch))) \
            if body.echo else None
        return await self._respond(body, batch, max_tokens, chat=False, key=request_key(request), echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        prompt = await self._chat_prompt(body)
        return await self._respond(body, [prompt.ids], prompt.max_tokens, chat=True, key=request_key(request),
                                   length_param=prompt.length_param, tools=prompt.tools, reasoning=prompt.reasoning)

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's route: a prompt's or a chat's token ids (the chat through the template, as chat
        completions render it), their count and the context they must fit in."""
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            refuse(body.conversation_problems())
            text, _ = await self._render(body)
            ids = await self._offload(self._encode, text, "messages", False)
        else:
            ids = await self._offload(self._encode, body.prompt, "prompt", body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": (await self.info())["max_model_len"], "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await self._offload(self.tokenizer.convert_ids_to_tokens, ids)
        return out

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's route: token ids -> their text (special tokens included)."""
        self._check_model(body.model)
        info = await self.info()
        if len(body.tokens) > info["max_model_len"]:
            raise OpenAIError(400, f"at most {info['max_model_len']} tokens (the model's context)", "tokens")
        if body.tokens and max(body.tokens) >= info["vocab_size"]:
            raise OpenAIError(400, f"tokens must be token ids in [0, {info['vocab_size']})", "tokens")
        return {"prompt": await self._offload(self.tokenizer.decode, body.tokens)}

    # -- the Responses API (responses_schema.py, responses_api.py, response_store.py) ----------------
    @app.post("/v1/responses")
    async def create_response(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, run as the chat it translates to; kept in the store (`store`)."""
        refuse(body.unsupported())
        if body.background and not self._store.on:
            raise OpenAIError(400, "background responses need the server's response store (responses.store)",
                              "background")
        owner = request_key(request)  # (a stored response is found again only with the API key that made it)
        body, history = await self._resolved(body, owner)
        shape = ResponseShape(item_id("resp"), self.config.served_model_name, body, body.store and self._store.on)
        inputs = [with_id(item.model_dump(by_alias=True, exclude_none=True)) for item in body.items()]
        conversation = body.conversation_id()

        async def add(response: dict) -> None:  # (to the conversation: a response that did not fail)
            if conversation is not None and response["status"] != "failed":
                await self._conversations.add(conversation, inputs + response["output"], owner)

        async def keep(response: dict) -> None:
            response["store"] = shape.stored and await self._store.keep(response, history, inputs, owner)
            await add(response)

        field = self.reasoning_field
        compacting, rendered = await self._compaction_due(body, history)
        generation = self._generation(body, history, shape, owner, compacting, rendered)
        if not (compacting and (body.background or body.stream)):
            generation = await generation  # (admitted now: its errors are this request's own)
        # else its summary runs once the response has begun: after its first events, or in its task
        # (the logprobs of a reasoning model's text are its own tokens': counted once, for usage too)
        events = ResponseEvents(shape, field, body.logprobs_wanted()) if body.stream else None
        if body.background:
            response = await self._background.start(shape, generation, field, history, inputs, owner, events, add)
            if events is None:
                return response
            return ClosingStream(self._background.opening(shape.rid), lambda: self._background.creator_gone(shape.rid))
        if events is None:
            return await whole_response(shape, generation, field, keep)
        return StreamingResponse(events.stream(generation, keep), media_type="text/event-stream")

    async def _resolved(self, body: ResponsesRequest, owner: int) -> tuple[ResponsesRequest, list[dict]]:
        """The request with its `item_reference` items resolved (a stored response's or the
        conversation's, named by id), and the items it goes on from: its conversation's, or its
        previous response's."""
        if body.conversation is None:
            history = await self._store.history(body.previous_response_id, owner)
        else:
            history = await self._conversations.found("items", body.conversation_id(), owner, param="conversation")
        if body.references():
            body = body.resolved(await self._referenced(body.references(), history, owner))
        return body, history

    async def _generation(self, body: ResponsesRequest, history: list[dict], shape: ResponseShape, owner: int,
                          compacting: bool, rendered: Rendered | None = None):
        """The answer's generation admitted (its ResponseFormat and pieces): `compacting`, after
        the conversation is compacted (`_compacted`); else from the whole conversation as
        `rendered` already (where `_compaction_due` rendered it)."""
        answering = await self._compacted(body, history, shape, owner) if compacting else body
        chat, prompt = await self._response_prompt(answering, ITEMS.validate_python(history),
                                                   None if compacting else rendered)
        return await self._chat_generation(chat, prompt, shape.rid, owner)

    async def _compaction_due(self, body: ResponsesRequest, history: list[dict]) -> tuple[bool, Rendered | None]:
        """Whether the request's prompt is past its compact_threshold (context_management), and
        the whole conversation rendered, where it had to be to tell."""
        threshold = body.compact_threshold((await self.info())["max_model_len"])
        if threshold is None:
            return False, None
        rendered = await self._rendered(body.chat(ITEMS.validate_python(history)), "input")
        return len(rendered.ids) > threshold, rendered

    async def _compacted(self, body: ResponsesRequest, history: list[dict], shape: ResponseShape,
                         owner: int) -> ResponsesRequest:
        """The request the answer runs from once the conversation is compacted into a compaction
        item, which the output begins with (shape.first; its pass's usage: shape.spent)."""
        room = self._summary_room((await self.info())["max_model_len"])
        summarise = summary_request(body.model, body.items(), body.instructions, room)
        summary, shape.spent = await self._summary(summarise, history, owner)
        item = compaction_item(summary)
        shape.first = [item]
        return body.model_copy(update={"input": body.items() + [ITEM.validate_python(item)]})

    async def _summary(self, summarise: ResponsesRequest, history: list[dict], owner: int) -> tuple[str, dict]:
        """A summary request's answer (responses_schema.summary_request) and its chat usage."""
        chat, prompt = await self._response_prompt(summarise, ITEMS.validate_python(history))
        fmt, pieces = await self._chat_generation(chat, prompt, item_id("resp"), owner)
        whole = await whole_body([(fmt, pieces)])
        return whole["choices"][0]["message"]["content"] or "", whole["usage"]

    def _summary_room(self, context: int) -> int:
        """A summary's most tokens: responses.compaction_max_tokens, and a quarter of the context."""
        return min(self.config.responses.compaction_max_tokens, context // 4)

    async def _rendered_tokens(self, body: ResponsesRequest, history: list) -> int:
        """How many tokens a Responses request's prompt renders to, whether or not it fits."""
        return len((await self._rendered(body.chat(history), "input")).ids)

    async def _referenced(self, item_ids: list[str], history: list[dict], owner: int) -> dict[str, dict]:
        """The items these `item_reference` inputs name: the conversation's, else a stored response's."""
        own = {item["id"]: item for item in history if item.get("id") in item_ids}
        rest = [i for i in item_ids if i not in own]
        return {**own, **(await self._store.referenced(rest, owner) if rest else {})}

    async def _response_prompt(self, body: ResponsesRequest, history: list,
                               rendered: Rendered | None = None) -> tuple[ChatCompletionRequest, ChatPrompt]:
        """The chat a Responses request is, and its prompt. With truncation "auto", where the
        whole conversation does not fit the context with max_output_tokens (or one token) after
        it, the fewest first turns dropped that let it fit (`cuts`; found in O(log turns)
        renders); where even the latest turn alone does not fit, its own 400. `rendered`: the
        whole conversation rendered already (`_compaction_due`)."""
        cuts = body.cuts(history) if body.truncation == "auto" else [0]
        context = (await self.info())["max_model_len"]

        async def fitting(drop: int, last: bool) -> tuple[ChatCompletionRequest, ChatPrompt] | None:
            chat = body.chat(history, drop)
            try:
                prompt = await self._chat_prompt(chat, "max_output_tokens", rendered if drop == 0 else None)
            except OpenAIError as err:
                if last or err.code != "context_length_exceeded":
                    raise
                return None
            fits = len(prompt.ids) + (body.max_output_tokens or 1) <= context
            return (chat, prompt) if fits or last else None

        whole = await fitting(0, len(cuts) == 1)  # (the usual case)
        if whole is not None:
            return whole
        low, high, best = 1, len(cuts) - 1, None  # the fewest cuts that fit: cuts[k], k in [low, high]
        while low < high:  # (best: what cuts[high] gave, once probed)
            mid = (low + high) // 2
            probe = await fitting(cuts[mid], False)
            low, high, best = (mid + 1, high, best) if probe is None else (low, mid, probe)
        return best if best is not None else await fitting(cuts[high], True)

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request, stream: bool = False,
                           starting_after: int | None = Query(None, ge=0)):
        """A stored response; with `stream`, a streamed background response's events after
        `starting_after`, then the rest as they come."""
        owner = request_key(request)
        if stream:
            events = await self._background.follow(response_id, owner, starting_after)
            return StreamingResponse(events, media_type="text/event-stream")
        if starting_after is not None:
            raise OpenAIError(400, "starting_after needs stream=true", "starting_after")
        return await self._store.stored("get", response_id, owner)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> dict:
        await self._store.stored("delete", response_id, request_key(request))
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request) -> dict:
        response = await self._store.stored("cancel", response_id, request_key(request))
        if not response.get("background"):
            raise OpenAIError(400, f"response {response_id!r} was not created with background: true: only "
                                   "background responses can be cancelled", "response_id")
        return response

    @app.post("/v1/responses/input_tokens")
    async def count_response_tokens(self, body: InputTokensRequest, request: Request) -> dict:
        """The tokens a Responses request's input renders to, as POST /v1/responses renders it
        (with truncation "auto", after the turns it drops; else whether or not it fits the context)."""
        responses = body.request(self.config.served_model_name)
        refuse(responses.unsupported())
        responses, history = await self._resolved(responses, request_key(request))
        history = ITEMS.validate_python(history)
        if responses.truncation == "auto":
            _, prompt = await self._response_prompt(responses, history)
            return {"object": "response.input_tokens", "input_tokens": len(prompt.ids)}
        return {"object": "response.input_tokens", "input_tokens": await self._rendered_tokens(responses, history)}

    @app.post("/v1/responses/compact")
    async def compact_response(self, body: CompactRequest, request: Request) -> dict:
        """A conversation compacted (OpenAI's `/v1/responses/compact`): its user messages, then one
        compaction item with the model's summary of it (at most responses.compaction_max_tokens,
        and a quarter of the context); nothing is stored."""
        room = self._summary_room((await self.info())["max_model_len"])
        summarise = body.summary_request(self.config.served_model_name, room)
        refuse(summarise.unsupported())
        summarise, history = await self._resolved(summarise, request_key(request))
        summary, spent = await self._summary(summarise, history, request_key(request))
        items = history + [item.model_dump(by_alias=True, exclude_none=True) for item in summarise.items()[:-1]]
        return compacted(item_id("resp"), items, summary, spent)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                                   order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict:
        items = await self._store.stored("input_items", response_id, request_key(request))
        return input_page(items, limit, order, after)

    # -- the Conversations API (conversations_schema.py, conversation_store.py) ------------------------
    @app.post("/v1/conversations")
    async def create_conversation(self, body: ConversationCreate, request: Request) -> dict:
        owner = request_key(request)
        items = await self._conversation_items(body, owner)
        return await self._conversations.found("create", items, body.metadata or {}, owner)

    @app.get("/v1/conversations/{conversation_id}")
    async def get_conversation(self, conversation_id: str, request: Request) -> dict:
        return await self._conversations.found("get", conversation_id, request_key(request))

    @app.post("/v1/conversations/{conversation_id}")
    async def update_conversation(self, conversation_id: str, body: ConversationUpdate, request: Request) -> dict:
        refuse(body.problems())
        return await self._conversations.found("update", conversation_id, body.metadata or {}, request_key(request))

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(self, conversation_id: str, request: Request) -> dict:
        await self._conversations.found("delete", conversation_id, request_key(request))
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.get("/v1/conversations/{conversation_id}/items")
    async def conversation_items(self, conversation_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                                 order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict:
        return await self._conversations.found("page", conversation_id, limit, order, after, request_key(request))

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_conversation_items(self, conversation_id: str, body: ItemsCreate, request: Request) -> dict:
        owner = request_key(request)
        items = await self._conversation_items(body, owner)
        added = await self._conversations.found("append", conversation_id, items, owner)
        return input_page(added, len(added), "asc", None)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def conversation_item(self, conversation_id: str, item_id: str, request: Request) -> dict:
        return await self._conversations.found("item", conversation_id, item_id, request_key(request))

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_conversation_item(self, conversation_id: str, item_id: str, request: Request) -> dict:
        return await self._conversations.found("delete_item", conversation_id, item_id, request_key(request))

    async def _conversation_items(self, body: ConversationCreate | ItemsCreate, owner: int) -> list[dict]:
        """A request's items as dicts (an `item_reference`: the stored response's item it names)."""
        self._conversations.require("conversation_id")
        refuse(body.problems())
        return body.dumped(await self._store.referenced(body.references(), owner) if body.references() else {})

    # -- Anthropic's Messages API (messages_schema.py, messages_api.py) ----------------------------
    @app.post("/v1/messages")
    async def create_message(self, body: MessagesRequest, request: Request):
        """Anthropic's Messages API, run as the chat it translates to (errors in Anthropic's shape)."""
        refuse(body.unsupported())
        chat = body.chat()
        prompt = await self._chat_prompt(chat)
        shape = MessageShape(message_id(), self.config.served_model_name, self.reasoning_field)
        fmt, pieces = await self._chat_generation(chat, prompt, shape.mid, request_key(request))
        if body.stream:
            return StreamingResponse(MessageEvents(shape).stream(fmt, pieces), media_type="text/event-stream")
        return await whole_message(shape, fmt, pieces)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(self, body: CountTokensRequest) -> dict:
        """The tokens a Messages request's prompt renders to (as /v1/messages renders it)."""
        messages = body.request()
        refuse(messages.unsupported())
        chat = messages.chat()
        self._check(chat)
        text, _ = await self._render(chat)
        return {"input_tokens": len(await self._offload(self._encode, text, "messages", False))}


OpenAIIngress = serve.deployment(ray_actor_options={"num_cpus": 0.1})(serve.ingress(app)(OpenAIServer))
