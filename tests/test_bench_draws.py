"""The draws bench: inverse-CDF draws flip far more often than Gumbel-max ones when logits move a little."""
import json

from specserve.bench import draws


def test_inverse_cdf_draws_flip_more_than_gumbel_max_and_both_are_timed(tmp_path):
    out = tmp_path / "draws.json"
    assert draws.main(["--source", "random", "--vocab", "3000", "--positions", "4", "--noise", "1e-4",
                       "--uniforms", "4000", "--gumbel-draws", "400", "--batches", "1,3", "--repeats", "2",
                       "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    engine, wide, gumbel = (r["flips"] for r in result["flips"])
    assert engine > 0.01 and wide > 0.01 and gumbel < engine / 5
    assert [r["batch"] for r in result["costs"]] == [1, 3]
    assert all(r["engine_ms"] > 0 and r["gumbel_ms"] > 0 for r in result["costs"])


def test_keyed_gumbel_draws_follow_the_distribution():
    """A keyed draw is a sample of p: frequencies over 100k draws within a few standard errors."""
    import torch

    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(2.0 * torch.randn(1, 12, generator=gen), -1)  # [1, V]
    offsets = torch.arange(1, 13, dtype=torch.long) * draws.GOLDEN
    uniforms = torch.rand(100_000, dtype=torch.float64, generator=gen)
    tokens = draws.keyed_gumbel(probs.expand(100_000, -1), uniforms, offsets)
    freq = torch.bincount(tokens, minlength=12).double() / 100_000
    p = probs[0].double()
    assert ((freq - p).abs() < 5 * (p * (1 - p) / 100_000).sqrt() + 1e-4).all()
