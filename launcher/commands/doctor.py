"""``doctor [--json] [--comm] [CONFIG [key=value ...]]``: can this container train?

Reports what was detected (GPUs with vendor, name, memory, UUID, visibility; driver
vs the image's torch build), the plan a ``train`` would make (device, backend,
processes, nodes), a token dataset's size, order and fetch per epoch
(:mod:`train.core.datasets.footprint`), /dev/shm, the output folder, network
interfaces, the rendezvous host's resolution, the image's build manifest and the Python
packages (a version moved from its lock, a project module hiding a package:
:mod:`launcher.commands.packages`).
Exits 0 when training would start, 2 for an invalid config or environment, 3 when this
machine/image cannot run it. ``--comm`` adds the preflight check across the local
processes/GPUs: a timed matmul on each, a timed all-reduce among them
(:mod:`launcher.commands.comm`).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from launcher import conventions
from launcher.commands import packages
from launcher.detection import rdma, system
from launcher.detection.hardware import Finding, TorchBuild
from launcher.planning.replica_plan import quote, shell
from launcher.planning.variables import Environ
from train.core.config import DistributedConfig
from train.core.machine.host import read_build_manifest
from train.core.storage.credentials import redacted

GIB = 1024 ** 3


def gather(env: Environ, config_path: str | None, overrides: list[str]) -> dict:
    """Everything doctor reports, as plain data, plus findings and the exit code: the
    launch pipeline's own findings (:func:`launcher.running.runner.prepare`, as train would
    meet them), then what only doctor looks at (DNS, network, RDMA, the image)."""
    from launcher.running import runner
    p = runner.prepare(runner.Request("doctor", config_path, tuple(overrides)), env)
    findings = list(p.findings)
    report: dict[str, Any] = {"torch": p.torch.to_dict(), "hardware": p.hardware.to_dict(),
                              "visibility": env.visibility.as_dict(),
                              "convention": conventions.detect(env).NAME if p.cfg else None,
                              "plan": p.plan.to_dict() if p.plan else None,
                              "data": p.data}
    if p.plan and p.plan.rdzv_host:
        host = p.plan.rdzv_host
        addrs = system.resolve(host)
        findings.append(Finding("ok" if addrs else "warn", "rendezvous",
                                f"rendezvous host {host} resolves to {', '.join(addrs)}"
                                if addrs else f"rendezvous host {host} does not resolve yet",
                                None if addrs else "train waits for it (TRAIN_DNS_WAIT_S)"))
    settings = p.cfg.distributed if p.cfg else DistributedConfig()
    report["preflight"] = {"mode": settings.preflight, "slow_ratio": settings.preflight_slow_ratio}
    report["network"] = _network(env)
    report["slurm"] = _slurm_allocation(env)
    report["rdma"] = rdma.detect(env.hw_root, env.raw)
    multi_node_gpu = bool(p.plan and p.plan.device == "gpu" and p.plan.nnodes[1] > 1)
    findings += rdma.findings(report["rdma"], multi_node_gpu)
    manifest = read_build_manifest(env.build_manifest)
    report["build_manifest"] = {"path": env.build_manifest, "present": manifest is not None,
                                "content": manifest}
    report["sbom"] = _sbom((manifest or {}).get("sbom"))
    findings += _manifest_findings(manifest, p.torch)
    # the project folder is the working directory, first on the workers' sys.path
    report["packages"], more = packages.findings(Path(runner.APP_ROOT), Path.cwd(),
                                                 pythonpath=env.raw.get("PYTHONPATH"))
    findings += more
    report["findings"] = [f.to_dict() for f in _dedupe(findings)]
    report["exit_code"] = max((f.exit_code for f in findings if f.level == "fail"), default=0)
    return report


def _sbom(recorded: dict | None) -> dict | None:
    """The image's CycloneDX SBOM, which its build manifest names: path and SHA-256 as on
    disk now, and whether that is what the build recorded (None: no SBOM named)."""
    import hashlib  # here: this hunk stays one piece while launcher/ is being moved
    if not recorded or not recorded.get("path"):
        return None
    path = Path(recorded["path"])
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"path": str(path), "sha256": digest, "as_built": digest == recorded.get("sha256")}


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if (f.level, f.message) not in seen:
            seen.add((f.level, f.message))
            out.append(f)
    return out


def _network(env: Environ) -> dict:
    host = socket.gethostname()
    fqdn = socket.getfqdn(host)
    return {"hostname": host, "fqdn": fqdn, "fqdn_resolves_to": system.resolve(fqdn),
            "interfaces": system.interfaces(),
            "NCCL_SOCKET_IFNAME": env.raw.get("NCCL_SOCKET_IFNAME"),
            "GLOO_SOCKET_IFNAME": env.raw.get("GLOO_SOCKET_IFNAME")}


SLURM_SHOWN = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NNODES", "SLURM_NTASKS",
               "SLURM_TASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_NODEID", "SLURM_PROCID",
               "SLURM_LOCALID", "SLURM_GPUS_ON_NODE", "SLURM_RESTART_COUNT")


def _slurm_allocation(env: Environ) -> dict | None:
    """The SLURM allocation as SLURM describes it (the plan line says what it makes of it)."""
    if not env.get("SLURM_JOB_ID"):
        return None
    return {k: env.get(k) for k in SLURM_SHOWN if env.get(k) is not None}


def _gpu_line(g: dict) -> str:
    mem = f"{g['memory_bytes'] / GIB:.1f} GiB" if g.get("memory_bytes") else "memory ?"
    return (f"  [{g['index']}] {g['name']}  {mem}  {g.get('arch') or ''}  "
            f"{g.get('uuid') or ''}").rstrip()


def render(report: dict) -> str:
    """The human-readable report: one line (or a few) for each part, in this order."""
    t, hw = report["torch"], report["hardware"]
    lines = [_torch_line(t),
             _gpus_line(hw),
             *(_gpu_line(g) for g in hw["gpus"]),
             _visibility_line(report["visibility"]),
             f"cpus       {hw['cpus']}",
             *_plan_lines(report.get("plan")),
             *(f"data       {line}" for line in (report.get("data") or {}).get("lines", [])),
             *_slurm_lines(report.get("slurm")),
             _network_line(report["network"]),
             f"rdma       {rdma.line(report['rdma'])}",
             _image_line(report["build_manifest"]),
             *(f"note       {note}" for note in hw.get("notes", [])),
             *(_finding_line(f) for f in report["findings"]),
             *(_comm_lines(report["comm"]) if "comm" in report else []),
             _verdict_line(report["exit_code"])]
    return "\n".join(lines)


def _torch_line(t: dict) -> str:
    return (f"torch      {t['version']} ({t['kind']}"
            + (f", CUDA {t['cuda']}" if t.get("cuda") else "")
            + (f", HIP {t['hip']}" if t.get("hip") else "")
            + "); backends: " + (", ".join(b for b in ("nccl", "gloo", "mpi") if t.get(b))
                                 or "none"))


def _gpus_line(hw: dict) -> str:
    if not hw.get("vendor"):
        return "gpus       none found (CPU only)"
    return (f"gpus       {len(hw['gpus'])} usable of {hw['listed']} listed "
            f"({hw['vendor']}, via {hw['source']})"
            + (f"; driver {hw['driver_version']} (CUDA <= {hw['cuda_driver_version']})"
               if hw.get("driver_version") else ""))


def _visibility_line(visibility: dict) -> str:
    vis = {k: v for k, v in visibility.items() if v is not None}
    return "visibility " + (", ".join(f"{k}={v!r}" for k, v in vis.items()) or "(none set)")


def _plan_lines(p: dict | None) -> list[str]:
    if not p:
        return []
    return [f"plan       {p['mode']}: device={p['device']} backend={p['backend']} "
            f"nproc_per_node={p['nproc_per_node']} nnodes={p['nnodes'][0]}:"
            f"{p['nnodes'][1]} ({p['convention']})",
            *(f"plan note  {n}" for n in p["notes"] if n.startswith("launch convention")),
            *_replica_lines(p.get("replica_groups"))]


def _replica_lines(r: dict | None) -> list[str]:
    """fault_tolerance=replicas: the groups, the spares, the Lighthouse, each command
    (on SLURM and Kubernetes: this node's or pod's group, and whose Lighthouse)."""
    if not r:
        return []
    ids = r.get("ids") or range(r["replicas"] + r["spares"])
    if r.get("at"):
        one = "pod" if r.get("owner") else "node"
        per = r.get("per_group", 1)
        each = f"one per {one}" if per == 1 else f"{per} {one}s each"
        where = (f"{each}, this {one}'s: group {ids[0]}; Lighthouse at {r['at']}, "
                 + (f"started here: {shell(r['lighthouse'])}" if r.get("serve")
                    else r.get("owner") or "node 0's"))
    else:
        where = ("one torchrun each; Lighthouse on 127.0.0.1 at a free port picked at each "
                 f"start: {shell(r['lighthouse'])}")
    return [f"replicas   {r['replicas']} group(s) + {r['spares']} spare(s), {where}",
            *(f"group {g}    {'replica' if g < r['replicas'] else 'spare'}: "
              f"{' '.join(f'{k}={quote(v)}' for k, v in env.items())} "
              f"{shell(argv)}"
              for g, argv, env in zip(ids, r["argvs"], r["envs"], strict=True))]


def _slurm_lines(slurm: dict | None) -> list[str]:
    if not slurm:
        return []
    return ["slurm      " + ", ".join(f"{k.removeprefix('SLURM_')}={v}"
                                       for k, v in slurm.items())]


def _network_line(net: dict) -> str:
    ifaces = ", ".join(f"{i['name']}={i['ipv4'] or '-'}" for i in net["interfaces"])
    return (f"network    {net['fqdn']} -> {', '.join(net['fqdn_resolves_to']) or '?'}; "
            f"{ifaces}")


def _image_line(bm: dict) -> str:
    return f"image      {bm['path']}: " + (_manifest_line(bm["content"]) if bm["present"]
                                            else "not present (not running in the image)")


def _finding_line(f: dict) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[f["level"]]
    return f"{mark}       {f['message']}" + (f"\n             fix: {f['fix']}"
                                            if f.get("fix") else "")


def _verdict_line(code: int) -> str:
    return "verdict    " + ("ready to train" if code == 0 else
                            f"training would fail (exit {code})")


def _manifest_line(content: dict | None) -> str:
    if not content:
        return "unreadable"
    torch = content.get("torch") if isinstance(content.get("torch"), dict) else {}
    args = content.get("build_args") if isinstance(content.get("build_args"), dict) else {}
    shown = {"flavor": content.get("flavor"), "base": content.get("base_image"),
             "torch": torch.get("version"), "python": content.get("python"),
             "version": args.get("VERSION"), "commit": args.get("VCS_REF")}
    return ", ".join(f"{k}={v}" for k, v in shown.items() if v) or f"{len(content)} keys"


def _manifest_findings(content: dict | None, tb: TorchBuild) -> list[Finding]:
    """The image says which torch it installed; a different one means the venv changed."""
    torch = (content or {}).get("torch")
    recorded = torch.get("version") if isinstance(torch, dict) else None
    if recorded and tb.importable and recorded != tb.version:
        return [Finding("warn", "image", f"the build manifest records torch {recorded}, but "
                        f"torch {tb.version} is installed: the image's environment was changed",
                        "rebuild the image instead of installing into it")]
    return []


def bandwidth(gb_s: float) -> str:
    """A bandwidth in the unit that shows it (CPU processes over gloo reach MB/s, not GB/s)."""
    if gb_s >= 1:
        return f"{gb_s:.1f} GB/s"
    mb_s = gb_s * 1000
    return f"{mb_s:.0f} MB/s" if mb_s >= 10 else f"{mb_s:.2g} MB/s" if mb_s >= 0.01 else \
        "under 0.01 MB/s"


def _comm_lines(c: dict) -> list[str]:
    if c.get("skipped"):
        return [f"comm       skipped: {c['skipped']}"]
    head = (f"comm       matmul and all-reduce over {c['processes']} process(es), "
            f"{c['device']}/{c['backend']}: " + ("ok" if c["ok"] else "FAILED"))
    if c.get("seconds"):
        head += f"; all-reduce {c['seconds'] * 1000:.1f} ms"
    if c.get("bus_gb_s"):
        head += f", bus bandwidth {bandwidth(c['bus_gb_s'])}"
    shown = [f"comm       {line}" for line in c.get("preflight", [])
             if line not in c["problems"] + c.get("slow", [])]  # the summary: the rest are findings
    return [head, *shown] + [f"FAIL       {p}" for p in c["problems"]]


def add_comm(report: dict, env: Environ, timeout_s: float) -> None:
    """Run the preflight check (matmul, all-reduce) with the planned device/backend; fold
    it into the report. A rank far slower than the others is a warning, or a failure
    (exit 3) when the config says distributed.preflight: fail, as training would."""
    from launcher.commands import comm
    p = report.get("plan")
    if not p:
        report["comm"] = {"skipped": "no launch plan (see the failures above)", "ok": False}
        report["exit_code"] = report["exit_code"] or 3
        return
    nproc = p["nproc_per_node"] if p["nproc_per_node"] > 1 else \
        ((len(report["hardware"]["gpus"]) or 1) if p["device"] == "gpu" else 2)
    mode, ratio = report["preflight"]["mode"], report["preflight"]["slow_ratio"]
    result = comm.run(p["device"], p["backend"], nproc, timeout_s, env.raw, p["env"],
                      system.free_port(), slow_ratio=ratio)
    report["comm"] = result
    if not result["ok"]:
        report["exit_code"] = 1
        report["findings"].append(Finding("fail", "comm", "; ".join(result["problems"]), None,
                                          1).to_dict())
    for line in result["slow"]:
        fail = mode == "fail"
        report["findings"].append(Finding(
            "fail" if fail else "warn", "comm", line, "distributed.preflight=fail would stop "
            "training here (exit 3)" if fail else None, 3 if fail else 0).to_dict())
        if fail:
            report["exit_code"] = report["exit_code"] or 3


def main(env: Environ, config_path: str | None, overrides: list[str], *, as_json: bool,
         comm: bool, comm_timeout_s: float) -> int:
    report = gather(env, config_path, overrides)
    if comm:
        add_comm(report, env, comm_timeout_s)
    # what it quotes of a config that failed before its credentials were refused
    text = json.dumps(report, indent=2, default=str) if as_json else render(report)
    print(redacted(text))
    return report["exit_code"]
