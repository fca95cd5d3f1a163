"""q read in place (serve/placed_q.py): the draft worker's buffers, another process reading them,
the handshake, and the step through the coordinator with q placed. The CUDA IPC side runs on a
GPU only (`bench gpu_checks`); here the same protocol runs over host shared memory."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from specserve.engine import Proposal, SamplingParams
from specserve.engine.sampling import BatchSampling
from specserve.serve import placed_q
from specserve.serve.placed_q import Outbox, PlacedQ
from specserve.serve.wire import RowsProbs, pack, unpack


def _q(*shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_placed_q_reads_back_exactly_as_a_copy_of_its_own(dtype):
    box = Outbox()
    try:
        q = _q(3, 2, 50, dtype=dtype)  # [R, G', V]
        placed = box.place(q)
        assert placed.kind == "host" and placed.shape == (3, 2, 50) and placed.dtype == dtype
        back = placed_q.read(placed)
        assert back.dtype == dtype and torch.equal(back, q)
        box.place(_q(3, 2, 50, seed=1, dtype=dtype))  # the other buffer of the ring
        box.place(torch.zeros(3, 2, 50, dtype=dtype))  # this one again: what was read is unchanged
        assert torch.equal(back, q)
    finally:
        box.close()


def test_the_ring_takes_turns_and_grows_a_buffer_that_is_too_small():
    box = Outbox()
    try:
        first, second, third = (box.place(_q(2, 1, 30, seed=s)) for s in range(3))
        assert first.handle != second.handle and third.handle == first.handle
        big = _q(64, 4, 1000, seed=4)  # 1 MB: past the first buffer's 64 KiB
        grown = box.place(big)
        assert grown.handle not in (first.handle, second.handle)
        assert torch.equal(placed_q.read(grown), big)
        assert torch.equal(placed_q.read(third), _q(2, 1, 30, seed=2))
    finally:
        box.close()


def test_segments_left_by_killed_processes_are_swept(monkeypatch):
    """A worker killed outright leaves its segments' names: the next process to create one on
    the host unlinks those of processes that are gone, and no other."""
    import os

    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    left = os.path.join(placed_q._SHM_DIR, f"{placed_q._PREFIX}{dead.pid}-abc")
    mine = os.path.join(placed_q._SHM_DIR, f"{placed_q._PREFIX}{os.getpid()}-abc")
    for path in (left, mine):
        open(path, "wb").close()
    monkeypatch.setattr(placed_q, "_swept", False)
    box = Outbox()
    try:
        box.place(_q(1, 1, 8))
        assert not os.path.exists(left) and os.path.exists(mine)
    finally:
        box.close()
        for path in (left, mine):
            if os.path.exists(path):
                os.unlink(path)


def _read_elsewhere(placed: PlacedQ, conn) -> None:
    q = placed_q.read(placed)
    conn.send((str(q.dtype), q.float().tolist()))  # (plain values: a tensor would go by torch's fd sharing)


def test_another_process_reads_the_placed_q_exactly():
    box = Outbox()
    try:
        q = _q(4, 3, 200, seed=5, dtype=torch.bfloat16)
        placed = box.place(q)
        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        child = context.Process(target=_read_elsewhere, args=(placed, theirs))
        child.start()
        try:
            assert mine.poll(60), "the reader did not answer"
            assert mine.recv() == (str(q.dtype), q.float().tolist())
        finally:
            child.join(10)
    finally:
        box.close()


def test_the_handshake_accepts_only_a_probe_read_back_exactly():
    box = Outbox()
    try:
        probe = placed_q.offer(box, "cpu")
        assert placed_q.accept(probe, "cpu")
        placed, there, values = probe
        assert not placed_q.accept((placed, "host:elsewhere", values), "cpu")  # another host
        assert not placed_q.accept((placed, there, [v + 1 for v in values]), "cpu")  # not what it placed
        missing = PlacedQ("host", ("specserve-q-0-gone", 1 << 16), placed.shape, placed.dtype)
        assert not placed_q.accept((missing, there, values), "cpu")  # a segment this host does not have
    finally:
        box.close()


def test_a_placed_part_crosses_the_codec_and_resolves_as_the_sent_one():
    """RowsProbs with an outbox: the dense part the rule reads is placed (its handle crosses), and
    resolves to exactly what the same cut sent as a tensor resolves to."""
    probs = _q(4, 3, 11, seed=6)  # [B, G, V]
    tokens = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(7))
    sampling = BatchSampling.from_params([SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0, 0.7)])
    num_draft = torch.tensor([3, 2, 3, 1])
    box = Outbox()
    try:
        placed = RowsProbs.of(probs, sampling, num_draft, box)
        assert isinstance(placed.probs, PlacedQ) and placed.rows == (1, 3) and placed.probs.shape == (2, 2, 11)
        sent = RowsProbs.of(probs, sampling, num_draft)
        back = unpack(pack(Proposal(tokens, placed, [])))
        assert len(pack(Proposal(tokens, placed, []))) < 1024
        assert torch.equal(back.probs.resolve(tokens), sent.resolve(tokens))
        every = BatchSampling.from_params([SamplingParams(temperature=1.0)] * 4)  # all of q: placed too
        whole = RowsProbs.of(probs, every, torch.tensor([3, 3, 3, 3]), box)
        assert isinstance(whole.probs, PlacedQ) and torch.equal(whole.resolve(tokens), probs)
        filtering = BatchSampling.from_params([SamplingParams(temperature=1.0, top_k=2)] * 4)
        assert not isinstance(RowsProbs.of(probs, filtering, num_draft, box).probs, PlacedQ)  # sparse is smaller
    finally:
        box.close()


def test_a_buffer_that_cannot_be_had_sends_the_cut_as_before(monkeypatch):
    """The device out of memory for a (larger) buffer: that step's q crosses as a tensor, and
    placing resumes once a buffer can be had."""
    probs = _q(4, 3, 11, seed=8)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * 4)
    box, real = Outbox(), placed_q._Buffer

    def out_of_memory(nbytes, device):
        raise RuntimeError("CUDA out of memory (stand-in)")

    try:
        monkeypatch.setattr(placed_q, "_Buffer", out_of_memory)
        num_draft = torch.tensor([3, 0, 3, 1])  # row 1 verifies nothing: rows 0, 2, 3 cross
        sent = RowsProbs.of(probs, sampling, num_draft, box)
        assert isinstance(sent.probs, torch.Tensor) and torch.equal(sent.probs, probs[[0, 2, 3]])
        monkeypatch.setattr(placed_q, "_Buffer", real)
        assert isinstance(RowsProbs.of(probs, sampling, num_draft, box).probs, PlacedQ)
        assert isinstance(RowsProbs.of(probs, sampling, num_draft, box).probs, PlacedQ)  # both buffers had
        big = _q(4, 3, 20000, seed=9)  # past both buffers: a new one, which cannot be had
        monkeypatch.setattr(placed_q, "_Buffer", out_of_memory)
        assert isinstance(RowsProbs.of(big, sampling, num_draft, box).probs, torch.Tensor)
        monkeypatch.setattr(placed_q, "_Buffer", real)
        for _ in range(2):  # that buffer's turn comes again, and is had
            again = RowsProbs.of(big, sampling, num_draft, box)
            assert isinstance(again.probs, PlacedQ) and torch.equal(placed_q.read(again.probs), big[[0, 2, 3]])
    finally:
        box.close()


PARAMS = [SamplingParams(max_tokens=n, seed=30 + i, ignore_eos=True, temperature=t)
          for i, (n, t) in enumerate(zip((9, 30, 14, 22), (0.8, 1.0, 0.0, 0.7)))]


def test_on_plain_calls_placed_q_gives_the_tokens_of_q_through_the_store(local_coordinator, monkeypatch):
    """Through the coordinator on two plain calls (stand-in actors in this process: one host), the
    handshake turns placement on and the draft side sends its cut of q as a handle; the tokens are
    those of the same steps with q in the replies. (Pipelined on plain calls, the coordinator
    assembles blocks from q it holds: q crosses through it there, as before.)"""
    import specserve.serve.workers as workers
    from test_pipeline import PROMPTS, config, generate

    whole = generate(local_coordinator(config(pipelined=False, gamma=4, place_q=False)), PROMPTS, PARAMS)
    coordinator = local_coordinator(config(pipelined=False, gamma=4))
    sent, shared = [], workers.shared_q

    def recorded(*args):
        proposal = shared(*args)
        sent.append(proposal.probs)
        return proposal

    monkeypatch.setattr(workers, "shared_q", recorded)
    assert generate(coordinator, PROMPTS, PARAMS) == whole
    assert coordinator.executor.q_placed
    placed = [isinstance(q, RowsProbs) and isinstance(q.probs, PlacedQ) for q in sent]
    assert any(placed)  # (the handshake runs beside the first step, which sends q as before)
    assert not any(isinstance(q, torch.Tensor) or (isinstance(q, RowsProbs) and isinstance(q.probs, torch.Tensor)
                                                   and q.probs.numel()) for q in sent[placed.index(True):])


def test_a_draft_that_cannot_place_sends_q_as_before(local_coordinator):
    """A draft worker whose device cannot place (`q_offer` None), or a target that cannot read the
    probe: placement stays off and the tokens are unchanged."""
    from test_pipeline import PROMPTS, config, generate

    whole = generate(local_coordinator(config(pipelined=False, gamma=3, place_q=False)), PROMPTS, PARAMS)
    for side, method in (("draft_worker", "q_offer"), ("target", "q_accept")):
        coordinator = local_coordinator(config(pipelined=False, gamma=3))
        worker = getattr(coordinator, side)._obj
        setattr(worker, method, lambda *a: None if method == "q_offer" else False)
        assert generate(coordinator, PROMPTS, PARAMS) == whole
        assert not coordinator.executor.q_placed
        assert not coordinator.draft_worker._obj._placing


def test_a_placed_q_that_cannot_be_opened_replans_the_step_without_drafts(local_coordinator, monkeypatch):
    """A draft worker gone between placing q and the target's read (its segment unlinked before
    the target opened it): the verify raises QGone, the step is planned again without drafts,
    and the draft is asked again once it answers. The greedy row's tokens are unchanged; seeded
    sampled rows draw fresh numbers for the replanned step (as after any draft failure), so they
    are another sample of the same distribution, whole."""
    import specserve.serve.workers as workers
    from test_pipeline import PROMPTS, config, generate

    whole = generate(local_coordinator(config(pipelined=False, gamma=3, place_q=False)), PROMPTS, PARAMS)
    coordinator = local_coordinator(config(pipelined=False, gamma=3))
    draft, shared, placed = coordinator.draft_worker._obj, workers.shared_q, []

    def vanishing(*args):
        proposal = shared(*args)
        if isinstance(proposal.probs, RowsProbs) and isinstance(proposal.probs.probs, PlacedQ):
            placed.append(proposal.probs.probs)
            if len(placed) == 3:  # its buffers gone, and never opened by the target
                draft._outbox.close()
                monkeypatch.setattr(placed_q, "_opened", type(placed_q._opened)())
        return proposal

    monkeypatch.setattr(workers, "shared_q", vanishing)
    got = generate(coordinator, PROMPTS, PARAMS)
    assert got[2] == whole[2] and [len(t) for t in got] == [p.max_tokens for p in PARAMS]  # (row 2: greedy)
    assert len(placed) > 3 and coordinator._totals["target_only_steps"] > 0
    assert coordinator.executor.q_placed and draft._placing  # tried again once the draft answered
