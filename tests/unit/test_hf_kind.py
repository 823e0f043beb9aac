"""model.kind hf: a transformers causal LM named by the config (a configuration class or
model_type with overrides, or a local pretrained directory), trained on the byte-level
text data, exported in the layout from_pretrained reads (sharded above
--max-shard-size), and sampled by generate. Bad values are one line naming the key before
anything starts; no transformers is exit 3 naming the extra. A real run (one process) and
the real export and generate commands; the checks in process.

Needs transformers (`make hf`); skipped without it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    entry,
    limit,
    merge,
    run_train,
    worker_env,
    write_config,
)
from tests.harness.runs import installed as has
from train.core.config import load_config
from train.core.errors import CannotRunHere, ConfigError

pytestmark = pytest.mark.skipif(not has("transformers"),
                                reason="transformers is not installed (make hf)")

GPT2 = {"config": "GPT2Config", "overrides": {"n_layer": 1, "n_embd": 32, "n_head": 2}}
TINY_HF = merge(TINY_GPT, {"model": {"kind": "hf", "args": GPT2}, "train": {"max_steps": 3}})


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "entrypoint.py", *map(str, args)], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=limit(180))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    config = write_config(root / "h.yaml", merge(TINY_HF, {"output": {"dir": str(root)}}))
    done = run_train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "h"


@pytest.fixture(scope="module")
def exported(run):
    """The run exported with shards of at most 100 KB (the model is ~215 KB)."""
    out = command("export", run, "--max-shard-size", "100KB")
    assert out.returncode == 0, out.stderr
    return run / "export"


def logits_of(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_from_pretrained_reads_the_export_and_computes_the_trained_models_logits(run, exported):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from train.export import load_model
    files = sorted(p.name for p in exported.iterdir())
    assert files == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.json",
                     "model.safetensors.index.json"]
    meta = json.loads((exported / "model.json").read_text())
    assert sorted(meta["files"]) == files and meta["step"] == 3
    # only the keys kind hf reads: none of the built-in gpt's depth/width/heads
    assert meta["model"] == {"kind": "hf", "args": GPT2, "context_length": 16}
    assert meta["io"]["transformers"] == "GPT2LMHeadModel"
    theirs = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    assert isinstance(theirs, GPT2LMHeadModel) and theirs.config.vocab_size == 256
    assert theirs.config.use_cache  # the training-only setting is not exported
    assert json.loads((exported / "generation_config.json").read_text()).get("use_cache", True)
    # the trained model: the checkpoint's own weights in a model of the run's architecture
    trained = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256))
    state = torch.load(run / "checkpoints" / "step-3" / "state.pt", weights_only=True)
    trained.load_state_dict(state["model"])
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = logits_of(trained.eval(), ids)
    assert torch.equal(logits_of(theirs, ids), expected)
    assert torch.equal(logits_of(load_model(exported), ids), expected)


def test_generate_samples_the_hf_models_likeliest_bytes(exported):
    from train.export import load_model
    out = command("generate", exported, "--prompt", "def ", "--tokens", 12, "--temperature", 0)
    assert out.returncode == 0, out.stderr
    model, ids = load_model(exported), list(b"def ")
    for _ in range(12):
        ids.append(int(logits_of(model, torch.tensor([ids[-16:]]))[0, -1].argmax()))
    assert out.stdout == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_a_second_export_replaces_the_shards_it_wrote(run, exported, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(exported, out)  # the sharded export, elsewhere
    whole = command("export", run, "--out", out)  # one file now: the shards go
    assert whole.returncode == 0, whole.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.json", "model.safetensors"]


def test_a_pretrained_directory_is_where_training_starts(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from train.core.config import ModelConfig
    from train.models.hf import build
    torch.manual_seed(1)
    saved = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300))
    saved.save_pretrained(tmp_path / "pre")
    model = build(ModelConfig(kind="hf", args={"pretrained": str(tmp_path / "pre")}),
                  input_shape=(16,), num_classes=256, source="c.yaml")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  saved.state_dict().values(), strict=True))
    assert not model.config.use_cache and next(model.parameters()).dtype == torch.float32


def test_a_truncated_pretrained_weights_file_is_one_line_naming_it(tmp_path):
    """Bad input (exit 2) naming the folder and the key, not a SafetensorError traceback."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from train.core.config import ModelConfig
    from train.models.hf import build
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(
        tmp_path / "pre")
    weights = tmp_path / "pre" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short, as by a failed copy
    with pytest.raises(ConfigError) as err:
        build(ModelConfig(kind="hf", args={"pretrained": str(tmp_path / "pre")}),
              input_shape=(16,), num_classes=256, source="c.yaml")
    line = err.value.one_line()
    assert line.startswith(f"error: c.yaml: model.args.pretrained: {tmp_path / 'pre'}: "
                           "from_pretrained failed: SafetensorError") and "\n" not in line
    assert err.value.exit_code == 2


def problem(tmp_path, *overrides: str) -> str:
    """The one line a config of kind hf with these overrides is refused with."""
    from train.core.user import usercode
    config = write_config(tmp_path / "c.yaml", merge(TINY_HF, {"output": {"dir": str(tmp_path)}}))
    with pytest.raises(ConfigError) as err:
        cfg = load_config(config, list(overrides))
        usercode.check(cfg, str(config), module=True)
    assert err.value.exit_code == 2
    return err.value.one_line().replace(str(tmp_path), "TMP")


@pytest.mark.parametrize("overrides, line", [
    (["model.args.config=GTP2Config"], "error: command line: model.args.config: 'GTP2Config' "
     "is no transformers configuration class or model_type (e.g. GPT2Config or gpt2), nor a "
     "directory holding config.json; did you mean GPT2Config?"),
    (["model.args.overrides.n_lyer=2"], "error: command line: model.args.overrides.n_lyer: "
     "GPT2Config has no field 'n_lyer'; did you mean n_layer?"),
    (["model.args.config=null", "model.args.pretrained=TMP/none"], "error: command line: "
     "model.args.pretrained: TMP/none: no such directory (only local directories are read; "
     "nothing is downloaded)"),
    (["model.args.pretrained=TMP"], "error: command line: model.args: model.kind=hf needs "
     "exactly one of model.args.config (a configuration class such as GPT2Config, its "
     "model_type such as gpt2, or a directory with config.json) and model.args.pretrained (a "
     "local from_pretrained directory); got 2"),
    (["model.args.overrides.vocab_size=200"], "error: command line: "
     "model.args.overrides.vocab_size: the model has 200 token ids, the data 256 "
     "(data.kind=text): ids from 200 on would have no logit; make them agree "
     "(model.args.overrides)"),
    (["model.context_length=2048"], "error: command line: model.context_length: 2048 tokens, "
     "but GPT2Config takes at most 1024 positions; lower it or raise the model's "
     "(model.args.overrides)"),
    (["model.args.overrides.n_embd=31"], "error: command line: model.args.overrides: no "
     "causal LM builds from this GPT2Config: ValueError: `embed_dim` must be divisible by "
     "num_heads (got `embed_dim`: 31 and `num_heads`: 2)."),
])
def test_a_bad_value_is_one_line_naming_the_key(tmp_path, overrides, line):
    overrides = [o.replace("TMP", str(tmp_path)) for o in overrides]
    assert line in problem(tmp_path, *overrides).splitlines()  # with any others, one a line


def test_the_launcher_refuses_a_bad_value_before_any_worker_starts(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_HF, {"output": {"dir": str(tmp_path)}}))
    out = entry("train", config, "model.args.overrides.n_lyer=2", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "error: command line: model.args.overrides.n_lyer: GPT2Config has no field 'n_lyer'; "
        "did you mean n_layer?")
    assert "Traceback" not in out.stderr and not (tmp_path / "c").exists()


def test_without_transformers_kind_hf_is_exit_3_naming_the_extra(tmp_path, monkeypatch):
    from train.core.user import usercode
    config = write_config(tmp_path / "c.yaml", TINY_HF)
    cfg = load_config(config)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(CannotRunHere) as err:
        usercode.check(cfg, str(config), module=True)
    assert err.value.exit_code == 3
    assert err.value.one_line() == (
        "error: transformers is not installed here; model.kind hf needs it: pip install "
        "'trainpod[hf]' (in a checkout: make hf)")


def test_a_configuration_directory_gets_the_datas_vocabulary_and_the_overrides(tmp_path):
    """config: a directory holding config.json (GPT-2's defaults but 3 layers): random
    init from it, the data's 256 symbols, the override on top; its special token ids,
    beyond 256 symbols, unset. A pretrained directory without weights is refused."""
    from transformers import GPT2Config

    from train.core.config.hf_kind import model_config
    GPT2Config(n_layer=3, n_embd=32, n_head=2).save_pretrained(tmp_path / "arch")
    tree = merge(TINY_HF, {})
    tree["model"]["args"] = {"config": str(tmp_path / "arch"), "overrides": {"n_head": 4}}
    config = write_config(tmp_path / "c.yaml", tree)
    made = model_config(load_config(config), str(config))
    assert (made.n_layer, made.n_embd, made.n_head, made.vocab_size) == (3, 32, 4, 256)
    assert made.bos_token_id is None and made.eos_token_id is None and not made.use_cache
    line = problem(tmp_path, "model.args.config=null",
                   f"model.args.pretrained={tmp_path / 'arch'}")
    assert line == ("error: command line: model.args.pretrained: TMP/arch: no weights in it "
                    "(model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
                    "pytorch_model.bin.index.json); for a configuration alone, use "
                    "model.args.config")


# A tiny Llama: LlamaConfig derives head_dim (hidden_size // heads: 16) in its constructor
LLAMA = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 256}


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_overrides_build_the_model_their_configuration_class_builds(tmp_path):
    """The overrides go to the class's constructor, as LlamaConfig(**overrides): the
    fields it derives follow them (not the default's head_dim of 128), also for a
    config.json that does not fix them."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from train.core.config import ModelConfig
    from train.models.hf import build
    theirs = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA))
    ours = build(ModelConfig(kind="hf", args={"config": "LlamaConfig", "overrides": LLAMA}),
                 input_shape=(16,), num_classes=256, source="c.yaml")
    assert ours.config.head_dim == theirs.config.head_dim == 16
    assert parameters(ours) == parameters(theirs) == 115_008
    folder = tmp_path / "arch"  # hand-written: no head_dim, 256 wide
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 256,
                                                    "num_attention_heads": 4}))
    ours = build(ModelConfig(kind="hf", args={"config": str(folder), "overrides": LLAMA}),
                 input_shape=(16,), num_classes=256, source="c.yaml")
    assert ours.config.head_dim == 16 and parameters(ours) == parameters(theirs)
    assert not ours.config.use_cache  # training's setting, given to the constructor too


def test_overrides_the_configuration_class_refuses_are_one_line_naming_the_key(tmp_path):
    from train.core.user import usercode
    tree = merge(TINY_HF, {})
    tree["model"]["args"] = {"config": "LlamaConfig", "overrides": {**LLAMA, "hidden_size": 30}}
    config = write_config(tmp_path / "c.yaml", tree)
    with pytest.raises(ConfigError) as err:
        usercode.check(load_config(config), str(config), module=True)
    line = err.value.one_line().replace(str(tmp_path), "TMP")
    assert line.startswith("error: TMP/c.yaml: model.args.overrides: LlamaConfig refuses "
                           "them: "), line
    assert "The hidden size (30) is not a multiple of the number of attention heads (4)" in line


def test_the_export_keeps_the_cache_on_and_takes_the_tokenizers_special_ids(tmp_path):
    """Training turns the key/value cache off; neither config.json nor
    generation_config.json keeps that. The tokenizer's ids replace Llama's 1 and 2, but
    for those the overrides set."""
    from train.core.config import ModelConfig
    from train.models.hf import build, save_pretrained
    section = {"kind": "hf", "args": {"config": "LlamaConfig",
                                      "overrides": {**LLAMA, "pad_token_id": 7}}}
    model = build(ModelConfig(**section), input_shape=(16,), num_classes=256, source="c.yaml")
    assert not model.config.use_cache and not model.generation_config.use_cache
    save_pretrained(model, model.state_dict(), tmp_path, "5GB", section,
                    {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 5})
    config = json.loads((tmp_path / "config.json").read_text())
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert config["use_cache"] and generation.get("use_cache", True)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        None, 0, 7)
    assert generation.get("bos_token_id") is None and generation["eos_token_id"] == 0
    assert generation.get("pad_token_id") == 7


def test_a_run_checkpointed_before_overrides_went_to_the_constructor_exports_as_trained(
        tmp_path, capsys):
    """Its LlamaConfig kept the default's head_dim (128): the export rebuilds that model,
    says so, and from_pretrained reads it with the checkpoint's weights."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from train.export.layout import write_pretrained
    from train.models.hf import rebuild
    section = {"kind": "hf", "args": {"config": "LlamaConfig", "overrides": LLAMA},
               "context_length": 16}
    io = {"transformers": "LlamaForCausalLM", "num_classes": 256}
    old = rebuild(section, io, "c.yaml", legacy=True)
    assert old.config.head_dim == 128
    saved = SimpleNamespace(config={"model": section, "data": {"kind": "text"}}, model_io=io)
    assert "config.json" in write_pretrained(tmp_path, saved, old.state_dict(), None, "c.yaml")
    assert "exported as it was trained, the fields it derives left at the defaults' " \
           "(head_dim 128); a new run of this config builds LlamaConfig(**overrides)" in \
           capsys.readouterr().err
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert theirs.config.head_dim == 128
    assert all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(),
                                                  old.state_dict().values(), strict=True))
