"""How the ingress renders a chat: the config's `chat_template` (inline Jinja, or the path of a
file holding it) in place of the tokenizer's own, and the config's `default_chat_template_kwargs`
under each request's `chat_template_kwargs` (vLLM's --chat-template and
--default-chat-template-kwargs: a base model without a template, a template fixed for tool calls,
a reasoning model whose thinking is off unless asked)."""
from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateSyntaxError

from .front_door import OpenAIError
from .schema import RESERVED_TEMPLATE_KWARGS
from .tools import renders_tools


class ChatTemplate:
    def __init__(self, tokenizer, template: str | None = None, defaults: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = None if template is None else template_text(template, tokenizer)
        self.defaults = dict(defaults or {})
        reserved = sorted(set(self.defaults) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"default_chat_template_kwargs may not set {', '.join(reserved)} (the server sets them)")
        self.renders_tools = renders_tools(tokenizer, self.source)  # it renders `tools` itself

    def render(self, messages: list[dict], tools: list[dict] | None, options: dict) -> str:
        """options: add_generation_prompt, continue_final_message and the request's chat_template_kwargs."""
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=self.source,
                                                      **{**self.defaults, **options})
        except Exception as err:  # a template may reject a role order, or a final message to continue
            raise OpenAIError(400, f"chat template failed: {err}", "messages") from err


def template_text(value: str, tokenizer) -> str:
    """A template given inline, or read from the file it names; refused (ValueError) when it is
    neither, or does not compile."""
    text = value
    if "{{" not in value and "{%" not in value:
        try:
            text = Path(value).expanduser().read_text()
        except OSError as err:
            raise ValueError(f"chat_template is neither a Jinja template nor a readable file: {err}") from None
    try:  # (compiled as transformers compiles it; a template's own raise_exception is not an error here)
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=text, tokenize=False)
    except TemplateSyntaxError as err:
        raise ValueError(f"chat_template does not compile: {err}") from None
    except Exception:
        pass
    return text
