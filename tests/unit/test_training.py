"""Training behaviour with real processes: determinism, world-size invariance, metrics.
The quick start as users run it: tests/e2e/test_training_runs.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    TINY_MLP,
    losses,
    merge,
    read_metrics,
    run_train,
    write_config,
)

STEPS = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same 20-step fp32 run three times: twice on 1 process, once on 2 (torchrun)."""
    base = tmp_path_factory.mktemp("runs")
    tree = merge(TINY_GPT, {"output": {"dir": str(base)}, "deterministic": True,
                            "train": {"max_steps": STEPS}, "checkpoint": {"every_steps": 5}})
    config = write_config(base / "tiny.yaml", tree)
    out = {}
    for name, nproc in (("one_a", 1), ("one_b", 1), ("two", 2)):
        proc = run_train(config, f"run.name={name}", nproc=nproc)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        out[name] = base / name
    return out


def test_same_seed_gives_bitwise_identical_losses(runs):
    a, b = losses(runs["one_a"]), losses(runs["one_b"])
    assert len(a) == STEPS
    assert a == b


def test_one_and_two_processes_follow_the_same_trajectory(runs):
    one, two = losses(runs["one_a"]), losses(runs["two"])
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert math.isclose(one[step], two[step], rel_tol=1e-5), (step, one[step], two[step])
    manifest = json.loads((runs["two"] / "manifest.json").read_text())
    assert manifest["starts"][-1]["world_size"] == 2


def test_loss_falls(runs):
    series = losses(runs["one_a"])
    assert series[STEPS] < 0.8 * series[1]


def tensorboard_run(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(path), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_opens_on_train_and_val_loss_in_one_chart(runs):
    """Both TensorBoard runs (tb/train, tb/val) hold the tag `loss`, so TensorBoard draws
    them in one chart; it orders tag groups by name, and `loss` sorts before the others."""
    train, val = (tensorboard_run(runs["one_a"] / "tb" / name) for name in ("train", "val"))
    scalars = {e.step: e.value for e in train.Scalars("loss")}
    expected = losses(runs["one_a"])
    assert sorted(scalars) == sorted(expected)
    for step, value in expected.items():
        assert math.isclose(scalars[step], value, rel_tol=1e-6)
    result = json.loads((runs["one_a"] / "result.json").read_text())
    val_loss = val.Scalars("loss")
    assert val_loss[-1].step == STEPS and math.isclose(val_loss[-1].value, result["val/loss"],
                                                       rel_tol=1e-6)
    tags = train.Tags()["scalars"] + val.Tags()["scalars"]
    assert min(tags) == "loss" and all(t == "loss" or "/" in t for t in tags), tags
    assert "config/text_summary" in train.Tags()["tensors"]


def test_tensorboard_hparams_keep_types_and_put_model_first(runs):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata
    val = EventAccumulator(str(runs["one_a"] / "tb" / "val"))  # TensorBoard's own reader
    val.Reload()
    content = val.PluginTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    start = metadata.parse_session_start_info_plugin_data(
        content[metadata.SESSION_START_INFO_TAG])
    metric_tags = [m.name.tag for m in experiment.metric_infos]  # the val run's own series
    assert metric_tags[0] == "loss" and set(metric_tags) == set(
        tensorboard_run(runs["one_a"] / "tb" / "val").Tags()["scalars"])
    names = [h.name for h in experiment.hparam_infos]
    assert names[0].startswith("model.") and names.index("optim.lr") < names.index("seed")
    config = yaml.safe_load((runs["one_a"] / "config.yaml").read_text())
    assert start.hparams["deterministic"].WhichOneof("kind") == "bool_value"
    assert start.hparams["deterministic"].bool_value is config["deterministic"]
    assert start.hparams["optim.lr"].number_value == config["optim"]["lr"]
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.STATUS_SUCCESS


def test_run_directory_layout(runs):
    run = runs["one_a"]
    manifest = json.loads((run / "manifest.json").read_text())
    for key in ("config_sha256", "data_sha256", "code_version", "software", "seed", "starts"):
        assert key in manifest
    assert manifest["software"]["torch"].startswith("2.")
    assert (run / "config.yaml").read_text().startswith("seed: 0")
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS}"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step-10", "step-15", "step-20"], "checkpoint.keep_last defaults to 3"
    rows = read_metrics(run)
    assert {"step", "loss", "lr", "grad_norm", "throughput"} <= set(rows[0])
    assert any("val/loss" in r for r in rows)


def test_readme_states_the_recorded_quickstart_measurement():
    """The quick start's promises are the numbers bench/quickstart.py recorded (and the
    machine they came from), so README and measurement cannot drift apart."""
    recorded = json.loads((ROOT / "bench" / "quickstart.json").read_text())
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## Commands")]
    assert f"{recorded['steps']} steps in {recorded['wall_s']:.0f} s" in quick
    assert f"({recorded['step_time_ms'] / 1000:.2f} s a" in quick
    assert f"loss {recorded['first_loss']:.2f} at step {recorded['first_step']}" in quick
    assert f"{recorded['final_loss']:.2f} at step {recorded['steps']}" in quick
    assert f"validation {recorded['val_loss']}" in quick
    cpus = recorded["machine"].split()[0]
    assert f"{cpus}-core" in quick and recorded["machine"].split("Python ")[1][:4] in quick


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, precision):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "precision": precision}))
    proc = run_train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = losses(tmp_path / "c")
    assert all(math.isfinite(v) for v in series.values())
    assert series[10] < series[1]


def test_cnn_with_loader_workers_and_accumulation(tmp_path):
    config = write_config(tmp_path / "c.yaml", {
        "model": {"kind": "cnn", "depth": 2, "width": 8},
        "data": {"kind": "synthetic", "num_samples": 256, "shape": [3, 16, 16],
                 "num_workers": 2},
        "optim": {"name": "sgd", "lr": 0.05},
        "train": {"max_steps": 6, "global_batch_size": 16, "micro_batch_size": 4},
        "logging": {"every_steps": 2, "progress": "plain"},
        "output": {"dir": str(tmp_path)}})
    proc = run_train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "micro-batch 4 x 4 accumulation" in proc.stderr
    assert sorted(losses(tmp_path / "c")) == [1, 2, 4, 6]  # step 1, then every 2


def test_log_lines_carry_the_rank(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {"output": {"dir": str(tmp_path)}}))
    proc = run_train(config, "train.max_steps=2")
    assert proc.returncode == 0
    assert "[rank 0] INFO model mlp" in proc.stderr


def test_the_fused_optimizer_changes_the_kernel_not_the_trajectory(tmp_path):
    """optim.fused: auto takes torch's fused kernel here (CPU); a run with it and one with
    optim.fused=false follow the same losses to float rounding."""
    import torch

    from train.core.config import OptimConfig
    from train.models.optim import build_optimizer
    layer = torch.nn.Linear(4, 4)
    assert build_optimizer(layer, OptimConfig()).defaults["fused"] is True
    assert not build_optimizer(layer, OptimConfig(fused=False)).defaults["fused"]
    series = {}
    for fused in ("true", "false"):
        config = write_config(tmp_path / f"f{fused}.yaml", merge(TINY_GPT, {
            "output": {"dir": str(tmp_path)}}))
        proc = run_train(config, f"optim.fused={fused}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        series[fused] = losses(tmp_path / f"f{fused}")
    assert series["true"].keys() == series["false"].keys() and len(series["true"]) == 10
    for step, loss in series["true"].items():
        assert math.isclose(loss, series["false"][step], rel_tol=1e-4), (step, series)


@pytest.mark.parametrize("clip", [0.0, 1e-3, 1.0, 1e6])
def test_grad_norm_and_clip_gives_clip_grad_norms_numbers(clip):
    """The norm and the gradients bit for bit as torch's clip_grad_norm_ (clipping off:
    an infinite clip), whether the norm is under the clip (no multiply) or over it."""
    import torch

    from train.models.optim import grad_norm_and_clip

    def model_with_grads():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        model(torch.randn(32, 8)).square().sum().backward()
        return model

    ours, theirs = model_with_grads(), model_with_grads()
    norm = grad_norm_and_clip(ours, clip)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), clip if clip > 0 else math.inf)
    assert norm == float(expected)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    clipped = 0 < clip < norm
    assert clipped == (clip in (1e-3, 1.0)), norm  # both branches are exercised
