"""The q-crossing bench: a 16-bit q crosses in about half the bytes, a top-k q as its k entries a position."""
import json

from specserve.bench import qwire


def test_a_bfloat16_q_crosses_in_half_the_bytes_and_a_top_k_one_as_its_entries(tmp_path):
    out = tmp_path / "qwire.json"
    assert qwire.main(["--batches", "2,4", "--gammas", "1,3", "--vocab", "2000", "--top-k", "0,50", "--warmup", "1",
                       "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gamma"], r["batch"], r["top_k"], r["dtype"]) for r in rows] == [
        (g, b, k, d) for g in (1, 3) for b in (2, 4) for k in (0, 50) for d in ("float32", "bfloat16")]
    for wide, narrow in zip(rows[::2], rows[1::2]):
        entries = wide["batch"] * wide["gamma"] * (wide["top_k"] or wide["vocab"])
        index = 4 * entries if wide["top_k"] else 0  # a sparse q's token ids: int32
        assert 4 * entries + index < wide["bytes"] < 4 * entries + index + 4096  # q, and a small head
        assert 2 * entries + index < narrow["bytes"] < 2 * entries + index + 4096
        assert wide["draft_ms"] > 0 and narrow["target_ms"] > 0
