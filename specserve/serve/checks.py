"""What a request's body may hold, checked against the server's limits and the model: the lists and
strings a client controls, token ids against the vocabulary, and the engine's SamplingParams built
from it. Pure functions (the ingress passes the config and the model's figures): every failure is
an OpenAIError, a 400 naming the parameter."""
from __future__ import annotations

from pydantic import ValidationError

from specserve.config import FimConfig, FrontDoorConfig
from specserve.engine.grammar import Grammar
from specserve.engine.sampling import MAX_PREDICTION_TOKENS, SamplingParams

from .front_door import OpenAIError, check_unicode
from .schema import ChatCompletionRequest, SamplingRequest


def refuse(bad: list[tuple[str, str]]) -> None:
    """A 400 naming the first (param, why) of `bad`, if any."""
    if bad:
        param, why = bad[0]
        raise OpenAIError(400, why, param, "unsupported_parameter")


def check_limits(body: SamplingRequest, front: FrontDoorConfig) -> None:
    """The lists and strings a client controls (the prompt's size is the ingress's pre-check)."""
    stops = body.stop_list()
    if len(stops) > front.max_stop_sequences:
        raise OpenAIError(400, f"at most {front.max_stop_sequences} stop sequences", "stop", "too_many_stop_sequences")
    for stop in stops:
        if len(stop) > front.max_stop_chars:
            raise OpenAIError(400, f"a stop sequence may have at most {front.max_stop_chars} characters", "stop",
                              "stop_sequence_too_long")
        check_unicode(stop, "stop")
    if body.logit_bias is not None and len(body.logit_bias) > front.max_logit_bias_entries:
        raise OpenAIError(400, f"at most {front.max_logit_bias_entries} logit_bias entries", "logit_bias")
    if body.stop_token_ids is not None and len(body.stop_token_ids) > front.max_stop_sequences:
        raise OpenAIError(400, f"at most {front.max_stop_sequences} stop_token_ids", "stop_token_ids")
    if len(body.bad_words or []) > front.max_stop_sequences:
        raise OpenAIError(400, f"at most {front.max_stop_sequences} bad_words", "bad_words")
    for word in body.bad_words or []:
        if not word.strip() or len(word) > front.max_stop_chars:
            raise OpenAIError(400, f"a bad word has 1 to {front.max_stop_chars} characters, not only spaces",
                              "bad_words")
        check_unicode(word, "bad_words")


def logit_bias_ids(body: SamplingRequest, vocab: int) -> dict[int, float]:
    """logit_bias's keys as token ids of the model's vocabulary (OpenAI sends them as strings)."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().isdigit() or int(key) >= vocab:
            raise OpenAIError(400, f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
        bias[int(key)] = value
    return bias


def token_ids(ids: list[int] | None, param: str, vocab: int) -> tuple[int, ...] | None:
    """A list of token ids a request sends (a prompt, stop_token_ids, allowed_token_ids), checked
    against the model's vocabulary (None for none)."""
    if not ids:
        return None
    if min(ids) < 0 or max(ids) >= vocab:
        raise OpenAIError(400, f"{param} must be token ids in [0, {vocab})", param)
    return tuple(ids)


def kept_tokens(body: SamplingRequest, context: int) -> int | None:
    """truncate_prompt_tokens as a count (-1: the model's context); None: no truncation."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return None
    if keep == 0 or keep > context:
        raise OpenAIError(400, f"truncate_prompt_tokens must be -1 or in [1, {context}]", "truncate_prompt_tokens")
    return context if keep == -1 else keep


def sampling_params(body: SamplingRequest, max_tokens: int, vocab: int, grammar: Grammar | None,
                    bad_words: tuple[tuple[int, ...], ...],
                    prediction: tuple[int, ...] | None = None) -> SamplingParams:
    """The engine's parameters for one generation of `body` (its ids checked against the vocabulary;
    `bad_words` and `prediction` already tokenized)."""
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=max(body.top_k, 0),
                              top_p=body.top_p, min_p=body.min_p, seed=body.seed, ignore_eos=body.ignore_eos,
                              presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                              repetition_penalty=body.repetition_penalty, logit_bias=logit_bias_ids(body, vocab),
                              logprobs=body.logprobs_wanted(), grammar=grammar, min_tokens=body.min_tokens,
                              stop_token_ids=token_ids(body.stop_token_ids, "stop_token_ids", vocab) or (),
                              allowed_token_ids=token_ids(body.allowed_token_ids, "allowed_token_ids", vocab),
                              bad_words_ids=bad_words, prediction=prediction)
    except ValueError as err:  # the engine's own checks: a client error, never a 500
        named = str(err).split(maxsplit=1)[0]  # (the engine's messages start with the field's name)
        raise OpenAIError(400, str(err), named if named in type(body).model_fields else None) from err


def prediction_ids(tokenizer, body: SamplingRequest, context: int, vocab: int) -> tuple[int, ...] | None:
    """`prediction` as token ids (its text tokenized without special tokens, or its ids checked
    against the vocabulary; None for none or an empty one); one longer than the model's context
    could never be followed to its end, and is refused."""
    if body.prediction is None:
        return None
    if body.prediction.type == "token_ids":
        ids = token_ids(body.prediction.token_ids, "prediction.token_ids", vocab) or ()
    else:
        text = body.prediction.text()
        check_unicode(text, "prediction")
        if len(text) > 64 * context:  # (no tokenizer packs 64 characters into one token)
            raise OpenAIError(400, f"prediction is longer than the model's context of {context} tokens", "prediction")
        ids = tuple(tokenizer(text, add_special_tokens=False).input_ids)
    if len(ids) > min(context, MAX_PREDICTION_TOKENS):
        raise OpenAIError(400, f"prediction holds {len(ids)} tokens, more than the model's context of "
                               f"{min(context, MAX_PREDICTION_TOKENS)}", "prediction")
    return ids or None


def fill_in_the_middle(fim: FimConfig | None, prompts: list, suffix: str) -> list[str]:
    """Text prompts with the text after the cursor, in the model's FIM order and tokens (config
    `fim`; None: refused)."""
    if fim is None:
        raise OpenAIError(400, "suffix: this server's model does not fill in the middle (its config has no fim)",
                          "suffix")
    if not all(isinstance(p, str) for p in prompts):
        raise OpenAIError(400, "suffix needs text prompts, not token ids", "suffix")
    if fim.order == "spm":
        return [f"{fim.prefix}{fim.suffix}{suffix}{fim.middle}{p}" for p in prompts]
    return [f"{fim.prefix}{p}{fim.suffix}{suffix}{fim.middle}" for p in prompts]


def as_chat(body: dict, params: dict[str, str], fallback: str) -> ChatCompletionRequest:
    """Another API's request, translated to a chat body, validated as a chat request; a field it
    refuses is a 400 naming the other API's parameter (`params`: chat's name -> the other's)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        loc = [str(x) for x in err.errors()[0].get("loc", ())]
        param = params.get(loc[0], loc[0]) if loc else fallback
        raise OpenAIError(400, f"{param}: {err.errors()[0].get('msg', 'invalid request')}", param) from None
