"""The Conversations API's requests (`/v1/conversations`): a conversation's items are the
Responses API's input items (responses_schema.py), at most MAX_ITEMS a request, as OpenAI's."""
from __future__ import annotations

from pydantic import Field

from .responses_schema import InputItem, ItemReference, MediaContent
from .schema import Strict, metadata_problems

MAX_ITEMS = 20  # items one request may add


class _Items(Strict):
    def problems(self) -> list[tuple[str, str]]:
        """(param, why) for what a conversation cannot hold: media (this server's model reads text)."""
        for item in getattr(self, "items", None) or []:
            if any(isinstance(part, MediaContent) for part in getattr(item, "content", None) or []
                   if not isinstance(part, str)):
                return [("items", "images, files and audio are not supported: this server's model takes text")]
        return metadata_problems(getattr(self, "metadata", None))

    def references(self) -> list[str]:
        return [item.id for item in getattr(self, "items", None) or [] if isinstance(item, ItemReference)]

    def dumped(self, stored: dict[str, dict]) -> list[dict]:
        """The items as dicts, each `item_reference` the stored item it names (`stored`: by id)."""
        return [stored[item.id] if isinstance(item, ItemReference) else item.model_dump(by_alias=True,
                                                                                         exclude_none=True)
                for item in getattr(self, "items", None) or []]


class ConversationCreate(_Items):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None


class ConversationUpdate(_Items):
    metadata: dict[str, str] | None  # (required, as OpenAI's; null: none)


class ItemsCreate(_Items):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS)
