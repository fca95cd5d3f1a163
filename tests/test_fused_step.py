"""A drafter inside the target worker drafts and verifies in one plain call (`RemoteExecutor._fused`,
`TargetWorker.fused_step`): the same tokens as the two calls it replaces, with the same random
numbers, through a failing drafter and through cache misses on either side.

No Ray here: the Coordinator runs in this process with its real workers (tests/local_actors.py).
"""
from __future__ import annotations

import pytest

from models import hf_greedy
from specserve.config import AppConfig
from specserve.engine import SamplingParams
from test_pipeline import TINY, generate

PROMPT = [5, 6, 7, 8, 9] * 6  # repetitive: prompt lookup proposes, the target accepts some


def colocated(drafter: dict, gamma: int = 4) -> AppConfig:
    return AppConfig.model_validate(dict(
        served_model_name="tiny", target=TINY, drafter=drafter,
        speculation=dict(num_speculative_tokens=gamma, adaptive=False, execution="eager", transport="actor_calls"),
        max_model_len=256))


def drafting_steps(coordinator) -> int:
    return sum(1 for r in coordinator._records if r.gamma > 0)


class Counting:
    """Counts the calls the coordinator makes to a worker method (wraps it on the worker object)."""

    def __init__(self, worker, name: str) -> None:
        self.calls, self._fn = 0, getattr(worker, name)
        setattr(worker, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._fn(*args, **kwargs)


def test_every_drafting_step_is_one_call_with_the_targets_greedy(local_coordinator):
    coordinator = local_coordinator(colocated({"kind": "prompt_lookup"}))
    worker = coordinator.target._obj
    fused, propose = Counting(worker, "fused_step"), Counting(worker, "propose")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 9)]
    out = generate(coordinator, [PROMPT, PROMPT[3:]], params)
    target = worker.model.runner.model
    assert out == [hf_greedy(target, PROMPT, 24), hf_greedy(target, PROMPT[3:], 9)]
    totals = coordinator._totals
    assert totals["spec_decode_num_accepted_tokens"] > 0
    assert totals["fused_steps"] == fused.calls == drafting_steps(coordinator) > 0
    assert propose.calls == fused.calls  # inside the fused calls only: no propose call of its own
    assert coordinator.policy.fused


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.6, top_k=5, top_p=0.9)])
def test_seeded_sampling_draws_the_two_calls_numbers(local_coordinator, sampling):
    """A drafter with q (layer skip): one call gives the tokens that two calls give."""
    drafter = {"kind": "layer_skip", "skip_layers": [1]}
    params = [SamplingParams(max_tokens=20, ignore_eos=True, seed=s, **sampling) for s in (1, 2, 3)]
    prompts = [PROMPT, [72, 101, 108, 108, 111], [97]]
    two_calls = local_coordinator(colocated(drafter, gamma=3))
    two_calls.executor.fused = False
    expected = generate(two_calls, prompts, params)
    one_call = local_coordinator(colocated(drafter, gamma=3))
    assert generate(one_call, prompts, params) == expected
    assert one_call._totals["fused_steps"] == drafting_steps(one_call) > 0
    assert two_calls._totals["fused_steps"] == 0


def test_a_failing_drafter_reruns_the_step_as_two_calls(local_coordinator):
    coordinator = local_coordinator(colocated({"kind": "prompt_lookup"}))
    worker = coordinator.target._obj
    real, failures = worker.proposer.propose, {"left": 2}

    def flaky(*args, **kwargs):
        if failures["left"] and coordinator._totals["steps"] == 3:
            failures["left"] -= 1
            raise RuntimeError("injected drafter failure")
        return real(*args, **kwargs)

    worker.proposer.propose = flaky
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    assert generate(coordinator, [PROMPT], params) == [hf_greedy(worker.model.runner.model, PROMPT, 24)]
    totals = coordinator._totals
    assert failures["left"] == 0  # the fused call failed, then its two-call rerun's propose
    assert totals["target_only_steps"] >= 1 and totals["fused_steps"] < totals["steps"], totals


@pytest.mark.parametrize("side", ["proposer", "target"])
def test_cache_misses_in_a_fused_step_move_the_marks_back_and_resend(local_coordinator, side):
    coordinator = local_coordinator(colocated({"kind": "layer_skip", "skip_layers": [1]}, gamma=2))
    worker = coordinator.target._obj
    holder = worker.proposer if side == "proposer" else worker.model
    real, dropped, calls = worker.fused_step, [], []

    def forgetting(call):
        calls.append(call)
        if coordinator._totals["steps"] == 4 and not dropped:
            dropped.extend([call.target_rows[0].request_id, len(calls) - 1])
            holder.free(dropped[0])  # as a restarted worker would have lost it
        return real(call)

    worker.fused_step = forgetting
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    assert generate(coordinator, [PROMPT], params) == [hf_greedy(worker.model.runner.model, PROMPT, 20)]
    assert dropped and coordinator._totals["fused_steps"] == drafting_steps(coordinator)


def test_a_feature_head_with_a_confidence_floor_verifies_fewer_in_one_call(local_coordinator, tmp_path):
    """The shipped demo's drafter kind: a feature head in the target worker whose rows stop
    drafting where it is unsure. Still the target's greedy; the coordinator counts the drafts
    verified, not the positions planned."""
    import torch

    from specserve.distill.train import init_head
    from specserve.engine.feature_drafter import save_feature_head
    from specserve.engine.proposers import target_vocab_size

    probe = local_coordinator(colocated({"kind": "prompt_lookup"}))
    model = probe.target._obj.model.runner.model  # the tiny target the config builds
    torch.manual_seed(0)
    save_feature_head(init_head(model, torch.arange(target_vocab_size(model))), tmp_path, store_lm_head=True)
    floor = 1.5 / target_vocab_size(model)  # an untrained head: top probabilities near 1 / V
    coordinator = local_coordinator(colocated({"kind": "eagle", "path": str(tmp_path), "min_confidence": floor}))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12)]
    out = generate(coordinator, [PROMPT, [72, 101, 108, 108, 111]], params)
    assert out == [hf_greedy(model, PROMPT, 20), hf_greedy(model, [72, 101, 108, 108, 111], 12)]
    totals = coordinator._totals
    planned = sum(r.gamma * r.batch for r in coordinator._records)
    assert 0 < totals["spec_decode_num_draft_tokens"] < planned, (totals, planned)
    assert totals["fused_steps"] == drafting_steps(coordinator)


def test_the_prediction_drafter_drafts_only_predictions_in_one_call(local_coordinator):
    """`drafter: {kind: prediction}` inside the target worker: a request with a prediction drafts
    it (fused calls), one without decodes as the target alone, each with the target's greedy
    tokens; the replica's prediction totals count what was drafted; γ 0 is refused at start."""
    coordinator = local_coordinator(colocated({"kind": "prediction"}, gamma=6))
    assert not coordinator.policy.own_drafts
    target = coordinator.target._obj.model.runner.model
    refs = [hf_greedy(target, PROMPT, 30), hf_greedy(target, PROMPT[4:], 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prediction=tuple(refs[0])),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    assert generate(coordinator, [PROMPT, PROMPT[4:]], params) == refs
    totals = coordinator._totals
    assert totals["spec_decode_num_prediction_tokens"] == totals["spec_decode_num_accepted_prediction_tokens"]
    assert totals["spec_decode_num_draft_tokens"] == totals["spec_decode_num_prediction_tokens"] >= 24
    assert totals["fused_steps"] == drafting_steps(coordinator) > 0
    with pytest.raises(ValueError, match="prediction drafts up to"):
        colocated({"kind": "prediction"}, gamma=0)


class Outage:
    """The draft side out for good: its calls (propose, prefill, the fused step) raise and its
    `ready` probes go unanswered."""

    def __init__(self, coordinator) -> None:
        from ray.exceptions import RayActorError

        from specserve.serve.calls import ProposerSide

        executor = coordinator.executor
        executor.probe_delay_s = 0.001
        executor.draft = ProposerSide(**{**executor.draft.__dict__, "propose": self.failing(RuntimeError),
                                         "prefill": self.failing(RuntimeError), "ready": self.failing(RayActorError)})
        if executor.fused:
            executor.target.fused_step = self.failing(RuntimeError)

    @staticmethod
    def failing(error):
        from local_actors import _Done

        def fail():
            raise error("the draft side is out (injected)")

        return type("Failing", (), {"remote": staticmethod(lambda *args, **kwargs: _Done(fail, (), {}))})()


@pytest.mark.parametrize("where", ["colocated", "draft worker"])
def test_a_prediction_is_drafted_while_the_draft_is_out(local_coordinator, monkeypatch, where):
    """While the draft side is out, the steps of a request with a prediction still draft its runs
    (with no model), and the draft's marks stay where its cache ends. Every request keeps the
    target's greedy tokens. (Coming back is `test_a_failing_drafter_reruns_the_step_as_two_calls`'s.)"""
    from test_pipeline import config

    if where == "colocated":
        coordinator = local_coordinator(colocated({"kind": "layer_skip", "skip_layers": [1]}, gamma=4))
    else:
        coordinator = local_coordinator(config(pipelined=False, gamma=4))
    Outage(coordinator)
    executor, killed = coordinator.executor, []
    # (a draft worker silent for health_misses probes is killed for a restart: no Ray here to do it)
    monkeypatch.setattr("specserve.serve.executor.ray.kill", lambda actor, **kw: killed.append(actor))
    target = coordinator.target._obj.model.runner.model
    refs = [hf_greedy(target, PROMPT, 40), hf_greedy(target, PROMPT[4:], 24)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prediction=tuple(refs[0])),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    marks, real_stepped = {}, executor.stepped

    def stepped(plan, ran, policy, began):
        real_stepped(plan, ran, policy, began)
        for s in plan.seqs:
            marks.setdefault(s.request_id, set()).add(s.draft_len)

    executor.stepped = stepped
    assert generate(coordinator, [PROMPT, PROMPT[4:]], params) == refs
    totals = coordinator._totals
    assert totals["target_only_steps"] == totals["steps"] < 24 + 2, totals  # (the second request: 24 alone)
    assert totals["spec_decode_num_draft_tokens"] == totals["spec_decode_num_prediction_tokens"] >= 28  # (4 a step)
    assert totals["spec_decode_num_accepted_prediction_tokens"] == totals["spec_decode_num_prediction_tokens"]
    assert all(len(m) == 1 for m in marks.values()), marks  # (the draft cached nothing while out)
    assert len(killed) == (where == "draft worker")  # (once per outage)
