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
