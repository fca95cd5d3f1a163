"""The grammar bench: every setting of the drafts' masking gives the target alone's tokens, and
only the settings that may leave a mask out do."""
import json

from specserve.bench import grammar


def test_every_setting_gives_the_target_alone_s_tokens(tmp_path):
    out = tmp_path / "grammar.json"
    assert grammar.main(["--tiny", "--prompts", "2", "--max-tokens", "12", "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["grammar"], r["drafts"]) for r in rows] == [(g, s) for g in grammar.GRAMMARS for s in grammar.SETTINGS]
    assert all(r["same"] and r["tokens"] > 0 for r in rows)
    assert all(r["unmasked_calls"] == 0 for r in rows if r["drafts"] == "masked")
    assert all(r["unmasked_calls"] == 1 for r in rows if r["drafts"] == "free")


def test_the_batch_section_runs_its_three_settings_losslessly(tmp_path):
    out = tmp_path / "batch.json"
    assert grammar.main(["--section", "batch", "--tiny", "--device", "cpu", "--batch", "3", "--prompt-len", "8",
                         "--max-tokens", "10", "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["no grammar row", "one row masked", "one row unmasked"]
    assert all(r["same"] and r["step_ms"] > r["draft_ms"] > 0 for r in rows)
