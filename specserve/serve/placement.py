"""Whether a replica's workers still have a node to run on: its placement group, watched.

A worker actor that dies on a live node is restarted there by Ray, and the coordinator waits for
it (serve/calls.py). A worker whose *node* is gone can come back only where its bundle finds
another node with the resources it asks for; until then Ray holds the group in RESCHEDULING with
that bundle placed nowhere (an empty node id). `PlacementWatch.check` reads the group's table (one
GCS call) and returns the bundles that have had no node for `lost_after_s` or longer: the
coordinator gives its requests up to the other replicas and leaves when the target's is among
them (serve/coordinator.py); a draft without a node only costs speculation (target-only steps).

How soon Ray itself sees a node as gone is the cluster's GCS health check (by default about 15 s
after the node stops answering; docs/multi-gpu.md, "Failure domains").
"""
from __future__ import annotations

import time
from typing import Callable

COORDINATOR_BUNDLE, TARGET_BUNDLE, DRAFT_BUNDLE = 0, 1, 2  # the bundles of AppConfig.coordinator_bundles()
POLL_S = 1.0  # how often a replica reads its group's table


class PlacementWatch:
    """Per bundle of one placement group, how long it has been without a node."""

    def __init__(self, placement_group, lost_after_s: float, table: Callable | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if table is None:
            from ray.util import placement_group_table as table
        self.placement_group, self.lost_after_s = placement_group, lost_after_s
        self._table, self._clock = table, clock
        self._since: dict[int, float] = {}  # bundle -> when it was first seen without a node

    def check(self) -> list[int]:
        """Read the group's table -> the bundles without a node for lost_after_s or longer."""
        table = self._table(self.placement_group)
        nodes = table.get("bundles_to_node_id", {})
        now = self._clock()
        for index in table.get("bundles", nodes):
            if nodes.get(index):
                self._since.pop(index, None)
            else:
                self._since.setdefault(index, now)
        return sorted(i for i, since in self._since.items() if now - since >= self.lost_after_s)

    def unplaced_s(self, index: int) -> float:
        """Seconds this bundle has been without a node as of the last check (0: it has one)."""
        since = self._since.get(index)
        return 0.0 if since is None else self._clock() - since
