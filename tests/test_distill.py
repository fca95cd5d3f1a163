"""`specserve distill` end to end on a tiny local checkpoint: data, training with a checkpoint,
a head a config can name, and a held-out report; a rerun resumes instead of starting over."""
import json

import pytest

from specserve.cli import main
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.feature_drafter import FeatureDrafterSpec
from specserve.models.tiny import byte_tokenizer, tiny_llama


def tiny_checkpoint(tmp_path, layers: int, prompts: list[str]):
    """(model, its checkpoint dir, a prompt file): a tiny Llama saved as a local HF checkpoint."""
    model_dir = tmp_path / "model"
    model = tiny_llama(0, layers=layers, hidden_size=32)
    model.save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return model, model_dir, path


def assert_drafts_losslessly(model, head_dir, gamma: int, prompt: bytes, tokens: int) -> None:
    engine = SpeculativeEngine(model, drafter=FeatureDrafterSpec(str(head_dir)), num_speculative_tokens=gamma,
                               adaptive=False)
    got = engine.generate([list(prompt)], SamplingParams(max_tokens=tokens, temperature=0.0))[0].token_ids
    alone = SpeculativeEngine(model, num_speculative_tokens=0).generate(
        [list(prompt)], SamplingParams(max_tokens=tokens, temperature=0.0))[0].token_ids
    assert got == alone


def test_distill_tiny_checkpoint(tmp_path):
    model, model_dir, prompts = tiny_checkpoint(tmp_path, 2, [f"Tell me about item {i}." for i in range(8)])
    text = tmp_path / "notes.txt"
    text.write_text("Speculative decoding drafts tokens and the target verifies them. " * 20)
    out = tmp_path / "head"
    args = ["distill", "--model", str(model_dir), "--out", str(out), "--no-default-prompts",
            "--prompts", str(prompts), "--text", str(text), "--max-new", "12", "--gen-batch", "4",
            "--answer-repeat", "2", "--draft-vocab", "64", "--time-budget", "2", "--batch-tokens", "256",
            "--threads", "1",
            "--eval-per-category", "1", "--eval-tokens", "8", "--eval-gamma", "2"]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["sequences"] > 8  # answers + text chunks
    assert report["training"]["steps"] > 0
    assert set(report["heldout"]) == {"chat", "code", "summarise"}
    assert all(r["identical"] for r in report["heldout"].values())
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and (out / "checkpoint.pt").is_file()

    assert_drafts_losslessly(model, out, 2, b"hello there", 10)  # the output is a drafter: lossless

    # A rerun finds its data and its finished checkpoint: no new training steps.
    assert main(args[:-8] + ["--eval-per-category", "0"]) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["training"]["steps"] == report["training"]["steps"]


def test_local_text_files_leave_out_held_out_code_and_text(tmp_path, monkeypatch):
    import random

    from specserve.distill import data
    from specserve.distill.data import PromptRecord, local_text_files

    stdlib, purelib = tmp_path / "lib", tmp_path / "site"
    (purelib / "pkg-1.0.dist-info").mkdir(parents=True)
    stdlib.mkdir()
    body = "x = 1\n" * 60
    (stdlib / "fine.py").write_text("def parse_args(argv):\n    return argv\n" + body)
    (stdlib / "banned.py").write_text("def fibonacci(n):\n    return n\n" + body)
    (purelib / "mod.py").write_text("class Stack :\n    pass\n" + body)
    (purelib / "README.md").write_text("A guide to the package and its options. " * 10)
    (purelib / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\n\nWhy is the sky blue? Answer in two "
                                                            "sentences. " + "More words here. " * 20)
    (stdlib / "tiny.py").write_text("y = 2\n")  # too short to teach anything
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib), "purelib": str(purelib)})
    held = [PromptRecord('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False),
            PromptRecord("class Stack:\n    def __init__(self):\n", False),
            PromptRecord("Why is the sky blue? Answer in two sentences.", True)]
    files = local_text_files(random.Random(0), held)
    assert sorted(p.name for p in files) == ["README.md", "fine.py"]
    assert [p.suffix for p in files] == [".py", ".md"]  # code and prose alternate


def test_label_text_caps_tokens_per_file_and_warm_start_keeps_layer(tmp_path):
    import torch

    from specserve.distill.data import label_text, load_shards
    from specserve.distill.train import choose_draft_vocab, init_head, warm_start

    model = tiny_llama(0, layers=2, hidden_size=32)
    text = tmp_path / "a.txt"
    text.write_text("abcdefgh" * 100)  # 800 byte tokens
    rows = load_shards(label_text(model, byte_tokenizer(), [text], tmp_path / "d", chunk=64, batch_size=4,
                                  max_tokens=200))
    assert [len(r["ids"]) for r in rows] == [64, 64, 64]  # the 8-token tail is dropped
    assert rows[0]["ids"].tolist() == list(b"abcdefgh" * 8)

    vocab = model.get_output_embeddings().weight.shape[0]
    source = init_head(model, choose_draft_vocab(rows, 64, vocab))
    with torch.no_grad():
        source.fc.weight.add_(1.0)
    head = init_head(model, choose_draft_vocab(rows, 32, vocab))
    warm_start(head, source)
    assert torch.equal(head.fc.weight, source.fc.weight)
    assert head.lm_head.weight.shape[0] == 32  # its own draft vocabulary's rows
    assert torch.equal(head.lm_head.weight, model.get_output_embeddings().weight[head.draft_token_map])
    wider = init_head(tiny_llama(0, layers=2, hidden_size=48), choose_draft_vocab(rows, 32, vocab))
    with pytest.raises(ValueError, match="shaped differently"):
        warm_start(wider, source)


def test_eagle3_head_trains_on_the_answers_of_an_earlier_run(tmp_path, monkeypatch):
    """A fused-layer (EAGLE-3) head distils from the answers a final-norm run already generated
    (only the features are made anew), trains with its soft labels from the final norm, feeds its
    own output back directly, and drafts losslessly."""
    import torch

    from specserve.distill import data

    model, model_dir, prompts = tiny_checkpoint(tmp_path, 6, [f"Say something about {i}." for i in range(6)])
    common = ["distill", "--model", str(model_dir), "--no-default-prompts", "--prompts", str(prompts),
              "--data-dir", str(tmp_path / "data"), "--max-new", "10", "--gen-batch", "3", "--label-tokens", "64",
              "--draft-vocab", "64", "--batch-tokens", "256", "--threads", "1", "--eval-per-category", "0"]
    assert main(common + ["--out", str(tmp_path / "plain"), "--data-only"]) == 0
    answers = sorted(p.name for p in (tmp_path / "data").glob("answers-*.pt"))
    assert len(answers) == 2  # one per batch of three prompts

    def no_generation(*args, **kwargs):
        raise AssertionError("the answers were generated again")

    monkeypatch.setattr(data, "answer_batch", no_generation)
    out = tmp_path / "fused"
    assert main(common + ["--out", str(out), "--eagle3-features", "--time-budget", "30", "--ttt-steps", "3"]) == 0
    assert sorted(p.name for p in (tmp_path / "data").glob("answers-*.pt")) == answers
    config = json.loads((out / "config.json").read_text())
    assert config["specserve"]["feature_layers"] == [1, 2, 2] and config["specserve"]["feedback"] == "direct"
    assert config["specserve"]["training"]["steps"] > 0

    rows = [torch.load(p)[0] for p in (tmp_path / "data").glob("file-prompts-*.pt")]
    row = next(r for r in rows if r["features"].shape[1] == 96)  # three fused layers of 32
    assert row["final"].shape == (len(row["ids"]), 32)  # the teacher's input beside the fused features

    # With no prompts of its own, --all-shards trains on what the data dir holds for its layers.
    alone = [a for a in common if a not in ("--prompts", str(prompts))]
    assert main(alone + ["--out", str(tmp_path / "again"), "--all-shards", "--time-budget", "2"]) == 0
    assert json.loads((tmp_path / "again" / "report.json").read_text())["data"]["sequences"] == 6
    assert main(alone + ["--out", str(tmp_path / "none"), "--time-budget", "2"]) == 2  # no data at all

    assert_drafts_losslessly(model, out, 3, b"tell me more", 12)


def test_labelling_in_bounded_groups_equals_one_forward():
    import torch

    from specserve.distill.data import FeatureCapture, label_batch

    model = tiny_llama(0, layers=2, hidden_size=32)
    seqs = [list(range(5, 5 + n)) for n in (7, 30, 12, 3, 25)]
    capture = FeatureCapture(model)
    try:
        whole = label_batch(model, capture, seqs, max_tokens=10_000)
        grouped = label_batch(model, capture, seqs, max_tokens=40)  # 30 x 2 > 40: groups of one or two
    finally:
        capture.remove()
    assert [len(r["ids"]) for r in grouped] == [7, 30, 12, 3, 25]
    for a, b in zip(whole, grouped):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["argmax"], b["argmax"])
        torch.testing.assert_close(a["features"], b["features"], atol=2e-3, rtol=2e-3)


def test_self_instruct_keeps_whole_new_prompts_only(tmp_path, monkeypatch):
    """The target's own prompts: a cut-off one, a repeat, a too-short one and one overlapping a
    held-out prompt are dropped; the rest are saved and read back on a rerun."""
    from specserve.distill import data
    from specserve.distill.data import PromptRecord, self_instruct_prompts

    tok = byte_tokenizer()
    template = tok.apply_chat_template([{"role": "user", "content": "\x00PROMPT\x00"}], tokenize=False,
                                       add_generation_prompt=True)
    end = tok(template.split("\x00PROMPT\x00")[1], add_special_tokens=False)["input_ids"][0]
    written = ["How do tides work on the open ocean?", "Explain why the sky is blue at noon and red at dusk",
               "How do tides work on the open ocean?", "Hi", "Name three rivers in Europe, please."]
    calls = []

    def fake_answers(model, tokenizer, prompts, max_new, temperature, eos_ids=None):
        calls.append(len(prompts))
        assert end in eos_ids and temperature == 0.9
        out = [list(w.encode()) + [end] for w in written]
        out[-1] = out[-1][:-1]  # cut off by max_new: not a whole prompt
        return out[: len(prompts)]

    monkeypatch.setattr(data, "answer_batch", fake_answers)
    held = [PromptRecord("Why is the sky blue at noon and red at dusk? Answer in two sentences.", True)]
    path = tmp_path / "self.jsonl"
    got = self_instruct_prompts(None, tok, 10, seed=0, batch_size=5, held_out=held, path=path)
    prompts = [r.prompt for r in got]
    assert len(prompts) == 1 and prompts[0].endswith("How do tides work on the open ocean?")
    assert all(r.chat for r in got)
    assert len(calls) == 4 * (10 // 5 + 1)  # it keeps asking, within its bound, for more
    again = self_instruct_prompts(None, tok, 10, seed=0, batch_size=5, held_out=held, path=path)
    assert again == got and len(calls) == 12  # read back, nothing generated


def test_self_summaries_wrap_the_targets_own_prose_only(tmp_path):
    """Summarise prompts over earlier answers: cut after the last whole sentence; code, lists,
    too short, held-out overlaps and the summary set's own answers are left out."""
    import random

    import torch

    from specserve.distill.data import SUMMARY_TASKS, PromptRecord, self_summary_prompts

    tok = byte_tokenizer()
    prose = ("Tides rise and fall twice a day because the moon pulls on the oceans. The sun adds a smaller pull, "
             "so the highest tides come when both line up. Coastal towns plan harbours, fishing and walks around "
             "these rhythms, which repeat about every twelve hours and twenty five minutes. Then the answer was cut")
    held_prose = ("The Great Barrier Reef is the world's largest coral reef system, stretching over 2,300 "
                  "kilometres off the coast of Queensland, and many other words follow here to make it long enough "
                  "for the filter that wants at least two hundred and fifty characters of plain prose. It ends.")
    code = "Here is code:\n```python\nprint(1)\n```\n" + prose
    listing = "Steps:\n1. Do this.\n2. Do that.\n" + prose
    answers = [([1, 2], list(t.encode())) for t in (prose, code, listing, "Too short. Really.", held_prose)]
    torch.save(answers, tmp_path / "answers-self-abc.pt")
    torch.save([([1], list(("Summary text that is long enough to pass. " * 10).encode()))],
               tmp_path / "answers-self-summary-def.pt")
    held = [PromptRecord("Summarise this paragraph in one sentence:\n\n" + held_prose, True)]
    got = self_summary_prompts(tok, tmp_path, 10, random.Random(0), held)
    assert len(got) == 1 and got[0].chat
    kept = got[0].prompt
    assert any(kept.startswith(task.split("{}")[0]) for task in SUMMARY_TASKS)
    assert kept.endswith("twenty five minutes.") and "Tides rise" in kept


def test_a_batch_out_of_gpu_memory_is_done_in_halves(tmp_path, monkeypatch):
    """Answering and labelling a batch that runs out of GPU memory: each half is done in turn,
    down to single sequences, and the shard holds every sequence, in order, as one batch gives;
    a single sequence that does not fit still raises."""
    import torch

    from specserve.distill import data
    from specserve.distill.data import PromptRecord, generate_shards, in_halves

    model = tiny_llama(0, layers=2, hidden_size=32)
    tok = byte_tokenizer()
    records = [PromptRecord(f"prompt number {i} " + "x" * i, False) for i in range(5)]
    real_answers, real_label = data.answer_batch, data._label_group
    sizes = []

    def small_answers(model, tokenizer, prompts, *args, **kwargs):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real_answers(model, tokenizer, prompts, *args, **kwargs)

    def small_label(model, capture, seqs, final):
        if len(seqs) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real_label(model, capture, seqs, final)

    kwargs = dict(max_new=6, temperature=0.0, batch_size=5, seed=0, tag="t")
    whole = data.load_shards(generate_shards(model, tok, records, tmp_path / "whole", **kwargs))
    monkeypatch.setattr(data, "answer_batch", small_answers)
    monkeypatch.setattr(data, "_label_group", small_label)
    halves = data.load_shards(generate_shards(model, tok, records, tmp_path / "halves", **kwargs))
    assert sizes == [5, 2, 3, 1, 2]  # 5 fails; 2 fits; 3 fails, then 1 and 2 fit
    assert len(halves) == len(whole) == 5
    for a, b in zip(whole, halves):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["argmax"], b["argmax"])
        assert a["prompt_len"] == b["prompt_len"]
        torch.testing.assert_close(a["features"], b["features"], atol=2e-3, rtol=2e-3)

    tried = []

    def never_fits(part):
        tried.append(len(part))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        in_halves(never_fits, [1, 2, 3])
    assert tried == [3, 1]  # split once, then the first single item raises
    assert in_halves(lambda part: [x * 2 for x in part], [1, 2, 3]) == [2, 4, 6]
