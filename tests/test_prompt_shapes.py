"""How the config shapes prompts: its chat template and default template variables
(serve/templates.py: chats, and /tokenize, rendered with the config's template, inline or from a
file, instead of the tokenizer's; the defaults under each request's own chat_template_kwargs; bad
templates refused at start), and a code model's fill in the middle (config `fim`, completions'
`suffix`)."""
from __future__ import annotations

import pytest

from test_serve_api import MODEL, FakeCoordinator, _error, _server

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}|{{ mood | default('plain') }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def rendered(fake, monkeypatch, body: dict, **config) -> str:
    """The text a chat renders to under this config (through /tokenize, as chat completions render it)."""
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    _server(fake, monkeypatch, **config)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        chat = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "Hi"}], **body})
        assert chat.status_code == 200 and fake.requests[-1].prompt_token_ids == ids  # chat renders the same
    return text


@pytest.fixture()
def fake():
    return FakeCoordinator()


def test_the_config_s_template_renders_chats_inline_or_from_a_file(fake, monkeypatch, tmp_path):
    assert rendered(fake, monkeypatch, {}, chat_template=TEMPLATE) == "[user|plain] Hi\n[assistant] "
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert rendered(fake, monkeypatch, {}, chat_template=str(path)) == "[user|plain] Hi\n[assistant] "
    assert "<|im_start|>user\nHi" in rendered(fake, monkeypatch, {})  # without: the tokenizer's own


def test_default_variables_go_under_the_request_s_own(fake, monkeypatch):
    defaults = {"chat_template": TEMPLATE, "default_chat_template_kwargs": {"mood": "calm"}}
    assert rendered(fake, monkeypatch, {}, **defaults) == "[user|calm] Hi\n[assistant] "
    assert rendered(fake, monkeypatch, {"chat_template_kwargs": {"mood": "loud"}}, **defaults) == \
        "[user|loud] Hi\n[assistant] "


def test_a_template_that_renders_tools_gets_them_itself(fake, monkeypatch):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    template = TEMPLATE + "{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}"
    server = _server(fake, monkeypatch, chat_template=template)
    assert server._chat.renders_tools
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                           "tools": [tool]})
        text = client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("[assistant] <lookup>") and "# Tools" not in text


@pytest.mark.parametrize("config,message", [
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "does not compile"),
    ({"chat_template": "/no/such/template.jinja"}, "neither a Jinja template nor a readable file"),
    ({"default_chat_template_kwargs": {"add_generation_prompt": False}}, "may not set add_generation_prompt"),
])
def test_bad_templates_stop_the_ingress_at_start(fake, monkeypatch, config, message):
    with pytest.raises(ValueError, match=message):
        _server(fake, monkeypatch, **config)


def test_a_template_that_refuses_a_conversation_is_a_400(fake, monkeypatch):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}ok"
    _server(fake, monkeypatch, chat_template=strict)  # (a template's own exception is no reason to refuse it)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert "a system message first" in _error(r, 400)["message"]


# -- fill in the middle -------------------------------------------------------------------------------
FIM = {"prefix": "<PRE>", "suffix": "<SUF>", "middle": "<MID>"}


@pytest.mark.parametrize("order,expected", [("psm", "<PRE>def f(x):<SUF>    return y<MID>"),
                                            ("spm", "<PRE><SUF>    return y<MID>def f(x):")])
def test_a_suffix_is_filled_in_in_the_model_s_order(fake, monkeypatch, order, expected):
    from starlette.testclient import TestClient

    from specserve.models.tiny import byte_tokenizer
    from specserve.serve.openai_api import app

    _server(fake, monkeypatch, fim={**FIM, "order": order})
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"model": MODEL, "prompt": "def f(x):", "suffix": "    return y", "max_tokens": 3}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert fake.requests[-1].prompt_token_ids == byte_tokenizer()(expected).input_ids
        batch = client.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
        assert batch.status_code == 200 and len(fake.requests) >= 3
        assert client.post("/v1/completions", json={**body, "suffix": ""}).status_code == 200
        assert fake.requests[-1].prompt_token_ids == byte_tokenizer()("def f(x):").input_ids  # (no suffix)
        for extra, param in (({"prompt": [1, 2, 3]}, "suffix"), ({"echo": True}, "suffix"),
                             ({"truncate_prompt_tokens": 8}, "suffix")):
            assert _error(client.post("/v1/completions", json={**body, **extra}), 400)["param"] == param


def test_without_fim_a_suffix_is_refused(fake, monkeypatch):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    _server(fake, monkeypatch)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y", "max_tokens": 2})
    assert "fill in the middle" in _error(r, 400)["message"]
