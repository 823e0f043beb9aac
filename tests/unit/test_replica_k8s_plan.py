"""Replica groups on Kubernetes (an Indexed Job of k8s/kustomize/replicas): each pod's
launcher plans ITS group alone (group id = JOB_COMPLETION_INDEX, NUM_REPLICA_GROUPS =
TRAIN_NNODES) under a torchrun of its own pod, the Lighthouse at TORCHFT_LIGHTHOUSE (its
own Deployment's: no pod starts it), the group reached at the pod's IP; pods other than
replicas + spares are exit 2 naming the key; a bad index, exit 2 naming it; an Indexed
Job without TORCHFT_LIGHTHOUSE, exit 3. The manifests: tests/static/test_k8s_replicas.py;
the pods for real: tests/e2e/test_k8s_replicas.py.
"""

from __future__ import annotations

import pytest

from launcher.commands import doctor
from launcher.running import lighthouse
from tests.unit import test_replica_plan as one_machine
from train.core.errors import UserError
from train.core.run.replica_contract import ADDR_VAR, GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR

LIGHTHOUSE, prepare = one_machine.LIGHTHOUSE, one_machine.prepare
config, torchft_here = one_machine.config, one_machine.torchft_here  # its fixtures
URL = "http://train-lighthouse:29510"


def pod(index: int | None, nnodes: str = "3", lighthouse_url: str | None = URL) -> dict:
    env = {"TRAIN_NNODES": nnodes, "TRAIN_RDZV_ENDPOINT": "train-rendezvous:29400",
           "TRAIN_RDZV_ID": "0b7c-uid", "TRAIN_LOCAL_ADDR": f"10.0.0.{7 + (index or 0)}"}
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = str(index)
    if lighthouse_url:
        env[LIGHTHOUSE_VAR] = lighthouse_url
    return env


def plan_of(config, index, *overrides, **kw):
    return prepare("train", config, "distributed.replicas=2", "distributed.spares=1",
                   *overrides, env=pod(index, **kw))


@pytest.mark.parametrize("n", [0, 1, 2])
def test_each_pod_runs_its_own_group_and_no_pod_starts_the_lighthouse(config, torchft_here, n):
    p = plan_of(config, n, "distributed.max_restarts=4")
    groups = p.plan.replica_groups
    assert groups.here == (n,) and groups.groups == 3 and len(groups.argvs) == 1
    assert groups.envs[0] == {GROUP_VAR: str(n), GROUPS_VAR: "3", LIGHTHOUSE_VAR: URL,
                              ADDR_VAR: f"10.0.0.{7 + n}"}
    text = " ".join(groups.argvs[0])
    # the pod's own rendezvous on 127.0.0.1, its own restarts; not the job's store
    assert "--rdzv-endpoint 127.0.0.1:${RDZV_PORT} --rdzv-id replica-group-" \
           f"{n} --nnodes 1 --local-addr 127.0.0.1" in text
    assert "train-rendezvous" not in text and "10.0.0." not in text
    assert "--max-restarts 4" in text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in p.plan.env
    assert p.plan.nnodes == (1, 1) and p.plan.store is None and p.plan.world_sizes == (2,)
    assert not groups.serve and groups.owner and groups.at == "train-lighthouse:29510"
    assert p.plan.job == "0b7c-uid"  # one lease for every pod of the Job
    assert f"this pod runs replica group {n} of 3, the Lighthouse at train-lighthouse:29510" \
           in " ".join(p.plan.notes)


def test_dry_run_and_doctor_say_which_group_and_whose_lighthouse(config, torchft_here):
    p = prepare("train", config, "distributed.replicas=2", "distributed.spares=1",
                env=pod(2), dry_run=True)
    text = p.plan.render()
    assert "# replica group 2 of 3 on this pod (2 + 1 spare(s), one per pod)" in text
    assert f"# Lighthouse at {URL}: its Deployment's, waited for" in text
    assert "--bind" not in text and "REPLICA_GROUP_ID=2 \\" in text
    d = prepare("doctor", config, "distributed.replicas=2", "distributed.spares=1",
                env=pod(1))
    lines = doctor._plan_lines(d.plan.to_dict())
    line = next(ln for ln in lines if ln.startswith("replicas "))
    assert "2 group(s) + 1 spare(s), one per pod, this pod's: group 1; Lighthouse at " \
           "train-lighthouse:29510, its Deployment's" in line
    assert any(ln.startswith("group 1    replica: REPLICA_GROUP_ID=1") for ln in lines)


@pytest.mark.parametrize("nnodes", ["2", "4", "1:3"])
def test_pods_other_than_the_groups_are_exit_2_naming_the_key(config, torchft_here, nnodes):
    p = plan_of(config, 0, nnodes=nnodes)
    assert isinstance(p, UserError) and p.exit_code == 2
    line = p.one_line()
    assert "distributed.replicas" in line and "2 replica(s) + 1 spare(s)" in line
    assert f"TRAIN_NNODES is {nnodes}" in line and "completions and parallelism" in line
    assert "\n" not in line


def test_an_index_beyond_the_groups_is_exit_2_naming_it(config, torchft_here):
    p = plan_of(config, 3)
    assert isinstance(p, UserError) and p.exit_code == 2
    assert "JOB_COMPLETION_INDEX" in p.one_line() and "expected 0..2" in p.one_line()


@pytest.mark.parametrize("index, url", [(0, None), (None, URL)])
def test_an_indexed_job_without_lighthouse_or_index_is_exit_3(config, torchft_here, index, url):
    p = plan_of(config, index, lighthouse_url=url)
    assert isinstance(p, UserError) and p.exit_code == 3
    assert "TORCHFT_LIGHTHOUSE (k8s/kustomize/replicas)" in p.one_line()


def test_a_bad_lighthouse_address_is_exit_2_naming_it(config, torchft_here):
    p = plan_of(config, 0, lighthouse_url="http://train-lighthouse:http")
    assert isinstance(p, UserError) and p.exit_code == 2
    assert LIGHTHOUSE_VAR in p.one_line()


def test_without_replicas_the_lighthouse_variable_changes_nothing(config, torchft_here):
    from launcher.planning import environ
    from launcher.running import runner
    request = runner.Request("train", config, overrides=())
    p = runner.prepare(request, environ.read({"PATH": "/usr/bin", **pod(0)}),
                       hardware=one_machine.Hardware(cpus=8), tb=one_machine.CPU_TORCH,
                       master_port=29511)
    assert p.plan.replica_groups is None and p.plan.store == "train-rendezvous:29400"


def test_the_deployments_lighthouse_is_lost_after_refusals_and_named(monkeypatch):
    answers = iter([False, False, False])
    monkeypatch.setattr(lighthouse, "reachable", lambda endpoint: next(answers))
    monkeypatch.setattr(lighthouse, "CHECK_S", 0.0)
    far = lighthouse.Lighthouse(None, 29510, "train-lighthouse", by="its Deployment's")
    assert [far.gone() for _ in range(3)] == [None, None, "stopped accepting connections"]
    assert far.named() == f"the Lighthouse (its Deployment's, {URL})"


def test_the_lighthouse_command_runs_the_launchers_command_line(config, monkeypatch):
    """``entrypoint.py lighthouse``: the argv the launcher gives the Lighthouse elsewhere,
    bound where the Service sends; exec'ed (here: the argv it would exec)."""
    from launcher.commands import lighthouse as command
    from train.core.run.replica_contract import Timeouts, lighthouse_argv
    monkeypatch.setattr(command, "lighthouse_binary", lambda: LIGHTHOUSE)
    got = command.argv(config, ["distributed.replica_timeout_s=7"], "0.0.0.0", 29510)
    assert got == lighthouse_argv(LIGHTHOUSE, "0.0.0.0:29510", Timeouts.of(7))
    assert command.argv(None, [], "::", 29510)[1:3] == ["--bind", "[::]:29510"]
    seen = []
    monkeypatch.setattr(command.os, "execve", lambda path, argv, env: seen.append(
        (path, argv, env["RUST_LOG"])))
    command.serve(config, [], "0.0.0.0", 29510, lambda line: None)
    assert seen == [(LIGHTHOUSE, lighthouse_argv(LIGHTHOUSE, "0.0.0.0:29510", Timeouts.of(60)),
                     "warn")]


def test_the_lighthouse_command_says_what_is_wrong_in_one_line(config, monkeypatch, capsys):
    from launcher import cli
    from launcher.commands import lighthouse as command
    monkeypatch.setattr(command, "lighthouse_binary", lambda: None)
    assert cli.main(["lighthouse", config]) == 3
    assert "pip install 'trainpod[ft]'" in capsys.readouterr().err
    monkeypatch.setattr(command, "lighthouse_binary", lambda: LIGHTHOUSE)
    assert cli.main(["lighthouse", config, "distributed.replica_timeout_s=-1"]) == 2
    err = capsys.readouterr().err
    assert "distributed.replica_timeout_s" in err and err.count("\n") == 1
    assert cli.main(["lighthouse", "--port", "0"]) == 2


def test_a_heal_is_served_at_the_groups_address_not_its_hostname():
    """A pod's hostname does not resolve from the other pods: the heal server advertises
    TRAIN_REPLICA_ADDR (the pod IP) instead."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from train.distributed.replica_group import _weights_only_transport
    transport = _weights_only_transport(timedelta(seconds=5), "10.0.0.9")
    try:
        assert transport.address().startswith("http://10.0.0.9:")
        assert transport.address().endswith("/checkpoint/")
    finally:
        transport.shutdown(wait=False)
