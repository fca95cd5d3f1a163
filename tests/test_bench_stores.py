"""The stores bench: every operation measured in memory and with a journal, and a restart that reads back the same."""
import json

from specserve.bench import stores


def test_the_stores_bench_measures_each_operation_and_a_restart_that_reads_back_the_same(tmp_path):
    out = tmp_path / "stores.json"
    assert stores.main(["--turns", "40", "--conversations", "4", "--repeats", "1", "--dir", str(tmp_path / "j"),
                        "--out", str(out)]) == 0
    found = json.loads(out.read_text())
    assert [row["op"] for row in found["rows"]] == list(stores.OPS)
    assert all(row["memory_us"] > 0 and row["journal_us"] > 0 for row in found["rows"])
    back = found["restart"]
    assert back["same"] and back["responses"] == 40 + 4  # (every turn, and a streamed one every 10)
    assert back["file_bytes"] >= back["held_bytes"] > 0
