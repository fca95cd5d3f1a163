"""The stores' journals (`responses.persist_dir`): a store opened again on its journal holds
what the store that wrote it held, through torn lines, rewrites, failed writes and restarts of
its Serve replica."""
import json
import os
import time

import pytest

from specserve.config import ResponsesConfig
from specserve.serve import journal as journal_module
from specserve.serve import response_store
from specserve.serve.conversation_store import ConversationStore
from specserve.serve.journal import Journal
from specserve.serve.response_store import ResponseStore


def _turn(store, k: int, previous: str | None = None, pad: int = 100, owner: int = -1) -> str:
    said = {"type": "message", "id": f"out{k}", "role": "assistant", "content": "a" * pad}
    store.put({"id": f"r{k}", "status": "completed", "output": [said]}, [{"role": "user", "content": f"q{k}" * pad}], owner, previous)
    return f"r{k}"


def _background(store, k: int, streamed: bool) -> str:
    rid = f"bg{k}"
    store.put({"id": rid, "background": True, "status": "in_progress", "output": []},
              [{"role": "user", "content": f"go {k}"}], -1, None, streamed)
    return rid


def _stop(store):
    """A store's replica stopped as Serve stops one: its `__del__` lets go of the journal, so the
    next store on it reads it back at once (until then it would wait for it)."""
    store.__del__()


def _responses_view(store: ResponseStore, ids: list[str]) -> dict:
    """Everything a client can read of these responses, and what the store counts."""
    owners = {rid: (int(rid[1:]) % 2 if rid[0] == "r" and int(rid[1:]) >= 4 else -1) for rid in ids}  # (_a_busy_store's)
    view = {rid: (store.get(rid, o), store.conversation(rid, o), store.input_items(rid, o), store.events(rid, o))
            for rid, o in owners.items()}
    items = [f"out{k}" for k in range(12)]
    return {"responses": view, "items": [store.items(items, owner) for owner in (-1, 0, 1)], "len": len(store),
            "bytes": store._bytes,
            "links": sorted(store._links), "shown": list(store._shown)}


def _a_busy_store(path, **bounds) -> tuple[ResponseStore, list[str]]:
    """A store that took every kind of change: turns and branches, a deleted turn that stays as
    history, one dropped by the bound, streamed and plain background responses ended, cancelled
    and running."""
    store = ResponseStore(**{"max_stored": 9, "max_stored_bytes": 1 << 20, **bounds}, journal=str(path))
    first = _turn(store, 0)
    second = _turn(store, 1, first)
    _turn(store, 2, second)
    _turn(store, 3, second)  # (a branch from r1)
    assert store.delete(second)  # r1 stays, hidden, as r2's and r3's history
    streamed = _background(store, 0, True)
    assert store.append(streamed, -1, ["event: a\ndata: {}\n\n", "event: b\ndata: {\"x\": \"\\u00e9\"}\n\n"])
    assert store.finish({"id": streamed, "background": True, "status": "completed", "output": []}, -1, ["c\n\n"])
    cancelled = _background(store, 1, False)
    store.cancel(cancelled)
    running = _background(store, 2, True)
    store.append(running, -1, ["event: d\ndata: {}\n\n"])
    for k in range(4, 8):  # past max_stored: the least recently used (r0) hidden, kept as r2's history
        _turn(store, k, owner=k % 2)
    assert store.get("r0") is None
    assert store.delete("r6", owner=0)  # (a recent one: what the bound would drop next is another)
    ids = ["r0", "r1", "r2", "r3", streamed, cancelled, running] + [f"r{k}" for k in range(4, 8)]
    return store, ids


def test_a_response_store_reads_back_what_it_held(tmp_path):
    path = tmp_path / "responses.jsonl"
    store, ids = _a_busy_store(path)
    before = _responses_view(store, ids)
    assert before["responses"]["r2"][1][0]["content"] == "q0" * 100  # (r0's items, through the hidden r1)
    _stop(store)
    again = ResponseStore(9, 1 << 20, journal=str(path))
    assert _responses_view(again, ids) == before
    _stop(again)
    once_more = ResponseStore(9, 1 << 20, journal=str(path))  # (from the snapshot the last start wrote)
    assert _responses_view(once_more, ids) == before
    # the index that item_reference reads, per owner
    assert once_more.items(["out5"], owner=1) == store.items(["out5"], owner=1) != [None]


def test_a_running_background_response_goes_on_after_a_restart_or_fails_once_its_lease_runs_out(
        tmp_path, monkeypatch):
    path = tmp_path / "responses.jsonl"
    store = ResponseStore(9, 1 << 20, journal=str(path))
    going, lost = _background(store, 0, True), _background(store, 1, False)
    store.append(going, -1, ["event: a\n\n"])
    _stop(store)
    again = ResponseStore(9, 1 << 20, journal=str(path))
    assert again.append(going, -1, ["event: b\n\n"])  # its ingress goes on handing over
    assert again.finish({"id": going, "background": True, "status": "completed", "output": []}, -1, [])
    now = response_store.time.monotonic()
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now + response_store.LEASE_S + 1)
    assert again.get(lost)["status"] == "failed"  # nobody asked after it since the restart
    monkeypatch.undo()
    _stop(again)
    last = ResponseStore(9, 1 << 20, journal=str(path))
    assert last.get(lost)["status"] == "failed" and not last.poll(lost)
    assert last.get(going)["status"] == "completed"
    assert last.events(going)["events"] == ["event: a\n\n", "event: b\n\n"]


def test_bounds_smaller_at_a_restart_hold_at_once(tmp_path):
    path = tmp_path / "responses.jsonl"
    store, _ = _a_busy_store(path)
    store.get("r2")  # now the most recently used; a rewrite (as when one is due) keeps that order
    store._journal.rewrite(store._snapshot())
    _stop(store)
    smaller = ResponseStore(3, 1 << 20, journal=str(path))
    assert len(smaller) == 3 and smaller.get("r7", owner=1) is not None and smaller.get("r2") is not None
    _stop(smaller)
    assert len(ResponseStore(3, 1 << 20, journal=str(path))) == 3


def test_the_journal_is_rewritten_once_it_has_grown_past_what_the_store_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "MIN_REWRITE", 1 << 14)
    path = tmp_path / "responses.jsonl"
    store = ResponseStore(4, 1 << 20, journal=str(path))
    rewrites = []
    rewrite = Journal.rewrite
    monkeypatch.setattr(Journal, "rewrite", lambda self, records: rewrites.append(1) or rewrite(self, records))
    for k in range(300):  # ~300 x 600 bytes written, at most 4 turns held
        _turn(store, k, pad=200)
    assert len(rewrites) > 3
    assert path.stat().st_size < 2 * max(store._bytes, 1 << 14) + 4096
    ids = [f"r{k}" for k in range(290, 300)]
    _stop(store)
    assert _responses_view(ResponseStore(4, 1 << 20, journal=str(path)), ids) == _responses_view(store, ids)


def test_a_torn_last_line_is_dropped_and_the_file_made_whole(tmp_path, caplog):
    path = tmp_path / "responses.jsonl"
    store, ids = _a_busy_store(path)
    before = _responses_view(store, ids)
    with open(path, "ab") as out:
        out.write(b'["put","r99",-1,null,"{\\"id')  # (the process died in the middle of a write)
    _stop(store)
    again = ResponseStore(9, 1 << 20, journal=str(path))
    assert _responses_view(again, ids) == before and again.get("r99") is None
    assert all(json.loads(line) for line in path.read_bytes().splitlines())  # written anew, whole
    _turn(again, 10)
    _stop(again)
    assert ResponseStore(9, 1 << 20, journal=str(path)).get("r10") is not None


def test_a_damaged_line_is_left_out_and_the_rest_read_back(tmp_path, caplog):
    path = tmp_path / "responses.jsonl"
    store = ResponseStore(9, 1 << 20, journal=str(path))
    for k in range(3):
        _turn(store, k)
    lines = path.read_bytes().split(b"\n")
    damaged = next(n for n, line in enumerate(lines) if line.startswith(b'["put","r1"'))
    lines[damaged] = b'["put", "r1", garbage'  # (r1's record, damaged)
    lines.insert(damaged + 1, b'["events", "nobody", ["e"]]')  # (a record that cannot be applied)
    path.write_bytes(b"\n".join(lines))
    _stop(store)
    with caplog.at_level("WARNING", logger="specserve.responses"):
        again = ResponseStore(9, 1 << 20, journal=str(path))
    assert again.get("r0") == store.get("r0") and again.get("r2") == store.get("r2") and again.get("r1") is None
    assert f"line {damaged + 1} is not a whole record" in caplog.text and "could not be applied" in caplog.text


def test_a_rewrite_that_cannot_be_written_leaves_the_journal_in_use(tmp_path, monkeypatch):
    path = tmp_path / "responses.jsonl"
    store = ResponseStore(9, 1 << 20, journal=str(path))
    _turn(store, 0)
    real_fsync = journal_module.os.fsync

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module.os, "fsync", full)
    with pytest.raises(OSError):
        store._journal.rewrite(store._snapshot())
    monkeypatch.setattr(journal_module.os, "fsync", real_fsync)
    assert not (tmp_path / "responses.jsonl.new").exists()
    _turn(store, 1)  # (the old file, still open, takes the next change)
    _stop(store)
    again = ResponseStore(9, 1 << 20, journal=str(path))
    assert again.get("r0") is not None and again.get("r1") is not None


def test_a_change_whose_record_cannot_be_written_is_not_made(tmp_path, monkeypatch):
    path = tmp_path / "responses.jsonl"
    store, ids = _a_busy_store(path)
    before, size = _responses_view(store, ids), path.stat().st_size

    class Full:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            self.file.write(data[:5])  # (a part went out before the disk filled)
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.file, name)

    store._journal._file = Full(store._journal._file)
    with pytest.raises(OSError):
        _turn(store, 11)
    assert _responses_view(store, ids) == before and store.get("r11") is None
    assert path.stat().st_size == size
    _stop(store)
    assert _responses_view(ResponseStore(9, 1 << 20, journal=str(path)), ids) == before


def test_a_journal_is_read_only_by_its_own_kind_of_store(tmp_path):
    path = tmp_path / "store.jsonl"
    ResponseStore(9, 1 << 20, journal=str(path))
    with pytest.raises(ValueError, match="responses store's journal, not the conversations"):
        ConversationStore(8, 1 << 20, journal=str(path))
    other = tmp_path / "other.jsonl"
    other.write_text("hello\n")
    with pytest.raises(ValueError, match="not a specserve store journal"):
        ResponseStore(8, 1 << 20, journal=str(other))
    newer = tmp_path / "newer.jsonl"
    newer.write_text('{"specserve_journal": "responses", "version": 99}\n')
    with pytest.raises(ValueError, match="version 99"):
        ResponseStore(8, 1 << 20, journal=str(newer))


def test_a_conversation_store_reads_back_what_it_held(tmp_path):
    path = tmp_path / "conversations.jsonl"
    store = ConversationStore(3, 1 << 20, journal=str(path))
    said = [{"type": "message", "role": "user", "content": f"hello {k}"} for k in range(3)]
    ids = [store.create(said[:1], {"k": str(k)}, owner=k % 2)["id"] for k in range(4)]  # the first dropped
    assert store.get(ids[0], 0) == "no_conversation"
    added = store.append(ids[1], said[1:], owner=1)
    store.append(ids[1], [{**added[0]}], owner=1)  # (an id it holds already: a new one given)
    store.update(ids[2], {"topic": "é"}, owner=0)
    store.delete_item(ids[1], added[1]["id"], owner=1)
    store.delete(ids[3], owner=1)
    owners = {cid: k % 2 for k, cid in enumerate(ids)}
    views = lambda s: {cid: (s.get(cid, owners[cid]), s.items(cid, owners[cid]),  # noqa: E731
                             s.page(cid, 2, "desc", None, owners[cid])) for cid in ids}
    before = (views(store), len(store), store._bytes)
    _stop(store)
    again = ConversationStore(3, 1 << 20, journal=str(path))
    assert (views(again), len(again), again._bytes) == before
    assert len(again.items(ids[1], 1)) == 3 and again.get(ids[2], 0)["metadata"] == {"topic": "é"}
    _stop(again)
    smaller = ConversationStore(1, 1 << 20, journal=str(path))
    assert len(smaller) == 1 and smaller.get(ids[2], 0) != "no_conversation"  # (the most recently changed)


def test_a_store_waits_for_the_one_holding_its_journal_and_reads_what_it_wrote_last(tmp_path):
    """A redeploy's new replica starts while the old one drains: it waits for the old one to let
    go, then holds everything, the changes made while it waited too; the old one changes
    nothing after."""
    import threading

    path = tmp_path / "responses.jsonl"
    old = ResponseStore(9, 1 << 20, journal=str(path))
    _turn(old, 0)
    opened = []
    starting = threading.Thread(target=lambda: opened.append(ResponseStore(9, 1 << 20, journal=str(path))))
    starting.start()
    starting.join(0.5)
    assert not opened  # (waiting for the old one)
    _turn(old, 1, "r0")  # (a call the old one was still answering)
    _stop(old)
    starting.join(10)
    (new,) = opened
    assert new._journal.waited_s >= 0.5
    assert [item["content"] for item in new.conversation("r1")[:1]] == ["q0" * 100]
    with pytest.raises(OSError, match="closed"):
        _turn(old, 2)
    assert old.get("r2") is None and new.get("r2") is None
    _turn(new, 3, "r1")
    _stop(new)
    assert ResponseStore(9, 1 << 20, journal=str(path)).get("r3") is not None


def test_a_journal_held_past_the_handover_is_taken_over_and_its_old_store_changes_nothing(
        tmp_path, monkeypatch, caplog):
    """A holder that does not let go (another app or cluster on the same directory, as a
    RayService upgrade runs the new cluster beside the old one): the new store takes the journal
    over after HANDOVER_S, and the old one refuses every change from then on rather than write
    where nobody reads."""
    monkeypatch.setattr(journal_module, "HANDOVER_S", 0.3)
    path = tmp_path / "conversations.jsonl"
    old = ConversationStore(8, 1 << 20, journal=str(path))
    made = old.create([{"type": "message", "role": "user", "content": "hi"}], {})
    with caplog.at_level("WARNING", logger="specserve.responses"):
        new = ConversationStore(8, 1 << 20, journal=str(path))
    assert new._journal.waited_s >= 0.3
    assert f"still held by another conversations store (pid {os.getpid()} on " in caplog.text
    assert "taken over" in caplog.text
    with pytest.raises(OSError, match="taken over by another store"):
        old.append(made["id"], [{"type": "message", "role": "user", "content": "lost?"}])
    assert len(old.items(made["id"])) == 1  # (refused before it was made)
    new.append(made["id"], [{"type": "message", "role": "user", "content": "kept"}])
    _stop(new)
    _stop(old)
    again = ConversationStore(8, 1 << 20, journal=str(path))
    assert [item["content"][0]["text"] for item in again.items(made["id"])] == ["hi", "kept"]


def test_a_change_while_a_store_takes_the_journal_over_is_read_by_it_or_refused(tmp_path, monkeypatch):
    """The old store's change made while the new one reads the journal back (between its read and
    its rewrite): it waits for the rewrite and is then refused. Without the changes' lock it was
    appended to the file the rewrite replaced: answered as made, and lost."""
    import threading

    monkeypatch.setattr(journal_module, "HANDOVER_S", 0.1)
    path = tmp_path / "conversations.jsonl"
    old = ConversationStore(8, 1 << 20, journal=str(path))
    made = old.create([{"type": "message", "role": "user", "content": "hi"}], {})
    outcome = []

    def old_change():
        try:
            old.append(made["id"], [{"type": "message", "role": "user", "content": "meanwhile"}])
            outcome.append("made")
        except OSError as err:
            outcome.append(str(err))

    load = Journal.load

    def load_then_change(journal):
        records = load(journal)
        if journal is not old._journal:  # (the new store, between its read and its rewrite)
            changing = threading.Thread(target=old_change)
            changing.start()
            changing.join(0.3)
            assert changing.is_alive()  # (waiting for the rewrite)
        return records

    monkeypatch.setattr(Journal, "load", load_then_change)
    new = ConversationStore(8, 1 << 20, journal=str(path))
    for _ in range(200):
        if outcome:
            break
        time.sleep(0.05)
    assert len(outcome) == 1 and "taken over" in outcome[0], outcome
    assert [item["content"][0]["text"] for item in new.items(made["id"])] == ["hi"]
    assert len(old.items(made["id"])) == 1  # (refused before it was made)
    _stop(new)
    _stop(old)


def test_a_killed_store_process_lets_go_of_its_journal(tmp_path, monkeypatch, caplog):
    """The lock is the process's: a store in another process waits on it (here, past a short
    handover, then takes it over), and a process killed mid-run (as Serve kills a replica past
    its graceful stop, or it crashes) lets go at once."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "responses.jsonl"
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from specserve.serve.response_store import ResponseStore\n"
        f"store = ResponseStore(9, 1 << 20, journal={str(path)!r})\n"
        "store.put({'id': 'r0', 'status': 'completed', 'output': []}, [{'role': 'user', 'content': 'hi'}])\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        monkeypatch.setattr(journal_module, "HANDOVER_S", 0.2)
        with caplog.at_level("WARNING", logger="specserve.responses"):
            waited = ResponseStore(9, 1 << 20, journal=str(path))
        assert waited._journal.waited_s >= 0.2 and f"(pid {child.pid} on " in caplog.text
        _stop(waited)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        monkeypatch.setattr(journal_module, "HANDOVER_S", 10.0)
        again = ResponseStore(9, 1 << 20, journal=str(path))
        assert again._journal.waited_s < 1.0 and again.input_items("r0")[0]["content"] == "hi"
    finally:
        child.kill()
        child.wait(30)


def test_persist_dir_names_each_store_s_journal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = ResponsesConfig(persist_dir="state")
    assert config.journal("responses") == str(tmp_path / "state" / "responses.jsonl")
    assert config.journal("conversations") == str(tmp_path / "state" / "conversations.jsonl")
    assert ResponsesConfig().journal("responses") is None
    assert ResponsesConfig(persist_dir="state", store=False).journal("responses") is None


def test_over_http_a_restarted_server_goes_on_from_what_it_kept(tmp_path, monkeypatch):
    from test_responses_api import app_client
    from test_serve_api import MODEL, FakeCoordinator

    state = {"persist_dir": str(tmp_path / "state")}
    with app_client(FakeCoordinator(max_model_len=4096), monkeypatch, responses=state) as client:
        first = client.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 8}).json()
        conversation = client.post("/v1/conversations", json={"items": [
            {"type": "message", "role": "user", "content": "remember me"}], "metadata": {"k": "v"}}).json()
    from ray import serve

    stopped = serve.get_replica_context().servable_object  # (the routes' server: its stores let go, as at a stop)
    _stop(stopped._store._local)
    _stop(stopped._conversations._local)
    fake = FakeCoordinator(max_model_len=4096)
    with app_client(fake, monkeypatch, responses=state) as client:  # (a new server: new stores, same files)
        assert client.get(f"/v1/responses/{first['id']}").json() == first
        r = client.post("/v1/responses", json={"model": MODEL, "input": "again", "max_output_tokens": 8,
                                                 "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        assert b"hello" in bytes(t for t in fake.requests[-1].prompt_token_ids if t < 256)
        assert client.get(f"/v1/conversations/{conversation['id']}").json() == conversation
        items = client.get(f"/v1/conversations/{conversation['id']}/items").json()["data"]
        assert [item["content"][0]["text"] for item in items] == ["remember me"]
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        f"{store}.jsonl{lock}" for store in ("conversations", "responses") for lock in ("", ".changes", ".lock")]


def test_a_store_replica_that_serve_restarts_holds_what_it_held(server, tmp_path, monkeypatch):
    import asyncio

    import ray
    from ray import serve
    from serve_helpers import replica_actors

    from specserve.serve.response_store import ResponseStoreDeployment, StoreClient

    app = "journal-test"
    handle = serve.run(ResponseStoreDeployment.bind(8, 1 << 20, str(tmp_path / "responses.jsonl")), name=app,
                       route_prefix=None)
    try:
        said = [{"role": "user", "content": "hi"}]
        assert handle.put.remote({"id": "r0", "status": "completed", "output": []}, said).result() == "stored"
        (victim,) = replica_actors(app, "ResponseStore")
        ray.kill(victim, no_restart=True)
        # the ingress's read, asked right after the kill, is answered by the new replica: Serve's
        # router holds it until then, or it meets the lost replica and is asked again (within
        # STORE_RETRY_S: 20 s, here more, for a loaded machine)
        monkeypatch.setattr(response_store, "STORE_RETRY_S", 120.0)
        read = asyncio.run(StoreClient(handle, ResponsesConfig()).call("input_items", "r0", -1))
        assert read[0]["content"] == "hi"
        assert victim._actor_id not in {actor._actor_id for actor in replica_actors(app, "ResponseStore")}

        # a redeploy (other arguments: a new version) stops the old replica, then starts one
        # that waits for it to let go of the journal; it must neither wait forever nor miss a turn
        assert handle.put.remote({"id": "r1", "status": "completed", "output": []}, said, -1, "r0").result() == "stored"
        (old,) = replica_actors(app, "ResponseStore")
        handle = serve.run(ResponseStoreDeployment.bind(9, 1 << 20, str(tmp_path / "responses.jsonl")), name=app,
                           route_prefix=None)
        assert old._actor_id not in {actor._actor_id for actor in replica_actors(app, "ResponseStore")}
        assert [item["content"] for item in handle.conversation.remote("r1").result()] == ["hi", "hi"]
    finally:
        serve.delete(app)


def test_calls_from_many_threads_at_once_leave_each_store_whole(tmp_path):
    """Serve runs a deployment's sync methods on a pool of threads: many calls at once, switching
    threads as often as the interpreter allows, leave every count true and the journal reading
    back the same."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        path = tmp_path / "responses.jsonl"
        store = ResponseStore(50, 1 << 17, journal=str(path))
        conversations = ConversationStore(20, 1 << 16, journal=str(tmp_path / "conversations.jsonl"))
        failed = []

        def work(t: int) -> None:
            try:
                previous = None
                for k in range(150):
                    rid = f"t{t}r{k}"
                    store.put({"id": rid, "status": "completed", "output": []}, [{"role": "user", "content": "x" * 300}],
                              -1, previous)
                    previous = rid if k % 4 else None
                    store.get(f"t{(t + 1) % 6}r{k}")
                    store.conversation(rid)
                    if k % 7 == 0:
                        store.delete(f"t{t}r{k - 3}")
                    cid = conversations.create([{"type": "message", "role": "user", "content": "hi"}], {})
                    if isinstance(cid, dict):
                        conversations.append(cid["id"], [{"type": "message", "role": "user", "content": "y" * 200}])
            except Exception as err:  # (a race shows as an error, or as counts gone wrong below)
                failed.append(err)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failed, failed[:3]
    assert store._bytes == sum(link.size for link in store._links.values()) <= 1 << 17
    assert len(store) == len(store._shown) <= 50 and set(store._shown) <= set(store._links)
    assert conversations._bytes == sum(c.size for c in conversations._conversations.values())
    ids = list(store._shown)
    _stop(store)
    again = ResponseStore(50, 1 << 17, journal=str(path))
    assert [again.conversation(rid) for rid in ids] == [store.conversation(rid) for rid in ids]
