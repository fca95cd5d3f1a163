"""The host-time bench: the engine in graph mode over graphs that replay for free."""
import json

import torch

from specserve.bench import host


def test_every_step_replays_graphs_captured_ahead(tmp_path):
    out = tmp_path / "host.json"
    args = ["--batches", "1,3", "--gammas", "0,3", "--layers", "2", "--draft-layers", "1", "--warmup", "4",
            "--steps", "12", "--threads", str(torch.get_num_threads()), "--out", str(out)]
    assert host.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gamma"], r["batch"]) for r in rows] == [(0, 1), (0, 3), (3, 1), (3, 3)]
    for r in rows:
        # one replay for the verify, one more for a draft's whole loop; nothing captured while timed
        assert r["replays_per_step"] == (2 if r["gamma"] else 1), r
        assert r["captured_while_timed"] == 0, r
        assert r["tokens_per_step"] >= r["batch"] and 0 < r["step_median_ms"] <= r["step_p90_ms"]
