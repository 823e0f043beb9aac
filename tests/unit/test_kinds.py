"""The kind registry: every model.kind and data.kind names a builder that exists, the
schema offers exactly the registered kinds, and a kind's own rules are what the
config checks apply (the collector knows no kind by name)."""

from __future__ import annotations

import typing

import pytest

from train.core.config import Config, kinds, types
from train.core.config.checks import validate
from train.core.config.origins import Sources
from train.core.config.schema import DataConfig, ModelConfig
from train.core.errors import ConfigError
from train.models import losses


@pytest.mark.parametrize("kind", [*kinds.MODEL_KINDS.values(), *kinds.DATA_KINDS.values()],
                         ids=lambda k: f"{type(k).__name__}-{k.name}")
def test_every_kind_names_a_builder_that_exists(kind):
    assert callable(kinds.load_builder(kind.builder))


def test_the_schema_offers_exactly_the_registered_kinds():
    model_kind = {k.name: k for k in types.keys(ModelConfig)}["kind"]
    data_kind = {k.name: k for k in types.keys(DataConfig)}["kind"]
    assert typing.get_args(model_kind.type) == tuple(kinds.MODEL_KINDS)
    assert typing.get_args(data_kind.type) == tuple(kinds.DATA_KINDS)


def test_built_in_loss_names_match_the_loss_functions():
    assert losses.NAMES == kinds.BUILT_IN_LOSSES


def test_a_kinds_own_rules_are_what_validate_applies(monkeypatch):
    """A kind added to the registry alone is checked: its rules, its pairing with data."""
    def toy_rules(cfg, fail):
        if cfg.model.width > 8:
            fail("model.width", f"{kinds.val('model.width')} is too wide for a toy")
    monkeypatch.setitem(kinds.MODEL_KINDS, "toy", kinds.ModelKind(
        "toy", "train.models:mlp", toy_rules, data=("synthetic",)))
    cfg = Config()
    cfg.run.name = "toy"
    cfg.model.kind = "toy"
    with pytest.raises(ConfigError) as caught:
        validate(cfg, Sources("toy.yaml"))
    assert caught.value.one_line().splitlines() == [
        "error: toy.yaml: model.width: 128 (default) is too wide for a toy",
        "error: toy.yaml: data.kind: model.kind=toy (default) needs synthetic data, got text "
        "(default)"]
