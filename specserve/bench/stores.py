"""What a journal (`responses.persist_dir`) costs the stores, and what a restart costs.

    python -m specserve.bench.stores [--turns 2000] [--conversations 16] [--events 20] [--repeats 3]
        [--dir DIR] [--out bench-results/stores.json]

One workload, on a store in memory and on one with a journal, the two alternating repeat by
repeat: `--turns` responses put in `--conversations` chains (each ~2 KB of output, going on from
the chain's last), each read back (`get`, and `conversation` as a next turn does), a streamed
background response every 10 turns handed `--events` events (~230 bytes each, as the deltas
are) in 5 hand-overs and finished, and a Conversations API conversation per chain given each
turn's two items. Per operation, microseconds (median over its calls, best repeat) in memory
and with the journal, and their ratio. Then the restart: a store opened on the journal written
(read back, then written anew as a snapshot), its milliseconds, the bytes it holds and the
file's, and whether every response reads back as it was (`same`). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from specserve.bench import write_json
from specserve.serve.conversation_store import ConversationStore
from specserve.serve.response_store import ResponseStore

OPS = ("put", "get", "conversation", "hand_over", "finish", "conversation_append")


def workload(responses: ResponseStore, conversations: ConversationStore, args: argparse.Namespace) -> dict:
    """The bench's operations on these stores: op -> every call's microseconds."""
    took: dict[str, list[float]] = {op: [] for op in OPS}

    def timed(op: str, call, *call_args):
        began = time.perf_counter()
        answer = call(*call_args)
        took[op].append(1e6 * (time.perf_counter() - began))
        return answer

    last: list[str | None] = [None] * args.conversations
    cids = [conversations.create([], {"chain": str(c)})["id"] for c in range(args.conversations)]
    delta = "event: response.output_text.delta\ndata: " + "{\"delta\": \"abc\"}" * 12 + "\n\n"  # ~230 bytes
    for k in range(args.turns):
        chain = k % args.conversations
        said = {"type": "message", "id": f"msg_out{k}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": f"answer {k} " * 180, "annotations": []}]}
        asked = [{"type": "message", "role": "user", "content": f"question {k} " * 20}]
        rid = f"resp_{k}"
        timed("put", responses.put, {"id": rid, "status": "completed", "output": [said]}, asked, -1, last[chain])
        last[chain] = rid
        timed("get", responses.get, rid)
        timed("conversation", responses.conversation, rid)
        timed("conversation_append", conversations.append, cids[chain], asked + [said])
        if k % 10 == 0:
            streamed = f"resp_bg{k}"
            responses.put({"id": streamed, "background": True, "status": "in_progress", "output": []}, asked,
                          -1, None, True)
            for _ in range(5):
                timed("hand_over", responses.hand_over, {streamed: (-1, [delta] * (args.events // 5))})
            timed("finish", responses.finish, {"id": streamed, "background": True, "status": "completed",
                                               "output": [said]}, -1, [])
    return took


def restart(path: Path, args: argparse.Namespace, written: ResponseStore) -> dict:
    """A store opened on the journal `written` wrote, once that one has stopped (let go of it, as
    at a replica's stop): how long, what it holds, whether it reads back the same."""
    written.__del__()
    began = time.perf_counter()
    again = ResponseStore(args.turns * 2, 1 << 30, journal=str(path))
    ms = 1e3 * (time.perf_counter() - began)
    ids = list(written._shown)
    same = all(again.get(rid) == written.get(rid) and again.events(rid) == written.events(rid) for rid in ids)
    return {"read_back_ms": ms, "responses": len(again), "held_bytes": again._bytes,
            "file_bytes": path.stat().st_size, "same": same}


def measure(args: argparse.Namespace, folder: Path) -> tuple[list[dict], dict]:
    best: dict[str, dict[str, float]] = {"memory": {}, "journal": {}}
    last = None
    for repeat in range(args.repeats):
        for mode in ("memory", "journal"):
            run = folder / f"r{repeat}"
            run.mkdir(parents=True, exist_ok=True)
            journal = mode == "journal"
            responses = ResponseStore(args.turns * 2, 1 << 30, str(run / "responses.jsonl") if journal else None)
            conversations = ConversationStore(args.conversations, 1 << 30,
                                              str(run / "conversations.jsonl") if journal else None)
            for op, times in workload(responses, conversations, args).items():
                median = statistics.median(times)
                best[mode][op] = min(best[mode].get(op, median), median)
            if journal:
                last = restart(run / "responses.jsonl", args, responses)
    rows = [{"op": op, "memory_us": best["memory"][op], "journal_us": best["journal"][op],
             "ratio": best["journal"][op] / best["memory"][op]} for op in OPS]
    return rows, last


def table(rows: list[dict], back: dict) -> str:
    lines = ["| operation | memory µs | journal µs | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['memory_us']:.1f} | {r['journal_us']:.1f} | {r['ratio']:.2f} |" for r in rows]
    lines += ["", "| restart: responses | held MB | file MB | read back ms | same |", "|---|---|---|---|---|",
              f"| {back['responses']} | {back['held_bytes'] / 1e6:.1f} | {back['file_bytes'] / 1e6:.1f} | "
              f"{back['read_back_ms']:.0f} | {'yes' if back['same'] else 'NO'} |"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=2000)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where the journals go (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=Path("bench-results/stores.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specserve-stores-") as scratch:
        rows, back = measure(args, args.dir or Path(scratch))
    print(table(rows, back))
    write_json(args.out, args, rows=rows, restart=back)
    return 0 if back["same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
