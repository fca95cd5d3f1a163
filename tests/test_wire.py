"""The step messages' codec (serve/wire.py): every message kind comes back field for field, its
tensors exact in value, dtype and shape, whichever path a tensor takes (flat list, numpy array,
bits)."""
import dataclasses
import pickle
from types import SimpleNamespace

import torch

from specserve.engine import Proposal, RowInput, Verdict
from specserve.engine.model_runner import ForwardTiming
from specserve.engine.grammar import Grammar, GrammarRows, Reasoning
from specserve.engine.processing import LogitsProcessing
from specserve.engine.sampling import BatchSampling, SamplingParams
from specserve.serve.wire import _SMALL, AheadCall, Block, Reply, StepCall, StepReply, pack, unpack


def same(a, b) -> bool:
    """Deep equality with tensors compared exactly (value, dtype, shape)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach(), b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def sampling() -> BatchSampling:
    """Two rows, one with penalties, a logit bias and a grammar (after a reasoning), one with min-p,
    min_tokens and allowed token ids (each rides along with the step)."""
    grammar = Grammar.json_schema({"type": "array"}).after_reasoning(Reasoning("<think>", "</think>", True))
    params = [SamplingParams(temperature=0.0, grammar=grammar, presence_penalty=0.5, logit_bias={3: 1.0}),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, min_tokens=4, allowed_token_ids=[7, 9],
                             bad_words_ids=[(7, 9), (3,)])]
    seqs = [SimpleNamespace(request_id=r, params=p, output=o, prompt=[1], stop_ids=frozenset({2, 0})) for r, p, o in
            zip("ab", params, ([91, 49], [7]))]
    return BatchSampling.from_params(params, processing=LogitsProcessing.of(seqs), grammar=GrammarRows.of(seqs))


def test_a_pipelined_step_call_comes_back_whole():
    g = torch.Generator().manual_seed(0)
    ahead = AheadCall(7, [RowInput("a", 9, [0]), RowInput("b", 4, [3, 4])], [2, 0],
                      [frozenset({2}), frozenset()], 3, sampling(), torch.rand(2, 3, generator=g), branches=2)
    call = StepCall([RowInput("b", 3, [1, 2])], 2, sampling(), torch.rand(2, 2, generator=g),
                    [RowInput("a", 7, [5]), RowInput("b", 2, [5, 1, 2])], torch.tensor([2, 1]),
                    torch.rand(2, 2, generator=g), torch.rand(2, generator=g), Block(6, [0, None], 2),
                    BatchSampling.from_params([SamplingParams(temperature=0.7)]), ahead)
    back = unpack(pack(call))
    assert same(back, call)
    assert isinstance(back.draft_rows[0], RowInput) and isinstance(back.ahead.stop_ids[0], frozenset)


def test_proposals_keep_q_and_odd_tensors_exact():
    g = torch.Generator().manual_seed(1)
    big_q = torch.rand(2, 3, _SMALL, generator=g)  # [B, G, V] past the flat-list size: an array
    timings = [ForwardTiming(2, 0.003), ForwardTiming(2, 0.002, True)]
    for probs in (big_q, big_q.bfloat16(), big_q[:, :, :7].half(), big_q[:, 1:, :5]):
        proposal = Proposal(torch.tensor([[3, 1, 4], [1, 5, 9]]), probs, timings, False, torch.tensor([3, 2]),
                            torch.tensor([[2, 7, 1], [8, 2, 8]]))
        back = unpack(pack(Reply(proposal, 0.25)))
        assert same(back, Reply(proposal, 0.25))
        assert all(isinstance(t, ForwardTiming) for t in back.result.forwards)
    for t in (torch.zeros(()), torch.zeros(2, 0, dtype=torch.long), torch.tensor([True, False]),
              torch.arange(12).view(3, 4).t(), torch.tensor([0.1, -2.5e-30, 3.4e38]),
              torch.tensor([[1.5]], requires_grad=True)):
        proposal = Proposal(t, None)
        assert same(unpack(pack(proposal)).tokens, t)


def test_replies_misses_verdicts_and_anything_else():
    verdict = Verdict([2, 0], [7, 8], [ForwardTiming(6, 0.01), ForwardTiming(40, 0.2, True)], [[4, 5], [6, 0]],
                      cached_tokens={"b": 32})
    step = StepReply(Proposal(torch.tensor([[4, 5], [6, 0]]), None), verdict, {}, {"b": 3}, 0.01, 0.02,
                     Reply(Proposal(torch.tensor([[1, 2, 3]]), None), 0.004))
    assert same(unpack(pack(step)), step)
    for message in (Reply(None, 0.5, {"a": 4}), Reply(verdict, 0.1), Reply(step, 0.2, {}, {"a": 1}), None,
                    {"t": torch.arange(3), "rows": [RowInput("z", 0, [1])]}):
        assert same(unpack(pack(message)), message)


def test_shared_probs_keep_the_sampled_rows_and_rebuild_greedy_rows_one_hot(monkeypatch):
    """q left in the object store holds only the sampled rows; resolving gives the sampled rows'
    q exactly and a greedy row's one-hot at its drafts (what the draft side computes for it)."""
    import ray

    from specserve.serve.wire import SharedProbs

    store = {}

    def put(value):
        store[len(store)] = pickle.loads(pickle.dumps(value))  # as the object store would hold it
        return len(store) - 1

    monkeypatch.setattr(ray, "put", put)
    torch.manual_seed(0)
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6]])  # [B, G]
    probs = torch.softmax(torch.randn(3, 2, 11), dim=-1)  # [B, G, V]
    probs[1] = torch.nn.functional.one_hot(drafts[1], 11).float()  # the greedy row's q
    mixed = BatchSampling.from_params([SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
                                       SamplingParams(temperature=1.0)])
    shared = SharedProbs.put(probs, mixed)
    assert shared.rows == (0, 2) and store[shared.ref].shape == (2, 2, 11)  # the greedy row stays out
    assert torch.equal(shared.resolve(drafts, get=store.__getitem__), probs)
    sampled = BatchSampling.from_params([SamplingParams(temperature=0.5)] * 3)
    everyone = SharedProbs.put(probs, sampled)
    assert everyone.rows == (0, 1, 2) and torch.equal(everyone.resolve(drafts, get=store.__getitem__), probs)
    filtered = torch.zeros(3, 2, 64)  # [B, G, V]: rows that filter keep a few tokens each
    filtered[..., :3] = torch.softmax(torch.randn(3, 2, 3), dim=-1)
    top_k = BatchSampling.from_params([SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.0),
                                       SamplingParams(temperature=1.0, top_p=0.4)])
    sparse = SharedProbs.put(filtered, top_k)
    assert type(store[sparse.ref]).__name__ == "SparseQ" and store[sparse.ref].values.shape == (2, 2, 3)
    min_p = BatchSampling.from_params([SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=0.0),
                                       SamplingParams(temperature=1.0, top_k=40)])
    assert type(store[SharedProbs.put(filtered, min_p).ref]).__name__ == "SparseQ"
    expected = filtered.clone()
    expected[1] = torch.nn.functional.one_hot(drafts[1], 64).float()
    assert torch.equal(sparse.resolve(drafts, get=store.__getitem__), expected)


def test_shared_probs_keep_only_the_positions_rows_verify(monkeypatch):
    """Given each row's drafts to verify, q left in the object store stops at the most drafts a
    sampled row verifies and leaves out sampled rows that verify none (a prompt still in prefill);
    resolving gives those positions exactly and one-hot at the drafts elsewhere. A step whose
    sampled rows verify nothing puts nothing in the store."""
    import ray

    from specserve.serve.wire import SharedProbs

    store = {}

    def put(value):
        store[len(store)] = pickle.loads(pickle.dumps(value))
        return len(store) - 1

    monkeypatch.setattr(ray, "put", put)
    torch.manual_seed(1)
    drafts = torch.tensor([[1, 2, 3], [3, 4, 5], [5, 6, 7], [8, 9, 10]])  # [B, G]
    probs = torch.softmax(torch.randn(4, 3, 11), dim=-1).bfloat16()  # [B, G, V]
    sampling = BatchSampling.from_params([SamplingParams(temperature=t) for t in (0.7, 0.0, 1.0, 0.9)])
    shared = SharedProbs.put(probs, sampling, torch.tensor([2, 3, 1, 0]))
    assert shared.rows == (0, 2) and store[shared.ref].shape == (2, 2, 11)  # row 3 verifies none
    full = shared.resolve(drafts, get=store.__getitem__)  # [B, G, V]
    assert full.dtype == torch.bfloat16 and torch.equal(full[[0, 2], :2], probs[[0, 2], :2])
    one_hot = torch.nn.functional.one_hot(drafts, 11).bfloat16()
    assert torch.equal(full[[1, 3]], one_hot[[1, 3]]) and torch.equal(full[:, 2], one_hot[:, 2])
    before = len(store)
    none = SharedProbs.put(probs, sampling, torch.tensor([0, 3, 0, 0]))  # the sampled rows verify nothing
    assert none.rows == () and none.ref is None and len(store) == before
    assert torch.equal(none.resolve(drafts, get=store.__getitem__), one_hot.float())
    whole = SharedProbs.put(probs, BatchSampling.from_params([SamplingParams(temperature=1.0)] * 4),
                            torch.tensor([3, 1, 3, 2]))
    assert whole.rows == (0, 1, 2, 3) and store[whole.ref].shape == (4, 3, 11)
    assert torch.equal(whole.resolve(drafts, get=store.__getitem__), probs)


def test_on_plain_calls_the_store_holds_only_the_q_the_rule_reads(local_coordinator, monkeypatch):
    """Through the coordinator on two plain calls, the draft side puts q in the store cut to what
    the step's plan verifies: the sampled rows that verify drafts, up to the most drafts one of
    them verifies (rows near their limit verify fewer than G). Seeded sampled tokens are those of
    the same steps with q whole in the replies."""
    import ray

    from specserve.engine import SamplingParams
    from test_pipeline import PROMPTS, config, generate

    params = [SamplingParams(max_tokens=n, seed=20 + i, ignore_eos=True, temperature=t, top_p=0.95)
              for i, (n, t) in enumerate(zip((7, 30, 12, 21), (0.8, 1.0, 0.0, 0.7)))]
    whole = generate(local_coordinator(config(pipelined=False, gamma=4)), PROMPTS, params)
    import specserve.serve.workers as workers

    coordinator = local_coordinator(config(pipelined=False, gamma=4, place_q=False))  # (through the store)
    stored, planned, shared = [], [], workers.shared_q

    def recorded(proposal, sampling, share, num_draft, outbox=None):
        counts = [g for g, t in zip(num_draft.tolist(), sampling.temperature.tolist()) if t > 0 and g > 0]
        sampled = sum(t > 0 for t in sampling.temperature.tolist())
        planned.append((len(counts), max(counts, default=0), proposal.tokens.shape[1], sampled))
        return shared(proposal, sampling, share, num_draft, outbox)

    def put(value):  # as the object store holds it; the stand-in actors' ray.get hands it back
        stored.append((tuple(pickle.loads(pickle.dumps(value)).shape[:2]), planned[-1]))
        return pickle.loads(pickle.dumps(value))

    monkeypatch.setattr(workers, "shared_q", recorded)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # (once the coordinator is up: no placement group)
    monkeypatch.setattr(ray, "put", put)
    assert generate(coordinator, PROMPTS, params) == whole
    assert stored and all(shape == (rows, most) for shape, (rows, most, _, _) in stored)
    assert any((rows, most) != (sampled, width) for _, (rows, most, width, sampled) in stored)  # a cut
    assert len(stored) == sum(1 for rows, *_ in planned if rows)  # nothing put where no row needs q


def test_ray_pickles_host_tensors_as_arrays_exactly():
    """After `fast_tensor_pickling`, Ray's pickler sends a host tensor as a numpy array (torch's
    storage format only where it must): every kind comes back exact, its grad flag kept, a tensor
    of the receiver's own, and a whole step call as Ray sends a plain call's argument."""
    import numpy as np
    from ray import cloudpickle

    from specserve.serve.wire import _tensor_in, fast_tensor_pickling

    fast_tensor_pickling()
    g = torch.Generator().manual_seed(2)
    fast = [torch.rand(2, 3, generator=g), torch.arange(6).view(2, 3).t(), torch.tensor([True, False]),
            torch.zeros(()), torch.rand(4, 5, generator=g).bfloat16(), torch.rand(3, generator=g).half(),
            torch.zeros(2, 0, dtype=torch.long), torch.tensor([1, 255], dtype=torch.uint8)]
    as_torch = [torch.randn(3, dtype=torch.complex64, generator=g).conj(), torch.rand(2, requires_grad=True)]
    for i, t in enumerate(fast + as_torch):
        data = cloudpickle.dumps(t)
        back = pickle.loads(data)
        assert same(back, t) and back.requires_grad == t.requires_grad
        assert (b"_rebuild_tensor" in data) == (i >= len(fast))  # which path it took
    call = StepCall([RowInput("b", 3, [1, 2])], 2, sampling(), torch.rand(2, 2, generator=g),
                    [RowInput("a", 7, [5]), RowInput("b", 2, [5, 1, 2])], torch.tensor([2, 1]),
                    torch.rand(2, 2, generator=g), torch.rand(2, generator=g))
    assert same(pickle.loads(cloudpickle.dumps(call)), call)
    shared = np.arange(4.0)
    shared.flags.writeable = False  # as Ray hands out an array read in place from its buffers
    mine = _tensor_in((shared, None))
    mine.add_(1)
    assert shared[0] == 0.0 and mine[0] == 1.0


def test_large_arrays_travel_out_of_band_and_come_back_owned():
    """A message holding q crosses framed (its arrays after the rest, joined once); each array
    comes back exact and writable, and writing it leaves the packed bytes as they were."""
    probs = torch.softmax(torch.randn(4, 3, 1000, generator=torch.Generator().manual_seed(1)), dim=-1)
    proposal = Proposal(torch.arange(12).view(4, 3), probs, [ForwardTiming(12, 0.01, False)])
    data = pack(Reply(proposal, 0.5, {"a": 3}))
    assert data[:1] == b"F" and len(data) > probs.numel() * 4
    back = unpack(data)
    assert same(back.result, proposal) and back.misses == {"a": 3}
    back.result.probs.zero_()  # its own memory: the bytes, and a second decoding, are untouched
    assert same(unpack(data).result.probs, probs)
    half = probs.bfloat16()
    assert same(unpack(pack({"q": half, "small": torch.arange(3)}))["q"], half)
    assert pack(Reply(None, 0.1))[:1] == b"\x80"  # nothing large: a plain pickle, as before
