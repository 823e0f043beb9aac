"""The replica groups component (k8s/kustomize/replicas) in an overlay of each base, as
kubectl's kustomize renders it: valid for every promised Kubernetes version, held to
the image's contract like the other pods, the Lighthouse's Deployment + Service + policy
consistent with each other and with the workers' TORCHFT_LIGHTHOUSE, and each worker pod
planned by the real launcher code as one replica group of the Job's pods. The pods for
real: tests/e2e/test_k8s_replicas.py."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from launcher.detection.hardware import Hardware, TorchBuild
from launcher.planning import environ
from launcher.planning.plan import plan
from tests.harness.kubesim import literal_env
from tests.static.test_k8s import (
    APP_UID,
    EXAMPLE,
    EXAMPLE_GPU,
    KUSTOMIZE,
    LABELS,
    PREFIX_LINE,
    VERSIONS,
    final_codes,
    rendered,
    selects,
    share_nothing,
)
from train.core.config import load_config
from train.core.run.replica_contract import GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR

BASES = list(EXAMPLE_GPU)  # ../base, ../amd, ../cpu


def render(folders: dict[str, dict | str], top: str) -> tuple[dict, ...]:
    """What kubectl's kustomize renders for the folder ``top``, in a copy of k8s/kustomize
    with these folders made (or replaced) in it: name -> its kustomization (or the text)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kustomize"
        shutil.copytree(KUSTOMIZE, copy)
        for name, kustomization in folders.items():
            (copy / name).mkdir(exist_ok=True)
            text = kustomization if isinstance(kustomization, str) else \
                yaml.safe_dump(kustomization)
            (copy / name / "kustomization.yaml").write_text(text)
        return tuple(d for d in yaml.safe_load_all(rendered(copy / top)) if d)


@functools.cache
def objects(base: str) -> tuple[dict, ...]:
    """An overlay of ``base`` with the component, made next to them in a copy."""
    return render({"overlay": {"resources": [base], "components": ["../replicas"]}}, "overlay")


def one(base: str, kind: str, name: str) -> dict:
    return next(d for d in objects(base) if d["kind"] == kind and d["metadata"]["name"] == name)


def lighthouse(base: str) -> tuple[dict, dict, dict]:
    deployment = one(base, "Deployment", "train-lighthouse")
    spec = deployment["spec"]["template"]["spec"]
    return deployment, spec, spec["containers"][0]


def test_the_component_is_a_component_that_adds_the_lighthouse():
    text = (KUSTOMIZE / "replicas" / "kustomization.yaml").read_text()
    assert yaml.safe_load(text)["kind"] == "Component"
    kinds = {(d["kind"], d["metadata"]["name"]) for d in objects("../cpu")}
    assert {("Deployment", "train-lighthouse"), ("Service", "train-lighthouse"),
            ("NetworkPolicy", "train-lighthouse")} <= kinds


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("version", VERSIONS)
def test_the_component_validates_strictly(base, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in objects(base):
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("base", BASES)
def test_the_lighthouse_pod_keeps_the_image_contract(base):
    deployment, spec, c = lighthouse(base)
    job = one(base, "Job", "train-workers")
    assert all(k in deployment["metadata"]["labels"] for k in LABELS)
    assert all(k in deployment["spec"]["template"]["metadata"]["labels"] for k in LABELS)
    assert spec["serviceAccountName"] == "train" and not spec["automountServiceAccountToken"]
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == APP_UID and sc["runAsGroup"] == 0
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    writable = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/tmp"] in writable
    # the workers' image (it carries torchft), no GPU, one replica replaced as one
    assert c["image"] == job["spec"]["template"]["spec"]["containers"][0]["image"]
    assert not [k for k in c.get("resources", {}).get("limits", {}) if k.endswith("/gpu")]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("base", BASES)
def test_the_lighthouse_service_port_and_policy_agree_with_the_workers(base):
    _, spec, c = lighthouse(base)
    args = c["args"]
    assert args[0] == "lighthouse"
    port = int(args[args.index("--port") + 1])
    assert c["ports"] == [{"name": "lighthouse", "containerPort": port}]
    assert c["readinessProbe"]["tcpSocket"]["port"] == "lighthouse"
    config = Path(args[-1])  # the job's config, from its ConfigMap
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(config.parent))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "train-config"
    service = one(base, "Service", "train-lighthouse")["spec"]
    labels = lighthouse(base)[0]["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": service["selector"]}, labels)
    assert service["ports"] == [{"name": "lighthouse", "port": port, "targetPort": "lighthouse"}]
    job = one(base, "Job", "train-workers")
    env = literal_env(job["spec"]["template"]["spec"]["containers"][0])
    assert env[LIGHTHOUSE_VAR] == f"http://train-lighthouse:{port}"
    policy = one(base, "NetworkPolicy", "train-lighthouse")["spec"]
    assert selects(policy["podSelector"], labels)
    workers = job["spec"]["template"]["metadata"]["labels"]
    (rule,) = policy["ingress"]
    assert [selects(f["podSelector"], workers) for f in rule["from"]] == [True]
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}]


@pytest.mark.parametrize("base", BASES)
def test_the_job_still_fails_at_once_only_on_final_codes(base):
    s = one(base, "Job", "train-workers")["spec"]
    fail = [r for r in s["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert [r["onExitCodes"]["values"] for r in fail] == [final_codes()]
    assert s["backoffLimitPerIndex"] >= 1 and s["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize("base", BASES)
def test_each_pod_plans_one_group_of_the_jobs_pods(base, tmp_path, monkeypatch):
    """Every index's pod, planned by the real launcher code from the rendered env, args
    and config: one group each, the groups = the Job's pods, the Lighthouse the Service."""
    from launcher.detection import torchft_tools
    monkeypatch.setattr(torchft_tools, "lighthouse_binary", lambda *a, **k: "/x/lighthouse")
    job = one(base, "Job", "train-workers")
    c = job["spec"]["template"]["spec"]["containers"][0]
    text = one(base, "ConfigMap", "train-config")["data"]["config.yaml"]
    (tmp_path / "config.yaml").write_text(text)
    overrides = [a.replace("/workspace/runs", str(tmp_path / "runs")) for a in c["args"][2:]]
    cfg = load_config(tmp_path / "config.yaml", overrides)
    groups = cfg.distributed.replicas + cfg.distributed.spares
    env = literal_env(c)
    s = job["spec"]
    assert cfg.distributed.fault_tolerance == "replicas"
    assert s["completions"] == s["parallelism"] == int(env["TRAIN_NNODES"]) == groups
    hw = Hardware(cpus=16)  # the groups' plan alike on any base (its GPUs: the unit tests)
    tb = TorchBuild(version="2.13.0", gloo=True)
    for index in range(s["completions"]):
        pod = {**env, "TRAIN_RDZV_ID": "0b7c-uid", "TRAIN_LOCAL_ADDR": f"10.0.0.{index + 7}",
               "JOB_COMPLETION_INDEX": str(index)}
        p = plan(cfg, hw, tb, environ.read(pod), config_path=str(tmp_path / "config.yaml"),
                 overrides=[*overrides, "device=cpu"], python="python3", app_root="/app",
                 lighthouse="/x/lighthouse")
        r = p.replica_groups
        assert r.here == (index,) and not r.serve and r.owner
        assert r.envs[0][GROUP_VAR] == str(index) and r.envs[0][GROUPS_VAR] == str(groups)
        assert r.envs[0][LIGHTHOUSE_VAR] == env[LIGHTHOUSE_VAR]
        assert p.job == "0b7c-uid" and p.convention == "indexed-job"


def lighthouse_reached(objs: tuple[dict, ...]) -> tuple[str, str]:
    """(the workers' TORCHFT_LIGHTHOUSE as the kubelet expands it, the address of the one
    Service that selects the Lighthouse's pods, on its port)."""
    (job,) = [d for d in objs if d["kind"] == "Job"]
    (pods,) = [d["spec"]["template"] for d in objs if d["kind"] == "Deployment" and
               d["spec"]["template"]["spec"]["containers"][0]["args"][0] == "lighthouse"]
    (service,) = [d for d in objs if d["kind"] == "Service" and
                  selects({"matchLabels": d["spec"]["selector"]}, pods["metadata"]["labels"])]
    port = service["spec"]["ports"][0]["port"]
    return (literal_env(job["spec"]["template"]["spec"]["containers"][0])[LIGHTHOUSE_VAR],
            f"http://{service['metadata']['name']}:{port}")


# Where a job's names change: in the overlay that adds the component, or in one above it
RENAMED = {"a prefix beside the component": (
               {"overlay": {"namePrefix": "exp1-", "resources": ["../cpu"],
                            "components": ["../replicas"]}}, "exp1-train-lighthouse"),
           "a suffix beside the component": (
               {"overlay": {"nameSuffix": "-b", "resources": ["../base"],
                            "components": ["../replicas"]}}, "train-lighthouse-b"),
           "a prefix and a suffix in an overlay above": (
               {"overlay": {"namePrefix": "exp1-", "resources": ["../amd"],
                            "components": ["../replicas"]},
                "above": {"namePrefix": "top-", "nameSuffix": "-b",
                          "resources": ["../overlay"]}}, "top-exp1-train-lighthouse-b")}


@pytest.mark.parametrize("how", RENAMED)
def test_the_workers_reach_the_lighthouse_by_its_new_name(how):
    """A namePrefix or nameSuffix renames the Lighthouse's Service, and the workers'
    TORCHFT_LIGHTHOUSE follows it (references.yaml), wherever the rename is set; nothing
    else of the workers' env changes."""
    folders, name = RENAMED[how]
    objs = render(folders, list(folders)[-1])
    env, address = lighthouse_reached(objs)
    assert env == address == f"http://{name}:29510"
    (job,) = [d for d in objs if d["kind"] == "Job"]
    base = folders["overlay"]["resources"][0]
    plain = one(base, "Job", "train-workers")["spec"]["template"]["spec"]["containers"][0]
    mine = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in mine if e["name"] != "TRAIN_LIGHTHOUSE_SERVICE"] == \
        [e for e in plain["env"] if e["name"] != "TRAIN_LIGHTHOUSE_SERVICE"]
    assert lighthouse_reached(objects(base)) == ("http://train-lighthouse:29510",) * 2


def replica_example(prefix: str) -> tuple[dict, ...]:
    """The example as a second replica job sets it up: its namePrefix line uncommented,
    the component under components:, its nodes patch the component's fixed count."""
    text = (EXAMPLE / "kustomization.yaml").read_text()
    text, n = PREFIX_LINE.subn(rf"namePrefix: {prefix}\1", text)
    objectstore = "# components:\n#   - ../objectstore\n"
    assert n == 1 and objectstore in text and text.count('value: "2:4"') == 1
    text = text.replace(objectstore, "components:\n  - ../replicas\n")
    return render({"example": text.replace('value: "2:4"', 'value: "3"')}, "example")


def test_two_replica_jobs_in_one_namespace_share_nothing_and_each_reaches_its_lighthouse():
    jobs = [replica_example(prefix) for prefix in ("exp1-", "exp2-")]
    share_nothing(list(jobs[0]), list(jobs[1]))
    for prefix, objs in zip(("exp1-", "exp2-"), jobs, strict=True):
        env, address = lighthouse_reached(objs)
        assert env == address == f"http://{prefix}train-lighthouse:29510"
