"""A store's journal (`responses.persist_dir`): each change the store makes, one JSON line,
appended and flushed before the change is made, so that a store replica Serve restarts (killed,
crashed, or moved) reads the file back and holds what it held. A change the store answered was
written; one under way when the process died is at most a torn last line, which is dropped.

When the file has grown to twice what the store holds (and at least `MIN_REWRITE` bytes), and
once at each start, it is written anew as the records that make the store as it is now (a
snapshot): into a file beside it, synced, then renamed over it, so a crash at any moment leaves
either the old file or the new one whole. A line that cannot be read or applied (a torn last
line, a damaged one) is left out with a warning: the store starts with the rest. The lines are flushed to the operating system, not
synced one by one: a killed process loses nothing, a machine that loses power may lose the last
lines it had not yet written to disk.

The first line names the store (`kind`) and the format's version; a file of another kind or a
newer version is an error at start, not something to read as this one.

One store writes a journal at a time: it holds a lock on a file beside it (`<name>.lock`, flock)
from before it reads the journal until it closes it (Serve calls the store's `__del__` at a
replica's graceful stop) or its process ends. A store starting while another holds it (a
redeploy's new replica while the old one drains) waits for it to let go, up to `HANDOVER_S`.
One that still holds it then (another app or cluster on the same directory, as a RayService
upgrade runs the new cluster beside the old one) is taken over: the new store reads the journal
and writes it anew, and the old one, finding the file it appends to no longer the journal,
refuses every change from then on instead of writing where nobody reads. A second lock
(`<name>.changes`) keeps the two apart meanwhile: the old store holds it from each change's check
to its append, the new one from its read to its rewrite, so no change falls between the two.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterable

logger = logging.getLogger("specserve.responses")

VERSION = 1
MIN_REWRITE = 1 << 20  # a journal smaller than this is never rewritten for its size
# how long a store waits at start for the one holding its journal to stop: more than Serve's
# graceful stop of a store replica (its 2 s drain, then at most its 20 s timeout before the kill)
HANDOVER_S = 60.0
HANDOVER_POLL_S = 0.05
# how long a change waits for a store that is taking the journal over to have read and rewritten it
# (a read back: ~0.1 s for 6 MB), and that store for a change under way (microseconds)
CHANGES_WAIT_S = 10.0
CHANGES_POLL_S = 0.001


class Journal:
    def __init__(self, path: str | os.PathLike, kind: str) -> None:
        self.path, self.kind = Path(path), kind
        self.size = 0  # bytes in the file
        self._file = None
        self._held = None  # the lock file, open while this store holds the journal (`hold`)
        self._changes = None  # the changes' lock file (`exclusive`), open from `hold` to `close`
        self._depth = 0  # (`exclusive` calls under way: only the outermost takes the lock)
        self._closed = False  # (by `close`: nothing is written any more)
        self.waited_s = 0.0  # how long `hold` waited for another store to let go

    def hold(self) -> None:
        """The journal's lock taken, waiting up to HANDOVER_S for the store that holds
        it to let go; held until `close` or this process ends. A holder that does not let go is
        taken over (a warning naming it; its changes are refused from this store's rewrite on, see
        `write` and `exclusive`). Where the filesystem cannot lock (some network mounts): a warning,
        used unheld."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(self.path.with_name(self.path.name + ".lock"), "a+b")
        start = time.monotonic()
        try:
            locking = self._wait_for(lock, HANDOVER_S)
            if locking:
                self._changes = open(self.path.with_name(self.path.name + ".changes"), "a+b")
        except BaseException:
            lock.close()
            raise
        self.waited_s = time.monotonic() - start
        lock.truncate(0)  # (who holds it now, for a store that waits on it to name)
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode())
        lock.flush()
        self._held = lock

    def _wait_for(self, lock, wait_s: float) -> bool:
        """The lock taken, or taken over after wait_s; False where the filesystem cannot lock."""
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("%s is still held by another %s store (%s) after %g s: taken over; that store "
                                   "refuses every change from now on", self.path, self.kind, _holder(lock), wait_s)
                    return True
                if not told:
                    logger.warning("%s is held by another %s store (%s): waiting up to %g s for it to stop",
                                   self.path, self.kind, _holder(lock), wait_s)
                    told = True
                time.sleep(HANDOVER_POLL_S)
            except OSError as err:
                logger.warning("%s cannot be locked (%s): used without a lock; give no two apps this "
                               "responses.persist_dir", self.path, err)
                return False

    @contextlib.contextmanager
    def exclusive(self):
        """No other store reads or changes the file meanwhile: held by each change from its check to
        its append, and by a store reading the journal back until it has written it anew, so a
        change by a store being taken over is either in what the new one read or refused. An
        OSError where a store holds it past CHANGES_WAIT_S (a change is then not made)."""
        if self._depth or self._changes is None:  # (inside one already, or no locks here)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        deadline = time.monotonic() + CHANGES_WAIT_S
        while True:
            try:
                fcntl.flock(self._changes.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise OSError(f"{self.path} was kept by another store for {CHANGES_WAIT_S:g} s") from None
                time.sleep(CHANGES_POLL_S)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            fcntl.flock(self._changes.fileno(), fcntl.LOCK_UN)

    def load(self) -> list[list]:
        """The file's records, oldest first ([] where there is no file yet). A line that is not a
        whole record is left out: a torn last line (the process died writing it) quietly, any
        other with a warning."""
        if not self.path.exists():
            return []
        lines = self.path.read_bytes().split(b"\n")
        self._check_header(lines[0])
        records = []
        for number, line in enumerate(lines[1:], start=2):
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                last = not any(lines[number:])
                (logger.info if last else logger.warning)("%s: line %d is not a whole record: left out",
                                                          self.path, number)
        return records

    def rewrite(self, records: Iterable[list]) -> None:
        """The file replaced, whole, by these records (a snapshot); later writes go on from them.
        Where the new file cannot be written (a full disk), the old one stays as it was, in use,
        and the OSError is raised."""
        self._check_open()
        with self.exclusive():
            self._rewrite(records)

    def _rewrite(self, records: Iterable[list]) -> None:
        if self._file is not None:  # (a rewrite when due: not over a store that took the journal over)
            self._check_current()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = self.path.with_name(self.path.name + ".new")
        try:
            with open(fresh, "wb") as out:
                out.write(self._line({"specserve_journal": self.kind, "version": VERSION}))
                for record in records:
                    out.write(self._line(record))
                out.flush()
                os.fsync(out.fileno())
            os.replace(fresh, self.path)
        except OSError:
            fresh.unlink(missing_ok=True)
            raise
        _sync_dir(self.path.parent)
        if self._file is not None:
            self._file.close()
        self._file = open(self.path, "ab")
        self.size = self._file.tell()

    def write(self, record: list) -> None:
        """One record appended and flushed; where that fails (a full disk), the file is cut back
        to where it was and the OSError raised: the change it records is then not made. So too
        where the file appended to is no longer the journal (another store took it over)."""
        self._check_open()
        with self.exclusive():
            self._append(self._line(record))

    def _append(self, line: bytes) -> None:
        self._check_current()
        try:
            self._file.write(line)
            self._file.flush()
        except OSError:
            self._file.close()
            with open(self.path, "r+b") as cut:
                cut.truncate(self.size)
            self._file = open(self.path, "ab")
            raise
        self.size += len(line)

    def due(self, held: int) -> bool:
        """Whether the file has grown enough past a store holding `held` bytes to be rewritten."""
        return self.size > max(2 * held, MIN_REWRITE)

    def close(self) -> None:
        """The file closed and the lock let go: a store starting on it now goes on at once. Nothing
        is written after it (a write is an OSError)."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        for lock in (self._changes, self._held):  # (closing a file lets go of its lock)
            if lock is not None:
                lock.close()
        self._changes = self._held = None

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(f"{self.path} is closed: its store has stopped")

    def _check_current(self) -> None:
        """An OSError where the file open is no longer the journal: another store, taking it over,
        wrote it anew (or it was removed)."""
        try:
            named, held = os.stat(self.path), os.fstat(self._file.fileno())
            current = (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
        except FileNotFoundError:
            current = False
        if not current:
            raise OSError(f"{self.path} was taken over by another store: this one makes no more changes")

    def _check_header(self, line: bytes) -> None:
        try:
            header = json.loads(line)
            kind, version = header["specserve_journal"], header["version"]
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"{self.path} is not a specserve store journal") from None
        if kind != self.kind:
            raise ValueError(f"{self.path} is the {kind} store's journal, not the {self.kind} store's")
        if version > VERSION:
            raise ValueError(f"{self.path} is a journal of version {version}, newer than this specserve "
                             f"reads ({VERSION})")

    @staticmethod
    def _line(record) -> bytes:
        return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def _holder(lock) -> str:
    """Who holds a journal's lock, as its lock file says."""
    lock.seek(0)
    try:
        said = json.loads(lock.read() or b"{}")
        return f"pid {said['pid']} on {said['host']}, since {said['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not said who it is"


def _sync_dir(directory: Path) -> None:
    """The directory's entry of a renamed file on disk too (where the system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Journaled:
    """A store that records its changes in a Journal: it calls `_log(record)` at the start of
    each change, before making it, and gives `_apply(record)` (the change made again, logging
    nothing), `_snapshot()` (records that make the store as it is), `_bound()` (its bounds
    enforced) and `_bytes` (what it holds). A change never enforces the bounds itself (its
    caller does, after it): which links or conversations the bounds dropped is in the journal,
    and reading it back must not drop others (reads are not recorded, so the least recently
    used order read back is not always the one that was)."""

    _journal: Journal | None = None
    _replaying = False
    _bytes = 0

    def _open(self, journal: Journal) -> None:
        """What the journal holds read back, the store's bounds enforced (they may be smaller
        than when it was written), then the file written anew from it; first its lock taken
        (waiting for a store that holds it to stop)."""
        journal.hold()
        try:
            with journal.exclusive():  # (no change of a store taken over falls between read and rewrite)
                self._read_back(journal)
                self._bound()
                journal.rewrite(self._snapshot())
        except BaseException:
            journal.close()  # (a journal it could not read or write is not kept held)
            raise
        self._journal = journal
        logger.info("%s store: %d bytes read back from %s", journal.kind, self._bytes, journal.path)

    def _read_back(self, journal: Journal) -> None:
        self._replaying = True
        try:
            for number, record in enumerate(journal.load(), start=1):
                try:
                    self._apply(record)
                except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
                    logger.warning("%s: record %d could not be applied (%r): left out", journal.path, number, err)
        finally:
            self._replaying = False

    def __del__(self) -> None:
        """The journal let go (Serve calls this at a replica's graceful stop, once its calls are
        done): the next replica reads it back at once. A change after it is refused, not lost."""
        if self._journal is not None:  # (a store whose journal was read back: its `_lock` is set)
            with self._lock:
                self._journal.close()

    def _log(self, record: list) -> None:
        """A change recorded before it is made (the journal rewritten first where it is due)."""
        if self._journal is None or self._replaying:
            return
        if self._journal.due(self._bytes):
            self._journal.rewrite(self._snapshot())
        self._journal.write(record)

    def _apply(self, record: list) -> None:
        raise NotImplementedError

    def _snapshot(self):
        raise NotImplementedError

    def _bound(self) -> None:
        raise NotImplementedError
