"""A Hugging Face model as the user's model, unwrapped: a GPT-2 from transformers,
randomly initialised from its config (nothing downloaded), returned by the user's
factory on the byte-level text data, on two processes. DDP and FSDP (sharded by its
_no_split_modules) give the same losses, and a run stopped by SIGTERM and started again
(FSDP) ends with the losses of an uninterrupted one, bitwise; the FSDP run's export is
read by from_pretrained. A model returning the wrong output is exit 2 before step 1, never
trained again. In process: tests/unit/test_model_outputs.py.

Needs transformers (`make hf`); skipped without it."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.runs import (
    ENTRY,
    TINY_GPT,
    clean_env,
    entry,
    failure_lines,
    installed,
    last_line,
    limit,
    losses,
    merge,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.skipif(not installed("transformers"),
                                reason="transformers is not installed (make hf)")

# The user's project: the factory of the GPT-2 (and its base model, which returns
# hidden states instead of logits). With PAUSE_DIR set, every rank stops at its
# PAUSE_AT-th training forward until PAUSE_DIR/go exists, then goes on at a slower pace,
# so that a signal sent meanwhile lands early in the run whatever the machine's speed.
FACTORY = '''
import os
import time
from pathlib import Path

from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model


def config(**kw):
    return GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=128,
                      bos_token_id=None, eos_token_id=None, use_cache=False, **kw)


def gpt2():
    model = GPT2LMHeadModel(config())
    if os.environ.get("PAUSE_DIR"):
        model.register_forward_pre_hook(pause(Path(os.environ["PAUSE_DIR"]),
                                              int(os.environ["PAUSE_AT"])))
    return model


def base():
    return GPT2Model(config())


def pause(folder, at):
    calls = [0]

    def hook(module, args):
        if not module.training:
            return
        calls[0] += 1
        if calls[0] == at:
            (folder / f"reached-{os.environ['RANK']}").touch()
            while not (folder / "go").exists():
                time.sleep(0.05)
        elif calls[0] > at:
            time.sleep(0.05)
    return hook
'''
STEPS = 24


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    (folder / "hf_gpt2.py").write_text(FACTORY)
    write_config(folder / "gpt2.yaml", merge(TINY_GPT, {
        "model": {"kind": "custom", "factory": "hf_gpt2:gpt2", "context_length": 32},
        "train": {"max_steps": STEPS},
        "checkpoint": {"every_steps": 8},
        "distributed": {"nproc_per_node": 2}}))
    return folder


@pytest.fixture(scope="module")
def uninterrupted(project) -> dict[str, dict[int, float]]:
    """strategy -> the losses of an uninterrupted run."""
    out = {}
    for strategy in ("ddp", "fsdp"):
        done = entry("train", "gpt2.yaml", f"distributed.strategy={strategy}",
                     f"run.name=ref-{strategy}", cwd=project)
        assert done.returncode == 0, done.stderr[-3000:]
        if strategy == "fsdp":
            assert "fsdp: sharding 2 x GPT2Block (by its _no_split_modules), then the rest " \
                   "of GPT2LMHeadModel" in done.stderr
        out[strategy] = losses(project / "runs" / f"ref-{strategy}")
    return out


def test_gpt2_trains_alike_under_ddp_and_fsdp(uninterrupted):
    ddp, fsdp = uninterrupted["ddp"], uninterrupted["fsdp"]
    assert sorted(ddp) == sorted(fsdp) == list(range(1, STEPS + 1))
    for step in ddp:  # the same math; only the order of the gradients' reduction differs
        assert math.isclose(ddp[step], fsdp[step], rel_tol=1e-5), (step, ddp[step], fsdp[step])
    assert ddp[STEPS] < ddp[1] - 1  # it learns


def test_the_fsdp_runs_export_loads_with_from_pretrained_and_computes_its_logits(
        project, uninterrupted):
    """The factory's GPT-2, trained under FSDP (a sharded checkpoint, consolidated by
    export): the export is what from_pretrained reads, and computes the logits of the
    factory's model holding the checkpoint's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(project))
    try:
        from hf_gpt2 import gpt2
    finally:
        sys.path.remove(str(project))
    from train.checkpoint.sharded import full_model_state
    from train.core.run.rundir import SHARDS
    run = project / "runs" / "ref-fsdp"
    out = entry("export", str(run), cwd=project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {"config.json", "model.safetensors", "model.json"} <= {
        p.name for p in (run / "export").iterdir()}
    trained = gpt2()
    trained.load_state_dict(full_model_state(run / "checkpoints" / f"step-{STEPS}" / SHARDS))
    theirs = AutoModelForCausalLM.from_pretrained(run / "export", local_files_only=True)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs.eval()(ids).logits, trained.eval()(ids).logits)


# FSDP only: its sharded checkpoint of GPT-2's tied embedding is the harder path, and the
# test above shows DDP computes the same losses (DDP resumes: test_checkpoint_runs.py)
@pytest.mark.parametrize("strategy", ["fsdp"])
def test_gpt2_stopped_by_sigterm_resumes_bitwise(project, uninterrupted, strategy, tmp_path):
    args = ["train", "gpt2.yaml", f"distributed.strategy={strategy}", f"run.name=cut-{strategy}"]
    log = (tmp_path / "out.log").open("w")
    launcher = subprocess.Popen([sys.executable, ENTRY, *args], cwd=project,
                                env=clean_env(PAUSE_DIR=str(tmp_path), PAUSE_AT="3"),
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: all((tmp_path / f"reached-{r}").exists() for r in (0, 1)), 180,
                 "the ranks never reached their third step")
        launcher.send_signal(signal.SIGTERM)
        (tmp_path / "go").touch()
        assert launcher.wait(timeout=limit(120)) == 143, (tmp_path / "out.log").read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    cut = losses(project / "runs" / f"cut-{strategy}")
    assert 3 <= max(cut) < STEPS
    again = entry(*args, cwd=project)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {max(cut)}" in again.stderr
    assert losses(project / "runs" / f"cut-{strategy}") == uninterrupted[strategy]


def test_a_base_model_without_logits_is_exit_2_before_step_1_and_not_restarted(project):
    out = entry("train", "gpt2.yaml", "model.factory=hf_gpt2:base", "run.name=base",
                "distributed.max_restarts=3", cwd=project)
    assert out.returncode == 2, out.stderr[-3000:]
    last = last_line(out.stderr)
    assert last.startswith(
        "error: gpt2.yaml: train.loss: cross_entropy needs the model's logits (a tensor, a "
        "ModelOutput or dict with `logits`, or a tuple whose first item is the logits); the "
        "model returned BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=[1, 32, "
        "128] float32) (rank "), last
    assert last.endswith("/traceback.log)"), last  # the first rank's, named
    # both workers met it: said once
    assert failure_lines(out.stdout + out.stderr, "needs the model's logits") == [last]
    assert "restarting the workers" not in out.stderr  # torchrun did not restart it
    assert "step 1/" not in out.stderr and "Traceback" not in out.stderr
