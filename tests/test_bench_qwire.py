"""The q-crossing bench: a 16-bit q crosses in about half the bytes, and its rows are all there."""
import json

from specserve.bench import qwire


def test_a_bfloat16_q_crosses_in_half_the_bytes(tmp_path):
    out = tmp_path / "qwire.json"
    assert qwire.main(["--batches", "2,4", "--gammas", "1,3", "--vocab", "2000", "--warmup", "1", "--repeats", "2",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gamma"], r["batch"], r["dtype"]) for r in rows] == [
        (g, b, d) for g in (1, 3) for b in (2, 4) for d in ("float32", "bfloat16")]
    for wide, narrow in zip(rows[::2], rows[1::2]):
        q_bytes = 4 * wide["batch"] * wide["gamma"] * wide["vocab"]
        assert q_bytes < wide["bytes"] < q_bytes + 4096  # q, whole, and a small head
        assert q_bytes / 2 < narrow["bytes"] < q_bytes / 2 + 4096
        assert wide["draft_ms"] > 0 and narrow["target_ms"] > 0
