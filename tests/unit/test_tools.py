"""The project tooling behind scripts/ (tools/): stage recording with real time limits,
the GPU check's notes, the image test's checks, lock reading. The GPU check's stages
run on the CPU: tests/e2e/test_tools_runs.py.

The image test's engine runs are exercised by `make image-test` itself; here are the
decisions it makes from what the engine returns, and its builds side by side (a stand-in
engine that builds nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.procs import alive
from tests.harness.runs import ROOT, clean_env, limit
from tools import gpu_check, image_checks, image_ft, image_test, locks, stages

# ------------------------------------------------------------------ stages

def test_a_stage_past_its_limit_is_stopped_with_its_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    t0 = time.monotonic()
    rc, out = stages.run_limited(
        ["bash", "-c", f"sleep 300 & echo $! > {pidfile}; echo started; wait"], 2)
    assert rc == stages.TIMED_OUT and "started" in out and "limit" in out
    assert time.monotonic() - t0 < 60
    child = int(pidfile.read_text())
    deadline = time.monotonic() + limit(10)
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)  # reaped by init once killed
    assert not alive(child)


def test_each_result_is_on_disk_as_soon_as_it_is_recorded(tmp_path):
    rec = stages.Recorder(tmp_path / "out", "check")
    rec.record(stages.Result("one", 0, 1.5, True, "fine"))
    assert "one      ok" in (tmp_path / "out/summary.txt").read_text()
    rec.record(stages.Result("two", 3, 0.2, False, "broken"))
    rows = [json.loads(x) for x in (tmp_path / "out/stages.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["one", "two"] and rec.failed
    assert "two      FAIL  rc=3" in rec.summary()


# ------------------------------------------------------------------ gpu check

def test_gpu_check_notes_read_real_outputs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in (
        {"step": 1, "loss": 5.25, "throughput": 100.0},
        {"step": 60, "loss": 2.5, "throughput": 4321.0, "gpu/peak_allocated_gb": 0.5})))
    assert gpu_check.loss_note(metrics, "tokens") == \
        "60 steps: loss 5.250 -> 2.500, 4,321 tokens/s, peak 0.50 GiB"
    assert gpu_check.loss_note(tmp_path / "none.jsonl") == "no metrics written"
    doctor = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "doctor", "--json"],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                            timeout=limit(120))
    gpus, note = gpu_check.doctor_summary(doctor.stdout)
    assert gpus == 0 and note.startswith("no GPU: ")
    assert gpu_check.doctor_summary("Traceback ...")[0] is None
    assert gpu_check.pytest_note("...\n3 passed, 2 skipped in 4.20s\n") == \
        "3 passed, 2 skipped in 4.20s"


# ------------------------------------------------------------------ image test

def test_image_checks_refuse_what_a_broken_image_shows(tmp_path):
    labels = {"org.opencontainers.image.revision": "abc", "train.torch": "2.13.0+cpu",
              "org.opencontainers.image.base.name": "debian:12"}
    assert image_checks.check_labels(labels).startswith("labels ok")
    with pytest.raises(image_checks.Failed, match="revision"):
        image_checks.check_labels({**labels, "org.opencontainers.image.revision": ""})
    manifest = {"flavor": "cpu", "torch": {"version": "2.13.0+cpu"}, "base_image": "debian",
                "python_packages": {"torch": "2.13.0+cpu"}, "system_packages": {"tini": "1"}}
    assert "1 packages" in image_checks.check_build_manifest(manifest, "2.13.0")
    with pytest.raises(image_checks.Failed, match="torch"):
        image_checks.check_build_manifest(manifest, "2.14.0")
    with pytest.raises(image_checks.Failed, match="flavor"):
        image_checks.check_build_manifest(manifest, "2.13.0", "rocm")
    other = {**manifest, "python_packages": {"torch": "2.13.0+cpu", "six": "1.0"}}
    assert image_checks.compare_build_manifests(manifest, manifest).startswith("identical")
    with pytest.raises(image_checks.Failed, match="six"):
        image_checks.compare_build_manifests(manifest, other)
    line = image_checks.layers_line(("a", ["1", "2", "3"]), ("b", ["1", "x", "3"]))
    assert line.startswith("layers: 2 of 3 identical") and "[1] differ" in line


def _sbom(**py):
    """A CycloneDX document as scripts/sbom writes it: Python, dpkg, the base image."""
    comps = [{"name": n, "version": v, "purl": f"pkg:pypi/{n.lower()}@{v}",
              "hashes": [{"alg": "SHA-256", "content": "a" * 64}]} for n, v in py.items()]
    comps += [{"name": "tini", "version": "0.19.0-1", "type": "library",
               "purl": "pkg:deb/debian/tini@0.19.0-1?arch=amd64&distro=debian-12"},
              {"name": "debian:12.11-slim", "type": "container", "version": "sha256:" + "b" * 64,
               "purl": "pkg:oci/debian@sha256:" + "b" * 64}]
    return {"bomFormat": "CycloneDX", "specVersion": "1.6", "components": comps}


def test_the_sbom_check_holds_the_sbom_to_pip_dpkg_and_the_lock():
    sbom = _sbom(PyYAML="6.0.4", boto3="1.44.8")
    pip = [{"name": "PyYAML", "version": "6.0.4"}, {"name": "boto3", "version": "1.44.8"}]
    dpkg = "ii \ttini\t0.19.0-1\nrc \told-removed\t1.0\n"
    locked = {"pyyaml": {"a" * 64, "c" * 64}}
    manifest = {"python_packages": {"pyyaml": "6.0.4", "boto3": "1.44.8"},
                "system_packages": {"tini": "0.19.0-1"}}
    ok = image_checks.check_sbom(sbom, pip, dpkg, locked, manifest)
    assert ok.startswith("SBOM ok: 2 Python distributions") and "1 Debian" in ok
    with pytest.raises(image_checks.Failed, match=r"boto3: installed 1\.44\.9, SBOM 1\.44\.8"):
        image_checks.check_sbom(sbom, [pip[0], {"name": "boto3", "version": "1.44.9"}], dpkg,
                                locked)
    with pytest.raises(image_checks.Failed, match="dpkg: g\\+\\+: installed 12, SBOM -"):
        image_checks.check_sbom(sbom, pip, dpkg + "ii \tg++\t12\n", locked)
    with pytest.raises(image_checks.Failed, match=r"pyyaml: SHA-256 .* not one of its lock's"):
        image_checks.check_sbom(sbom, pip, dpkg, {"pyyaml": {"c" * 64}})
    with pytest.raises(image_checks.Failed, match="build manifest's system_packages"):
        image_checks.check_sbom(sbom, pip, dpkg, locked, {**manifest, "system_packages": {}})
    without_base = {**sbom, "components": sbom["components"][:-1]}
    with pytest.raises(image_checks.Failed, match="no base image"):
        image_checks.check_sbom(without_base, pip, dpkg, locked)
    with pytest.raises(image_checks.Failed, match="reproducible"):
        image_checks.check_sbom({**sbom, "serialNumber": "urn:uuid:1"}, pip, dpkg, locked)


def test_the_size_line_names_each_image_and_the_optional_clients_shares():
    line = image_checks.size_line({"t:cpu": 1_430_000_000, "t:cuda-on-cpu": 1_440_000_000},
                                  {"boto3": 19_800_000, "torchft": 12_340_000})
    assert line == ("image sizes: t:cpu 1.43 GB, t:cuda-on-cpu 1.44 GB; boto3 and its "
                    "dependencies add 19.8 MB, torchft and its dependencies add 12.3 MB")
    assert image_test.CPU_LIMIT_GB == 1.5


def test_the_replica_check_wants_every_step_trained_once_by_every_group(tmp_path):
    def run(rows, result_step=3):
        d = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        (d / "logs").mkdir(parents=True)
        (d / "logs/lighthouse.log").write_text("")
        (d / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "result.json").write_text(json.dumps({"step": result_step}))
        return d
    full = [{"step": s, "samples": [], "replicas": [1, 0]} for s in (1, 2, 3)]
    assert "3 steps, each by all 2" in image_ft.check_replica_ledger(run(full), 3, 2)
    with pytest.raises(image_checks.Failed, match=r"steps \[2\] trained without all 2"):
        image_ft.check_replica_ledger(run([*full[:1], {**full[1], "replicas": [0]},
                                           full[2]]), 3, 2)
    with pytest.raises(image_checks.Failed, match=r"steps \[1, 3\], expected 1..3"):
        image_ft.check_replica_ledger(run([full[0], full[2]]), 3, 2)
    with pytest.raises(image_checks.Failed, match="not at step 3"):
        image_ft.check_replica_ledger(run(full, result_step=2), 3, 2)


def test_lock_hashes_are_read_per_package():
    allowed = locks.hashes((ROOT / "requirements/image-py311.lock").read_text())
    assert len(allowed["boto3"]) == 2 and all(len(h) == 64 for h in allowed["boto3"])
    assert "python-dateutil" in allowed and "torch" not in allowed


def test_run_directories_are_checked_as_the_host_sees_them(tmp_path, tiny_gpt):
    run = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "train",
                          str(tiny_gpt), "train.max_steps=2", "checkpoint.every_steps=2",
                          "run.name=quick"], cwd=tmp_path, env=clean_env(),
                         capture_output=True, text=True, timeout=limit(300))
    assert run.returncode == 0, run.stderr
    runs = tiny_gpt.parent / "runs"
    with pytest.raises(image_checks.Failed, match="image build manifest"):
        image_checks.check_run_dirs(runs, (("quick", 1),))  # not built in an image
    manifest = json.loads((runs / "quick/manifest.json").read_text())
    manifest["image_build_manifest"] = {"flavor": "cpu", "python_packages": {"torch": "x"}}
    (runs / "quick/manifest.json").write_text(json.dumps(manifest))
    assert image_checks.check_run_dirs(runs, (("quick", 1),))[0].startswith("quick: world 1")
    with pytest.raises(image_checks.Failed, match="world size"):
        image_checks.check_run_dirs(runs, (("quick", 2),))


def test_shm_warning_is_recognised_in_doctors_words(tmp_path):
    """doctor's own words for a small /dev/shm (a 64 MB tmpfs stands in: a folder's file
    system is what check_shm measures), then for a large one."""
    from launcher.detection.system import check_shm
    finding = check_shm(str(tmp_path / "absent"))
    assert image_checks.shm_warned(f"WARN       {finding.message}")
    assert not image_checks.shm_warned("ok         /dev/shm is 8.00 GiB")


def test_engine_flags_follow_the_engine(monkeypatch):
    podman = image_test.Engine.from_environ({"OCI_ENGINE": "podman",
                                             "OCI_BUILD_FLAGS": "--isolation=chroot"})
    assert podman.build_flags[0] == "--isolation=chroot" and "--format=docker" in \
        podman.build_flags and any(f.startswith("--timestamp=") for f in podman.build_flags)
    assert podman.tmp_flags == []
    docker = image_test.Engine.from_environ({"OCI_ENGINE": "docker"})
    assert docker.tmp_flags == ["--tmpfs", "/tmp:exec"] and docker.build_flags == []


# A container engine that builds nothing: a build fails if it sees more than two
# running, and waits until two are (or every one of the batch has started), so builds
# run one after another never finish; it fails for a tag named "bad". ``image inspect`` answers
# for any tag.
FAKE_ENGINE = """#!/usr/bin/env python3
import os, sys, time
from pathlib import Path
here = Path(os.environ["FAKE_ENGINE_DIR"])
if sys.argv[1] == "image":
    print("1000" if "Size" in sys.argv[4] else "sha256:" + sys.argv[5])
    sys.exit(0)
tag = sys.argv[sys.argv.index("-t") + 1].replace(":", "_")
count = lambda what: len(list(here.glob(what + "-*")))
(here / f"started-{tag}").touch()
try:
    if count("started") - count("ended") > 2 or "bad" in tag:
        sys.exit(1)
    deadline = time.monotonic() + float(os.environ["FAKE_ENGINE_WAIT_S"])
    while count("started") - count("ended") < 2 and \\
            count("started") < int(os.environ["FAKE_ENGINE_BUILDS"]):
        if time.monotonic() > deadline:
            sys.exit(2)
        time.sleep(0.05)
    time.sleep(0.5)  # a third build started at once would be there by now
    if count("started") - count("ended") > 2:
        sys.exit(3)
    (here / f"done-{tag}").touch()
finally:
    (here / f"ended-{tag}").touch()
"""


def _fake_engine(tmp_path, monkeypatch, builds: int) -> image_test.Engine:
    engine = tmp_path / "engine"
    engine.write_text(FAKE_ENGINE)
    engine.chmod(0o755)
    (tmp_path / "build").mkdir()
    monkeypatch.setattr("tools.oci.ROOT", tmp_path)  # the build logs go to its build/
    monkeypatch.setenv("FAKE_ENGINE_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_ENGINE_BUILDS", str(builds))
    monkeypatch.setenv("FAKE_ENGINE_WAIT_S", str(limit(60)))
    return image_test.Engine(str(engine))


def test_the_images_build_two_at_a_time(tmp_path, monkeypatch):
    engine = _fake_engine(tmp_path, monkeypatch, builds=5)
    engine.build_all([("Dockerfile.cpu", f"t:{n}", ["--no-cache"]) for n in range(5)],
                     context=str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("done-*")) == [f"done-t_{n}" for n in range(5)]


def test_a_failed_build_fails_the_batch_once_the_others_have_ended(tmp_path, monkeypatch):
    engine = _fake_engine(tmp_path, monkeypatch, builds=3)
    with pytest.raises(image_test.Failed, match=r"build of Dockerfile\.cuda failed"):
        engine.build_all([("Dockerfile.cpu", "t:cpu", []), ("Dockerfile.cuda", "t:bad", []),
                          ("Dockerfile.rocm", "t:rocm", [])], context=str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("done-*")) == ["done-t_cpu", "done-t_rocm"]


# ------------------------------------------------------------------ locks

def test_pytest_requirements_come_hash_locked_from_the_dev_lock(tmp_path):
    text = locks.pytest_requirements(ROOT / "requirements/image-py311.lock",
                                     ROOT / "requirements/dev-py311.lock")
    names = [line.split("==")[0] for line in text.splitlines() if "==" in line]
    assert "pytest" in names and "--hash=sha256:" in text
    runtime = locks.entries((ROOT / "requirements/image-py311.lock").read_text())
    assert not set(names) & set(runtime), "what the image has is not installed twice"
    lacking = tmp_path / "dev.lock"
    lacking.write_text("")
    with pytest.raises(ValueError, match="pytest"):
        locks.pytest_requirements(ROOT / "requirements/image-py311.lock", lacking)


def test_a_gpu_stage_that_exits_0_without_saying_what_it_must_fails(tmp_path):
    """The dcp stage passes only when the run resumed: a run that started over exits 0."""
    ctx = gpu_check.Context(python=sys.executable, out=tmp_path / "out", work=tmp_path,
                            env=dict(os.environ))
    rec = stages.Recorder(tmp_path / "out", "check")
    for said, ok in (("resumed from /r/step-30 at step 30", True), ("step 1/45", False)):
        stage = gpu_check.Stage("dcp", 30,
                                lambda c, said=said: [c.python, "-c", f"print({said!r})"],
                                lambda c, out: out.strip(), must_say=gpu_check.RESUMED)
        gpu_check.run_stage(rec, ctx, stage)
        row = json.loads((tmp_path / "out/stages.jsonl").read_text().splitlines()[-1])
        assert row["ok"] is ok and row["rc"] == 0, row


# ------------------------------------------------------------------ make venv's torch

def _closed_port() -> int:
    import socket
    with socket.socket() as s:  # bound, never listening: a connection is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install_torch(tmp_path: Path, index: str, retries: int) -> subprocess.CompletedProcess:
    """tools/install_torch.py as make venv runs it, with pip seeing no other source: no
    config file, no find-links, the main index on 127.0.0.1 too; into a throwaway folder."""
    env = clean_env(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=index.rsplit("/", 2)[0] +
                    "/simple", PIP_RETRIES=str(retries))
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_EXTRA_INDEX_URL", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "install_torch.py"), sys.executable,
         str(tmp_path / "pip.log"), "torch==2.13.0+cpu", index, "--no-deps",
         "--target", str(tmp_path / "site")], env=env, capture_output=True, text=True,
        timeout=limit(300))


@pytest.mark.parametrize("retries", [1, 0], ids=["pip says it", "pip is silent"])
def test_an_unreachable_torch_index_is_one_line_naming_the_alternatives(tmp_path, retries):
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    out = _install_torch(tmp_path, index, retries)
    assert out.returncode == 3, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"make venv: cannot reach {index} to install torch==2.13.0+cpu "
                               "(connection refused); set TORCH_INDEX_URL="), lines[0]
    assert "TORCH_SPEC=" in lines[0] and "TORCH_VARIANT=pypi" in lines[0], lines[0]
    assert "No matching distribution" in (tmp_path / "pip.log").read_text()  # pip's words kept
    assert not (tmp_path / "site").exists()


def test_an_index_without_the_build_says_so_not_unreachable(tmp_path):
    empty = tmp_path / "index"
    (empty / "torch").mkdir(parents=True)  # a reachable index (a folder) with no torch
    out = _install_torch(tmp_path, empty.as_uri(), 0)
    assert out.returncode == 3, out.stderr
    line = out.stderr.strip()
    assert line.startswith(f"make venv: {empty.as_uri()} has no torch==2.13.0+cpu for this "
                           "Python and platform"), line


def test_make_venv_takes_pypis_torch_for_the_pypi_variant():
    def recipe(*args: str) -> str:
        env = {k: v for k, v in clean_env().items() if not k.startswith("TORCH_")}
        out = subprocess.run(["make", "-n", "-B", "venv", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True).stdout
        return next(line for line in out.replace("\\\n", " ").splitlines()
                    if "install_torch.py" in line)
    assert '"torch==2.13.0+cpu"' in recipe() and "download.pytorch.org/whl/cpu" in recipe()
    pypi = recipe("TORCH_VARIANT=pypi")
    assert '"torch==2.13.0"' in pypi and "download.pytorch.org" not in pypi, pypi
