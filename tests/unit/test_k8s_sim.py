"""The k8s/ manifests' own pods, run by a stand-in kubelet and Job controller
(tests/harness/kubesim.py), given a broken config: every pod fails with an exit code that
fails the Job. The job's life through pod loss, scale-up, the loss of the rendezvous
pod, a drain, completion and a late pod: tests/e2e/test_k8s_sim_runs.py."""

from __future__ import annotations

import yaml

from tests.harness.kubesim import JOB


def test_a_broken_config_fails_every_pod_with_an_exit_code_that_fails_the_job(sim):
    config = sim.configmap("train-config") / "config.yaml"
    tree = yaml.safe_load(config.read_text())
    tree["model"]["widht"] = 64  # a typo
    config.write_text(yaml.safe_dump(tree))
    store = sim.start_deployment("train-rendezvous")
    store.wait_for(r"listening on", 60)
    pods = [sim.start_index(JOB, i) for i in (0, 1)]
    codes = [p.wait(120) for p in pods]
    assert codes == [2, 2] and [sim.judge(JOB, c) for c in codes] == ["FailJob", "FailJob"]
    for p in pods:
        last = p.text().strip().splitlines()[-1]
        assert last.endswith("model.widht: unknown key; did you mean model.width?"), last
