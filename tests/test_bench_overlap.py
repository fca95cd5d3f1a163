"""specserve bench overlap: its bounds are the cost models', its draft calibration converges."""
import pytest

from specserve.bench import overlap
from specserve.bench.overlap import bound, ceilings, next_layers


def test_bounds():
    # sequential: E / (γc + v); pipelined: E / (max(v, (γ+1)c) + (1 - α^(γ+1)) γc)
    assert bound("sequential", 0.8, 2, 0.5, 1.0) == pytest.approx(2.44 / 2.0)
    assert bound("pipelined", 0.8, 1, 0.5, 1.0) == pytest.approx(1.8 / (1.0 + 0.36 * 0.5))
    assert bound("target-only", 0.8, 0, 0.5, 1.0) == 1.0
    assert bound("oracle", 0.8, 1, 0.5, 1.0) == pytest.approx(1.8 / 1.0)  # every prepared block used
    # a branch at the first draft, runner-up right half the time: used 0.64 + 0.5 x 0.2 of the steps
    branch = overlap.Branching(1, 0.5)
    assert bound("pipelined-branches", 0.8, 1, 0.5, 1.0, branch) == pytest.approx(1.8 / (1.0 + 0.26 * 0.5))
    dear = overlap.Branching(1, 0.5, {1: 1.0, 2: 1.2})  # two draft rows cost 1.2 of one: the ahead call leads
    assert bound("pipelined-branches", 0.8, 1, 0.5, 1.0, dear) == pytest.approx(1.8 / (1.2 + 0.26 * 0.5))
    assert bound("pipelined", 0.8, 1, 0.5, 1.0, branch) == bound("pipelined", 0.8, 1, 0.5, 1.0)


def test_ceilings_at_the_issues_pair():
    # α 0.8, c 0.5, v 1: sequential best 2.44 / 2 (γ 2); one branch 1.8 / 1.18 (γ 1); foreseen 1.8 (γ 1)
    most = ceilings(0.8, 0.5, 1.0)
    assert most["one_branch"] == pytest.approx((1.8 / 1.18) / 1.22, abs=1e-3)
    assert most["every_verdict_foreseen"] == pytest.approx(1.8 / 1.22, abs=1e-3)


def test_draft_depth_moves_towards_the_wanted_cost():
    assert next_layers(3, 0.5, 0.52, 8) is None  # within 10%
    assert next_layers(3, 0.5, 0.75, 8) == 2  # too dear: shallower (by the ratio, at least one layer)
    assert next_layers(4, 0.5, 0.25, 8) == 8  # too cheap: deeper
    assert next_layers(2, 0.2, 0.25, 8) == 1
    assert next_layers(1, 0.2, 0.4, 8) is None  # cannot get shallower
    assert next_layers(8, 0.5, 0.3, 8) is None  # nor deeper


def test_a_pair_without_a_planted_draft_probes_once(monkeypatch):
    """The tiny pair has no draft shape to calibrate: its probe runs once and returns as it is
    (it used to unpack the missing shape and crash `bench overlap --quick`)."""
    import types

    from specserve.bench import overlap

    runs = []
    monkeypatch.setattr(overlap, "app_config", lambda *args, **kwargs: args)
    monkeypatch.setattr(overlap, "run_config", lambda *args: runs.append(args) or (None, None, {"c": 0.3}))
    bar = types.SimpleNamespace(update=lambda: None, refresh=lambda: None, total=0)
    probe, workers, shape = overlap.probe_pair(["request"], None, None, True, None, None, (None, 0), bar)
    assert probe == {"c": 0.3} and workers is None and shape is None and len(runs) == 1


def test_rounds_merge_into_medians_with_the_speedups_range():
    from specserve.bench.overlap import Row, merge_rounds

    def row(speedup: float, coord: float, identical: bool = True, hit: float | None = 0.6) -> Row:
        return Row("p", "pipelined", 1, False, 0.8, 0.8, 0.5, 1.1, 96, 1.0, 90.0 * speedup, speedup, 1.5, 0.0, hit,
                   None if hit is None else hit / 2, 2.0, 4.0, coord, 3.0, "compiled_graph", identical)

    merged = merge_rounds([row(1.2, 0.9), row(1.5, 2.0, hit=0.7), row(1.3, 1.1, hit=None)])
    assert merged.speedup == 1.3 and merged.coordination_p50_ms == 1.1 and merged.tokens_per_s == 117.0
    assert (merged.speedup_min, merged.speedup_max, merged.repeats) == (1.2, 1.5, 3)
    assert merged.efficiency == round(1.3 / 1.5, 3) and merged.hit_rate == 0.65 and merged.identical
    assert merged.branch_hit_rate == 0.325
    assert not merge_rounds([row(1.2, 0.9), row(1.3, 1.0, identical=False)]).identical
    assert merge_rounds([row(1.2, 0.9)]).repeats == 1


def test_pairs_are_parsed_and_checked():
    assert overlap.parse_pairs("0.3:0.5") == [(0.3, 0.5)]
    assert overlap.parse_pairs("0.6:0.2,0.8:0.5") == [(0.6, 0.2), (0.8, 0.5)]
    for bad in ("0.3", "0.3:0.5:1", "a:0.5", "1.0:0.5", "0.3:0", "0.3:1.5", ""):
        with pytest.raises(ValueError):
            overlap.parse_pairs(bad)
    with pytest.raises(SystemExit) as exit_:
        overlap.main(["--pairs", "0.3"])  # refused before any work
    assert exit_.value.code == 2


def test_a_ratio_above_the_one_branch_ceiling_is_flagged_with_both_modes_costs():
    from specserve.bench.overlap import Row, above_ceiling

    def row(mode: str, c: float, v: float, speedup: float) -> Row:
        return Row("p", mode, 1, False, 0.8, 0.8, c, v, 96, 1.0, 90.0, speedup, 1.5, speedup / 1.5, None, None,
                   2.0, 4.0, 2.0, 3.0, "compiled_graph", True)

    rows = [row("sequential", 0.6, 1.3, 0.9), row("pipelined", 0.45, 1.0, 1.2), row("pipelined-branches", 0.5, 1.1, 1.3)]
    branching = {"p": overlap.Branching(1, 0.5)}
    most = ceilings(0.8, 0.45, 1.0, branching=branching["p"])
    assert most["with_branches"] > most["one_branch"]
    assert above_ceiling(rows, {"p": {"pipelined": [most["one_branch"] - 0.01]}}) == {}
    flagged = above_ceiling(rows, {"p": {"pipelined": [most["one_branch"] + 0.1, most["one_branch"] + 0.2,
                                                       most["one_branch"] - 0.5]}})  # median above
    assert "c 0.6, v 1.3" in flagged["p"] and "c 0.45, v 1.0" in flagged["p"]
    # a branched ratio is held to its own, higher ceiling
    between = (most["one_branch"] + most["with_branches"]) / 2
    assert above_ceiling(rows, {"p": {"pipelined-branches": [between]}}, branching) == {}
    flagged = above_ceiling(rows, {"p": {"pipelined-branches": [most["with_branches"] + 0.05]}}, branching)
    assert "c 0.5, v 1.1" in flagged["p"]
