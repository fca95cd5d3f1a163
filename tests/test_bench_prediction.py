"""`specserve bench prediction --model tiny` runs end to end on CPU: every method, outputs equal to
the target alone's, and a JSON report whose rows say what the table says."""
import json

from specserve.bench import prediction


def test_tiny_run_reports_every_method(tmp_path, capsys):
    out = tmp_path / "prediction.json"
    code = prediction.main(["--model", "tiny", "--max-tokens", "24", "--gamma", "4", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    methods = [r["method"] for r in report["rows"]]
    assert methods == ["target only"] + [f"{d}{p}" for d in ("prompt lookup", "predictions alone")
                                         for p in ("", " + original", " + near answer")]
    assert all(r["identical"] and r["tokens"] > 0 for r in report["rows"])
    assert report["rows"][1]["predicted"] == 0 and report["rows"][0]["speedup"] == 1.0
    for near in (report["rows"][3], report["rows"][6]):
        assert near["predicted_accepted"] > 0.5 * near["predicted"] and near["steps"] < report["rows"][0]["steps"]
    alone = report["rows"][4]  # no prediction, nothing else drafts: a token a step, no draft
    assert alone["steps"] == report["rows"][0]["steps"] and alone["drafted"] == 0
    assert "predictions alone + near answer" in capsys.readouterr().out
