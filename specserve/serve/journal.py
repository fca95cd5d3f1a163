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
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable

logger = logging.getLogger("specserve.responses")

VERSION = 1
MIN_REWRITE = 1 << 20  # a journal smaller than this is never rewritten for its size


class Journal:
    def __init__(self, path: str | os.PathLike, kind: str) -> None:
        self.path, self.kind = Path(path), kind
        self.size = 0  # bytes in the file
        self._file = None

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
        self.close()
        self._file = open(self.path, "ab")
        self.size = self._file.tell()

    def write(self, record: list) -> None:
        """One record appended and flushed; where that fails (a full disk), the file is cut back
        to where it was and the OSError raised: the change it records is then not made."""
        line = self._line(record)
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
        if self._file is not None:
            self._file.close()
            self._file = None

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
        than when it was written), then the file written anew from it."""
        self._replaying = True
        try:
            for number, record in enumerate(journal.load(), start=1):
                try:
                    self._apply(record)
                except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
                    logger.warning("%s: record %d could not be applied (%r): left out", journal.path, number, err)
        finally:
            self._replaying = False
        self._bound()
        journal.rewrite(self._snapshot())
        self._journal = journal
        logger.info("%s store: %d bytes read back from %s", journal.kind, self._bytes, journal.path)

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
