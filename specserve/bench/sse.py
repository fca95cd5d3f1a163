"""Streamed completions (server-sent events) and the latency figures the HTTP benchmarks report."""
from __future__ import annotations

import json
import statistics
from collections.abc import AsyncIterator

import httpx

DATA = "data: "
DONE = "[DONE]"


async def events(response: httpx.Response) -> AsyncIterator[dict | None]:
    """Each `data: ` line of a streamed response as its JSON event; None for `data: [DONE]`."""
    async for line in response.aiter_lines():
        if line.startswith(DATA):
            payload = line[len(DATA):]
            yield None if payload == DONE else json.loads(payload)


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
