"""The planted-acceptance drafter (specserve.engine.planted): α by construction at the draft's real
cost, references matched by content, nothing planted off them, outputs always the target's."""
import pytest
import torch

from models import tiny_llama
from specserve.bench import gpu
from specserve.engine import RowInput, SamplingParams, SpeculativeEngine
from specserve.engine.planted import OWN, PlantedProposer, read_references, write_references
from specserve.engine.proposers import branch_id
from specserve.engine.sampling import BatchSampling

GREEDY = BatchSampling.from_params([SamplingParams(temperature=0.0)])
VOCAB = 64


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run many small ops: one thread is far faster than two on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _proposer(alpha: float, references, **kw) -> PlantedProposer:
    return PlantedProposer(tiny_llama(1, vocab=VOCAB), VOCAB, alpha, references, seed=0, execution="eager", **kw)


def _reference(seed: int, length: int = 400) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_plants_alpha_only_on_the_reference():
    reference = _reference(0)
    proposer = _proposer(0.7, [_reference(9), reference])
    planted = 0
    for start in range(8, 300, 4):  # on the reference: drafts j = reference[end + j] with probability α
        drafts = proposer.propose([RowInput("r", 0, reference[:start])], 4, GREEDY, None).tokens[0].tolist()
        planted += sum(d == t for d, t in zip(drafts, reference[start:start + 4]))
        proposer.free("r")
    assert 0.6 < planted / (4 * len(range(8, 300, 4))) < 0.8
    assert proposer.counts.off_reference == 0 and proposer.counts.own == 0
    # a context that left the reference (a speculative token that was wrong): nothing is planted
    wrong = (reference[20] + 1) % VOCAB
    proposer.propose([RowInput("r", 0, reference[:20])], 3, GREEDY, None)
    drafts = proposer.propose([RowInput("r", 20, [wrong])], 4, GREEDY, None).tokens[0].tolist()
    assert all(d != t for d, t in zip(drafts, reference[21:25]))
    assert proposer.counts.off_reference == 4
    # rolled back onto the reference, it plants again
    hits = 0
    for _ in range(40):
        drafts = proposer.propose([RowInput("r", 20, [reference[20]])], 1, GREEDY, None).tokens[0].tolist()
        hits += drafts[0] == reference[21]
    assert hits > 15


def test_matches_by_content_whatever_the_ids_and_shares_prefixes():
    """Two references share a 10-token prefix: a request follows the one its tokens pick out."""
    first = _reference(1, 60)
    second = first[:10] + _reference(2, 50)
    proposer = _proposer(1.0, [first, second])
    proposer.prefill([RowInput("x", 0, second[:6])])  # a chunk both references hold
    drafts = proposer.propose([RowInput("x", 6, second[6:14])], 3, GREEDY, None).tokens[0].tolist()
    assert drafts == second[14:17]
    drafts = proposer.propose([RowInput("y", 0, first[:30])], 3, GREEDY, None).tokens[0].tolist()
    assert drafts == first[30:33]


def test_no_reference_or_sampled_rows_get_the_drafts_own_choice():
    model = tiny_llama(1, vocab=VOCAB)
    own = PlantedProposer(model, VOCAB, 1.0, [], execution="eager")
    plain = PlantedProposer(model, VOCAB, 1.0, [_reference(3)], execution="eager")
    prompt = _reference(4, 12)  # matches no reference
    mine = own.propose([RowInput("a", 0, prompt)], 4, GREEDY, None).tokens
    theirs = plain.propose([RowInput("a", 0, prompt)], 4, GREEDY, None).tokens
    assert torch.equal(mine, theirs) and plain.counts.own == 4 and plain.counts.proposed == 0
    # a sampled row on a reference: own choice, with q (the rejection rule needs the true q)
    reference = _reference(3)
    sampled = BatchSampling.from_params([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)])
    out = plain.propose([RowInput("g", 0, reference[:20]), RowInput("s", 0, reference[:20])], 3, sampled,
                        torch.rand(2, 3))
    assert out.tokens[0].tolist() == reference[20:23] and out.probs is not None
    assert plain.counts.own == 4 + 3


def test_runner_ups_and_forks():
    """Where a planted draft is wrong, its runner-up is the true token with probability `second`;
    a fork fed that token holds the reference again and plants; the request adopts it."""
    reference = _reference(2, 200)
    proposer = _proposer(0.0, [reference], second=1.0)
    out = proposer.propose([RowInput("r", 0, reference[:20])], 3, GREEDY, None, alternates=True)
    assert out.tokens[0, 0] != reference[20] and out.alternates[0, 0] == reference[20]
    proposer.fork("r", branch_id("r", 1), 20)
    proposer.alpha = 1.0
    fork = proposer.propose([RowInput(branch_id("r", 1), 20, [reference[20]])], 3, GREEDY, None, alternates=True)
    assert fork.tokens[0].tolist() == reference[21:24]
    proposer.adopt(branch_id("r", 1), "r")
    assert proposer.propose([RowInput("r", 23, [reference[23]])], 2, GREEDY, None).tokens[0].tolist() == \
        reference[24:26]


def test_plants_after_a_chunked_prefill():
    reference = _reference(1, 200)
    proposer = _proposer(1.0, [reference])
    proposer.prefill([RowInput("r", 0, reference[:10])])
    proposer.prefill([RowInput("r", 10, reference[10:23])])
    drafts = proposer.propose([RowInput("r", 23, [reference[23]])], 4, GREEDY, None).tokens[0].tolist()
    assert drafts == reference[24:28]


def test_references_file_round_trip(tmp_path):
    write_references(tmp_path / "refs.jsonl", [[1, 2, 3], [4, 5]])
    assert read_references(tmp_path / "refs.jsonl") == [[1, 2, 3], [4, 5]]
    assert OWN < 0


def _run_planted(alpha: float, gamma: int):
    target = gpu.random_llama("tiny-target", "cpu", torch.float32, seed=0, peaked=True)
    draft = tiny_llama(1, layers=1, vocab=512)
    prompts = [[5, 6, 7], [9, 9, 9, 9, 1]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = SpeculativeEngine(target, None, 0, eos_token_ids=[]).generate(prompts, params)
    proposer = PlantedProposer(draft, 512, alpha, [p + o.token_ids for p, o in zip(prompts, base)], seed=3)
    engine = SpeculativeEngine(target, num_speculative_tokens=gamma, adaptive=False, proposer=proposer,
                               eos_token_ids=[])
    seqs, _ = gpu.generate(engine, prompts, ["a", "b"], 2, 24, "cpu")
    assert [s.output for s in seqs] == [o.token_ids for o in base]  # lossless whatever is planted
    return seqs, proposer


def test_all_or_nothing_through_the_engine():
    seqs, proposer = _run_planted(1.0, 3)
    for s in seqs:  # every draft right: 4 tokens a step (3 drafts + bonus) until the length limit
        assert s.metrics.num_accepted_tokens == s.metrics.num_draft_tokens
        assert s.metrics.num_steps <= 24 // 4 + 1
    assert proposer.counts.off_reference == 0 and proposer.counts.own == 0
    seqs, _ = _run_planted(0.0, 3)
    for s in seqs:  # every draft wrong: one token a step
        assert s.metrics.num_accepted_tokens == 0 and s.metrics.num_steps == 24


def test_hits_alpha_through_the_engine():
    seqs, proposer = _run_planted(0.6, 4)
    assert abs(proposer.counts.planted / proposer.counts.proposed - 0.6) < 0.15
    accepted = sum(s.metrics.num_accepted_tokens for s in seqs)
    rejections = sum(s.metrics.num_draft_steps - s.metrics.num_full_accept_steps for s in seqs)
    assert 0.3 < accepted / (accepted + rejections) < 0.85  # geometric MLE of α from ~20 steps
