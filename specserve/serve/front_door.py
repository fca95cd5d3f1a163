"""The ingress's front door: what runs before a route sees a request, and the cheap bounds it uses.

    FrontDoor (pure ASGI middleware), in this order, before any byte of the body is read:
      1. /health and /live pass untouched (load balancers, probes)
      2. the API key (401), on every other route, /openapi.json and unknown paths included
      3. per-key limits (429 + Retry-After): concurrent requests, tokens per minute (KeyLimits),
         on requests that do work (`limited`): not on reads, deletes and cancels, so that a key
         at its limit can still poll, stream again, stop and delete what it started
      4. the body limit (413): Content-Length, then the bytes of a chunked body as they arrive;
         the body is buffered (at most the limit) and replayed to the app

    token_floor(tokenizer): the fewest tokens a text can become, from its characters (the most
    input characters one token can stand for, when the tokenizer's pipeline provably loses no input
    but a known set of characters; else None): a text whose floor exceeds the context cannot fit,
    so it is refused without tokenizing it.

Errors are OpenAI-shaped JSON, as everywhere in the ingress (`OpenAIError`).
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from starlette.responses import JSONResponse


# -- errors --------------------------------------------------------------------------------------
class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The same error as Anthropic's Messages API shapes one (its routes answer with this)."""
        kind = ANTHROPIC_ERRORS.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        return _AsciiJSON(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                          headers=self.headers)


ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)  # routes whose errors take Anthropic's shape


def anthropic_route(scope) -> bool:
    return _route_path(scope).startswith(ANTHROPIC_PATHS)


class _AsciiJSON(JSONResponse):
    """Error bodies as pure ASCII JSON: a message that quotes client input (even a lone surrogate,
    which UTF-8 cannot encode) can always be sent."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def rate_limited(message: str, retry_after_s: float, code: str) -> OpenAIError:
    return OpenAIError(429, message, None, code, "rate_limit_error",
                       {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


# -- API keys --------------------------------------------------------------------------------------
def parse_keys(configured: str | tuple[str, ...] | None, env_value: str | None) -> tuple[bytes, ...]:
    """The accepted keys: the config's (one or a list), else the environment's (comma-separated)."""
    if configured:
        keys = [configured] if isinstance(configured, str) else list(configured)
    else:
        keys = [k.strip() for k in (env_value or "").split(",")]
    return tuple(k.encode() for k in keys if k)


def key_index(authorization: str, keys: tuple[bytes, ...]) -> int:
    """-> the index of the key `Authorization: Bearer <key>` carries; raises a 401 OpenAIError.
    Every key is compared in constant time, so timing tells nothing about which one nearly matched."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')", None,
                          "missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    sent, found = token.strip().encode(), -1
    for i, key in enumerate(keys):
        if hmac.compare_digest(sent, key) and found < 0:
            found = i
    if found < 0:
        raise OpenAIError(401, "incorrect API key provided", None, "invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})
    return found


# -- per-key limits --------------------------------------------------------------------------------
@dataclass
class _Account:
    running: int = 0
    tokens: float = 0.0  # token bucket balance; may go negative (a request's tokens are charged whole)
    refilled_at: float = 0.0


@dataclass
class KeyLimits:
    """Concurrent requests and tokens per minute, per key (key: the index of an accepted API key,
    or -1 without keys: every client shares one account). Per ingress replica.

    Tokens: a bucket of `tokens_per_minute` that refills continuously; a request is admitted while
    the balance is positive, and its prompt and generated tokens are charged as they become known
    (so a key may overshoot by one request's tokens, then waits until the bucket refills)."""

    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    clock: Callable[[], float] = time.monotonic
    accounts: dict[int, _Account] = field(default_factory=dict)

    def _account(self, key: int) -> _Account:
        acct = self.accounts.get(key)
        if acct is None:
            acct = self.accounts[key] = _Account(tokens=float(self.tokens_per_minute or 0), refilled_at=self.clock())
        if self.tokens_per_minute:
            now = self.clock()
            rate = self.tokens_per_minute / 60.0
            acct.tokens = min(float(self.tokens_per_minute), acct.tokens + (now - acct.refilled_at) * rate)
            acct.refilled_at = now
        return acct

    def enter(self, key: int) -> None:
        """Admit one request of `key` (pair with leave()) or raise a 429 OpenAIError."""
        acct = self._account(key)
        if self.max_concurrent is not None and acct.running >= self.max_concurrent:
            raise rate_limited(f"too many concurrent requests for this API key (limit {self.max_concurrent}); "
                               "retry when one finishes", 1, "concurrency_limit_exceeded")
        if self.tokens_per_minute and acct.tokens <= 0:
            wait = (1.0 - acct.tokens) / (self.tokens_per_minute / 60.0)
            raise rate_limited(f"tokens per minute exceeded for this API key (limit {self.tokens_per_minute}); "
                               "retry later", wait, "tokens_per_minute_exceeded")
        acct.running += 1

    def hold(self, key: int) -> None:
        """Count one more running request of `key`, unchecked: work that goes on after the
        request that passed `enter` (a background response's generation). Pair with leave()."""
        self._account(key).running += 1

    def leave(self, key: int) -> None:
        self.accounts[key].running -= 1

    def charge(self, key: int, tokens: int) -> None:
        if self.tokens_per_minute and tokens:
            self._account(key).tokens -= tokens


# -- the middleware --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Door:
    """What the middleware needs from the ingress replica that serves the request."""

    keys: tuple[bytes, ...]  # accepted API keys (empty: no authentication)
    limits: KeyLimits
    max_body_bytes: int


class _TooLarge(Exception):
    pass


class FrontDoor:
    """Pure ASGI middleware (see the module docstring). `door()` returns the serving replica's Door;
    the key index rides to the routes in scope[KEY_SCOPE]."""

    OPEN_PATHS = frozenset({"/health", "/live"})  # readiness and liveness: for load balancers and probes
    KEY_SCOPE = "specserve.api_key"

    def __init__(self, app, door: Callable[[], Door]) -> None:
        self.app, self.door = app, door

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) in self.OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        door = self.door()
        headers = _headers(scope)
        anthropic = anthropic_route(scope)
        counted = limited(scope)
        try:
            key = key_index(_credential(headers), door.keys) if door.keys else -1
            if counted:
                door.limits.enter(key)
        except OpenAIError as err:
            await err.response(anthropic)(scope, receive, send)
            return
        try:
            try:
                body = await _read_body(receive, headers.get("content-length"), door.max_body_bytes)
            except _TooLarge:
                await OpenAIError(413, f"request body too large (limit {door.max_body_bytes} bytes)", None,
                                  "request_too_large").response(anthropic)(scope, receive, send)
                return
            scope[self.KEY_SCOPE] = key
            await self.app(scope, _replay(body, receive), send)
        finally:
            if counted:
                door.limits.leave(key)


def limited(scope) -> bool:
    """Whether a request counts against its key's limits: every one but reads (GET, HEAD), DELETEs
    and cancels (`POST .../cancel`). Those start no work, and a key whose background responses
    hold its every slot must still be able to poll them, follow their events, cancel and delete
    them (a background response counts as a running request until it ends)."""
    method = scope.get("method", "GET")
    if method in ("GET", "HEAD", "OPTIONS", "DELETE"):
        return False
    return not (method == "POST" and _route_path(scope).rstrip("/").endswith("/cancel"))


def _route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _credential(headers: dict[str, str]) -> str:
    """The Authorization header, or Anthropic clients' `x-api-key` as a Bearer key."""
    key = headers.get("x-api-key", "").strip()
    return headers.get("authorization") or (f"Bearer {key}" if key else "")


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _read_body(receive, content_length: str | None, limit: int) -> bytes:
    """The whole body, refusing (_TooLarge) as soon as it is known to exceed `limit` bytes."""
    if content_length is not None and content_length.strip().isdigit() and int(content_length) > limit:
        raise _TooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: the app sees an empty body
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive) -> Callable[[], Awaitable[dict]]:
    """A receive() that hands the buffered body over once, then the real receive (disconnects).
    A client that went away mid-stream makes Serve cancel the request, and its receive then
    raises TaskCancelledError: that is the disconnect it is (the response stops as for any
    other), not an error out of the app, which Serve logged once per disconnect as a future
    whose exception nobody retrieved."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        try:
            return await receive()
        except Exception as err:
            # (imported here: the CLI imports this module before it sets Ray's auth mode, which
            # importing Ray fixes; in a replica Ray is imported already)
            from ray.exceptions import TaskCancelledError

            if isinstance(err, TaskCancelledError):
                return {"type": "http.disconnect"}
            raise

    return replay


# -- text checks ---------------------------------------------------------------------------------
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, param: str) -> None:
    """A lone surrogate (JSON "\\ud800") is not a character any encoding can carry: 400."""
    hit = _SURROGATE.search(text)
    if hit is not None:
        raise OpenAIError(400, f"{param}: invalid Unicode: lone surrogate {hit.group()!r} at position "
                               f"{hit.start()}", param, "invalid_unicode")


# -- how many tokens a text is at least --------------------------------------------------------------
# Pipeline steps that never drop input characters (see token_floor). Normalizers that can shrink
# the text (NFC/NFKC composition, Strip, StripAccents, Bert's cleaning, regex Replace) and
# pre-tokenizers that drop whitespace (Whitespace, Bert) are absent on purpose.
_KEEPING_NORMALIZERS = {"Lowercase", "NFD", "NFKD", "Prepend"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


@dataclass(frozen=True)
class TokenFloor:
    """The fewest tokens a text can become: (characters - those the tokenizer may drop) / the most
    characters one token covers, rounded up. Costs a few C-speed scans of the text, no tokenizing."""

    chars_per_token: int
    dropped: str = ""  # characters the tokenizer silently drops (ASCII bytes its byte vocabulary lacks)

    def __call__(self, text: str) -> int:
        kept = len(text) - sum(text.count(c) for c in self.dropped)
        return -(-kept // self.chars_per_token)


def token_floor(tokenizer) -> TokenFloor | None:
    """A TokenFloor for this tokenizer, or None when one token can cover unboundedly many characters
    or that cannot be proven from the tokenizer's serialized pipeline.

    Proof sketch: with a BPE model that gives every input symbol a token (see _dropped_symbols),
    normalizers and pre-tokenizers that never remove characters, and added tokens that do not
    swallow surrounding whitespace, every kept character ends up inside exactly one token, and a
    token covers at most len(its vocabulary string) characters (byte-level strings have one symbol
    per byte; fallback tokens stand for one byte). So tokens >= kept / max(len(token string))."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    dropped = _dropped_symbols(model, _has(spec.get("pre_tokenizer"), "ByteLevel"))
    if dropped is None:
        return None
    if not _keeps(spec.get("normalizer"), _KEEPING_NORMALIZERS) or not _keeps(spec.get("pre_tokenizer"),
                                                                                _KEEPING_PRE_TOKENIZERS):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    lengths = [len(t) for t in model["vocab"]] + [len(a["content"]) for a in added]
    return TokenFloor(max(lengths), dropped) if lengths else None


def max_chars_per_token(tokenizer) -> int | None:
    floor = token_floor(tokenizer)
    return None if floor is None else floor.chars_per_token


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
    bytes for U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _dropped_symbols(model: dict, byte_level: bool) -> str | None:
    """The characters BPE may drop ("" for none), or None when a whole run of text could vanish
    into nothing or into one token. BPE without an unk token silently drops a symbol it lacks; with
    an unfused <unk>, every unseen symbol is one token; a fused <unk> covers a whole run."""
    vocab = model["vocab"]
    if model.get("unk_token") is not None and not model.get("fuse_unk"):
        return ""
    if byte_level:
        missing = [b for b, symbol in _byte_symbols().items() if symbol not in vocab]
        if any(0x80 <= b < 0xC0 for b in missing):  # a continuation byte: a whole character may vanish
            return None
        # a lead byte >= 0xC0 is followed by continuation bytes, which do get tokens
        return "".join(chr(b) for b in missing if b < 0x80)
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return ""
    return None


def _has(step: dict | None, kind: str) -> bool:
    if not step:
        return False
    if step.get("type") == "Sequence":
        return any(_has(s, kind) for s in step.get("pretokenizers", step.get("normalizers", [])))
    return step.get("type") == kind


def _keeps(step: dict | None, allowed: set[str]) -> bool:
    """Whether a normalizer / pre-tokenizer (possibly a Sequence) provably keeps every character."""
    if not step:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_keeps(s, allowed) for s in step.get("pretokenizers", step.get("normalizers", [])))
    if kind == "Replace":  # a literal pattern replaced by something at least as long
        pattern = (step.get("pattern") or {}).get("String")
        return pattern is not None and len(step.get("content", "")) >= len(pattern)
    if step.get("behavior") == "Removed":  # Split / Punctuation that drops what it matches
        return False
    return kind in allowed


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server on this machine (a name other than localhost: no)."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_public() -> None:
    """Warn when Serve's proxy listens beyond loopback while this ingress takes no key (best effort:
    the HTTP options come from the Serve controller)."""
    try:
        import ray
        from ray.serve.context import _get_global_client

        if not ray.is_initialized():  # not inside a Ray worker: asking would start a cluster
            return
        host = _get_global_client(raise_if_no_controller_running=False).http_config.host
    except Exception:  # no controller (tests in process) or an older Serve: nothing to tell
        return
    if not is_loopback(host):
        logging.getLogger("specserve.ingress").warning(
            "Serve's HTTP proxy binds %s, beyond loopback, and this ingress has no API key: anyone who can reach "
            "it can use the model (set SPECSERVE_API_KEY)", host)
