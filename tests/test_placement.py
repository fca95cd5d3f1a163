"""Failure domains: a replica whose target worker's bundle has no node left gives its requests up
(`Lost`, which the ingress continues elsewhere: test_serve_api.py) and leaves; the placement watch
counts time without a node per bundle; configs that could put a coordinator on another group's
GPU node are refused. The node-loss run itself: tests/test_multinode.py."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from pydantic import ValidationError

from specserve.config import AppConfig
from specserve.engine.sampling import SamplingParams
from specserve.serve.placement import DRAFT_BUNDLE, TARGET_BUNDLE, PlacementWatch
from serve_helpers import tiny_app_spec


class FakeGroup:
    """A placement group's table as Ray reports it, and a clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.nodes = {0: "head", 1: "node-a", 2: "node-b"}

    def table(self, pg) -> dict:
        return {"state": "CREATED" if all(self.nodes.values()) else "RESCHEDULING",
                "bundles": {i: {} for i in self.nodes}, "bundles_to_node_id": dict(self.nodes)}


def test_the_watch_counts_time_without_a_node_per_bundle():
    group = FakeGroup()
    watch = PlacementWatch(None, 5.0, table=group.table, clock=lambda: group.now)
    assert watch.check() == []
    group.nodes[TARGET_BUNDLE] = ""  # node A is gone
    assert watch.check() == [] and watch.unplaced_s(TARGET_BUNDLE) == 0.0
    group.now += 4.9
    assert watch.check() == [] and watch.unplaced_s(TARGET_BUNDLE) == pytest.approx(4.9)
    group.nodes[DRAFT_BUNDLE] = ""
    group.now += 0.1
    assert watch.check() == [TARGET_BUNDLE]
    group.nodes[TARGET_BUNDLE] = "node-c"  # placed again elsewhere (capacity came back)
    group.now += 10
    assert watch.check() == [DRAFT_BUNDLE] and watch.unplaced_s(TARGET_BUNDLE) == 0.0


def test_a_replica_whose_target_has_no_node_gives_its_requests_up_and_leaves(local_coordinator, monkeypatch):
    from specserve.serve import coordinator as module
    from specserve.serve.coordinator import Delta, GenerateRequest, Lost

    config = AppConfig.model_validate({**tiny_app_spec()["args"], "deadlines": {"worker_lost_s": 0.3}})
    coordinator = local_coordinator(config)
    group, exits = FakeGroup(), []
    coordinator._placement = PlacementWatch(None, 0.3, table=group.table)
    monkeypatch.setattr(module, "POLL_S", 0.05)
    monkeypatch.setattr(module, "_exit_process", lambda: exits.append(True))
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    iterate = coordinator.loop.iterate

    async def stuck_once_gone(seqs):  # a call to a worker on a node that is gone hangs
        if group.nodes[TARGET_BUNDLE]:
            return await iterate(seqs)
        await asyncio.sleep(3600)

    coordinator.loop.iterate = stuck_once_gone

    async def one(prompt) -> list:
        items = []
        async for item in coordinator.generate(GenerateRequest(uuid.uuid4().hex, prompt, params)):
            items.append(item)
            if isinstance(item, Delta) and len(items) == 3:
                group.nodes[TARGET_BUNDLE] = ""  # the target's node is removed mid-stream
        return items

    async def run():
        streams = await asyncio.wait_for(asyncio.gather(one([72, 105]), one([1, 2, 3])), timeout=30)
        late = [item async for item in coordinator.generate(GenerateRequest("late", [5, 6], params))]
        with pytest.raises(RuntimeError, match="node is gone"):
            await coordinator.check_health()
        await asyncio.sleep(module.LEAVE_S + 0.2)
        return streams, late

    streams, late = asyncio.run(run())
    for items in streams:
        assert isinstance(items[-1], Lost) and "node is gone" in items[-1].message
        assert not any(getattr(i, "finish_reason", None) for i in items)  # given up, not finished
    assert late == [Lost(coordinator._lost)]  # a request arriving after: handed on at once
    assert exits == [True]


def _multinode(**overrides) -> dict:
    args = tiny_app_spec()["args"]
    return {**args, "target_worker": {"custom": {"gpu_node_a": 1}}, "draft_worker": {"custom": {"gpu_node_b": 1}},
            "placement_group_strategy": "SPREAD", **overrides}


def test_a_coordinator_bundle_that_could_land_on_another_groups_gpu_node_is_refused():
    with pytest.raises(ValidationError, match="coordinator.resources.custom"):
        AppConfig.model_validate(_multinode())
    pinned = AppConfig.model_validate(_multinode(coordinator={"resources": {"num_cpus": 0.1,
                                                                            "custom": {"cpu_node": 0.01}}}))
    assert pinned.coordinator_bundles()[0] == {"CPU": 0.1, "cpu_node": 0.01}
    AppConfig.model_validate(_multinode(placement_group_strategy="STRICT_PACK"))  # one node: nothing to pin
    AppConfig.model_validate(tiny_app_spec()["args"])  # nothing pinned anywhere: nodes are alike
