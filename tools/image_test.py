"""The image test: build the real images and run them (``make image-test``, ``.ci/run``).

1. fill a wheelhouse (``build/wheelhouse-pyXY``, cached by lock hash) with ``pip
   download``: the hash-locked runtime set, pytest's few wheels, the SBOM generator
   (``requirements/sbom.lock``), the CPU torch wheel;
   every ``requirements/torch-*.lock`` must resolve for its image's platform
   (``scripts/check-torch-resolution locks``: index metadata, no download), asked while
   the images build;
2. build every image before any check, two at a time (no package index inside a
   build): Dockerfile.cpu, and unless skipped its second build (step 6), then
   Dockerfile.cuda and Dockerfile.rocm (step 5) (``Engine.build_all``: why two);
3. check its SBOM (/app/sbom.cdx.json) against ``pip list`` and ``dpkg-query`` inside it
   and the runtime lock's hashes; run it as its non-root user with a host run directory:
   doctor, a short quickstart training, a 2-process gloo run, a fast subset of the
   suite; check the run directories on the host; train with ``checkpoint.remote``
   against a real S3 server and resume from the store in a fresh container with an empty
   run directory (:mod:`.image_s3`); serve ``entrypoint.py lighthouse`` and train 2
   replica groups with torchft (:mod:`.image_ft`);
4. run it as an arbitrary UID in group 0 (OpenShift-style), then with a read-only root,
   writable /tmp and /workspace and the default 64 MB /dev/shm: doctor must warn about
   shm, training must still work, torch.compile must work (g++ kept); build the user
   image of examples/custom_model/Dockerfile on it and run its default command the same
   way (the custom model, loss and data trained);
5. Dockerfile.cuda and Dockerfile.rocm, built on the CPU base with the CPU torch wheel
   (TORCH_VARIANT=cpu: every line but the vendor base and wheel), train;
6. the CPU image's two builds, both without cache (neither may reuse the other's layers
   while they run side by side), are compared: package sets, then every file's path,
   mode and content (``scripts/file-manifest``);
7. print each image's size and what the S3 client and torchft add; the CPU image stays
   within ``CPU_LIMIT_GB``.

``scripts/image-test`` finds the engine and runs this module. Settings (environment):
``OCI_ENGINE`` (docker | podman), ``OCI_BUILD_FLAGS``, ``OCI_RUN_FLAGS``,
``OCI_BASE_IMAGE`` (substitute every FROM), ``IMAGE_PYTHON`` (the base's python, 3.11),
``TORCH_WHEEL_INDEX`` (index of the CPU torch wheel; default: pip's configuration),
``TORCH_LOCK`` (auto | none), ``IMAGE_TEST_SKIP`` (space-separated: locks vendor
rebuild compile pytest s3 ft), ``IMAGE_TAG``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tools.image_checks import (
    check_build_manifest,
    check_labels,
    check_run_dirs,
    check_sbom,
    compare_build_manifests,
    layers_line,
    shm_warned,
    size_line,
    wheelhouse_stamp,
)
from tools.image_ft import replica_run
from tools.image_s3 import s3_run
from tools.locks import hashes, pytest_requirements
from tools.oci import ROOT, Engine, Failed, log, sh
from train.core.run import rundir


def dockerfile_arg(name: str, file: str = "Dockerfile.cpu") -> str:
    m = re.search(rf"^ARG {name}=(\S+)", (ROOT / file).read_text(), re.M)
    if not m:
        raise Failed(f"{file} has no ARG {name}")
    return m.group(1)


# ------------------------------------------------------------------ the run

@dataclass
class ImageTest:
    engine: Engine
    env: dict[str, str]
    tag: str = "trainimg"
    image_python: str = "3.11"
    skip: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.pyv = "py" + self.image_python.replace(".", "")
        self.torch_version = dockerfile_arg("TORCH_VERSION")
        self.base = self.env.get("OCI_BASE_IMAGE") or dockerfile_arg("BASE_IMAGE")
        self.base_args = [f"--build-arg=BASE_IMAGE={self.env['OCI_BASE_IMAGE']}"] \
            if self.env.get("OCI_BASE_IMAGE") else []
        self.wheels = ROOT / "build" / f"wheelhouse-{self.pyv}"
        self.image_wheels = ROOT / "build" / f"wheelhouse-{self.pyv}-image"
        self.pytest_req = ROOT / "build" / f"image-test-pytest-{self.pyv}.txt"
        self.img = f"{self.tag}:cpu"
        self.again = f"{self.tag}:cpu-rebuild"

    def provenance(self) -> list[str]:
        describe = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                  capture_output=True, text=True).stdout.strip() or "unknown"
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
        version = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(),
                            re.M).group(1)
        return [f"--build-arg=VCS_REF={rev}", f"--build-arg=CODE_VERSION={version}+git.{describe}",
                f"--build-arg=TORCH_LOCK={self.env.get('TORCH_LOCK', 'auto')}"]

    def build_images(self) -> None:
        """The CPU image and, unless skipped, its second build and the vendor images on the
        CPU base, two at a time (build/image-test-*.log)."""
        builds = [("Dockerfile.cpu", self.img, self.base_args)]
        if "rebuild" not in self.skip:
            builds = [(file, tag, [*args, "--no-cache"])
                      for file, tag, args in (*builds, ("Dockerfile.cpu", self.again,
                                                        self.base_args))]
        if "vendor" not in self.skip:
            builds += [(f"Dockerfile.{flavor}", f"{self.tag}:{flavor}-on-cpu",
                        [f"--build-arg=BASE_IMAGE={self.base}", "--build-arg=TORCH_VARIANT=cpu"])
                       for flavor in VENDORS]
        log(f"building {', '.join(tag for _, tag, _ in builds)}, two at a time "
            f"(base: {self.base})")
        self.engine.build_all([(file, tag, [*self.provenance(), *args])
                               for file, tag, args in builds], context=str(self.image_wheels))

    def locks_resolve(self) -> None:
        log("torch locks resolve for their images' Python and glibc (index metadata only)")
        sh(sys.executable, str(ROOT / "scripts/check-torch-resolution"), "locks")

    # -------------------------------------------------------------- wheelhouse
    def fill_wheelhouse(self) -> None:
        lock = ROOT / "requirements" / f"image-{self.pyv}.lock"
        if not lock.is_file():
            raise Failed(f"no runtime lock for python {self.image_python}: {lock}")
        (ROOT / "build").mkdir(exist_ok=True)
        self.pytest_req.write_text(pytest_requirements(
            lock, ROOT / "requirements" / f"dev-{self.pyv}.lock"))
        index = self.env.get("TORCH_WHEEL_INDEX", "")
        sbom_lock = ROOT / "requirements" / "sbom.lock"
        stamp = wheelhouse_stamp(lock.read_text(), self.pytest_req.read_text(),
                                 sbom_lock.read_text(), f"torch=={self.torch_version}+cpu {index}")
        stamp_file = self.wheels / ".stamp"
        if not stamp_file.is_file() or stamp_file.read_text().strip() != stamp:
            log(f"filling {self.wheels} (pip download; cached until the locks change)")
            shutil.rmtree(self.wheels, ignore_errors=True)
            self.wheels.mkdir(parents=True)
            # wheels for the image's python and glibc (Debian 12: 2.36), not the host's
            platforms = sh(str(ROOT / "scripts/wheel-platforms"), "2.36",
                           capture=True).stdout.split()
            download = [sys.executable, "-m", "pip", "download", "--quiet",
                        "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
                        "--python-version", self.image_python, "--dest", str(self.wheels),
                        *platforms]
            sh(*download, "--require-hashes", "-r", str(lock))
            sh(*download, "--require-hashes", "-r", str(self.pytest_req))
            sh(*download, "--require-hashes", "-r", str(sbom_lock))  # scripts/sbom's generator
            sh(*download, *(["--index-url", index] if index else []),
               f"torch=={self.torch_version}+cpu")
            stamp_file.write_text(stamp + "\n")
        # the images' wheelhouse must not carry pytest (packaging stays: tensorboard's too)
        shutil.rmtree(self.image_wheels, ignore_errors=True)
        self.image_wheels.mkdir()
        for wheel in self.wheels.glob("*.whl"):
            if not wheel.name.startswith(("pytest-", "iniconfig-", "pluggy-", "pygments-")):
                try:
                    os.link(wheel, self.image_wheels / wheel.name)
                except OSError:  # another file system
                    shutil.copy2(wheel, self.image_wheels / wheel.name)

    # -------------------------------------------------------------- the CPU image
    def plumbing(self) -> None:
        e, img = self.engine, self.img
        log("image plumbing: user, layout, labels, build manifest")
        e.run("--entrypoint", "bash", img, "-c", PLUMBING)
        log("PIP_CONSTRAINT: a derived image's pip cannot replace torch")
        e.run("--entrypoint", "bash", img, "-c", PIP_CONSTRAINT)
        print(check_labels(json.loads(e.inspect(img, "{{json .Config.Labels}}"))))
        entry = json.loads(e.inspect(img, "{{json .Config.Entrypoint}}"))
        if entry != ["tini", "--", "python3", "/app/entrypoint.py"]:
            raise Failed(f"unexpected ENTRYPOINT {entry}")
        manifest = self.manifest_of(img, ROOT / "build/image-test-manifest-1.json")
        print(check_build_manifest(manifest, self.torch_version))
        self.sbom(img, manifest)

    def sbom(self, tag: str, manifest: dict) -> None:
        """/app/sbom.cdx.json against pip list (/opt/venv) and dpkg-query inside the image,
        the hashes against the runtime lock's."""
        log(f"SBOM of {tag}: pip list, dpkg-query, the lock's hashes, the build manifest")
        facts = json.loads(self.engine.run("--entrypoint", "python3", tag, "-c", SBOM_FACTS,
                                           capture=True).stdout)
        locked = hashes((ROOT / "requirements" / f"image-{self.pyv}.lock").read_text())
        print(check_sbom(facts["sbom"], facts["pip"], facts["dpkg"], locked, manifest))
        sbom = manifest.get("sbom") or {}
        if sbom.get("sha256") != facts["sha256"]:
            raise Failed(f"the build manifest names SBOM {sbom}, the image holds "
                         f"{facts['sha256']}")

    def manifest_of(self, tag: str, keep: Path) -> dict:
        text = self.engine.run("--entrypoint", "cat", tag, "/app/build-manifest.json",
                               capture=True).stdout
        keep.write_text(text)
        return json.loads(text)

    def runs(self, runs: Path) -> None:
        e, img = self.engine, self.img
        ws = ["-v", f"{runs}:/workspace/runs", "--shm-size=1g"]
        log("entrypoint passes other commands through (bash)")
        out = e.run(img, "bash", "-c", "echo passthrough-ok; id -u", capture=True).stdout
        if "passthrough-ok" not in out:
            raise Failed(f"bash through the entrypoint: {out}")
        log("doctor (default user, --shm-size=1g)")
        e.run(*ws, img, "doctor")
        report = json.loads(e.run(*ws, img, "doctor", "--json", capture=True).stdout)
        if not (report.get("sbom") or {}).get("as_built"):
            raise Failed(f"doctor --json: SBOM {report.get('sbom')}, expected the one built")
        for name, title, extra in TRAININGS:
            log(f"train: {title}")
            e.run(*ws, img, "train", "configs/quickstart.yaml", *extra, f"run.name={name}")
        log("run directories on the host")
        print("\n".join(check_run_dirs(runs, (("quick", 1), ("ddp2", 2)))))
        if "pytest" not in self.skip:
            log("fast test subset inside the image (pytest from the wheelhouse, into /tmp)")
            e.run("--shm-size=1g", "-v", f"{ROOT / 'tests'}:/app/tests:ro",
                  "-v", f"{self.wheels}:/wheelhouse:ro",
                  "-v", f"{self.pytest_req}:/tmp/pytest-req.txt:ro", img, "bash", "-c", PYTEST)
        log("arbitrary UID in group 0 (OpenShift-style), image's own /workspace volume")
        e.run("--user", "54321:0", "--shm-size=1g", img, "bash", "-c", ANY_UID_WRITES)
        e.run("--user", "54321:0", "--shm-size=1g", img, "train", "configs/quickstart.yaml",
              *SHORT, "run.name=anyuid")
        log("read-only root filesystem, default 64 MB /dev/shm")
        ro = ["--read-only", *e.tmp_flags, "-v", f"{runs}:/workspace/runs"]
        doctor = e.run(*ro, img, "doctor", capture=True, check=False)
        print(doctor.stdout + doctor.stderr)
        if not shm_warned(doctor.stdout + doctor.stderr):
            raise Failed("doctor did not warn about a 64 MB /dev/shm")
        print(f"doctor exit code with 64 MB /dev/shm: {doctor.returncode}")
        e.run(*ro, img, "train", "configs/quickstart.yaml", "data.num_workers=0", *SHORT,
              "run.name=readonly")
        if not (runs / "readonly/checkpoints/latest").is_file():
            raise Failed("read-only run left no checkpoint on the host")

    def user_image(self, runs: Path) -> None:
        """examples/custom_model/Dockerfile on this image: one layer more (the user's
        files), and its default command trains the custom model as any UID on a read-only
        root filesystem."""
        e, tag = self.engine, f"{self.tag}:user-example"
        log("a user's image: FROM this one, COPY of examples/custom_model, its CMD trains")
        e.build("examples/custom_model/Dockerfile", tag, f"--build-arg=BASE_IMAGE={self.img}",
                context=str(self.image_wheels), directory="examples/custom_model")
        base, mine = (self.layers(t)[1] for t in (self.img, tag))
        if mine[:len(base)] != base or len(mine) != len(base) + 1:
            raise Failed(f"the user's image adds {len(mine) - len(base)} layers to the base "
                         "(expected 1: its COPY)")
        e.run("--read-only", *e.tmp_flags, "--user", "54321:0", "-v", f"{runs}:/workspace/runs",
              tag)  # its CMD: train /opt/project/config.yaml
        result = runs / "waves" / rundir.RESULT
        latest = runs / "waves" / rundir.CHECKPOINTS / rundir.LATEST
        if not result.is_file() or not latest.is_file():
            raise Failed("the user's image left no result.json or checkpoint on the host")
        print(f"the user's image trained the custom model: {result.read_text().strip()[:200]}")
        sh(e.name, "rmi", tag, capture=True)

    def compile(self) -> None:
        log("torch.compile (inductor, g++) as an arbitrary UID on a read-only root filesystem")
        self.engine.run("--read-only", *self.engine.tmp_flags, "--user", "54321:0",
                        "--entrypoint", "python3", self.img, "-c", COMPILE)

    def vendors(self) -> None:
        for flavor in VENDORS:
            tag = f"{self.tag}:{flavor}-on-cpu"
            log(f"Dockerfile.{flavor} built with BASE_IMAGE={self.base} and the CPU wheel")
            manifest = self.manifest_of(tag, ROOT / f"build/image-test-manifest-{flavor}.json")
            print(check_build_manifest(manifest, self.torch_version, flavor))
            self.sbom(tag, manifest)
            self.engine.run("--entrypoint", "bash", tag, "-c", VENDOR_RDMA)  # RDMA for NCCL
            self.engine.run("--shm-size=1g", tag, "train", "configs/quickstart.yaml",
                            "device=cpu", "train.max_steps=2", "schedule.warmup_steps=2",
                            "train.eval_every_steps=2", "checkpoint.every_steps=2",
                            f"run.name={flavor}")

    def rebuild(self) -> None:
        log("two builds of Dockerfile.cpu without cache: package sets, then every file")
        first = json.loads((ROOT / "build/image-test-manifest-1.json").read_text())
        print(compare_build_manifests(first, self.manifest_of(
            self.again, ROOT / "build/image-test-manifest-2.json")))
        for n, tag in ((1, self.img), (2, self.again)):
            listing = self.engine.run(
                "--user", "0", "-v", f"{ROOT / 'scripts/file-manifest'}:/tmp/file-manifest:ro",
                "--entrypoint", "python3", tag, "/tmp/file-manifest", "list", "/",
                capture=True).stdout
            (ROOT / f"build/image-test-files-{n}.tsv").write_text(listing)
        if sh(sys.executable, str(ROOT / "scripts/file-manifest"), "compare",
              str(ROOT / "build/image-test-files-1.tsv"),
              str(ROOT / "build/image-test-files-2.tsv"), check=False).returncode:
            raise Failed("two builds of the CPU image differ (above; "
                         "build/image-test-files-*.tsv)")
        print(layers_line(*(self.layers(t) for t in (self.img, self.again))))
        sh(self.engine.name, "rmi", self.again, capture=True)

    def layers(self, tag: str) -> tuple[str, list[str]]:
        return self.engine.inspect(tag, "{{.Id}}").strip(), \
            json.loads(self.engine.inspect(tag, "{{json .RootFS.Layers}}"))

    # -------------------------------------------------------------- all of it
    def main(self) -> None:
        log(f"engine: {self.engine.name}")
        self.fill_wheelhouse()
        with ThreadPoolExecutor(max_workers=1) as aside:  # the index's answers, not the CPU
            locks = None if "locks" in self.skip else aside.submit(self.locks_resolve)
            self.build_images()
            if locks is not None:
                locks.result()
        self.plumbing()
        runs = Path(tempfile.mkdtemp(prefix="image-test-runs.", dir=ROOT / "build"))
        runs.chmod(0o777)  # the container user (UID 1000, group 0) writes here on any host
        try:
            self.runs(runs)
            if "s3" not in self.skip:
                s3_run(self.engine, img=self.img)
            if "ft" not in self.skip:
                replica_run(self.engine, self.img, runs)
            self.user_image(runs)
        finally:
            self.remove_runs(runs)
        if "compile" not in self.skip:
            self.compile()
        if "vendor" not in self.skip:
            self.vendors()
        if "rebuild" not in self.skip:
            self.rebuild()
        self.sizes()
        log("image test passed")

    def sizes(self) -> None:
        """Each image's size; the CPU image within CPU_LIMIT_GB; what boto3 and torchft
        add."""
        tags = [self.img, *(f"{self.tag}:{f}-on-cpu" for f in VENDORS if "vendor" not in self.skip)]
        shares = json.loads(self.engine.run("--entrypoint", "python3", self.img, "-c",
                                            SHARE_BYTES, capture=True).stdout)
        sizes = {tag: int(self.engine.inspect(tag, "{{.Size}}")) for tag in tags}
        print(size_line(sizes, shares))
        if sizes[self.img] > CPU_LIMIT_GB * 1e9:
            raise Failed(f"{self.img} is {sizes[self.img] / 1e9:.2f} GB, over {CPU_LIMIT_GB} GB")

    def remove_runs(self, runs: Path) -> None:
        """Files written by the container's UID: removed from inside when the host can't."""
        shutil.rmtree(runs, ignore_errors=True)
        if runs.exists():
            self.engine.run("--user", "0", "-v", f"{runs}:/r", "--entrypoint", "sh", self.img,
                            "-c", "rm -rf /r/*", check=False)
            shutil.rmtree(runs, ignore_errors=True)


VENDORS = ("cuda", "rocm")
CPU_LIMIT_GB = 1.5  # with the compilers (docs/images.md, "Sizes")
SHORT = ("train.max_steps=4", "schedule.warmup_steps=2", "train.eval_every_steps=4",
         "checkpoint.every_steps=4")
TRAININGS = (
    ("quick", "quickstart, short, 1 process",
     ("train.max_steps=20", "schedule.warmup_steps=2", "train.eval_every_steps=10",
      "checkpoint.every_steps=10", "logging.every_steps=5")),
    ("ddp2", "2 processes (gloo)",
     ("distributed.nproc_per_node=2", "train.max_steps=10", "schedule.warmup_steps=2",
      "train.eval_every_steps=5", "checkpoint.every_steps=5", "logging.every_steps=5")),
)
# Shell run inside the image.
PLUMBING = """set -e
test "$(id -u)" != 0 || { echo "runs as root"; exit 1; }
test "$(pwd)" = /workspace
command -v tini; command -v g++; test "$(command -v python3)" = /opt/venv/bin/python3
test -w /workspace && test -w "$HOME" && ! test -w /app && ! test -w /opt/venv
python3 -c "import torch, train, launcher; print('torch', torch.__version__)"
python3 -m json.tool /app/build-manifest.json >/dev/null"""
PIP_CONSTRAINT = """set -e
want="torch==$(python3 -c 'import torch; print(torch.__version__)')"
grep -qx "$want" "$PIP_CONSTRAINT" || { echo "$PIP_CONSTRAINT lacks $want"; exit 1; }
if out=$(pip install --no-index --dry-run "torch==2.0.0" 2>&1); then echo "$out"; exit 1; fi
echo "$out" | grep -q "(constraint) $want" || { echo "$out"; exit 1; }
echo "PIP_CONSTRAINT holds $want"
"""
PYTEST = """set -e
PIP_CONSTRAINT= pip install --quiet --no-index --find-links /wheelhouse --require-hashes \
  --no-deps --target /tmp/pytest -r /tmp/pytest-req.txt
cd /app && PYTHONPATH=/tmp/pytest:/app python3 -m pytest -q -p no:cacheprovider \
  -m "not gpu" tests/unit/test_config.py tests/unit/test_data.py -k "not docs"
"""
ANY_UID_WRITES = ('set -e; touch "$HOME/.probe" /workspace/.probe /tmp/.probe; '
                  'echo "uid $(id -u) can write HOME, /workspace, /tmp"')
COMPILE = """import time, torch
t = time.time()
f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T).sum())
print(f"torch.compile ok: {float(f(torch.randn(8, 8))):.3f} in {time.time() - t:.1f} s")"""
SBOM_FACTS = """import hashlib, json, subprocess
run = lambda *a: subprocess.run(a, capture_output=True, text=True, check=True).stdout
raw = open("/app/sbom.cdx.json", "rb").read()
print(json.dumps({"sbom": json.loads(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                  "pip": json.loads(run("pip", "list", "--format", "json")),
                  "dpkg": run("dpkg-query", "-W", "-f",
                              "${db:Status-Abbrev}\\t${Package}\\t${Version}\\n")}))"""
# The bytes of the S3 client and of torchft, each with what only it brings to the image
# (every file their distributions installed; protobuf is tensorboard's, urllib3 boto3's).
SHARE_BYTES = """import json, os
from importlib.metadata import distribution
shares = {
  "boto3": ("boto3", "botocore", "s3transfer", "jmespath", "python-dateutil", "six", "urllib3"),
  "torchft": ("torchft", "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-proto",
              "opentelemetry-exporter-http-transport", "opentelemetry-exporter-otlp-common",
              "opentelemetry-exporter-otlp-proto-common", "opentelemetry-exporter-otlp-proto-http",
              "opentelemetry-semantic-conventions", "googleapis-common-protos", "requests",
              "certifi", "charset-normalizer", "idna")}
def size(names):
    paths = {str(d.locate_file(f)) for d in map(distribution, names) for f in d.files or ()}
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
print(json.dumps({k: size(v) for k, v in shares.items()}))"""
VENDOR_RDMA = """set -e; test "$(id -u)" != 0
python3 -c 'import sys; sys.path.insert(0, "/app"); from launcher.detection import rdma; \
assert rdma.verbs_loadable(), "no libibverbs.so.1"; print("libibverbs.so.1 loads")'
"""


def main() -> int:
    env = dict(os.environ)
    test = ImageTest(Engine.from_environ(env), env, tag=env.get("IMAGE_TAG", "trainimg"),
                     image_python=env.get("IMAGE_PYTHON", "3.11"),
                     skip=set(env.get("IMAGE_TEST_SKIP", "").split()))
    try:
        test.main()
    except (Failed, subprocess.CalledProcessError) as exc:
        print(f"\nimage-test: FAIL: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
