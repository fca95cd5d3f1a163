"""Random option mixes against a running app, every answer checked: a conformance run for a deployment.

    specserve bench mix [--url http://127.0.0.1:8000] [--requests 200] [--concurrency 4] [--seed 0]
                        [--routes chat,completions,responses,messages] [--out bench-results/mix.json]

Each request is drawn at random from the options the app takes, mixed: greedy or seeded sampling
(temperature, top-p / top-k / min-p), logprobs, penalties, logit bias, stop strings and stop ids,
min_tokens, n, best_of, batched prompts, echo, return_token_ids, bad words, prompt truncation, priority,
predictions, JSON object / schema / regex / choice outputs, tools with every tool_choice, streams
with usage chunks; on the Responses API text or item input, instructions, structured output,
tools, store, background and follow-up turns; on Anthropic's Messages API system prompts, stop
sequences and tools. `bench features` takes the options one at a time on fixed prompts; this
takes them together, as traffic does.

Checks, each a problem when it fails:
- a refusal is a 4xx with an OpenAI- (or Anthropic-) shaped error body; never a 5xx;
- a stream ends as its API says (`[DONE]`; a terminal `response.*` event with increasing sequence
  numbers; `message_stop`), says what its final object says, and has a usage chunk when asked;
- every choice has a finish reason; token ids, logprobs and usage agree in number;
- a greedy answer equals the same request sent whole with `num_speculative_tokens: 0` (the
  target alone): text, token ids, finish reason, tool calls and usage. (Seeded sampling is not
  compared: another batch shape may move a draw across a token boundary, docs/engine.md.)
- a stored response reads back as it was returned.

Prints a table per route (requests, answered, refused by message, with problems) and each problem
with its request; writes JSON; exits 1 on any problem. Loopback only unless --allow-remote; every
request has a timeout and the run stops by itself.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve.bench.sse import add_url_arguments, named_events, refuse_remote
from specserve.prompts import GENERAL, load_records

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
          "messages": "/v1/messages"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
WORD = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 20}}, "required": ["word"],
        "additionalProperties": False}
PREDICTION = "The answer is that it depends on many things."


@dataclass
class Context:
    """What the draws need from the app: its model, prompts, and some of its real token ids."""

    model: str
    prompts: list[str]
    token_ids: list[int]


@dataclass
class Outcome:
    route: str
    body: dict
    status: int = 0
    refusal: str = ""
    problems: list[str] = field(default_factory=list)


# -- draws ------------------------------------------------------------------------------------------
def draw_sampling(rng: random.Random, body: dict) -> None:
    if rng.random() < 0.6:
        body["temperature"] = 0
        return
    body.update(temperature=rng.choice([0.5, 1.0, 1.3]), seed=rng.randrange(1000))
    for key, values, share in (("top_p", [0.5, 0.9], 0.3), ("top_k", [1, 5, 40], 0.3), ("min_p", [0.1], 0.2)):
        if rng.random() < share:
            body[key] = rng.choice(values)


def draw_processing(rng: random.Random, body: dict, ctx: Context) -> None:
    """Options every route takes (SamplingOptions)."""
    for key, values, share in (("presence_penalty", [-1.0, 0.5, 1.5], 0.2), ("frequency_penalty", [0.3, 1.0], 0.2),
                               ("repetition_penalty", [1.1, 1.3], 0.1), ("min_tokens", [1, 4], 0.15),
                               ("priority", [-1, 5], 0.1), ("ignore_eos", [True], 0.1),
                               ("bad_words", [["the"]], 0.1), ("skip_special_tokens", [False], 0.1)):
        if rng.random() < share:
            body[key] = rng.choice(values)
    if rng.random() < 0.15:
        body["logit_bias"] = {str(rng.choice(ctx.token_ids)): rng.choice([-100, 5, 10])}
    if rng.random() < 0.1:
        body["stop_token_ids"] = [rng.choice(ctx.token_ids)]


def draw_openai(rng: random.Random, ctx: Context, chat: bool) -> dict:
    """A chat or a completions request."""
    body: dict = {"model": ctx.model, "max_tokens": rng.choice([1, 2, 5, 16, 32, 48])}
    prompt = rng.choice(ctx.prompts)
    if chat:
        body["messages"] = ([{"role": "system", "content": "You are terse."}] if rng.random() < 0.2 else []) + [
            {"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt if rng.random() < 0.8 else [prompt, rng.choice(ctx.prompts)]
        if rng.random() < 0.1:
            body["echo"] = True
    draw_sampling(rng, body)
    draw_processing(rng, body, ctx)
    if rng.random() < 0.3:
        body.update(logprobs=True, top_logprobs=rng.choice([0, 1, 3])) if chat else body.update(logprobs=rng.choice([0, 3]))
    for key, values, share in (("stop", [["."], [" the", "\n"], ","], 0.25), ("n", [2, 3], 0.2),
                               ("return_token_ids", [True], 0.3), ("truncate_prompt_tokens", [5, 20], 0.1),
                               ("include_stop_str_in_output", [True], 0.1),
                               ("prediction", [{"type": "content", "content": PREDICTION}], 0.15)):
        if rng.random() < share:
            body[key] = rng.choice(values)
    draw_format(rng, body)
    if chat and rng.random() < 0.12:
        body["tools"] = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                                           "parameters": WORD}}]
        body["tool_choice"] = rng.choice(["auto", "required", "none", {"type": "function", "function": {"name": "lookup"}}])
    if rng.random() < 0.4:
        body["stream"] = True
        if rng.random() < 0.6:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.3}
    elif not chat and rng.random() < 0.15:  # (a ranked best_of is never streamed)
        body["best_of"] = body.get("n", 1) + 1
    return body


def draw_format(rng: random.Random, body: dict) -> None:
    r = rng.random()
    if r < 0.08:
        body["response_format"] = {"type": "json_object"}
    elif r < 0.16:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    elif r < 0.2:
        body["response_format"] = {"type": "regex", "regex": "(yes|no|maybe)[.!]"}
    elif r < 0.24:
        body["structured_outputs"] = {"choice": ["red", "green", "blue"]}


def draw_responses(rng: random.Random, ctx: Context) -> dict:
    prompt = rng.choice(ctx.prompts)
    body: dict = {"model": ctx.model, "max_output_tokens": rng.choice([8, 16, 32, 48]),
                  "input": prompt if rng.random() < 0.5 else [
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}]}
    draw_sampling(rng, body)
    draw_processing(rng, body, ctx)
    r = rng.random()
    if r < 0.1:
        body["text"] = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}}
    elif r < 0.15:
        body["text"] = {"format": {"type": "json_object"}}
    elif r < 0.25:
        body["tools"] = [{"type": "function", "name": "lookup", "description": "Look a word up", "parameters": WORD}]
        body["tool_choice"] = rng.choice(["auto", "required", {"type": "function", "name": "lookup"}])
    for key, values, share in (("instructions", ["Answer briefly."], 0.3), ("top_logprobs", [0, 2], 0.2),
                               ("store", [False], 0.3), ("stream", [True], 0.4), ("truncation", ["auto"], 0.1)):
        if rng.random() < share:
            body[key] = rng.choice(values)
    if body.get("store", True) and rng.random() < 0.15:
        body["background"] = True
    return body


def draw_messages(rng: random.Random, ctx: Context) -> dict:
    body: dict = {"model": ctx.model, "max_tokens": rng.choice([8, 16, 32]),
                  "messages": [{"role": "user", "content": rng.choice(ctx.prompts)}]}
    draw_sampling(rng, body)
    draw_processing(rng, body, ctx)
    for key, values, share in (("system", ["Answer briefly."], 0.3), ("stop_sequences", [["."]], 0.2),
                               ("stream", [True], 0.4)):
        if rng.random() < share:
            body[key] = rng.choice(values)
    if rng.random() < 0.2:
        body["tools"] = [{"name": "lookup", "description": "Look a word up", "input_schema": WORD}]
        body["tool_choice"] = rng.choice([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "lookup"}])
    return body


def draw(rng: random.Random, ctx: Context, routes: list[str]) -> tuple[str, dict]:
    route = rng.choice(routes)
    if route in ("chat", "completions"):
        return route, draw_openai(rng, ctx, route == "chat")
    return route, (draw_responses if route == "responses" else draw_messages)(rng, ctx)


# -- sending ----------------------------------------------------------------------------------------
def send(client: httpx.Client, url: str, body: dict) -> tuple[int, object]:
    """-> (status, the JSON body, or for a 200 stream its events as (event name, data) pairs)."""
    if not body.get("stream"):
        r = client.post(url, json=body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"unparsed": r.text[:300]}
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        return 200, list(named_events(r.iter_lines()))


def refusal_of(status: int, data) -> tuple[str, list[str]]:
    """(the error's message, problems) of a non-200 answer."""
    error = data.get("error") if isinstance(data, dict) else None
    if status >= 500 or not isinstance(error, dict) or not error.get("message"):
        return "", [f"status {status} without a client error body: {str(data)[:300]}"]
    return error["message"], []


# -- what an answer says (the part a greedy rerun must repeat) -------------------------------------
def openai_answer(route: str, data, problems: list[str]) -> dict:
    """-> {"choices": {index: [text, token ids, finish, logprob count, tool calls]}, "usage": ...}."""
    chat, choices, usage = route == "chat", {}, None
    if isinstance(data, list):  # a stream
        if not data or data[-1][1] != "[DONE]":
            problems.append("the stream did not end with [DONE]")
        for _, chunk in data:
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                problems.append(f"an error event: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                add_choice(choices.setdefault(c["index"], ["", [], None, 0, []]), c, chat, c.get("delta", {}))
        return {"choices": choices, "usage": usage}
    for c in data["choices"]:
        add_choice(choices.setdefault(c["index"], ["", [], None, 0, []]), c, chat, c.get("message", {}))
    return {"choices": choices, "usage": data.get("usage")}


def add_choice(entry: list, choice: dict, chat: bool, message: dict) -> None:
    entry[0] += (message.get("content") or "") if chat else (choice.get("text") or "")
    entry[1] += choice.get("token_ids") or []
    entry[2] = choice.get("finish_reason") or entry[2]
    logprobs = choice.get("logprobs") or {}
    entry[3] += len(logprobs.get("content") or []) if chat else len(logprobs.get("tokens") or [])
    entry[4] += [json.dumps(call.get("function", {}), sort_keys=True) for call in message.get("tool_calls") or []]


def check_openai(body: dict, answer: dict, problems: list[str]) -> None:
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    choices, usage = answer["choices"], answer["usage"]
    if len(choices) != prompts * body.get("n", 1):
        problems.append(f"{len(choices)} choices for {prompts} prompts x n={body.get('n', 1)}")
    if body.get("stream") and (body.get("stream_options") or {}).get("include_usage") and usage is None:
        problems.append("no usage chunk")
    counted = not body.get("echo") and not body.get("tools")
    for i, (_, ids, finish, logprobs, _) in choices.items():
        if finish is None:
            problems.append(f"choice {i} has no finish_reason")
        if counted and body.get("return_token_ids") and body.get("logprobs") not in (None, False) and logprobs != len(ids):
            problems.append(f"choice {i}: {logprobs} logprobs for {len(ids)} token ids")
    if counted and body.get("return_token_ids") and usage is not None:
        total = sum(len(c[1]) for c in choices.values())
        # best_of over n, sampled: usage also counts the candidates not returned
        ranked = body.get("best_of", 1) > body.get("n", 1) and body.get("temperature", 1.0) != 0
        if total != usage["completion_tokens"] and not (ranked and total < usage["completion_tokens"]):
            problems.append(f"{total} token ids but usage.completion_tokens {usage['completion_tokens']}")


def responses_answer(client: httpx.Client, url: str, body: dict, data, problems: list[str]) -> dict | None:
    """The final response object (a stream's terminal event's; a background one's once done)."""
    if isinstance(data, list):
        numbers = [d.get("sequence_number") for _, d in data if isinstance(d, dict)]
        if numbers != sorted(set(numbers)):
            problems.append("sequence numbers do not increase")
        ends = [d for _, d in data if isinstance(d, dict) and d.get("type") in
                ("response.completed", "response.incomplete", "response.failed")]
        if not ends:
            problems.append("no terminal response event")
            return None
        final = ends[-1]["response"]
        streamed = "".join(d["delta"] for _, d in data if isinstance(d, dict) and d.get("type") == "response.output_text.delta")
        if streamed != output_text(final, calls=False):
            problems.append(f"streamed text {streamed!r} is not the final response's")
        return final
    deadline = time.monotonic() + 120
    while body.get("background") and data["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        data = client.get(f"{url}/{data['id']}").json()
    return data


def output_text(response: dict, calls: bool = True) -> str:
    parts = []
    for item in response["output"]:
        if item["type"] == "message":
            parts += [c.get("text", "") for c in item["content"]]
        elif item["type"] == "function_call" and calls:
            parts.append(f"<call {item['name']} {item['arguments']}>")
    return "".join(parts)


def messages_answer(data, problems: list[str]) -> dict:
    if not isinstance(data, list):
        text = "".join(b.get("text", "") if b["type"] == "text" else f"<tool {b['name']} {json.dumps(b['input'])}>"
                       for b in data["content"])
        return {"text": text, "stop": data.get("stop_reason"), "tokens": data["usage"]["output_tokens"]}
    kinds = [d.get("type") for _, d in data if isinstance(d, dict)]
    if kinds[:1] != ["message_start"] or kinds[-1:] != ["message_stop"]:
        problems.append(f"events {kinds[:2]} ... {kinds[-2:]}: not message_start ... message_stop")
    deltas = [d for _, d in data if isinstance(d, dict) and d.get("type") == "message_delta"]
    text = "".join(d["delta"].get("text", "") for _, d in data if isinstance(d, dict) and d.get("type") == "content_block_delta")
    return {"text": text, "stop": deltas[-1]["delta"].get("stop_reason") if deltas else None,
            "tokens": deltas[-1]["usage"]["output_tokens"] if deltas else None}


def summary(client: httpx.Client, route: str, url: str, body: dict, data, problems: list[str]):
    """What a greedy rerun must give again."""
    if route in ("chat", "completions"):
        answer = openai_answer(route, data, problems)
        check_openai(body, answer, problems)
        return {i: c[:3] + c[4:] for i, c in answer["choices"].items()}, (answer["usage"] or {}).get("completion_tokens")
    if route == "messages":
        answer = messages_answer(data, problems)
        return (answer["text"], answer["stop"]) if not body.get("tools") else None, answer["tokens"]
    final = responses_answer(client, url, body, data, problems)
    if final is None:
        return None, None
    if final["status"] not in ("completed", "incomplete"):
        problems.append(f"response {final['status']}: {final.get('error')}")
    if body.get("store", True) and not body.get("background"):
        stored = client.get(f"{url}/{final['id']}")
        if stored.status_code != 200 or output_text(stored.json()) != output_text(final):
            problems.append(f"the stored response ({stored.status_code}) is not the one returned")
    return (output_text(final), final["status"]), (final.get("usage") or {}).get("output_tokens")


def run_one(base: str, route: str, body: dict, timeout: float, transport: httpx.BaseTransport | None = None) -> Outcome:
    """Send one drawn request, check its answer, and rerun a greedy one at γ=0 to compare."""
    outcome, url = Outcome(route, body), base + ROUTES[route]
    with httpx.Client(timeout=timeout, transport=transport) as client:
        outcome.status, data = send(client, url, body)
        if outcome.status != 200:
            outcome.refusal, outcome.problems = refusal_of(outcome.status, data)
            return outcome
        answer, tokens = summary(client, route, url, body, data, outcome.problems)
        if body.get("temperature") != 0 or answer is None:
            return outcome
        alone = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "background")}
        alone.update(num_speculative_tokens=0, **({"store": False} if route == "responses" else {}))
        status, again = send(client, url, alone)
        if status != 200:
            outcome.problems.append(f"the same request at γ=0: status {status} {str(again)[:200]}")
            return outcome
        answer_alone, tokens_alone = summary(client, route, url, alone, again, [])
        if answer != answer_alone or (tokens is not None and tokens != tokens_alone):  # (a stream may send no usage)
            outcome.problems.append(f"greedy answer {answer!r} ({tokens} tokens) differs from the target "
                                    f"alone's {answer_alone!r} ({tokens_alone})")
    return outcome


# -- the run ----------------------------------------------------------------------------------------
def context(base: str, timeout: float) -> Context:
    with httpx.Client(timeout=timeout) as client:
        model = client.get(base + "/v1/models").json()["data"][0]["id"]
        ids = client.post(base + "/tokenize", json={"model": model, "prompt": "the cat sat on a mat, and"}).json()["tokens"]
    prompts = [r["prompt"] for r in load_records(GENERAL)]
    return Context(model, prompts, sorted(set(ids)))


def table(outcomes: list[Outcome]) -> str:
    lines = [f"{'route':<12} {'requests':>8} {'answered':>8} {'refused':>7} {'problems':>8}"]
    for route in ROUTES:
        mine = [o for o in outcomes if o.route == route]
        if mine:
            lines.append(f"{route:<12} {len(mine):>8} {sum(o.status == 200 for o in mine):>8} "
                         f"{sum(bool(o.refusal) for o in mine):>7} {sum(bool(o.problems) for o in mine):>8}")
    refusals = Counter(o.refusal[:100] for o in outcomes if o.refusal)
    lines += [f"  refused {n} x: {message}" for message, n in refusals.most_common()]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_url_arguments(p)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="request k is drawn from seed + k")
    p.add_argument("--routes", default=",".join(ROUTES), help="a comma-separated subset of " + ",".join(ROUTES))
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=Path("bench-results/mix.json"))


def run(args: argparse.Namespace) -> int:
    base, routes = args.url.rstrip("/"), args.routes.split(",")
    ctx = context(base, args.timeout)
    draws = [draw(random.Random(args.seed + k), ctx, routes) for k in range(args.requests)]
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        outcomes = list(pool.map(lambda d: run_one(base, d[0], d[1], args.timeout), draws))
    print(f"{args.requests} requests, {args.concurrency} at a time, {time.perf_counter() - began:.0f} s, {ctx.model}")
    print(table(outcomes))
    for k, o in enumerate(outcomes):
        if o.problems:
            print(f"--- request {k} (seed {args.seed + k}) {o.route}: {json.dumps(o.body)[:400]}")
            print("\n".join(f"    {p[:500]}" for p in o.problems))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": ctx.model, "seed": args.seed, "outcomes": [vars(o) for o in outcomes]},
                                   indent=1))
    print(f"wrote {args.out}")
    return 1 if any(o.problems for o in outcomes) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench mix", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    refuse_remote(parser, args)
    unknown = set(args.routes.split(",")) - set(ROUTES)
    if unknown:
        parser.error(f"unknown routes {sorted(unknown)}; choose from {sorted(ROUTES)}")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
