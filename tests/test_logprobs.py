"""Log-probabilities of generated tokens (SamplingParams.logprobs): every emitted token's (accepted
draft, recovered or bonus alike) and its top-k alternatives equal a one-forward reference over the
final sequence within 1e-4, through every drafter, greedy, sampled and under penalties; the tokens
themselves are unchanged by asking."""
from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams, SpeculativeEngine
from test_drafters import prompts
from test_feature_drafter import target
from test_processing import drafter, processed_naively

K = 3
ROWS = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=K),
    SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),  # asks for none
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=5, presence_penalty=1.0,
                   logit_bias={5: 3.0}),
]


def reference(prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """[len(out), V] log-probabilities at each generated position, from one forward."""
    with torch.no_grad():
        logits = target()(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    rows = [processed_naively(logits[j], prompt, out[:j], p) for j in range(len(out))]
    scale = p.temperature if p.temperature > 0 else 1.0
    return torch.log_softmax(torch.stack(rows) / scale, dim=-1)


@pytest.mark.parametrize("name", ["draft-model", "feature-head", "layer-skip", "prompt-lookup"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_logprobs_equal_a_one_forward_reference(name, gamma, head_dir):
    batch = prompts(len(ROWS), seed=11)
    engine = SpeculativeEngine(target(), proposer=drafter(name, head_dir), num_speculative_tokens=gamma,
                               adaptive=False)
    outs = engine.generate(batch, ROWS)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    for prompt, p, out in zip(batch, ROWS, outs):
        if p.logprobs is None:
            assert out.logprobs is None and out.top_logprobs is None
            continue
        ref = reference(prompt, out.token_ids, p)  # [N, V]
        chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), chosen, atol=1e-4), (name, p)
        for j, alternatives in enumerate(out.top_logprobs):
            assert len(alternatives) == p.logprobs
            top = ref[j].topk(p.logprobs)
            assert [t for t, _ in alternatives] == top.indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in alternatives], dtype=torch.float64), top.values,
                                  atol=1e-4)
        if p.temperature == 0:  # greedy: each token is its position's likeliest
            assert all(lp >= alternatives[0][1] - 1e-6 for lp, alternatives in zip(out.logprobs, out.top_logprobs))


def test_asking_for_logprobs_changes_no_token():
    batch = prompts(len(ROWS), seed=11)
    plain = [SamplingParams(**{**p.__dict__, "logprobs": None}) for p in ROWS]
    with_lp = SpeculativeEngine(target(), proposer=drafter("draft-model", None), num_speculative_tokens=3,
                                adaptive=False).generate(batch, ROWS)
    without = SpeculativeEngine(target(), proposer=drafter("draft-model", None), num_speculative_tokens=3,
                                adaptive=False).generate(batch, plain)
    assert [o.token_ids for o in with_lp] == [o.token_ids for o in without]
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("chunk", [3, 256])
def test_prompt_logprobs_equal_a_full_forward_chunk_by_chunk(chunk):
    """echo's prompt scores: the first token has none; every other token's, and its alternatives,
    equal the full forward's, whatever the chunk the output head is applied in."""
    from specserve.engine.verifier import prompt_logprobs

    model, tokens = target(), [5, 17, 40, 3, 9, 11, 2, 60, 61]
    scored = prompt_logprobs(model, tokens, 2, chunk=chunk)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    assert scored[0] is None and len(scored) == len(tokens)
    for j in range(1, len(tokens)):
        value, alternatives = scored[j]
        assert abs(value - ref[j - 1, tokens[j]].item()) < 1e-4
        assert [t for t, _ in alternatives] == ref[j - 1].topk(2).indices.tolist()
