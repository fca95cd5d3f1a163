"""Reasoning models (config `reasoning`): the thinking split out of a chat answer, whole and
streamed in any chunking (serve/reasoning.py); a grammar that applies after the reasoning, greedy
through every drafter identical to the target alone under the same grammar (engine/grammar.py);
and the HTTP layer in process: fields, usage, tools, include_reasoning, replayed messages."""
from __future__ import annotations

import json
import random

import llguidance
import pytest

from specserve.engine.grammar import Grammar, Reasoning
from specserve.models.tiny import EOS_TOKEN_IDS, byte_tokenizer
from specserve.serve.reasoning import ReasoningSpec, ReasoningSplit, check_tags, opens_reasoning, reasoning_tokens
from test_grammar import GRAMMARS, engine_for, params, reference, view
from test_drafters import prompts
from test_serve_api import MODEL, FakeCoordinator, _error, _server

START, END = "<think>", "</think>"


def split_whole(text: str, opened: bool) -> tuple[str | None, str | None, ReasoningSplit]:
    split = ReasoningSplit(START, END, opened)
    thinking, content = split.feed(text, True)
    return (thinking if split.reasoned else None), (content if split.answering else None), split


# -- the split -------------------------------------------------------------------------------------
@pytest.mark.parametrize("opened,text,parts", [
    (True, "Let me see.\n</think>\n\nParis.", ("Let me see.\n", "Paris.")),
    (True, "\nStill thinking", ("Still thinking", None)),  # cut while thinking: no content yet
    (True, "Short.</think>", ("Short.", "")),
    (True, "a </think> b </think> c", ("a ", "b </think> c")),  # the first end tag ends it
    (False, "<think>\nhmm</think>Answer", ("hmm", "Answer")),
    (False, "  <think>hmm</think>\n\n Answer ", ("hmm", "Answer ")),
    (False, "Answer, no reasoning", (None, "Answer, no reasoning")),
    (False, "  Answer", (None, "  Answer")),  # without reasoning the text is as it came
    (False, "<thinking>", (None, "<thinking>")),
    (False, "<thi", (None, "<thi")),  # the whole output a prefix of the tag
    (False, "", (None, "")),
    (False, "Answer <think>x</think>", (None, "Answer <think>x</think>")),  # a tag later is content
])
def test_the_parts_of_a_whole_answer(opened, text, parts):
    assert split_whole(text, opened)[:2] == parts


@pytest.mark.parametrize("seed", range(40))
def test_any_chunking_gives_the_same_parts(seed):
    """Streamed in random chunks (tags cut anywhere), the parts put together are the whole
    answer's, and nothing goes out before it is decided."""
    rng = random.Random(seed)
    pieces = ["<think>", "\n ", "plan <", "/thi", "nk", "> a", "</think>", "\n\n", "Done <think>", "."]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 9)))
    opened = rng.random() < 0.5
    whole_thinking, whole_content, whole = split_whole(text, opened)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    split = ReasoningSplit(START, END, opened)
    thinking = content = ""
    for i, chunk in enumerate(chunks):
        t, c = split.feed(chunk, i == len(chunks) - 1)
        thinking, content = thinking + t, content + c
        assert not c or split.answering
    assert (split.reasoned, split.answering) == (whole.reasoned, whole.answering), text
    assert thinking == (whole_thinking or "") and content == (whole_content or ""), (text, chunks)


def test_a_possible_tag_is_held_back_until_the_next_text_decides():
    split = ReasoningSplit(START, END, opened=True)
    assert split.feed("I think </th", False) == ("I think ", "")
    assert split.feed("ought", False) == ("</thought", "")  # not the end tag after all
    assert split.feed(" ok </", False) == (" ok ", "")
    assert split.feed("think>  Yes", False) == ("", "Yes")
    before = ReasoningSplit(START, END, opened=False)
    assert before.feed("  <th", False) == ("", "") and not before.reasoned
    assert before.feed("ink>x", False) == ("x", "") and before.reasoned


@pytest.mark.parametrize("prompt,opened", [
    ("<|im_start|>assistant\n<think>\n", True),  # DeepSeek-R1's template
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with thinking off
    ("<|im_start|>assistant\n", False),
    ("...<think>old</think>...<|im_start|>assistant\n<think>", True),
])
def test_the_prompt_says_whether_the_output_starts_inside_the_reasoning(prompt, opened):
    assert opens_reasoning(prompt, START, END) is opened


def test_tags_the_detokenizer_hides_are_refused():
    check_tags(byte_tokenizer(), START, END)
    with pytest.raises(ValueError, match="special token"):
        check_tags(byte_tokenizer(), "<|im_start|>", END)


def test_reasoning_tokens_count_through_the_end_tag():
    tok = byte_tokenizer()
    ids = list(b"<think>abc</think>Answer")
    spec = ReasoningSpec(START, END, opened=False)
    assert reasoning_tokens(tok, ids, spec) == len(b"<think>abc</think>")
    assert reasoning_tokens(tok, list(b"<think>abc"), spec) == len(b"<think>abc")  # never ended: all
    assert reasoning_tokens(tok, list(b"Answer"), spec) == 0
    opened = ReasoningSpec(START, END, opened=True)
    assert reasoning_tokens(tok, list(b"abc</think>Answer") + [EOS_TOKEN_IDS[0]], opened) == len(b"abc</think>")
    # an end tag that is one token of its own is found by its id
    single = byte_tokenizer.__wrapped__()
    single.add_tokens(["</R>"])
    end_id = single.convert_tokens_to_ids("</R>")
    assert reasoning_tokens(single, list(b"ab") + [end_id] + list(b"c"), ReasoningSpec("<R>", "</R>", True)) == 3


# -- the grammar after the reasoning ---------------------------------------------------------------
SCHEMA = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize("opened,text,ok", [
    (True, 'hmm </R>\n\n{"a":1}', True),
    (True, '{"a":1}', False),  # the prompt opened it: the reasoning must end first
    (True, 'x</R>{"a":1}</R>', False),  # the first end tag ends it
    (True, 'x</R>\n\n\n\n\n{"a":1}', False),  # at most MAX_SEPARATOR blanks before the grammar
    (False, '{"a":1}', True),  # no reasoning at all
    (False, '<R>x</R>{"a":2}', True),
    (False, 'x</R>{"a":2}', False),
    (False, '<R>x</R>{"b":2}', False),  # the grammar holds after it
])
def test_a_grammar_applies_from_the_reasoning_s_end(opened, text, ok):
    grammar = SCHEMA.after_reasoning(Reasoning("<R>", "</R>", opened))
    assert llguidance.LLMatcher.validate_grammar(grammar.text(), view(260)) == ""
    matcher = llguidance.LLMatcher(view(260), grammar.text(), log_level=0)
    consumed = all(matcher.consume_token(t) for t in byte_tokenizer().encode(text))
    assert (consumed and matcher.is_accepting()) is ok


def reasoned_rows(count: int) -> tuple[list[list[int]], list[Grammar | None]]:
    """Prompts, each with a grammar after a reasoning whose tags the target writes itself (its
    first greedy token opens it, a later one ends it), so that every row thinks, then follows its
    grammar; opened and not, every kind of grammar, and a free row."""
    batch, grammars = [], []
    inner = [g for g in GRAMMARS if g is not None]
    for prompt in prompts(12, seed=11):
        out = reference(tuple(prompt), None)
        end = next((j for j in range(2, 8) if out[j] not in out[:j]), None)
        if end is None:
            continue
        k = len(grammars)
        reasoning = Reasoning(chr(out[0]), chr(out[end]), open=k % 2 == 0)
        batch.append(prompt)
        grammars.append(inner[k % len(inner)].after_reasoning(reasoning))
        if len(batch) == count:
            break
    return batch + prompts(1, seed=5), grammars + [None]


@pytest.mark.parametrize("name", ["draft-model", "feature-head", "layer-skip", "prompt-lookup"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_through_the_reasoning_is_the_constrained_target_alone(name, gamma, head_dir):
    batch, grammars = reasoned_rows(5)
    outs = engine_for(name, gamma, head_dir).generate(batch, [params(g) for g in grammars])
    for prompt, g, out in zip(batch, grammars, outs):
        assert out.token_ids == reference(tuple(prompt), g), (name, gamma, g)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    for prompt, g in zip(batch, grammars):
        if g is None:
            continue
        ids, free = reference(tuple(prompt), g), reference(tuple(prompt), None)
        end = ids.index(ord(g.reasoning.end))
        assert ids[:end + 1] == free[:end + 1]  # the thinking is free ...
        assert ids != free  # ... and the grammar holds after it
        inner = Grammar(g.kind, g.source)
        matcher = llguidance.LLMatcher(view(260), inner.text(), log_level=0)
        answer = bytes(ids[end + 1:]).lstrip(b" \t\r\n")
        followed = 0  # the answer follows the grammar until the grammar is complete (no EOS among the test ids)
        while followed < len(answer) and matcher.validate_tokens([answer[followed]]) == 1:
            matcher.consume_token(answer[followed])
            followed += 1
        assert followed > 0 and (followed == len(answer) or matcher.is_accepting()), answer


# -- over HTTP, in process -----------------------------------------------------------------------------
def said(text: bytes) -> list[int]:
    return list(text) + [EOS_TOKEN_IDS[0]]


@pytest.fixture()
def fake():
    return FakeCoordinator(max_model_len=2048)


def reasoning_client(fake, monkeypatch, **reasoning):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    _server(fake, monkeypatch, reasoning=reasoning)
    return TestClient(app, raise_server_exceptions=False)


USER = {"role": "user", "content": "Capital of France?"}


def chat(client, stream: bool = False, **kw) -> tuple[dict, dict]:
    """(the message, or the deltas put together, of one chat request; its usage)."""
    body = {"model": MODEL, "messages": [USER], "max_tokens": 200, **kw}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"], r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    message: dict = {}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    for event in events[:-1]:
        for key, value in event["choices"][0]["delta"].items():
            if isinstance(value, str) and key != "role":
                message[key] = message.get(key, "") + value
        for call in event["choices"][0]["delta"].get("tool_calls") or []:
            function = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})["function"]
            for key in ("name", "arguments"):
                function[key] += call["function"].get(key) or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, events[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_answer_comes_without_its_thinking(fake, monkeypatch, stream):
    fake.script = said(b"<think>\nThe capital is Paris.\n</think>\n\nParis.")
    with reasoning_client(fake, monkeypatch) as client:
        message, usage = chat(client, stream)
    assert message["content"] == "Paris." and message["reasoning"] == "The capital is Paris.\n"
    assert usage["completion_tokens_details"] == {"reasoning_tokens": len(b"<think>\nThe capital is Paris.\n</think>")}
    assert "reasoning_content" not in message


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_opens_the_reasoning_and_both_field_names(fake, monkeypatch, stream):
    """The rendered prompt ends inside <think> (here: an assistant message continued): the
    output's first token is already reasoning; both field names carry it."""
    fake.script = said(b"still thinking</think>Done.")
    opened = [USER, {"role": "assistant", "content": "<think>"}]
    with reasoning_client(fake, monkeypatch, fields=["reasoning", "reasoning_content"]) as client:
        message, usage = chat(client, stream, messages=opened, add_generation_prompt=False,
                              continue_final_message=True)
    assert message["content"] == "Done."
    assert message["reasoning"] == message["reasoning_content"] == "still thinking"
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(b"still thinking</think>")


@pytest.mark.parametrize("stream", [False, True])
def test_without_reasoning_or_without_the_split(fake, monkeypatch, stream):
    fake.script = said(b"Paris.")
    with reasoning_client(fake, monkeypatch) as client:
        message, usage = chat(client, stream)
        assert message["content"] == "Paris." and message.get("reasoning") is None
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
        fake.script = said(b"<think>secret</think>Paris.")
        message, _ = chat(client, stream, include_reasoning=False)
        assert message["content"] == "Paris." and message.get("reasoning") is None
    fake.script = said(b"<think>x</think>Paris.")  # a server without `reasoning`: the text as it is
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    _server(fake, monkeypatch)
    with TestClient(app, raise_server_exceptions=False) as plain:
        message, usage = chat(plain, stream)
    assert message["content"] == "<think>x</think>Paris." and "reasoning" not in message
    assert "completion_tokens_details" not in usage


def test_cut_while_thinking(fake, monkeypatch):
    fake.script = said(b"<think>a long thought that goes on")
    with reasoning_client(fake, monkeypatch) as client:
        message, usage = chat(client, max_tokens=10)
    assert message["content"] is None and message["reasoning"] == "a l"  # (10 tokens: 7 of them the tag)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 10


@pytest.mark.parametrize("stream", [False, True])
def test_grammars_and_tools_apply_after_the_thinking(fake, monkeypatch, stream):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    with reasoning_client(fake, monkeypatch) as client:
        fake.requests.clear()
        fake.script = said(b'<think>Use JSON.</think>\n{"city": "Paris"}')
        message, _ = chat(client, stream, response_format={"type": "json_object"})
        grammar = fake.requests[-1].params.grammar
        assert grammar.kind == "json_object" and grammar.reasoning == Reasoning(START, END, False)
        assert message["content"] == '{"city": "Paris"}' and message["reasoning"] == "Use JSON."
        fake.script = said(b'<think>Call it.</think><tool_call>{"name": "get_weather", '
                           b'"arguments": {"city": "Oslo"}}</tool_call>')
        message, _ = chat(client, stream, tools=[weather])
        assert message["reasoning"] == "Call it." and not message.get("content")
        calls = message["tool_calls"]
        arguments = calls[0]["function"]["arguments"]
        assert calls[0]["function"]["name"] == "get_weather" and json.loads(arguments) == {"city": "Oslo"}
        fake.script = said(b'<think>Named.</think>{"city": "Rome"}')
        named = {"type": "function", "function": {"name": "get_weather"}}
        message, _ = chat(client, stream, tools=[weather], tool_choice=named)
        assert message["reasoning"] == "Named." and fake.requests[-1].params.grammar.reasoning is not None
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
        fake.script = said(b"<think>Cut before the call")  # a named call never began: none is made
        message, _ = chat(client, stream, tools=[weather], tool_choice=named)
        assert not message.get("tool_calls") and message["reasoning"] == "Cut before the call"


def test_a_replayed_answer_and_reasoning_effort(fake, monkeypatch):
    fake.script = said(b"Fine.")
    with reasoning_client(fake, monkeypatch) as client:
        history = [USER, {"role": "assistant", "content": "Paris.", "reasoning": "Easy."}, USER]
        assert chat(client, messages=history)[0]["content"] == "Fine."
        thought_only = [USER, {"role": "assistant", "content": None, "reasoning_content": "Hmm."}, USER]
        assert chat(client, messages=thought_only, reasoning_effort="low")[0]["content"] == "Fine."
        path = "/v1/chat/completions"
        differ = [USER, {"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}]
        _error(client.post(path, json={"model": MODEL, "messages": differ}), 400)
        _error(client.post(path, json={"model": MODEL, "messages": [USER], "reasoning_effort": "extreme"}), 400)
        twice = {"model": MODEL, "messages": [USER], "reasoning_effort": "low",
                 "chat_template_kwargs": {"reasoning_effort": "high"}}
        assert _error(client.post(path, json=twice), 400)["param"] == "chat_template_kwargs"


def test_the_template_gets_the_replayed_reasoning_and_the_effort():
    from specserve.serve.schema import ChatCompletionRequest
    from specserve.serve.tools import prompt_messages

    body = ChatCompletionRequest(model=MODEL, messages=[USER, {"role": "assistant", "content": "Paris.",
                                                               "reasoning": "Easy."}], reasoning_effort="high")
    for native in (False, True):
        assistant = prompt_messages(body.messages, None, native)[1]
        assert assistant["reasoning_content"] == assistant["reasoning"] == "Easy."
    assert body.template_options()["reasoning_effort"] == "high"


def test_a_special_token_tag_stops_the_ingress_at_start(fake, monkeypatch):
    with pytest.raises(ValueError, match="special token"):
        _server(fake, monkeypatch, reasoning={"start": "<|im_start|>"})
