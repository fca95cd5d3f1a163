"""The messages of a speculative step's worker calls, and their codec (`pack` / `unpack`).

On the compiled graph (serve/graph.py) every message crosses a shared-memory channel as one
`bytes`, so what it costs to encode and decode is paid on the step's critical path, three times
per execution and in three processes that have just woken up (their caches cold). Generic pickling
of these small dataclasses and tensors cost 0.1-0.2 ms per message measured inside the workers on
the 2-core machine (20-35 µs when hot); the codec below writes each message as nested tuples of
plain values that pickle's C code handles alone:

- a dataclass becomes the tuple of its fields (the decoder knows the order);
- a small tensor (at most `_SMALL` elements, a dtype in `_LIST_DTYPES`: a step's [B] counts and
  sampling parameters, [B, G] drafts and uniforms at small batches) becomes (dtype code, shape,
  flat list of values): exact for integers and bools, and for float32 too (a Python float holds
  every float32 value exactly); it is rebuilt with one `torch.tensor` call;
- a larger tensor (q: [B, G, V] float32 or 16-bit) crosses as a numpy array (one copy, no per-value work;
  past ~64 elements this is the cheaper of the two); a dtype numpy lacks (bfloat16, ...) as its
  bits;
- anything else (not a step message) falls back to pickling with tensors as numpy arrays.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from dataclasses import dataclass, field

import torch

from specserve.engine import Proposal, RowInput, Verdict
from specserve.engine.model_runner import ForwardTiming
from specserve.engine.sampling import BatchSampling, rows_over_one_hot

from . import placed_q
from .placed_q import Outbox, PlacedQ


@dataclass(frozen=True)
class Reply:
    """A worker method's answer: its result, the wall time inside the method, and cache misses."""

    result: Proposal | Verdict | StepReply | None  # None when misses
    seconds: float  # wall time inside the actor method
    misses: dict[str, int] = field(default_factory=dict)  # request id -> valid length
    draft_misses: dict[str, int] = field(default_factory=dict)  # a fused step's proposer misses


@dataclass(frozen=True)
class Block:
    """How the draft side assembles a pipelined step's block k: some rows take their drafts from
    a block it prepared during the last execution, the others from this execution's propose."""

    prepared_id: int  # the AheadCall whose drafts the prepared rows take
    rows: list[int | None]  # per row of the step: its row among that call's drafted rows (a branch's
    # past B: what its fork drafted goes into the request's cache); None: fresh (in order)
    width: int  # G of the assembled block


@dataclass(frozen=True)
class AheadCall:
    """The pipelined loop's ahead call (serve/pipeline.py), sent with the execution that verifies
    block k: the draft side drafts it right after block k, while the target verifies. Its rows'
    token is the row's last draft of block k, which only the draft side knows when the call is
    planned: a row with g_b > 0 carries a placeholder there."""

    ahead_id: int
    rows: list[RowInput]  # from each row's last token once block k is accepted whole
    num_draft: list[int]  # [B] g_b of block k
    stop_ids: list[frozenset[int]]  # per row: a row whose block k holds one finishes; then no ahead
    num_tokens: int  # G' + 1: the bonus guess, then block k+1
    sampling: BatchSampling
    uniforms: torch.Tensor | None  # [B, G' + 1]
    # Rejection points per row that get a branch of their own (`pipeline.branch_points`): at each
    # of a greedy row's first `branches` drafts, the draft's runner-up there, then block k+1 after it
    branches: int = 0


@dataclass(frozen=True)
class StepCall:
    """One speculative step's worker inputs (what `RemoteExecutor.execute` sends with plain calls). A
    pipelined step adds `block` (the draft rows are then only the fresh ones, with
    `draft_sampling`) and/or `ahead`."""

    draft_rows: list[RowInput]
    gamma: int  # G (0: a target-only step; the draft side returns at once)
    sampling: BatchSampling
    draft_uniforms: torch.Tensor | None  # [B, G]
    target_rows: list[RowInput]
    num_draft: torch.Tensor  # [B]
    accept_uniforms: torch.Tensor | None  # [B, G]
    final_uniforms: torch.Tensor | None  # [B]
    block: Block | None = None
    draft_sampling: BatchSampling | None = None  # of the draft rows, when not `sampling`'s rows
    ahead: AheadCall | None = None
    # Compiled graph only: seconds the draft side of a step that drafts nothing sleeps before
    # answering, through the target's forward (a graph loop's waiting read spins a core, serve/graph.py)
    draft_nap_s: float = 0.0


@dataclass(frozen=True)
class StepReply:
    """What an execution returns to the coordinator: the proposal without q (its token ids and
    forward timings), the verdict, and each side's misses (a side with misses returns no result;
    after draft misses the target does not run)."""

    proposal: Proposal | None
    verdict: Verdict | None
    draft_misses: dict[str, int]
    target_misses: dict[str, int]
    draft_seconds: float  # wall time inside the draft side's method
    target_seconds: float
    ahead: object | None = None  # the ahead call's Reply (its proposal without q), when one was sent


SPARSE_SHARE = 4  # q crosses sparse where no row has more than 1/SPARSE_SHARE of the vocabulary nonzero


@dataclass(frozen=True)
class SparseQ:
    """q [R, G', V] of rows that all filter (min-p, top-k, top-p), as each position's nonzero entries:
    exact (q is 0 elsewhere), and at top-k 50 of a 32k vocabulary 1/100 of the bytes or less."""

    values: torch.Tensor  # [R, G', K] q's entries (its dtype), K the widest position's nonzero count
    index: torch.Tensor  # [R, G', K] int32 their token ids
    vocab: int  # V

    @classmethod
    def of(cls, probs: torch.Tensor, sampling: BatchSampling, rows: tuple[int, ...]) -> "SparseQ | None":
        """probs [R, G', V]: the listed rows' q -> its nonzero entries, or None where some row does
        not filter or a position keeps more than V / SPARSE_SHARE tokens. Rows that filter with
        top-k alone keep at most their k (host reads of the sampling); with top-p, the count is
        one device read, just before q is copied off the device anyway."""
        top_k, top_p, min_p = sampling.top_k.tolist(), sampling.top_p.tolist(), sampling.min_ps().tolist()
        if not rows or probs.shape[1] == 0 or not all(top_k[b] > 0 or top_p[b] < 1 or min_p[b] > 0 for b in rows):
            return None
        if all(top_p[b] >= 1 and min_p[b] == 0 for b in rows):
            support = min(max(top_k[b] for b in rows), probs.shape[-1])
        else:
            support = int((probs != 0).sum(-1).max())
        if support * SPARSE_SHARE > probs.shape[-1]:
            return None
        values, index = probs.topk(support, dim=-1)  # every nonzero entry (there are at most `support`)
        return cls(values, index.to(torch.int32), probs.shape[-1])

    @property
    def shape(self) -> torch.Size:
        """[R, G', V]: the shape of the q it stands for."""
        return torch.Size((*self.values.shape[:-1], self.vocab))

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """-> q [R, G', V] on `device`: zeros, the entries scattered in there."""
        values = self.values.to(device)
        out = torch.zeros(*values.shape[:-1], self.vocab, dtype=values.dtype, device=device)
        return out.scatter_(-1, self.index.to(device, torch.long), values)

    def __reduce__(self):  # its tensors as numpy arrays (out of band in `pack`, as q itself is)
        return (SparseQ, (_Large(self.values), _Large(self.index), self.vocab))


def _dense(q, device: torch.device | str = "cpu") -> torch.Tensor:
    if isinstance(q, PlacedQ):
        return placed_q.read(q, device)
    return q.dense(device) if isinstance(q, SparseQ) else q


@dataclass(frozen=True)
class SharedProbs:
    """A proposal's q left in Ray's object store by the draft side, for the target worker to read
    there: on the actor-call transport q [B, G, V] would otherwise cross into the coordinator and
    out again, twice through its memory, where nothing reads it. Only the part the rule reads goes
    in (`needed_part`: the sampled rows that verify drafts, up to the most drafts one verifies;
    their nonzero entries alone where they all filter: `SparseQ`); the rest is one-hot at the
    drafts, rebuilt by `resolve` (the rule's outcome for a greedy row does not depend on q beyond
    that, and no row reads a position past its g_b)."""

    ref: object  # ray.ObjectRef of q [R, G', V] (host; or a `SparseQ`), the `rows` in order; None: no rows
    rows: tuple[int, ...]  # rows of the batch that need q
    vocab: int  # V

    @classmethod
    def put(cls, probs: torch.Tensor, sampling: BatchSampling, num_draft: torch.Tensor | None = None) -> "SharedProbs":
        """probs [B, G, V]; num_draft [B] (host) the drafts each row verifies, G each if None ->
        the part the rule reads (`needed_part`) in the object store (ray.put)."""
        import ray

        picked, rows = needed_part(probs, sampling, num_draft)  # [R, G', V]
        if not rows:
            return cls(None, rows, probs.shape[-1])
        sparse = SparseQ.of(picked, sampling, rows)
        return cls(ray.put(_Large(picked) if sparse is None else sparse), rows, probs.shape[-1])

    def resolve(self, draft_tokens: torch.Tensor, get=None, device: torch.device | str = "cpu") -> torch.Tensor:
        """draft_tokens [B, G] -> q [B, G, V] on `device` (get: ray.get unless given): the rows'
        q is copied there, the rest is built there one-hot at the drafts."""
        if self.ref is None:
            return rows_over_one_hot(None, (), draft_tokens.to(device), self.vocab)
        if get is None:
            import ray

            get = ray.get
        with warnings.catch_warnings():  # read-only: a view of the store's memory, which nothing writes
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            picked = _dense(get(self.ref), device)  # [R, G', V]
        return rows_over_one_hot(picked, self.rows, draft_tokens.to(device), picked.shape[-1])


@dataclass(frozen=True)
class RowsProbs:
    """A proposal's q as it crosses the compiled graph from the draft side to the target: the
    part the rule reads (`needed_part`, as SharedProbs sends: the rows that sample and verify
    drafts, their first positions up to the most drafts one of them verifies), the rest rebuilt
    one-hot at the drafts by `resolve`. Whole, q is [B, G, V]: at 32 rows, γ 3 and a 32k
    vocabulary 12 MB a step in float32, 6 MB in the 16 bits a bfloat16 target's draft worker sends
    (`sampling.q_to_send`: the drafts are drawn from those very values), copied off the draft's
    device, through the channel and onto the target's. Rows that all filter with top-k or top-p
    send only q's nonzero entries; where the two workers share a GPU (or a host), the part is
    placed in a buffer the target reads in place (`placed_q`), and only its handle crosses."""

    # [R, G', V] the sampling rows' q, positions 0..G'-1 (in the dtype it was drawn from); its
    # nonzero entries alone where every such row filters (`SparseQ`); else, where the target can
    # read the draft's buffers, the buffer holding it (`PlacedQ`)
    probs: torch.Tensor | SparseQ | PlacedQ
    rows: tuple[int, ...]  # rows of the batch that sample and verify drafts, in order
    width: int  # G of the whole q

    @classmethod
    def of(cls, probs: torch.Tensor, sampling: BatchSampling, num_draft: torch.Tensor,
           outbox: Outbox | None = None) -> "RowsProbs | torch.Tensor":
        """probs [B, G, V] (on the draft's device); sampling, num_draft [B]: the verify's rows and
        planned drafts (host) -> what crosses: the part the rule reads (`needed_part`), its nonzero
        entries alone where every row of it filters (`SparseQ`), else placed in `outbox` when
        given (the target reads it in place); q itself where that part is all of q and some row
        does not filter."""
        cut, rows = needed_part(probs, sampling, num_draft)  # [R, G', V]
        sparse = SparseQ.of(cut, sampling, rows)
        if sparse is None and outbox is not None and rows:
            placed = outbox.place_or_none(cut)
            if placed is not None:
                return cls(placed, rows, probs.shape[1])
        if sparse is None and cut is probs:
            return probs
        return cls(cut if sparse is None else sparse, rows, probs.shape[1])

    def resolve(self, draft_tokens: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """draft_tokens [B, G] -> q [B, G, V] on `device`: the rows' part copied there, the rest
        built there (on the target's GPU, only the cut crosses from the host)."""
        if draft_tokens.shape[1] != self.width:
            raise ValueError(f"q was cut from {self.width} positions; these drafts hold {draft_tokens.shape[1]}")
        probs = _dense(self.probs, device)  # [R, G', V]
        return rows_over_one_hot(probs, self.rows, draft_tokens.to(device), probs.shape[-1])


def sampling_rows(sampling: BatchSampling) -> tuple[int, ...]:
    """The rows of a step that sample (temperature > 0): the ones whose q the rule reads."""
    return tuple(b for b, t in enumerate(sampling.temperature.tolist()) if t > 0)


def needed_part(probs: torch.Tensor, sampling: BatchSampling,
                num_draft: torch.Tensor | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """probs [B, G, V]; num_draft [B] (host) the drafts each row verifies (G each if None) ->
    (q [R, G', V] of the rows that sample and verify a draft, their first G' positions, G' the
    most drafts any of them verifies; those rows). The rule reads no other part of q: a greedy
    row's outcome depends on the target's choice alone, and a row reads no position past its
    g_b. probs itself where that is all of it (no copy)."""
    batch, width = probs.shape[:2]
    counts = [width] * batch if num_draft is None else num_draft.tolist()
    rows = tuple(b for b in sampling_rows(sampling) if counts[b] > 0)
    most = max((counts[b] for b in rows), default=0)
    if len(rows) == batch and most == width:
        return probs, rows
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    return probs.index_select(0, index)[:, :most], rows


def light(proposal: Proposal) -> Proposal:
    """A proposal without q or runner-ups (token ids and timings only): what goes back to the coordinator."""
    return Proposal(proposal.tokens, None, proposal.forwards, proposal.deterministic, proposal.num_draft)


_FRAMED = b"F"  # a message whose arrays travel out of band (a pickle stream starts with its PROTO opcode)


def pack(message) -> bytes:
    """The message as one `bytes`. Its numpy arrays (q, `_Large` tensors) travel out of band: the
    pickle of the rest, then each array's bytes, joined once. Pickled in band, a 12 MB q went
    through pickle's growing output: 5.2 ms against 0.4 ms (2-core CPU, one thread)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(_encode(message), protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return head
    raws = [b.raw() for b in buffers]
    sizes = [len(head)] + [r.nbytes for r in raws]
    frame = _FRAMED + len(raws).to_bytes(4, "little") + b"".join(n.to_bytes(8, "little") for n in sizes)
    return b"".join([frame, head, *raws])


def unpack(data: bytes):
    if data[:1] != _FRAMED:
        return _decode(pickle.loads(data))
    count = int.from_bytes(data[1:5], "little")
    sizes = [int.from_bytes(data[5 + 8 * i : 13 + 8 * i], "little") for i in range(count + 1)]
    view = memoryview(bytearray(data))  # one writable copy: every array decoded owns its memory
    parts, at = [], 5 + 8 * (count + 1)
    for n in sizes:
        parts.append(view[at : at + n])
        at += n
    return _decode(pickle.loads(parts[0], buffers=parts[1:]))


def pack_pair(first: bytes, second: bytes) -> bytes:
    """Two packed messages as one `bytes` (a step's verdict and its ahead call's reply), so that
    a graph execution has one output: its length, then each."""
    return len(first).to_bytes(4, "little") + first + second


def unpack_pair(data: bytes) -> tuple:
    n = int.from_bytes(data[:4], "little")
    return unpack(data[4:4 + n]), unpack(data[4 + n:])


# -- tensors ---------------------------------------------------------------------------------------
_SMALL = 64
_LIST_DTYPES = (torch.int64, torch.float32, torch.bool, torch.int32)
_CODE = {dtype: code for code, dtype in enumerate(_LIST_DTYPES)}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor(x: torch.Tensor | None):
    if x is None:
        return None
    x = x.detach()
    code = _CODE.get(x.dtype)
    if code is not None and x.numel() <= _SMALL:
        return code, tuple(x.shape), x.reshape(-1).tolist()
    return _Large(x)


def _untensor(t) -> torch.Tensor | None:
    if t is None or isinstance(t, torch.Tensor):  # (a `_Large` one comes back as a tensor already)
        return t
    code, shape, values = t
    return torch.tensor(values, dtype=_LIST_DTYPES[code]).view(shape)


class _Large:
    """A large tensor inside an encoded message: pickled as a numpy array (or its bits)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self):
        array, dtype = _host_array(self.tensor.detach().cpu().contiguous())
        return (torch.from_numpy, (array,)) if dtype is None else (_from_bits, (array, dtype))


def _host_array(host: torch.Tensor):
    """A host tensor as a numpy array sharing its memory -> (array, None), or (its bits, its
    dtype) where numpy has no such dtype (bfloat16, ...)."""
    try:
        return host.numpy(), None
    except TypeError:
        return host.view(_BITS[host.element_size()]).numpy(), host.dtype


def _from_bits(bits, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(bits).view(dtype)


class _Pickler(pickle.Pickler):
    """The fallback for anything that is not a step message: tensors as numpy arrays."""

    def reducer_override(self, obj):
        return _Large(obj).__reduce__() if isinstance(obj, torch.Tensor) else NotImplemented


def fast_tensor_pickling() -> None:
    """Have Ray pickle a host tensor in this process as a numpy array (its dtype's bits where numpy
    lacks the dtype): torch's own pickling writes each storage with `torch.save` and reads it with
    `torch.load`, ~85 µs a tensor when hot and far more between forwards, and a plain step call
    carries a dozen small tensors each way (sampling parameters, uniforms, draft tokens, counts).
    A device tensor, one that needs grad, or any other kind is pickled as torch does. Ray's
    dispatch table is per process: every process that sends tensors calls this (the coordinator
    and the workers); the receiver needs nothing."""
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=_tensor_out, deserializer=_tensor_in)


def _tensor_out(t: torch.Tensor):
    if t.device.type == "cpu" and not t.requires_grad and t.layout == torch.strided:
        try:
            return _host_array(t)
        except RuntimeError:  # conjugate or negative views, ...: as torch pickles it
            pass
    return pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL)


def _tensor_in(data) -> torch.Tensor:
    if isinstance(data, bytes):
        return pickle.loads(data)
    array, dtype = data
    if not array.flags.writeable:  # a view of Ray's buffers: the receiver gets a tensor of its own
        array = array.copy()
    return torch.from_numpy(array) if dtype is None else _from_bits(array, dtype)


# -- messages ------------------------------------------------------------------------------------
def _rows(rows: list[RowInput]) -> list[tuple]:
    return [(r.request_id, r.start, r.tokens) for r in rows]


def _unrows(rows: list[tuple]) -> list[RowInput]:
    return [RowInput(*r) for r in rows]


def _sampling(s: BatchSampling | None):
    # (processing, grammar: small dataclasses of host lists, pickled as they are; None for most steps)
    return None if s is None else (_tensor(s.temperature), _tensor(s.top_k), _tensor(s.top_p), s.processing,
                                   s.logprobs, s.grammar, None if s.min_p is None else _tensor(s.min_p),
                                   None if s.forced is None else _tensor(s.forced))


def _unsampling(s) -> BatchSampling | None:
    return None if s is None else BatchSampling(*(_untensor(t) for t in s[:3]), s[3], s[4], s[5],
                                                *(None if t is None else _untensor(t) for t in s[6:8]))


def _probs(p):
    """A proposal's q: a tensor (or None) as `_tensor`, or the part that crosses (`RowsProbs`; its
    `SparseQ` pickles its tensors as numpy arrays itself)."""
    if not isinstance(p, RowsProbs):
        return _tensor(p)
    kept = isinstance(p.probs, (SparseQ, PlacedQ))  # (pickled as they are)
    return "rows", p.probs if kept else _tensor(p.probs), p.rows, p.width


def _unprobs(p):
    if isinstance(p, tuple) and p[0] == "rows":  # (a small tensor's tuple starts with its dtype code)
        kept = isinstance(p[1], (SparseQ, PlacedQ))
        return RowsProbs(p[1] if kept else _untensor(p[1]), tuple(p[2]), p[3])
    return _untensor(p)


def _times(forwards) -> list[tuple]:
    return [tuple(f) for f in forwards]


def _untimes(forwards: list[tuple]) -> list[ForwardTiming]:
    return [ForwardTiming(*f) for f in forwards]


def _encode(m):
    """A message as (kind, fields); None as None."""
    if m is None:
        return None
    kind = type(m)
    if kind is StepCall:
        return "c", (_rows(m.draft_rows), m.gamma, _sampling(m.sampling), _tensor(m.draft_uniforms),
                     _rows(m.target_rows), _tensor(m.num_draft), _tensor(m.accept_uniforms),
                     _tensor(m.final_uniforms), None if m.block is None else (m.block.prepared_id, m.block.rows,
                                                                              m.block.width),
                     _sampling(m.draft_sampling), _encode(m.ahead), m.draft_nap_s)
    if kind is AheadCall:
        return "a", (m.ahead_id, _rows(m.rows), m.num_draft, m.stop_ids, m.num_tokens, _sampling(m.sampling),
                     _tensor(m.uniforms), m.branches)
    if kind is Reply:
        return "r", (_encode(m.result), m.seconds, m.misses, m.draft_misses)
    if kind is StepReply:
        return "s", (_encode(m.proposal), _encode(m.verdict), m.draft_misses, m.target_misses, m.draft_seconds,
                     m.target_seconds, _encode(m.ahead))
    if kind is Proposal:
        return "p", (_tensor(m.tokens), _probs(m.probs), _times(m.forwards), m.deterministic, _tensor(m.num_draft),
                     _tensor(m.alternates))
    if kind is Verdict:
        return "v", (m.num_accepted, m.next_token, _times(m.forwards), m.draft_tokens, m.logprobs, m.top_logprobs,
                     m.cached_tokens)
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(m)
    return "x", out.getvalue()


def _decode(e):
    if e is None:
        return None
    kind, f = e
    if kind == "c":
        block = None if f[8] is None else Block(*f[8])
        return StepCall(_unrows(f[0]), f[1], _unsampling(f[2]), _untensor(f[3]), _unrows(f[4]), _untensor(f[5]),
                        _untensor(f[6]), _untensor(f[7]), block, _unsampling(f[9]), _decode(f[10]), f[11])
    if kind == "a":
        return AheadCall(f[0], _unrows(f[1]), f[2], f[3], f[4], _unsampling(f[5]), _untensor(f[6]), f[7])
    if kind == "r":
        return Reply(_decode(f[0]), f[1], f[2], f[3])
    if kind == "s":
        return StepReply(_decode(f[0]), _decode(f[1]), f[2], f[3], f[4], f[5], _decode(f[6]))
    if kind == "p":
        return Proposal(_untensor(f[0]), _unprobs(f[1]), _untimes(f[2]), f[3], _untensor(f[4]), _untensor(f[5]))
    if kind == "v":
        return Verdict(f[0], f[1], _untimes(f[2]), f[3], f[4], f[5], f[6])
    return pickle.loads(f)


def shared_q(proposal: Proposal, sampling: BatchSampling, share: bool, num_draft: torch.Tensor | None,
            outbox: Outbox | None = None) -> Proposal:
    """The proposal with the part of its q the rule reads (of num_draft [B] drafts a row) placed
    for the target (`outbox` given: `RowsProbs` of a `PlacedQ`), else in the object store
    (`SharedProbs`), when `share` and it has one (inside Ray, for the store: a worker object
    called in-process, as tests do, keeps q in the reply)."""
    if not share or proposal.probs is None:
        return proposal
    if outbox is not None:
        return dataclasses.replace(proposal, probs=RowsProbs.of(proposal.probs, sampling, num_draft, outbox))
    import ray

    if not ray.is_initialized():
        return proposal
    return dataclasses.replace(proposal, probs=SharedProbs.put(proposal.probs, sampling, num_draft))


def q_needed(reply: Reply, call: StepCall, outbox: Outbox | None = None) -> Reply:
    """The draft side's reply as it crosses the graph to the target: its q cut to what the rule
    reads (`RowsProbs`: the rows that sample, the positions they verify), placed in `outbox` when given."""
    proposal = reply.result
    if proposal is None or not isinstance(proposal.probs, torch.Tensor):
        return reply
    probs = RowsProbs.of(proposal.probs, call.sampling, call.num_draft, outbox)
    return dataclasses.replace(reply, result=dataclasses.replace(proposal, probs=probs))
