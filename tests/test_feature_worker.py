"""A feature head on the draft worker (`drafter: {kind: eagle, worker: draft}`): it pulls the
target's features of the committed tokens from the target worker before each fresh propose.

No Ray here (tests/local_actors.py): the Coordinator and both real workers run in this process,
the pull included. Lossless on every path the coordinator has for a draft worker (plain calls,
pipelined, the step graph), drafting exactly what the same head drafts inside the target worker,
and a draft worker that loses its caches and features mid-run rebuilds both.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from models import hf_greedy
from specserve.config import AppConfig, TinySource
from specserve.distill.train import init_head
from specserve.engine import SamplingParams
from specserve.engine.feature_drafter import save_feature_head
from specserve.engine.proposers import target_vocab_size
from specserve.models.loading import load_target
from test_feature_drafter import train_tiny_head
from test_graph import on_graph
from test_pipeline import PROMPTS, TINY, generate

LENGTHS = [24, 17, 30, 9]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A head trained briefly for the TINY target (as test_feature_drafter's for its own)."""
    model = load_target(TinySource(**{k: v for k, v in TINY.items() if k != "kind"}))
    return train_tiny_head(model, tmp_path_factory.mktemp("head"))


def config(head_dir, worker: str, pipelined: bool = False, lookup_min_n: int | None = None, **kw) -> AppConfig:
    drafter = {"kind": "eagle", "path": str(head_dir), "worker": worker, "lookup_min_n": lookup_min_n}
    return AppConfig.model_validate(dict(
        served_model_name="tiny", target=TINY, drafter=drafter,
        speculation=dict(num_speculative_tokens=3, adaptive=False, pipelined=pipelined, execution="eager",
                         transport="actor_calls"),
        max_model_len=256, **kw))


def greedy():
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]


def expected(coordinator) -> list[list[int]]:
    target = coordinator.target._obj.model.runner.model
    return [hf_greedy(target, p, n) for p, n in zip(PROMPTS, LENGTHS)]


def test_the_head_on_the_draft_worker_drafts_what_it_drafts_beside_the_target(local_coordinator, head_dir):
    beside = local_coordinator(config(head_dir, "target"))
    outs_beside = generate(beside, PROMPTS, greedy())
    coordinator = local_coordinator(config(head_dir, "draft"))
    assert coordinator.draft_worker is not None and not coordinator.executor.fused
    assert coordinator.target._obj.proposer is None and coordinator.target._obj.feature_server is not None
    outs = generate(coordinator, PROMPTS, greedy())
    assert outs == outs_beside == expected(coordinator)
    accepted = coordinator._totals["spec_decode_num_accepted_tokens"]
    assert accepted > 0 and accepted == beside._totals["spec_decode_num_accepted_tokens"]
    assert asyncio.run(coordinator.num_cached()) == {"target": 0, "draft": 0}
    assert len(coordinator.draft_worker._obj.model.features) == 0  # freed with their requests


@pytest.mark.parametrize("lookup_min_n", [None, 2])
@pytest.mark.parametrize("graph", [False, True])
def test_pipelined_and_on_the_graph_stay_lossless(local_coordinator, head_dir, graph, lookup_min_n):
    """With lookup rows, an ahead call past the committed tokens drafts real tokens for rows that
    repeat themselves (the head has no features there): the prepared blocks it gives stay exact."""
    coordinator = local_coordinator(config(head_dir, "draft", pipelined=True, lookup_min_n=lookup_min_n))
    assert coordinator.executor.pipeline is not None
    if graph:
        on_graph(coordinator)
    outs = generate(coordinator, PROMPTS, greedy())
    assert outs == expected(coordinator)
    assert coordinator._totals["spec_decode_num_accepted_tokens"] > 0
    if lookup_min_n is not None:  # some prepared blocks came from lookup rows and were verified
        assert coordinator._totals["pipelined_hits"] > 0
    if graph:
        assert coordinator._totals["graph_steps"] > 0


@pytest.mark.parametrize("worker", ["target", "draft"])
def test_served_head_loops_are_captured_before_the_first_request(local_coordinator, head_dir, monkeypatch, worker):
    """Workers in graph mode (emulated), the head beside the target or on the draft worker:
    the head's draft loops are captured before the first request (`capture_ahead`), and greedy
    and sampled requests together meet no loop that was not; tokens equal the eager run's."""
    import specserve.engine.model_runner as model_runner
    from test_serve_units import workers_in_graph_mode

    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: 1 << 40)
    params = [SamplingParams(temperature=t, max_tokens=n, seed=k, ignore_eos=True)
              for k, (t, n) in enumerate(zip((0.0, 1.0, 0.0, 0.7), LENGTHS))]
    eager = generate(local_coordinator(config(head_dir, worker, max_batch_size=4)), PROMPTS, params)
    workers_in_graph_mode(monkeypatch)
    coordinator = local_coordinator(config(head_dir, worker, max_batch_size=4))
    side = coordinator.target if worker == "target" else coordinator.draft_worker
    head = side._obj.proposer.runner if worker == "target" else side._obj.model.runner
    ahead = set(head.graphs._entries)
    assert ahead and all(key[0] == "head" for key in ahead)
    assert generate(coordinator, PROMPTS, params) == eager
    assert set(head.graphs._entries) == ahead
    assert coordinator._totals["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("worker, pipelined", [("target", False), ("draft", False), ("draft", True)])
def test_a_cached_prefix_comes_with_its_features_beside_the_target_or_pulled(local_coordinator, head_dir,
                                                                             monkeypatch, worker, pipelined):
    """Under prefix caching, requests that share a system prompt take its blocks in the target's
    cache and in the head's (beside the target, or on the draft worker), and the head gets the
    target features kept with them: same tokens as the target alone, as many drafts accepted as
    without the cache."""
    from specserve.engine.paged_cache import PagedKVCache

    taken, match = {}, PagedKVCache.match

    def counted(self, *args, **kwargs):
        got = match(self, *args, **kwargs)
        taken[id(self)] = taken.get(id(self), 0) + got
        return got
    monkeypatch.setattr(PagedKVCache, "match", counted)
    system = list(range(40, 100))
    prompts = [system + p for p in PROMPTS]
    accepted = {}
    for sharing in (True, False):
        taken.clear()
        coordinator = local_coordinator(config(head_dir, worker, pipelined, kv_block_size=8, prefix_caching=sharing))
        first = generate(coordinator, prompts[:1], greedy()[:1])
        later = [generate(coordinator, [p], [sp])[0] for p, sp in zip(prompts[1:], greedy()[1:])]
        target = coordinator.target._obj.model.runner.model
        assert first + later == [hf_greedy(target, p, n) for p, n in zip(prompts, LENGTHS)]
        accepted[sharing] = coordinator._totals["spec_decode_num_accepted_tokens"]
        # each later request, in each cache (the target's, the head's): the system prompt's whole blocks
        assert sorted(taken.values()) == ([3 * 56, 3 * 56] if sharing else [])
    assert accepted[True] == accepted[False] > 0


def test_a_draft_worker_that_loses_its_state_pulls_every_feature_again(local_coordinator, head_dir):
    """Mid-run the draft worker's head is replaced by a fresh one (a restart: no cache, no
    features): its next propose misses, the coordinator resends the rows from 0, and the head
    pulls the features of every committed token again and goes on accepting drafts."""
    coordinator = local_coordinator(config(head_dir, "draft"))
    worker = coordinator.draft_worker._obj
    fresh_model = type(worker)(coordinator.config.target, coordinator.vocab_size, 256, execution="eager",
                               feature_head=coordinator.config.drafter, target=coordinator.target).model
    pulls, accepted_at_swap = [0], []
    real_pull = worker._pull_features

    def pull(rows):
        pulls[0] += 1
        if pulls[0] == 6:
            worker.model = fresh_model
            accepted_at_swap.append(coordinator._totals["spec_decode_num_accepted_tokens"])
        return real_pull(rows)

    worker._pull_features = pull
    outs = generate(coordinator, PROMPTS, greedy())
    assert outs == expected(coordinator)
    assert worker.model is fresh_model
    assert coordinator._totals["spec_decode_num_accepted_tokens"] > accepted_at_swap[0]


def test_features_handed_to_the_draft_worker_leave_the_targets_device(local_coordinator, head_dir):
    """Once a read hands a request's committed features to the draft worker, the target keeps them
    on the host only: on its device stay the positions not handed out yet (the newest token's and
    the last verify's drafts), and a later read from 0 (a restarted draft worker) still gets them."""
    coordinator = local_coordinator(config(head_dir, "draft"))
    server = coordinator.target._obj.feature_server
    on_device, read = [], server.read

    def counted(wants):
        got = read(wants)
        on_device.extend(server.store.written(rid) - server.store.held_from(rid) for rid in wants)
        for rid, (start, features) in got.items():  # what a restarted worker would get
            again = read({rid: (0, start + features.shape[0])})[rid][1]
            assert torch.equal(again[start:], features)
        return got

    server.read = counted
    outs = generate(coordinator, PROMPTS, greedy())
    assert outs == expected(coordinator)
    assert on_device and max(on_device) <= coordinator.config.speculation.num_speculative_tokens + 1


def test_the_shipped_draft_worker_config_asks_for_a_draft_worker_bundle():
    from pathlib import Path

    import yaml

    app = yaml.safe_load((Path(__file__).parents[1] / "configs" / "local-eagle-worker.yaml").read_text())
    cfg = AppConfig.model_validate(app["applications"][0]["args"])
    assert cfg.has_draft_worker and cfg.draft is None and cfg.drafter.worker == "draft"
    assert len(cfg.coordinator_bundles()) == 3 and cfg.speculation.pipelined


@pytest.mark.parametrize("tied", [False, True])
def test_the_draft_worker_reads_only_the_targets_embedding_and_output_head(tmp_path, tied):
    """load_target_io from a local HF checkpoint (sharded in two files, or tied embeddings): the
    same rows as the whole model's, and a head built on it drafts what one built on the model does."""
    from specserve.config import HFSource
    from specserve.models.loading import load_target_io
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=tied)).eval()
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    assert tied or (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    io = load_target_io(HFSource(path=str(tmp_path / "ckpt"), dtype="float32"))
    assert torch.equal(io.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(io.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert io.config.num_hidden_layers == 2 and not any(p.requires_grad for p in io.parameters())
    save_feature_head(init_head(model, torch.arange(target_vocab_size(model))), tmp_path / "head", store_lm_head=False)
    from specserve.engine.feature_drafter import load_feature_head

    a, b = load_feature_head(tmp_path / "head", model), load_feature_head(tmp_path / "head", io)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
