"""What the HTTP benchmarks share: the server they may load, streamed completions (server-sent events) and
the latency figures they report."""
from __future__ import annotations

import argparse
import ipaddress
import json
import statistics
from collections.abc import AsyncIterator, Iterable, Iterator
from urllib.parse import urlparse

import httpx

DATA = "data: "
EVENT = "event: "
DONE = "[DONE]"
LOCAL_URL = "http://127.0.0.1:8000"


def add_url_arguments(p: argparse.ArgumentParser) -> None:
    """--url (the server to send requests to) and --allow-remote (the only way past `refuse_remote`)."""
    p.add_argument("--url", default=LOCAL_URL, help=f"the running app (default: {LOCAL_URL})")
    p.add_argument("--allow-remote", action="store_true", help="allow a --url outside the loopback range")


def is_loopback(url: str) -> bool:
    """Whether the URL's host is this machine: `localhost`, 127.0.0.0/8 or ::1."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # any other name
        return False


def refuse_remote(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A benchmark sends load to loopback only, unless told otherwise: argparse's error (exit 2) for any
    other --url without --allow-remote."""
    if not is_loopback(args.url) and not args.allow_remote:
        parser.error(f"--url {args.url} is not loopback; pass --allow-remote to load another host on purpose")


async def events(response: httpx.Response) -> AsyncIterator[dict | None]:
    """Each `data: ` line of a streamed response as its JSON event; None for `data: [DONE]`."""
    async for line in response.aiter_lines():
        if line.startswith(DATA):
            payload = line[len(DATA):]
            yield None if payload == DONE else json.loads(payload)


def named_events(lines: Iterable[str]) -> Iterator[tuple[str | None, object]]:
    """(name, data) for each `data: ` line of a stream: the name of the `event: ` line before it (None
    where there was none: OpenAI's chunks), and the data's JSON, or DONE as it stands."""
    name = None
    for line in lines:
        if line.startswith(EVENT):
            name = line[len(EVENT):]
        elif line.startswith(DATA):
            payload = line[len(DATA):]
            yield name, payload if payload == DONE else json.loads(payload)


def percentile(values: list[float], q: int, method: str = "exclusive") -> float | None:
    """The q-th of 99 cut points by `statistics.quantiles`; the value itself when there is one, None for none."""
    if not values:
        return None
    return statistics.quantiles(values, n=100, method=method)[q - 1] if len(values) > 1 else values[0]


def nearest_rank(values: list[float], q: float) -> float | None:
    """The sorted value at the rank nearest q (0 to 1) of the way from the smallest; None for none."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def ms(seconds: float | None, digits: int | None = 1) -> float | None:
    """Seconds as milliseconds, rounded to `digits` places (None: not rounded); None stays None."""
    if seconds is None:
        return None
    return 1e3 * seconds if digits is None else round(1e3 * seconds, digits)
