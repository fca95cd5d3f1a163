"""The GPU benchmark runs on CPU with --tiny, imports nothing of Ray/FastAPI/pydantic, and its
controlled drafter really controls acceptance."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from models import tiny_llama
from specserve.bench import gpu
from specserve.engine import SamplingParams, SpeculativeEngine


def test_tiny_run_without_serving_imports(tmp_path):
    out = tmp_path / "gpu.json"
    script = textwrap.dedent(f"""
        import sys
        from specserve.bench import gpu
        assert gpu.main(["--tiny", "--sections", "random", "--alphas", "0.5,0.9", "--out", {str(out)!r}]) == 0
        leaked = {{m.split(".")[0] for m in sys.modules}} & {{"ray", "fastapi", "pydantic", "starlette"}}
        assert not leaked, leaked
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bound_v" in done.stdout and "eff." in done.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["gamma"] for r in rows} == {0, 2, 4, None} and {r["batch"] for r in rows} == {1, 4}
    assert all(r["identical"] for r in rows)  # lossless against the target-only run
    assert all(r.get("off_reference", 0) == 0 for r in rows)
    for r in rows:
        assert r["bound_v"] > 0 and r["speedup"] > 0 and r["c"] > 0
    anchors = {(a["batch"], a["anchor"].split(" (")[0]) for a in result["anchors"]}
    assert {(b, n) for b in (1, 4) for n in ("HF generate() eager", "bandwidth limit")} <= anchors
    assert all(a["identical"] in (True, None) for a in result["anchors"])  # HF's greedy tokens are the engine's


def test_smollm2_section_skips_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu, "_load_smollm2", lambda device, dtype: "FileNotFoundError: no checkpoint")
    assert gpu.main(["--tiny", "--sections", "smollm2", "--out", str(tmp_path / "g.json")]) == 0
    assert "smollm2 section skipped: FileNotFoundError: no checkpoint" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run many small ops: one thread is far faster than two on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run_controlled(alpha: float, gamma: int):
    target = gpu.random_llama("tiny-target", "cpu", torch.float32, seed=0, peaked=True)
    draft = tiny_llama(1, layers=1, vocab=512)
    prompts = [[5, 6, 7], [9, 9, 9, 9, 1]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = SpeculativeEngine(target, None, 0, eos_token_ids=[]).generate(prompts, params)
    ids = ["a", "b"]
    refs = {rid: p + o.token_ids for rid, p, o in zip(ids, prompts, base)}
    proposer = gpu.ControlledProposer(draft, alpha, refs, 512, seed=3)
    engine = SpeculativeEngine(target, num_speculative_tokens=gamma, adaptive=False, proposer=proposer,
                               eos_token_ids=[])
    seqs, _ = gpu.generate(engine, prompts, ids, 2, 24, "cpu")
    assert [s.output for s in seqs] == [o.token_ids for o in base]
    return seqs, proposer


def test_controlled_drafter_all_or_nothing():
    seqs, proposer = _run_controlled(1.0, 3)
    for s in seqs:  # every draft right: 4 tokens a step (3 drafts + bonus) until the length limit
        assert s.metrics.num_accepted_tokens == s.metrics.num_draft_tokens
        assert s.metrics.num_steps <= 24 // 4 + 1
    assert proposer.off_reference == 0
    seqs, _ = _run_controlled(0.0, 3)
    for s in seqs:  # every draft wrong: one token a step
        assert s.metrics.num_accepted_tokens == 0 and s.metrics.num_steps == 24


def test_controlled_drafter_hits_alpha():
    seqs, proposer = _run_controlled(0.6, 4)
    assert abs(proposer.planted / proposer.proposed - 0.6) < 0.15
    accepted = sum(s.metrics.num_accepted_tokens for s in seqs)
    rejections = sum(s.metrics.num_draft_steps - s.metrics.num_full_accept_steps for s in seqs)
    assert 0.3 < accepted / (accepted + rejections) < 0.85  # geometric MLE of α from ~20 steps
