"""entrypoint.py as users meet it: --help, --dry-run, exit codes 2/3 with one-line
errors, doctor (with fake AMD tools), the rendezvous store. Real training through
torchrun (two ranks), SIGTERM -> 143, doctor --comm and two simulated nodes:
tests/e2e/test_entrypoint_runs.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from tests.harness.runs import ENTRY, FAKES, QUICKSTART, ROOT, clean_env, entry, limit, read_until

TORCH_IS_ROCM = bool(__import__("torch").version.hip)
TORCH_KIND = "rocm" if TORCH_IS_ROCM else "cuda" if __import__("torch").version.cuda else "cpu"


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------- CLI

def test_help_imports_nothing_heavy(tmp_path):
    out = subprocess.run([sys.executable, "-X", "importtime", ENTRY, "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=limit(30))
    assert out.returncode == 0, out.stderr
    assert "train CONFIG" in out.stdout and "rendezvous" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "launcher.cli" in imported
    assert not {"torch", "yaml", "numpy", "train.core.config"} & imported


def test_help_lists_every_exit_code(tmp_path):
    from train.core.errors import EXIT_CODES
    out = entry("--help", cwd=tmp_path, timeout=30)
    listed = " ".join(out.stdout.split("exit codes:", 1)[1].split())
    assert [int(c) for c in re.findall(r"(?:^|; )(\d+) ", listed)] == list(EXIT_CODES)


def test_no_arguments_prints_help(tmp_path):
    out = entry(cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: entrypoint.py")


def documented_multinode_dry_runs() -> list[str]:
    """The docs' and README's commands that dry-run a multi-node range (TRAIN_NNODES=)."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"^```(?:bash|sh)?\n(.*?)^```", page.read_text(), re.M | re.S):
            command = block.replace("\\\n", " ")
            found += [line.strip() for line in command.splitlines()
                      if "TRAIN_NNODES=" in line and "--dry-run" in line]
    return found


@pytest.mark.parametrize("command", documented_multinode_dry_runs())
def test_a_documented_multinode_dry_run_passes_as_written(tmp_path, command):
    """Its range's world sizes all divide the config's global batch (exit 0, a plan)."""
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    args = words[words.index("entrypoint.py") + 1:]
    out = entry(*args, cwd=ROOT, env=clean_env(**env), timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"nnodes={env['TRAIN_NNODES']}" in out.stdout


def test_an_indexed_job_pod_without_a_store_is_told_it_trains_alone(tmp_path):
    out = entry("train", QUICKSTART, "--dry-run", cwd=tmp_path,
                env=clean_env(JOB_COMPLETION_INDEX="1"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "convention=single" in out.stdout
    assert ("# note: JOB_COMPLETION_INDEX=1 without TRAIN_RDZV_ENDPOINT: this pod trains alone, "
            "as a single node; for one job across pods set TRAIN_RDZV_ENDPOINT, TRAIN_NNODES "
            "and TRAIN_RDZV_ID") in out.stdout.splitlines()
    alone = entry("train", QUICKSTART, "--dry-run", cwd=tmp_path, timeout=120)
    assert "JOB_COMPLETION_INDEX" not in alone.stdout


def test_dry_run_prints_a_runnable_plan(tmp_path):
    out = entry("train", QUICKSTART, "distributed.nproc_per_node=2", "--dry-run", cwd=tmp_path,
                timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("# mode=torchrun device=cpu backend=gloo nproc_per_node=2")
    argv = shlex.split(lines[-1])
    assert "OMP_NUM_THREADS=" in out.stdout and argv[1:3] == ["-m", "launcher.torchrun"]
    assert argv[-4:] == [QUICKSTART, "distributed.nproc_per_node=2", "device=cpu",
                         "distributed.backend=gloo"]
    assert argv[argv.index("-m", 3) + 1] == "train.worker"
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.parametrize("args, env, start", [
    (["train", "missing.yaml"], {}, "error: missing.yaml: no such file"),
    (["train", QUICKSTART, "optim.lrr=1"], {}, "error: command line: optim.lrr: unknown key"),
    (["train", QUICKSTART, "train.max_steps=-1"], {}, "error: command line: train.max_steps:"),
    (["train", QUICKSTART, "oops"], {}, "error: command line: oops: overrides look like"),
    (["train", QUICKSTART, "distributed.nproc_per_node=3"], {},
     f"error: {QUICKSTART}: train.global_batch_size: 32 is not divisible by world size 3"),
    (["train", QUICKSTART, "--bogus"], {}, "error: command line: train: unrecognized"),
    (["train"], {}, "error: command line: train: the following arguments are required"),
    (["train", QUICKSTART], {"PET_NNODES": "x:y"}, "error: environment: PET_NNODES:"),
    (["train", QUICKSTART], {"TRAIN_DEBUG": "maybe"}, "error: environment: TRAIN_DEBUG:"),
    (["no-such-command-xyz"], {}, "error: command line: no-such-command-xyz: unknown command"),
    (["--nope"], {}, "error: command line: --nope: unknown option"),
    (["rendezvous", "--port", "http"], {}, "error: command line: rendezvous: argument --port"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, env, start):
    out = entry(*args, cwd=tmp_path, env=clean_env(**env), timeout=120)
    assert out.returncode == 2, out.stderr
    assert one_error_line(out.stderr).startswith(start)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", [["train", QUICKSTART, "--dry-run"], ["doctor"]])
def test_every_bad_environment_variable_is_reported_at_once(tmp_path, command):
    """Like a config's problems: one line each, exit 2, not one per attempt."""
    env = clean_env(OMP_NUM_THREADS="0", TRAIN_DEBUG="maybe", TRAIN_DNS_WAIT_S="-1")
    out = entry(*command, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: environment: OMP_NUM_THREADS: got '0'; expected a positive integer",
        "error: environment: TRAIN_DEBUG: got 'maybe'; expected 1 or 0",
        "error: environment: TRAIN_DNS_WAIT_S: got '-1'; expected a number of seconds >= 0"]


@pytest.mark.parametrize("command", [["train", QUICKSTART, "--dry-run"], ["doctor"]])
def test_a_launch_conventions_bad_variables_come_with_the_others_at_once(tmp_path, command):
    """A convention stops at its first bad variable; all of them are said, together with
    the environment's own, in one answer."""
    env = clean_env(OMP_NUM_THREADS="0", PET_NNODES="abc", PET_NPROC_PER_NODE="x",
                    PET_MAX_RESTARTS="y")
    out = entry(*command, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0] == "error: environment: OMP_NUM_THREADS: got '0'; expected a positive integer"
    assert sorted(lines[1:]) == [
        "error: environment: PET_MAX_RESTARTS: got 'y'; expected an integer",
        "error: environment: PET_NNODES: got 'abc'; expected N or MIN:MAX with 1 <= MIN <= MAX",
        "error: environment: PET_NPROC_PER_NODE: got 'x'; expected an integer"], out.stderr
    # the same without the environment's own problem: the plan's stage says all three
    out = entry(*command, cwd=tmp_path, env=dict(env, OMP_NUM_THREADS="1"), timeout=120)
    said = [line for line in (out.stderr + out.stdout).splitlines() if "PET_" in line]
    assert out.returncode == 2 and len(said) == 3, out.stderr + out.stdout


def test_every_missing_or_bad_store_variable_is_reported_at_once(tmp_path):
    env = clean_env(TRAIN_RDZV_ENDPOINT="store:99999", TRAIN_NNODES="4:1")
    out = entry("train", QUICKSTART, "--dry-run", cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert [line.split(": ")[1] for line in out.stderr.strip().splitlines()] == [
        "environment", "environment", "environment"]
    assert [line.split(": ")[2] for line in out.stderr.strip().splitlines()] == [
        "TRAIN_RDZV_ID", "TRAIN_NNODES", "TRAIN_RDZV_ENDPOINT"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides, words", [
    (["device=gpu"], "device=gpu but no usable GPU here"),
    (["distributed.backend=nccl"], "nccl needs GPUs"),
    (["distributed.backend=mpi"], "was built without mpi"),
    (["distributed.strategy=dp"], "dp needs GPUs"),
])
def test_not_runnable_here_exits_3_with_one_line(tmp_path, overrides, words):
    out = entry("train", QUICKSTART, *overrides, cwd=tmp_path, timeout=120)
    assert out.returncode == 3, out.stderr
    assert words in one_error_line(out.stderr)


def test_unwritable_output_dir_exits_3(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for dry in ([], ["--dry-run"]):
        out = entry("train", QUICKSTART, f"output.dir={tmp_path / 'file' / 'runs'}", *dry,
                    cwd=tmp_path, timeout=120)
        assert out.returncode == 3, out.stderr
        assert "is not writable" in one_error_line(out.stderr)


def test_other_commands_are_executed(tmp_path):
    out = entry("python", "-c", "import sys; print('hi'); sys.exit(5)", cwd=tmp_path, timeout=120)
    assert out.returncode == 5 and out.stdout == "hi\n"


# ------------------------------------------------------------------------- doctor

def test_doctor_here_is_ready_on_cpu(tmp_path):
    manifest = tmp_path / "m.json"
    sbom = tmp_path / "sbom.cdx.json"
    sbom.write_text('{"bomFormat": "CycloneDX"}')
    manifest.write_text(json.dumps({"flavor": "cpu", "base_image": "debian:12",
                                    "torch": {"version": "9.9.9"},
                                    "sbom": {"path": str(sbom), "sha256": "0" * 64}}))
    out = entry("doctor", "--json", cwd=tmp_path,
                env=clean_env(TRAIN_BUILD_MANIFEST=str(manifest)), timeout=120)
    digest = hashlib.sha256(sbom.read_bytes()).hexdigest()
    assert json.loads(out.stdout)["sbom"] == {"path": str(sbom), "sha256": digest,
                                              "as_built": False}  # changed since the build
    out = entry("doctor", cwd=tmp_path, env=clean_env(TRAIN_BUILD_MANIFEST=str(manifest)),
                timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpus       none found (CPU only)" in out.stdout
    assert "NVIDIA_VISIBLE_DEVICES=void" in out.stdout and "/dev/shm" in out.stdout
    assert "flavor=cpu, base=debian:12, torch=9.9.9" in out.stdout
    assert "records torch 9.9.9" in out.stdout  # venv changed after the build
    assert out.stdout.strip().endswith("verdict    ready to train")


def test_doctor_json(tmp_path):
    out = entry("doctor", "--json", cwd=tmp_path, timeout=120)
    report = json.loads(out.stdout)
    assert out.returncode == report["exit_code"] == 0
    assert report["torch"]["kind"] == TORCH_KIND and report["hardware"]["vendor"] is None
    assert report["plan"]["device"] == "cpu" and report["plan"]["backend"] == "gloo"
    assert report["build_manifest"] == {"path": "/app/build-manifest.json", "present": False,
                                        "content": None}
    assert report["sbom"] is None  # not in an image: no build manifest names one
    assert {f["topic"] for f in report["findings"]} >= {"plan", "output", "shm"}
    assert report["network"]["interfaces"]


def test_doctor_reports_a_bad_config_with_exit_2(tmp_path):
    out = entry("doctor", QUICKSTART, "model.width=7", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "FAIL" in out.stdout and "model.heads" in out.stdout


@pytest.mark.skipif(TORCH_IS_ROCM, reason="this torch can drive the fake AMD GPU")
def test_doctor_with_amd_gpus_and_a_non_rocm_torch_exits_3(tmp_path):
    from tests.harness.plans import kfd_tree
    kfd_tree(tmp_path / "hw", {7: (31896, 128, 90010)}, present=[128])
    env = clean_env(PATH=f"{FAKES}:{os.environ['PATH']}", TRAIN_HW_ROOT=str(tmp_path / "hw"),
                    FAKE_ROCM_SMI_OUTPUT=str(FAKES / "outputs" /
                                             "rocm-smi-showproductname-mi250x.json"),
                    ROCR_VISIBLE_DEVICES="0", HIP_VISIBLE_DEVICES="0")
    out = entry("doctor", cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 3, out.stdout
    assert "1 usable of 1 listed (amd, via rocm-smi)" in out.stdout
    assert "AMD INSTINCT MI200" in out.stdout and "gfx90a" in out.stdout
    assert re.search(r"(CPU-only|CUDA) build and cannot use the 1 AMD GPU", out.stdout)
    assert "use the ROCm image" in out.stdout
    assert "both ROCR_VISIBLE_DEVICES='0' and HIP_VISIBLE_DEVICES='0'" in out.stdout
    train = entry("train", QUICKSTART, cwd=tmp_path, env=env, timeout=120)
    assert train.returncode == 3 and "use the ROCm image" in one_error_line(train.stderr)
    cpu = entry("train", QUICKSTART, "device=cpu", "--dry-run", cwd=tmp_path, env=env, timeout=120)
    assert cpu.returncode == 0 and "ignoring 1 GPU" in cpu.stdout


def test_doctor_sees_listed_but_unusable_amd_gpus(tmp_path):
    env = clean_env(PATH=f"{FAKES}:{os.environ['PATH']}", TRAIN_HW_ROOT=str(tmp_path),
                    FAKE_ROCM_SMI_OUTPUT=str(FAKES / "outputs" / "rocm-smi-7900xt-2cards.json"))
    out = entry("doctor", cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0  # trains on the CPU, with the warning
    assert "0 usable of 2 listed" in out.stdout and "--device /dev/kfd" in out.stdout


def test_comm_summary_names_the_rank_that_did_not_answer(tmp_path):
    from launcher.commands import comm
    from train.core.run import protocol
    protocol.write(tmp_path, protocol.Report(rank=0, kind="comm", stage="allreduce"))
    protocol.write(tmp_path, protocol.Report(rank=1, kind="comm", stage="init"))
    result = comm.summarise(str(tmp_path), 3, [0, 1], ["", "", "ImportError: x"], "gpu",
                            "nccl", 30)
    assert not result["ok"]
    assert result["problems"] == [
        "rank 0 did not answer within 30 s (stuck at stage 'allreduce')",
        "rank 1 did not answer within 30 s (stuck at stage 'init')",
        "rank 2 did not answer within 30 s (stuck at stage 'not started')"]


# --------------------------------------------------------------------- rendezvous

def test_rendezvous_store_serves_clients_and_stops_on_sigterm(tmp_path):
    proc = subprocess.Popen([sys.executable, ENTRY, "rendezvous", "--port", "0"], cwd=tmp_path,
                            env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        port = int(read_until(proc, r"listening on 0\.0\.0\.0:(\d+)")[1])
        import datetime

        import torch.distributed as dist
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=datetime.timedelta(seconds=limit(10)))
        client.set("some/key", "v")
        assert client.get("some/key") == b"v"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=limit(20)) == 0
        read_until(proc, "stopping")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_gpu_check_reports_no_gpu_cleanly_here(tmp_path):
    out = subprocess.run([str(ROOT / "scripts" / "gpu-check")], cwd=tmp_path,
                         env=clean_env(PYTHON=sys.executable, OUT=str(tmp_path / "out")),
                         capture_output=True, text=True, timeout=limit(120))
    assert out.returncode == 3, out.stdout + out.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "deps     ok" in summary and "doctor   ok" in summary
    assert "no GPU: NVIDIA_VISIBLE_DEVICES=void" in summary
    assert "skipped: no GPU here" in summary
    assert json.loads((tmp_path / "out" / "doctor.json").read_text())["hardware"]["gpus"] == []
    stages = [json.loads(x) for x in (tmp_path / "out" / "stages.jsonl").read_text().splitlines()]
    assert [s["name"] for s in stages] == ["deps", "doctor", "gpu-stages"]


# ------------------------------------------------------------- the wrong Python

def test_install_fix_points_a_checkout_at_its_venv(tmp_path, monkeypatch):
    from launcher.detection.compat import install_fix
    image = tmp_path / "app"
    image.mkdir()
    assert "rebuild the image" in install_fix(str(image))
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "Makefile").write_text("")
    assert "make venv" in install_fix(str(checkout))  # no .venv yet
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".venv" / "bin" / "python").touch()
    monkeypatch.chdir(checkout)
    fix = install_fix(str(checkout), python="/usr/bin/python3")
    assert "/usr/bin/python3 is not this checkout's environment" in fix
    assert "`.venv/bin/python entrypoint.py ...`" in fix and ". .venv/bin/activate" in fix
    monkeypatch.chdir(tmp_path)  # elsewhere: absolute paths
    assert f"`{checkout}/.venv/bin/python {checkout}/entrypoint.py ...`" in install_fix(
        str(checkout), python="/usr/bin/python3")


@pytest.mark.parametrize("missing", ["torch", "yaml"])
def test_a_python_without_the_dependencies_gets_one_line_and_exit_3(tmp_path, missing):
    """As with the system python instead of .venv's: no traceback, what to do instead."""
    code = (f"import sys; sys.modules[{missing!r}] = None; sys.path.insert(0, {str(ROOT)!r}); "
            "from launcher.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "train", QUICKSTART], cwd=tmp_path,
                         env=clean_env(), capture_output=True, text=True, timeout=limit(120))
    line = one_error_line(out.stderr)
    assert out.returncode == 3, out.stderr
    assert missing in line and ".venv" in line, line
    assert not (tmp_path / "runs").exists()
