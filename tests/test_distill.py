"""`specserve distill` end to end on a tiny local checkpoint: data, training with a checkpoint,
a head a config can name, and a held-out report; a rerun resumes instead of starting over."""
import json

from specserve.cli import main
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.feature_drafter import FeatureDrafterSpec
from specserve.models.tiny import byte_tokenizer, tiny_llama


def test_distill_tiny_checkpoint(tmp_path):
    model_dir = tmp_path / "model"
    model = tiny_llama(0, layers=2, hidden_size=32)
    model.save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Tell me about item {i}." for i in range(8)) + "\n")
    text = tmp_path / "notes.txt"
    text.write_text("Speculative decoding drafts tokens and the target verifies them. " * 20)
    out = tmp_path / "head"
    args = ["distill", "--model", str(model_dir), "--out", str(out), "--no-default-prompts",
            "--prompts", str(prompts), "--text", str(text), "--max-new", "12", "--gen-batch", "4",
            "--draft-vocab", "64", "--time-budget", "2", "--batch-tokens", "256", "--threads", "1",
            "--eval-per-category", "1", "--eval-tokens", "8", "--eval-gamma", "2"]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["sequences"] > 8  # answers + text chunks
    assert report["training"]["steps"] > 0
    assert set(report["heldout"]) == {"chat", "code", "summarise"}
    assert all(r["identical"] for r in report["heldout"].values())
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and (out / "checkpoint.pt").is_file()

    # The output is a drafter: lossless in the engine.
    engine = SpeculativeEngine(model, drafter=FeatureDrafterSpec(str(out)), num_speculative_tokens=2, adaptive=False)
    prompt = list(b"hello there")
    got = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].token_ids
    alone = SpeculativeEngine(model, num_speculative_tokens=0).generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].token_ids
    assert got == alone

    # A rerun finds its data and its finished checkpoint: no new training steps.
    assert main(args[:-8] + ["--eval-per-category", "0"]) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["training"]["steps"] == report["training"]["steps"]
