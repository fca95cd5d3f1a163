"""What each OpenAI option costs under speculation, against a running app, in one run.

    python -m specserve.bench.features --url http://127.0.0.1:8000 [--prompts 20] [--features plain,json_schema]

For each feature (plain greedy chat, logprobs, penalties, repetition penalty, logit bias, n=2,
json_object, json_schema, a tool call of a named function or a required one, and the same plain
request through the Responses API, `/v1/responses`) and each held-out
chat prompt of the shipped sets (specserve/prompts, interleaved by category), it sends the same
request twice, back to back: with the app's own speculation and with the per-request
`num_speculative_tokens: 0` (target-only decoding on the same replica and workers). One request
at a time, so the ratio is the per-request speed a user sees.

Per feature: completion tokens/s of each (all tokens / time inside the requests), their ratio,
the acceptance rate (accepted / drafted), and its checks: greedy answers' token ids identical with
and without speculation (the Responses API gives no ids: its text), greedy logprobs within 1e-4 (alternatives too), json_schema answers that
validate against the schema (tool calls: arguments that validate against the function's
parameters). Prints a table and writes JSON. Loopback only unless --allow-remote.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from specserve.bench.sse import add_url_arguments, refuse_remote
from specserve.prompts import EXTRACTION, GENERAL, interleaved, load_records

ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
          "properties": {"answer": {"type": "string", "maxLength": 160},
                         "confidence": {"enum": ["low", "medium", "high"]}}}  # (a number may run on: 1.0000...)
ANSWER_TOOL = {"type": "function", "function": {"name": "answer", "description": "Give the answer",
                                               "parameters": ANSWER}}
FEATURES = {  # name -> extra request fields (all greedy but n, which samples two seeded choices)
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "penalties": {"presence_penalty": 0.6, "frequency_penalty": 0.4},
    "repetition": {"repetition_penalty": 1.15},
    "logit_bias": {"logit_bias": {"13": -100, "28": 4, "30": -4}},
    "n=2": {"n": 2, "temperature": 0.8, "seed": 1},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}},
    "tool_named": {"tools": [ANSWER_TOOL], "tool_choice": {"type": "function", "function": {"name": "answer"}}},
    "tool_required": {"tools": [ANSWER_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    "responses": {},  # plain, as the Responses API asks it
}
STRUCTURED_MAX_TOKENS = 160  # an answer of up to 160 characters and its JSON frame (json_object: may not end)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_url_arguments(p)
    p.add_argument("--model", default=None, help="default: the server's only model")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=48, help="per request (structured output: %d)" %
                   STRUCTURED_MAX_TOKENS)
    p.add_argument("--features", default=",".join(FEATURES))
    p.add_argument("--out", type=Path, default=Path("bench-results/features.json"))
    p.add_argument("--timeout", type=float, default=600.0)


def _request(client: httpx.Client, body: dict, route: str = "/v1/chat/completions") -> tuple[dict, float]:
    began = time.perf_counter()
    r = client.post(route, json=body)
    seconds = time.perf_counter() - began
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return r.json(), seconds


def _as_response(chat: dict) -> dict:
    """A chat request's body as the Responses API takes it (one user message, no ids)."""
    (message,) = chat["messages"]
    extra = {k: v for k, v in chat.items() if k not in ("messages", "max_tokens", "return_token_ids")}
    return {**extra, "input": message["content"], "max_output_tokens": chat["max_tokens"], "store": False}


def _as_chat(response: dict) -> dict:
    """A Responses API answer in the chat shape the rows read (its text where chat has token ids)."""
    usage = response["usage"]
    return {"usage": {"completion_tokens": usage["output_tokens"]}, "speculation": response["speculation"],
            "choices": [{"token_ids": response["output"][0]["content"][0]["text"], "logprobs": None,
                         "finish_reason": "stop" if response["status"] == "completed" else "length",
                         "message": {}}]}


def _logprobs_match(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return a is b
    x, y = a["content"], b["content"]
    return len(x) == len(y) and all(
        abs(p["logprob"] - q["logprob"]) < 1e-4 and [t["token"] for t in p["top_logprobs"]] ==
        [t["token"] for t in q["top_logprobs"]] for p, q in zip(x, y))


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _checked(name: str, message: dict) -> bool:
    """Whether a structured answer is what its feature asked for (other features: False)."""
    if name.startswith("tool_"):
        calls = message.get("tool_calls") or []
        return len(calls) == 1 and calls[0]["function"]["name"] == "answer" and \
            _valid(calls[0]["function"]["arguments"], ANSWER)
    if name.startswith("json"):
        return _valid(message["content"], ANSWER if name == "json_schema" else {"type": "object"})
    return False


def run_feature(client: httpx.Client, model: str, name: str, prompts: list[str], max_tokens: int) -> dict:
    extra = FEATURES[name]
    structured = "response_format" in extra or "tools" in extra
    row = {"feature": name, "prompts": len(prompts), "tokens": [0, 0], "seconds": [0.0, 0.0], "drafted": 0,
           "accepted": 0, "same_tokens": 0, "same_logprobs": 0, "valid": 0, "finished": 0}
    for prompt in prompts:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                "max_tokens": STRUCTURED_MAX_TOKENS if structured else max_tokens, "return_token_ids": True, **extra}
        answers = []
        for i, fields in enumerate(({}, {"num_speculative_tokens": 0})):
            if name == "responses":
                answer, seconds = _request(client, _as_response({**body, **fields}), "/v1/responses")
                answer = _as_chat(answer)
            else:
                answer, seconds = _request(client, {**body, **fields})
            row["tokens"][i] += answer["usage"]["completion_tokens"]
            row["seconds"][i] += seconds
            answers.append(answer)
        spec, alone = answers
        row["drafted"] += spec["speculation"]["num_draft_tokens"]
        row["accepted"] += spec["speculation"]["num_accepted_tokens"]
        ids = lambda a: [c["token_ids"] for c in a["choices"]]  # noqa: E731
        row["same_tokens"] += ids(spec) == ids(alone)
        row["same_logprobs"] += all(_logprobs_match(c["logprobs"], d["logprobs"])
                                    for c, d in zip(spec["choices"], alone["choices"]))
        choice = spec["choices"][0]
        row["finished"] += choice["finish_reason"] in ("stop", "tool_calls")
        row["valid"] += _checked(name, choice["message"])
    tps = [t / s if s else None for t, s in zip(row["tokens"], row["seconds"])]
    row.update(spec_tok_s=tps[0], alone_tok_s=tps[1], speedup=tps[0] / tps[1] if all(tps) else None,
               acceptance=row["accepted"] / row["drafted"] if row["drafted"] else None)
    return row


def _table(rows: list[dict]) -> str:
    head = (f"{'feature':<13} {'spec tok/s':>10} {'γ=0 tok/s':>10} {'ratio':>6} {'accept':>6} {'same ids':>9} "
            f"{'same lp':>8} {'valid':>7} {'stop':>6}")
    lines = [head]
    for r in rows:
        n = r["prompts"]
        valid = f"{r['valid']}/{n}" if r["feature"].startswith(("json", "tool")) else "-"
        same = "-" if "temperature" in FEATURES[r["feature"]] else f"{r['same_tokens']}/{n}"  # (sampled)
        same_lp = f"{r['same_logprobs']}/{n}" if "logprobs" in FEATURES[r["feature"]] else "-"
        lines.append(f"{r['feature']:<13} {r['spec_tok_s']:>10.1f} {r['alone_tok_s']:>10.1f} {r['speedup']:>6.2f} "
                     f"{(r['acceptance'] or 0):>6.2f} {same:>9} {same_lp:>8} {valid:>7} {r['finished']:>3}/{n:<2}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    records = [r for r in interleaved(load_records(GENERAL, EXTRACTION)) if r["chat"]][: args.prompts]
    prompts = [r["prompt"] for r in records]
    names = [n.strip() for n in args.features.split(",") if n.strip()]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise SystemExit(f"unknown features {unknown}: choose from {', '.join(FEATURES)}")
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        _request(client, {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})  # warm-up
        rows = []
        for name in names:
            rows.append(run_feature(client, model, name, prompts, args.max_tokens))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"url": args.url, "model": model, "prompts": len(prompts), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench features", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    refuse_remote(parser, args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
