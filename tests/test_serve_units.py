"""Serving pieces that need no Ray cluster: config validation, detokenisation, stop strings."""
from pathlib import Path

import pydantic
import pytest
import yaml

from specserve.config import load_app_config
from specserve.serve.text import IncrementalDetokenizer, StopStrings
from specserve.models.tiny import byte_tokenizer

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_validates_and_builds(path):
    from specserve.serve.app import build_app

    for app in yaml.safe_load(path.read_text())["applications"]:
        config = load_app_config(app["args"])
        assert len(config.coordinator_bundles()) == (3 if config.draft is not None else 2)
        build_app(app["args"])


@pytest.mark.parametrize("bad", [
    {"served_model_name": "x", "target": {"kind": "tiny"}},  # γ = 4 by default, no draft
    {"served_model_name": "x", "target": {"kind": "nope"}},
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}, "max_batch_size": 0},
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}, "typo": 1},
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"},
     "coordinator": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
])
def test_bad_config_is_rejected(bad):
    with pytest.raises(pydantic.ValidationError):
        load_app_config(bad)


def test_custom_resources_join_the_bundles_and_the_actor_options():
    from specserve.serve.app import _options

    base = {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}}
    config = load_app_config({**base, "target_worker": {"num_cpus": 0.2, "custom": {"gpu_node_a": 1}},
                              "draft_worker": {"num_gpus": 1, "custom": {"accelerator_type:H100": 0.001, "z": 0}},
                              "ingress": {"resources": {"num_cpus": 0.1, "custom": {"edge": 1}}}})
    assert config.coordinator_bundles()[1:] == [{"CPU": 0.2, "gpu_node_a": 1.0},
                                                 {"CPU": 0.25, "GPU": 1.0, "accelerator_type:H100": 0.001}]
    assert _options(config.ingress)["ray_actor_options"]["resources"] == {"edge": 1.0}
    assert "resources" not in _options(config.coordinator)["ray_actor_options"]
    for bad in [{"GPU": 1}, {"cpu": 1}, {"memory": 1}, {"object_store_memory": 1}, {"": 1}, {"a": -1},
                {"a": float("nan")}, {"a": float("inf")}, {"a": "lots"}]:
        with pytest.raises(pydantic.ValidationError):
            load_app_config({**base, "draft_worker": {"custom": bad}})


def test_incremental_detokenizer_never_splits_a_character():
    tok = byte_tokenizer()
    text = "héllo → 你好 🙂 done"
    ids = tok(text).input_ids
    detok = IncrementalDetokenizer(tok, tok("prompt: ").input_ids)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings_hold_back_and_cut():
    stops = StopStrings(["END", "xyz"])
    out = [stops.feed(t, False) for t in ["abc E", "N", "D tail"]]
    assert "".join(o for o, _ in out) == "abc " and out[-1][1] is True
    plain = StopStrings(["zzz"])
    assert plain.feed("abcz", False) == ("ab", False) and plain.feed("", True) == ("cz", False)


def test_drafter_config_is_either_a_draft_model_or_a_colocated_drafter():
    from specserve.config import AppConfig
    from specserve.engine.proposers import LayerSkipSpec, PromptLookupSpec

    base = {"served_model_name": "m", "target": {"kind": "tiny"}}
    lookup = AppConfig.model_validate({**base, "drafter": {"kind": "prompt_lookup", "min_n": 2, "max_n": 4}})
    assert lookup.drafter.engine_spec() == PromptLookupSpec(2, 4) and len(lookup.coordinator_bundles()) == 2
    skip = AppConfig.model_validate({**base, "drafter": {"kind": "layer_skip", "skip_layers": [3, 1]}})
    assert skip.drafter.engine_spec() == LayerSkipSpec((1, 3))
    with_draft = AppConfig.model_validate({**base, "draft": {"kind": "tiny", "noise": 0.1}})
    assert len(with_draft.coordinator_bundles()) == 3
    for bad in ({"draft": {"kind": "tiny"}, "drafter": {"kind": "prompt_lookup"}},
                {"drafter": {"kind": "prompt_lookup", "min_n": 3, "max_n": 2}},
                {"drafter": {"kind": "layer_skip", "skip_layers": []}},
                {"drafter": {"kind": "medusa"}}):
        with pytest.raises(ValueError):
            AppConfig.model_validate({**base, **bad})


def test_a_public_bind_needs_a_key(monkeypatch):
    from specserve.cli import main, unauthenticated_public

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    app = {"name": "a", "args": {}}
    public = {"http_options": {"host": "0.0.0.0"}, "applications": [app]}
    assert unauthenticated_public(public) == ["a"]
    assert unauthenticated_public({**public, "http_options": {"host": "127.0.0.1"}}) == []
    assert unauthenticated_public({**public, "http_options": {"host": "::1"}}) == []
    assert unauthenticated_public(public, allow=True) == []
    assert unauthenticated_public({**public, "applications": [{"name": "a", "args": {"api_key": "k"}}]}) == []
    opt_out = {"name": "a", "args": {"front_door": {"allow_unauthenticated_public": True}}}
    assert unauthenticated_public({**public, "applications": [opt_out]}) == []
    monkeypatch.setenv("SPECSERVE_API_KEY", "k")
    assert unauthenticated_public(public) == []
    monkeypatch.delenv("SPECSERVE_API_KEY")
    # the CLI refuses before starting anything
    path = Path(__file__).resolve().parent / "_public.yaml"
    path.write_text(yaml.safe_dump(public))
    try:
        assert main(["serve", str(path)]) == 2
    finally:
        path.unlink()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_bind_loopback_or_require_a_key(path):
    from specserve.serve.front_door import is_loopback

    spec = yaml.safe_load(path.read_text())
    if not is_loopback(spec.get("http_options", {}).get("host", "127.0.0.1")):
        for app in spec["applications"]:
            assert load_app_config(app["args"]).front_door.require_api_key, app["name"]
