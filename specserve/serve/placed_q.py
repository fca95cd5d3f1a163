"""q read in place: a draft worker and its target worker that share a GPU (or, on CPUs, a host)
pass q through memory both can reach instead of through the host and a channel.

The draft side (`Outbox`) keeps a ring of `RING` buffers on its device: CUDA memory that another
process opens through a CUDA IPC handle, or on a CPU a POSIX shared-memory segment. Each step it
copies the part of q the rule reads into the next buffer, waits for that copy, and sends a
`PlacedQ` (a handle, a shape and a dtype: a few hundred bytes) where q [R, G', V] would have
crossed. The target (`read`) opens each buffer once and copies q out of it onto its own device.

Why a ring of two is enough: only a step's propose writes (an ahead call's q waits in the draft
worker until the next propose assembles its block), propose calls run one at a time, and the
target has copied q out before its verify returns (the verdict's one copy to the host comes after
the rule read q, on the same stream). The next propose writes the other buffer; the one after it
is sent only once the coordinator holds the verdict of the step that read this one.

Whether the target can open what the draft places is tried once (`offer` / `accept`: a probe of
random values read back exactly, on the same GPU by its UUID), before the replica's first step
and again after a worker comes back; until then, and wherever it fails (workers on two nodes, or on two
GPUs), q crosses as before (`wire.RowsProbs`, `wire.SharedProbs`). A draft worker that restarts
starts with placement off.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

logger = logging.getLogger("specserve.placed_q")

RING = 2  # buffers a draft worker writes in turn (see the module docstring)
_OPENED = 8  # buffers a target keeps open (a restarted draft worker brings new ones)
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments
_PREFIX = "specserve-q-"  # a segment's name: this, the creating process's pid, a random part


class QGone(RuntimeError):
    """A placed q this process cannot open: the draft worker that placed it is gone (or it was
    placed where this process cannot reach). The step is planned again without drafts, as when
    a q in the object store is lost with its draft worker."""


@dataclass(frozen=True)
class PlacedQ:
    """q [R, G', V] placed by the draft worker: what crosses instead of it."""

    kind: str  # "cuda": CUDA IPC; "host": a shared-memory segment
    handle: tuple  # cuda: torch's arguments to rebuild the buffer in another process; host: (segment name, bytes)
    shape: tuple[int, ...]  # [R, G', V]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty((), dtype=self.dtype).element_size()


class _Buffer:
    """One buffer of the ring: flat bytes on the device, and how another process opens them."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.kind, self.handle, self.segment = "cuda", tuple(reduce_tensor(self.flat)[1]), None
        elif device.type == "cpu" and os.path.isdir(_SHM_DIR):
            from multiprocessing import shared_memory

            _sweep_once()
            name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            self.segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            self.flat = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=nbytes)
            self.kind, self.handle = "host", (self.segment.name, nbytes)
            _SEGMENTS.add(self.segment)
        else:
            raise RuntimeError(f"q cannot be placed for another process from a {device.type} device")

    def release(self) -> None:
        """Give a host segment's name back (a target that opened it keeps its mapping until it lets go)."""
        self.flat = None
        if self.segment is not None:
            _unlink(self.segment)


class Outbox:
    """The draft worker's side: `place(q)` -> PlacedQ, into the ring's next buffer (grown as needed)."""

    def __init__(self) -> None:
        self._ring: list[_Buffer | None] = [None] * RING
        self._next = 0

    def place(self, q: torch.Tensor) -> PlacedQ:
        """q [R, G', V] (on the draft's device) -> PlacedQ; the copy has finished on return."""
        nbytes = q.numel() * q.element_size()
        turn, self._next = self._next, (self._next + 1) % RING
        buffer = self._ring[turn]
        if buffer is None or buffer.nbytes < nbytes or buffer.flat.device != q.device:
            if buffer is not None:
                buffer.release()
                self._ring[turn] = None  # (until the new one is had: its allocation may fail)
            buffer = self._ring[turn] = _Buffer(_rounded(nbytes), q.device)
        buffer.flat[:nbytes].view(q.dtype).view(q.shape).copy_(q)
        if q.device.type == "cuda":  # the target reads it from another process: the copy must be over
            torch.cuda.current_stream(q.device).synchronize()
        return PlacedQ(buffer.kind, buffer.handle, tuple(q.shape), q.dtype)

    def place_or_none(self, q: torch.Tensor) -> PlacedQ | None:
        """`place`, or None where its buffer cannot be had (the device out of memory: the step's q
        then crosses as before; the buffer is tried again next step)."""
        try:
            return self.place(q)
        except (RuntimeError, OSError) as err:  # (torch.OutOfMemoryError is a RuntimeError)
            logger.warning("q not placed this step (%s: %s)", type(err).__name__, str(err)[:200])
            return None

    def close(self) -> None:
        for buffer in self._ring:
            if buffer is not None:
                buffer.release()
        self._ring = [None] * RING


def read(placed: PlacedQ, device: torch.device | str = "cpu") -> torch.Tensor:
    """-> q [R, G', V] on `device`: a copy of its own (the draft worker writes the buffer again two
    proposes later)."""
    try:
        flat = _open(placed)
    except Exception as err:
        raise QGone(f"cannot open the draft worker's q buffer ({type(err).__name__}: {err})") from err
    view = flat[: placed.nbytes].view(placed.dtype).view(placed.shape)
    return view.to(device, copy=True)


# -- the handshake -----------------------------------------------------------------------------------
def offer(outbox: Outbox, device: torch.device | str) -> tuple[PlacedQ, str, list[float]]:
    """The draft worker's probe: random values placed from its device -> (their PlacedQ, where it
    sits (a GPU's UUID, a host's name), the values)."""
    values = torch.rand(1, 1, 64, generator=torch.Generator().manual_seed(secrets.randbits(31)))
    placed = outbox.place(values.to(device))
    return placed, where(device), values.flatten().tolist()


def accept(probe: tuple[PlacedQ, str, list[float]], device: torch.device | str) -> bool:
    """The target worker's side: whether it sits where the draft does and reads the probe exactly."""
    placed, there, values = probe
    if there != where(device):
        return False
    try:
        return read(placed).flatten().tolist() == values
    except Exception:  # cannot open it here
        return False


def where(device: torch.device | str) -> str:
    """The GPU by its UUID (two processes may number it differently), or the host by its name."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda:{getattr(props, 'uuid', props.name)}"
    return f"host:{os.uname().nodename}"


# -- opening -------------------------------------------------------------------------------------------
_opened: OrderedDict = OrderedDict()  # handle -> flat uint8 tensor (this process's view of a buffer)
_opened_lock = threading.Lock()


def _open(placed: PlacedQ) -> torch.Tensor:
    key = (placed.kind, placed.handle)
    with _opened_lock:
        flat = _opened.get(key)
        if flat is not None:
            _opened.move_to_end(key)
            return flat
    if placed.kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        flat = rebuild_cuda_tensor(*placed.handle)
    elif placed.kind == "host":
        name, nbytes = placed.handle
        path = os.path.join(_SHM_DIR, name)
        if not os.path.exists(path):  # (torch.from_file would create it)
            raise FileNotFoundError(f"no shared-memory segment {name} on this host")
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    else:
        raise ValueError(f"unknown placement {placed.kind!r}")
    with _opened_lock:
        _opened[key] = flat
        while len(_opened) > _OPENED:
            _opened.popitem(last=False)
    return flat


def _rounded(nbytes: int) -> int:
    """A buffer's size: the next power of two from 64 KiB, so that a growing batch reallocates rarely."""
    size = 1 << 16
    while size < nbytes:
        size <<= 1
    return size


_SEGMENTS: set = set()  # this process's live segments, unlinked at exit


def _unlink(segment) -> None:
    _SEGMENTS.discard(segment)
    try:
        segment.unlink()
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_all() -> None:
    for segment in list(_SEGMENTS):
        _unlink(segment)


_swept = False


def _sweep_once() -> None:
    """Unlink the segments of processes that are gone (once per process, at its first segment): a
    worker killed outright (SIGKILL, as Ray stops and restarts actors) leaves its names behind."""
    global _swept
    if _swept:
        return
    _swept = True
    for name in os.listdir(_SHM_DIR):
        pid = name[len(_PREFIX):].split("-")[0] if name.startswith(_PREFIX) else ""
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
