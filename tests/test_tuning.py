"""Smoke test of the layer-skip tuner on a tiny model: it searches, writes its outputs, and the result loads."""
import json

import torch
import yaml

from specserve.config import LayerSkipDrafter, load_app_config
from specserve.engine.proposers import LayerSkipSpec
from specserve.tuning.layer_skip import main


def test_tune_layer_skip_tiny(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        code = main(["--model", "tiny", "--trials", "4", "--prompts", "2", "--max-new-tokens", "8", "--reps", "3",
                     "--threads", "1", "--out-dir", str(tmp_path), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    printed = capsys.readouterr().out
    assert "baseline" in printed and "tuned" in printed
    result = json.loads((tmp_path / "layer_skip.json").read_text())
    assert result["baseline"]["skip_layers"] == [1, 3, 5]  # every other layer of six, evaluated first
    assert 2 <= len(result["trials"]) <= 5  # the baseline + up to 4 search trials
    best = result["best"]
    assert best["bound"] >= result["baseline"]["bound"]
    assert 0.0 <= best["alpha"] <= 1.0 and best["c"] > 0
    snippet = yaml.safe_load((tmp_path / "layer_skip.yaml").read_text())
    # The snippet merges into a serve application's args and the app config takes it as it is.
    config = load_app_config({"served_model_name": "tiny", "target": {"kind": "tiny", "layers": 6}, **snippet})
    assert isinstance(config.drafter, LayerSkipDrafter)
    assert config.drafter.skip_layers == tuple(best["skip_layers"])
    assert config.speculation.num_speculative_tokens == best["best_gamma"]
    assert config.drafter.engine_spec() == LayerSkipSpec(tuple(best["skip_layers"]))
    assert (tmp_path / "layer_skip_trials.png").stat().st_size > 1000
