"""What a model returns and what the loss takes from it: logits as a tensor, a
ModelOutput-like mapping, a dict or a tuple; the model's own loss; and a model and loss
that do not fit, found on one sample before step 1 (exit 2, one line). In process, with
small modules; one real run of a model without logits. A GPT-2 from transformers across
processes: tests/e2e/test_hf_models_runs.py."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import pytest
import torch
from torch import nn

from tests.harness.runs import TINY_GPT, entry, installed, merge, read_metrics, write_config
from train.core.errors import CannotRunHere, ConfigError
from train.models.losses import Objective, logits_of

# fixed ids (up to 7: an embedding of 4 fails on them, one of 8 does not)
SAMPLE = (torch.tensor([[1, 7, 3, 0, 5]]), torch.tensor([[7, 3, 0, 5, 2]]))


class Output(OrderedDict):
    """Like transformers' ModelOutput: a mapping of the fields that are set, also
    readable as attributes."""

    def __getattr__(self, name):
        return self.get(name)


class Returns(nn.Module):
    """Token logits wrapped as ``form`` says (and a loss when given labels)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(8, 8)

    def forward(self, x, labels=None):
        logits = self.emb(x)
        loss = None if labels is None else nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten())
        return {"tensor": lambda: logits,
                "output": lambda: Output(loss=loss, logits=logits) if loss is not None
                else Output(logits=logits),
                "dict": lambda: {"logits": logits, "hidden": logits.detach()},
                "tuple": lambda: (logits, logits.detach()),
                "hidden": lambda: Output(last_hidden_state=logits),
                }[self.form]()


def check(model: nn.Module, loss: str = "cross_entropy") -> None:
    Objective(loss, "c.yaml").check(model, SAMPLE, contextlib.nullcontext, "model.factory")


@pytest.mark.parametrize("form", ["tensor", "output", "dict", "tuple"])
def test_each_form_of_logits_gives_the_same_loss(form):
    torch.manual_seed(0)
    plain = Returns("tensor")
    model = Returns(form)
    model.load_state_dict(plain.state_dict())
    check(model)
    x, y = SAMPLE
    expected, _ = Objective("cross_entropy", "c.yaml")(plain, x, y)
    loss, outputs = Objective("cross_entropy", "c.yaml")(model, x, y)
    assert torch.equal(loss, expected)
    assert torch.equal(logits_of(outputs), plain(x))


def test_the_models_own_loss_is_used_only_when_asked():
    model = Returns("output")
    check(model, "model")
    x, y = SAMPLE
    own, _ = Objective("model", "c.yaml")(model, x, y)
    ce, _ = Objective("cross_entropy", "c.yaml")(model, x, y)
    assert torch.allclose(own, ce)  # this model's own loss is cross entropy


def test_an_output_without_logits_names_what_the_model_returned():
    with pytest.raises(ConfigError) as err:
        check(Returns("hidden"))
    assert err.value.key == "train.loss"
    assert "cross_entropy needs the model's logits" in err.value.problem
    assert "the model returned Output(last_hidden_state=[1, 5, 8] float32)" in err.value.problem


def test_the_models_own_loss_needs_a_model_that_returns_one():
    with pytest.raises(ConfigError) as err:
        check(Returns("dict"), "model")
    assert "model needs its own loss as `loss`" in err.value.problem
    assert "dict(logits=[1, 5, 8] float32, hidden=[1, 5, 8] float32)" in err.value.problem


def test_a_model_that_takes_no_labels_cannot_compute_its_own_loss():
    with pytest.raises(ConfigError) as err:
        check(nn.Embedding(8, 8), "model")
    assert err.value.key == "train.loss" and "labels" in err.value.problem


def test_a_forward_that_fails_on_the_sample_names_the_model():
    with pytest.raises(ConfigError) as err:
        check(nn.Embedding(4, 8))  # token ids up to 7 in an embedding of 4
    assert err.value.key == "model.factory"
    assert "fails on training sample 0 (inputs [1, 5] int64): IndexError" in err.value.problem


class Fails(nn.Module):
    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def forward(self, x):
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access"),
                                   RuntimeError("NCCL error in: ...")])
def test_the_machines_errors_are_no_config_errors(error):
    """An accelerator's failure on the sample: not the config's fault, so not exit 2 (the
    worker's usual ending applies)."""
    with pytest.raises(type(error)):
        check(Fails(error))


class Allocates(nn.Module):
    """A forward that asks the allocator for more than any machine has (2^50 bytes)."""

    def forward(self, x):
        return torch.empty(1 << 50, dtype=torch.uint8)


@pytest.mark.parametrize("model", [Allocates(), Fails(torch.OutOfMemoryError("CUDA out of "
                                                                            "memory")),
                                   Fails(MemoryError())])
def test_out_of_memory_on_the_sample_is_exit_3_naming_what_to_change(model):
    """The documented code of a batch this machine cannot hold: 3, not 2 (bad input)."""
    with pytest.raises(CannotRunHere) as err:
        check(model)
    line = err.value.one_line()
    assert err.value.exit_code == 3 and "\n" not in line
    assert "runs out of memory on one training sample" in line and "precision=bf16" in line


def test_a_loss_without_a_gradient_or_not_a_scalar_is_refused(monkeypatch):
    import train.models.losses as losses
    for fn, words in ((lambda out, y: out.sum().detach(), "without a gradient"),
                      (lambda out, y: out.mean(-1), "tensor of one floating-point value")):
        monkeypatch.setattr(losses.usercode, "resolve", lambda *a, fn=fn: fn)
        with pytest.raises(ConfigError) as err:
            check(Returns("tensor"), "mine:loss")
        assert words in err.value.problem


def test_the_check_leaves_the_models_mode_and_draws_no_random_numbers():
    model = nn.Sequential(nn.Embedding(8, 8), nn.Dropout(0.5))
    state = torch.get_rng_state()
    check(model)
    assert model.training and torch.equal(torch.get_rng_state(), state)


def test_a_model_without_logits_is_exit_2_before_step_1(tmp_path):
    (tmp_path / "nets.py").write_text(
        "import torch\n\n"
        "class Hidden(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(256, 8)\n\n"
        "    def forward(self, x):\n"
        "        return {'last_hidden_state': self.emb(x)}\n")
    write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "model": {"kind": "custom", "factory": "nets:Hidden", "depth": 1},
        "output": {"dir": str(tmp_path / "runs")}}))
    out = entry("train", "c.yaml", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "error: c.yaml: train.loss: cross_entropy needs the model's logits (a tensor, a "
        "ModelOutput or dict with `logits`, or a tuple whose first item is the logits); the "
        "model returned dict(last_hidden_state=[1, 16, 8] float32)")
    metrics = tmp_path / "runs" / "c"
    assert not (metrics / "metrics.jsonl").exists() or not [
        row for row in read_metrics(metrics) if "loss" in row]


@pytest.mark.skipif(not installed("transformers"),
                    reason="transformers is not installed (make hf)")
def test_a_causal_lms_own_loss_on_its_inputs_equals_cross_entropy_on_the_next_tokens():
    """train.loss=model with labels = the inputs (the model shifts them) is the same
    objective as cross_entropy on its logits against the next tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256,
                                       n_positions=32, use_cache=False)).eval()
    tokens = torch.randint(0, 256, (2, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]
    own, _ = Objective("model", "c.yaml")(model, tokens, tokens)
    ce, outputs = Objective("cross_entropy", "c.yaml")(model, x, y)
    assert type(outputs).__name__ == "CausalLMOutputWithCrossAttentions"
    assert torch.allclose(own, ce, rtol=1e-5)


class Blk(nn.Linear):
    pass


class Hinted(nn.Module):
    """A model with Hugging Face's hint of its blocks, and no `blocks` attribute."""
    _no_split_modules = ("Blk",)

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(Blk(4, 4), Blk(4, 4))


def test_blocks_named_by_no_split_modules_are_found_also_when_recomputed():
    from train.distributed.parallel import (
        apply_activation_checkpointing,
        blocks_of,
        describe_blocks,
    )
    model = Hinted()
    assert describe_blocks(model) == "2 x Blk (by its _no_split_modules), then the rest of Hinted"
    assert apply_activation_checkpointing(model, "full", 1) == 2
    assert blocks_of(model) == list(model.layers)  # their class is now CheckpointedBlk
    assert describe_blocks(model).startswith("2 x Blk ")
    assert describe_blocks(nn.Linear(2, 2)).startswith("Linear as one unit")


@pytest.mark.parametrize("overrides, words", [
    (["train.loss=model"], "needs a model that computes one (model.kind custom or hf), got "
                           "model.kind=gpt"),
    (["train.loss=model", "model.kind=custom", "model.factory=nets:build"],
     "model with data.kind=text (c.yaml): its targets are the next tokens already"),
])
def test_the_models_own_loss_is_refused_where_it_cannot_be_right(tmp_path, overrides, words):
    """A built-in model has no loss of its own; a causal LM would shift text or tokens
    targets, which are the next tokens already, a second time."""
    from train.core.config import load_config
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}}))
    with pytest.raises(ConfigError) as err:
        load_config(str(config), overrides, source="c.yaml")
    assert err.value.key == "train.loss" and words in err.value.problem
