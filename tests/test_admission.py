"""Admission against what the dense KV cache really allocates (no Ray): the coordinator's admission
logic drives real TargetVerifier / DraftModelProposer caches on tiny models, in process."""
from __future__ import annotations

import random

import pytest
import torch

from models import hf_greedy
from specserve.engine import DraftModelProposer, SamplingParams, TargetVerifier
from specserve.engine.kv_cache import capacity_for
from specserve.engine.policy import SpeculationPolicy
from specserve.engine.sharding import kv_cache_bytes_per_token
from specserve.engine.executor import speculative_step
from specserve.engine.step import new_sequence
from specserve.models.tiny import tiny_llama
from specserve.engine.admission import Admission, allocation, positions_needed

GAMMA = 3
MAX_LEN = 1024


def _seq(rid: str, prompt_len: int, max_tokens: int, seed: int = 0):
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 250) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return new_sequence(rid, prompt, params, vocab_size=256, max_model_len=MAX_LEN, eos_token_ids=frozenset())


def test_allocation_is_slots_times_the_longest_capacity():
    short, long = _seq("s", 5, 20), _seq("l", 40, 600)
    assert positions_needed(short, GAMMA) == 5 + 20 + GAMMA
    # slots: the batch padded to its bucket (2, 4, 8, ...) plus the scratch slot
    assert allocation([28, 643]) == 3 * capacity_for(643) == 3 * 768
    assert allocation([28] * 3) == 5 * 256 and allocation([]) == 0
    admission = Admission(max_batch_size=8, budget=2400, max_gamma=GAMMA)
    for seq in [_seq(f"s{i}", 5, 20) for i in range(3)] + [long] + [_seq("s9", 5, 20)]:
        admission.enqueue(seq)
    admitted = admission.admit()  # 3 shorts (5 slots of 256), then the long one would need 5 x 768
    assert [s.request_id for s in admitted] == ["s0", "s1", "s2"] and admission.allocated() == 5 * 256
    admission.release("s0")
    admission.release("s1")
    assert [s.request_id for s in admission.admit()] == ["l"]  # 3 x 768 fits; FIFO: s9 waits behind
    assert admission.allocated() == 3 * 768 and [s.request_id for s in admission.waiting] == ["s9"]
    assert not Admission(8, 512, GAMMA).too_big(short) and Admission(8, 512, GAMMA).too_big(long)
    assert not Admission(8, None, GAMMA).too_big(long)


def test_cache_bytes_stay_within_the_admitted_budget():
    """One long request among many short ones of varied lengths: after every step the bytes that
    both workers' caches hold stay within budget x bytes per position, and greedy output is the
    target's own."""
    target = tiny_llama(seed=0, max_position_embeddings=MAX_LEN)
    draft = tiny_llama(seed=0, max_position_embeddings=MAX_LEN, noise=0.2)
    verifier = TargetVerifier(target, MAX_LEN)
    proposer = DraftModelProposer(draft, verifier.vocab_size, MAX_LEN)
    policy = SpeculationPolicy(GAMMA, adaptive=False)
    budget = 4096  # 8 shorts of 256 (8 + scratch slots), or the long one (768) and 2 more (4 + scratch)
    admission = Admission(max_batch_size=16, budget=budget, max_gamma=GAMMA)
    rng = random.Random(1)
    shorts = [_seq(f"s{i}", rng.randint(3, 12), rng.randint(4, 40), seed=i) for i in range(24)]
    long = _seq("long", 300, 300, seed=99)  # its prefill alone takes a 512-position capacity
    for seq in shorts[:16] + [long] + shorts[16:]:
        admission.enqueue(seq)
    per_position = {name: kv_cache_bytes_per_token(m.config, torch.float32) for name, m in
                    (("target", target), ("draft", draft))}
    caches = {"target": verifier.runner.cache, "draft": proposer.runner.cache}
    outputs: dict[str, list[int]] = {}
    peak = {name: 0 for name in caches}
    saw_long_with_others = False
    while admission.waiting or admission.running:
        admission.admit()
        seqs = list(admission.running.values())
        saw_long_with_others |= "long" in admission.running and len(seqs) > 1
        assert admission.allocated() <= budget
        for out in speculative_step(seqs, proposer, verifier, policy):
            if out.finish_reason is not None:
                seq = admission.running[out.request_id]
                outputs[seq.request_id] = list(seq.output)
                admission.release(seq.request_id)
                verifier.free(seq.request_id)
                proposer.free(seq.request_id)
        for name, cache in caches.items():
            held = cache.memory_bytes()
            peak[name] = max(peak[name], held)
            assert held <= budget * per_position[name], (name, cache.allocated(), held)
    assert saw_long_with_others and len(outputs) == 25
    assert peak["target"] >= capacity_for(600) * per_position["target"]  # the long one really ran
    for seq in [long, *shorts[:3]]:
        assert outputs[seq.request_id] == hf_greedy(target, seq.prompt, seq.params.max_tokens)


@pytest.mark.parametrize("lengths", [[1, 100], [2, 60, 90]])
def test_padding_never_grows_the_cache_past_the_longest_row(lengths):
    """Rows of different lengths in one forward: a short row far along its context must not write
    padding past what the longest row needs."""
    from specserve.engine import RowInput

    verifier = TargetVerifier(tiny_llama(seed=0, max_position_embeddings=MAX_LEN), MAX_LEN)
    runner = verifier.runner
    runner.forward([RowInput("far", 0, [1] * 200)], logits="none")
    rows = [RowInput("far", 200, [2] * lengths[0])] + [RowInput(f"new{i}", 0, [3] * n)
                                                       for i, n in enumerate(lengths[1:])]
    runner.forward(rows, logits="last")
    assert runner.cache.allocated()[1] == capacity_for(200 + lengths[0] + 1) == 256


def test_the_engine_admits_by_the_same_budget():
    """SpeculativeEngine keeps its requests in the same Admission: with a KV budget it runs the
    long request beside only what fits, its caches stay within the budget after every step, it
    refuses a request that could never fit, and greedy output is the target's own."""
    from specserve.engine import SpeculativeEngine
    from specserve.engine.step import ContextLengthExceeded

    target = tiny_llama(seed=0, max_position_embeddings=MAX_LEN)
    draft = tiny_llama(seed=0, max_position_embeddings=MAX_LEN, noise=0.2)
    budget = 1536  # the long one (512 positions) and one short (3 slots), or 4 shorts of 256 (5 slots)
    engine = SpeculativeEngine(target, draft, GAMMA, adaptive=False, max_batch_size=16, max_model_len=MAX_LEN,
                               eos_token_ids=[], execution="eager", max_cached_tokens=budget)
    with pytest.raises(ContextLengthExceeded, match="budget of 1536"):
        engine.add_request("huge", [5] * 900, SamplingParams(max_tokens=100, temperature=0.0))
    rng = random.Random(2)
    seqs = [_seq(f"s{i}", rng.randint(3, 12), rng.randint(4, 30), seed=i) for i in range(6)]
    seqs.insert(2, _seq("long", 300, 200, seed=7))
    for s in seqs:
        engine.add_request(s.request_id, s.prompt, s.params)
    per_position = kv_cache_bytes_per_token(target.config, torch.float32)
    outputs, batches = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        batches.append(sorted(engine.admission.running))
        assert engine.admission.allocated() <= budget
        assert engine.verifier.runner.cache.memory_bytes() <= budget * per_position
    assert any("long" in b and len(b) > 1 for b in batches) and max(map(len, batches)) < len(seqs)
    for s in seqs:
        assert outputs[s.request_id] == hf_greedy(target, s.prompt, s.params.max_tokens), s.request_id
    assert engine.num_cached() == {"target": 0, "draft": 0}
    with pytest.raises(ContextLengthExceeded):  # generate(): one prompt refused, none of the batch left behind
        engine.generate([[5] * 8, [5] * 900], SamplingParams(max_tokens=100, temperature=0.0))
    assert not engine.has_unfinished()


def test_continuations_wait_ahead_of_new_requests():
    admission = Admission(max_batch_size=1, budget=None, max_gamma=GAMMA)
    for rid, resumed in [("new1", False), ("cont1", True), ("new2", False), ("cont2", True)]:
        seq = _seq(rid, 4, 10)
        if resumed:
            seq.output.append(7)
        admission.enqueue(seq)
    assert [s.request_id for s in admission.waiting] == ["cont1", "cont2", "new1", "new2"]
    assert admission.get("new2").request_id == "new2" and admission.get("gone") is None
    admission.admit()
    assert admission.get("cont1") is admission.running["cont1"]  # found running now, once
    admission.drop_waiting({"new1", "gone"})
    assert admission.get("new1") is None and [s.request_id for s in admission.waiting] == ["cont2", "new2"]
    assert list(admission.running) == ["cont1"] and admission.release("cont1") and not admission.release("cont1")


def test_a_lower_priority_value_waits_ahead_fifo_within_one():
    """vLLM's priority: new requests wait by priority, FIFO among equals; continuations stay ahead
    of every new request whatever their priority."""
    admission = Admission(max_batch_size=1, budget=None, max_gamma=GAMMA)
    for rid, priority, resumed in [("a", 0, False), ("b", 5, False), ("c", -1, False), ("d", 0, False),
                                   ("cont", 9, True), ("e", 5, False), ("f", -1, False)]:
        seq = _seq(rid, 4, 10)
        seq.priority = priority
        if resumed:
            seq.output.append(7)
        admission.enqueue(seq)
    assert [s.request_id for s in admission.waiting] == ["cont", "c", "f", "a", "d", "b", "e"]
    order = []
    while admission.waiting:
        (seq,) = admission.admit()
        order.append(seq.request_id)
        admission.release(seq.request_id)
    assert order == ["cont", "c", "f", "a", "d", "b", "e"]


def test_preemption_takes_the_least_urgent_first():
    """A paged budget that the running requests outgrow: the highest priority value goes back to
    the queue first (the newest of equals), and the queue's head is then the most urgent of them."""
    admission = Admission(max_batch_size=8, budget=None, max_gamma=GAMMA, block_size=16)
    for rid, priority in [("old-low", 3), ("urgent", -2), ("new-low", 3), ("plain", 0)]:
        seq = _seq(rid, 40, 200)
        seq.priority = priority
        admission.enqueue(seq)
    admission.admit()
    assert list(admission.running) == ["urgent", "plain", "old-low", "new-low"]
    admission.budget = admission.allocated() - 1  # one block too few: one request must go
    assert [s.request_id for s in admission.preempt()] == ["new-low"]
    admission.budget = allocation([admission.need(admission.running["urgent"])], 16)  # room for one alone
    assert [s.request_id for s in admission.preempt()] == ["old-low", "plain"]
    assert list(admission.running) == ["urgent"]
    assert [s.request_id for s in admission.waiting] == ["plain", "old-low", "new-low"]


def test_paged_needs_leave_out_what_every_windowed_cache_gave_back():
    """A paged cache whose model is windowed everywhere holds at most `kept_behind` positions
    before its mark: a request's need leaves the rest out, by the cache that gives back least;
    one cache keeping everything (None) keeps the whole count."""
    seq = _seq("w", 90, 50)
    seq.output, seq.target_len, seq.draft_len = [7] * 10, 99, 60  # 100 tokens
    full = 100 + 2 * GAMMA + 2
    assert Admission(8, None, GAMMA, 4).need(seq) == full
    assert Admission(8, None, GAMMA, 4, {"target_len": 16}).need(seq) == full - (99 - 16)
    assert Admission(8, None, GAMMA, 4, {"target_len": 16, "draft_len": 16}).need(seq) == full - (60 - 16)
    assert Admission(8, None, GAMMA, 4, {"target_len": 16, "draft_len": None}).need(seq) == full
    seq.target_len = seq.draft_len = 0  # (preempted, or not prefilled yet: it will write everything)
    assert Admission(8, None, GAMMA, 4, {"target_len": 16}).need(seq) == full
