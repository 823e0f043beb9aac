"""What the image test concludes from what an image shows: labels, build manifests,
run directories on the host, two builds compared. Pure functions of the engine's
answers, so each is unit-tested (tests/unit/test_tools.py)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from tools.oci import Failed
from train.core.run import rundir


def check_labels(labels: dict) -> str:
    for key in ("org.opencontainers.image.revision", "org.opencontainers.image.base.name",
                "train.torch"):
        if not labels.get(key):
            raise Failed(f"label {key} missing or empty: {labels}")
    return f"labels ok: {labels['train.torch']} {labels['org.opencontainers.image.base.name']}"


def check_build_manifest(m: dict, torch_version: str, flavor: str = "cpu") -> str:
    problems = []
    if m.get("flavor") != flavor:
        problems.append(f"flavor {m.get('flavor')}")
    if flavor == "cpu" and (m.get("torch", {}).get("version") != torch_version + "+cpu" or
                            m.get("python_packages", {}).get("torch") != torch_version + "+cpu"):
        problems.append(f"torch {m.get('torch')}")
    if not m.get("base_image"):
        problems.append("base image not recorded")
    if flavor == "cpu" and "tini" not in m.get("system_packages", {}):
        problems.append("tini not among the system packages")
    if problems:
        raise Failed("build manifest: " + "; ".join(problems))
    return f"build manifest ok: {len(m['python_packages'])} packages, base {m['base_image']}"


def check_run_dirs(runs: Path, expected: tuple[tuple[str, int], ...]) -> list[str]:
    """Each (run name, world size) left its files on the host, readable."""
    lines = []
    for name, world in expected:
        d = runs / name
        checkpoints = d / rundir.CHECKPOINTS
        for path in (d / rundir.CONFIG, d / rundir.MANIFEST, d / rundir.METRICS,
                     checkpoints / rundir.LATEST, d / rundir.BOARD):
            if not path.exists():
                raise Failed(f"{path} missing")
        latest = (checkpoints / rundir.LATEST).read_text().strip()
        if not (checkpoints / latest).is_dir():
            raise Failed(f"{d}: latest names {latest}, not a directory")
        m = json.loads((d / rundir.MANIFEST).read_text())
        if m["starts"][-1]["world_size"] != world:
            raise Failed(f"{d}: world size {m['starts']}, expected {world}")
        bm = m.get("image_build_manifest") or {}
        if bm.get("flavor") != "cpu" or not bm.get("python_packages"):
            raise Failed(f"{d / rundir.MANIFEST} lacks the image build manifest")
        rows = [ln for ln in (d / rundir.METRICS).read_text().splitlines() if ln.strip()]
        if not rows:
            raise Failed(f"{d / rundir.METRICS} is empty")
        lines.append(f"{name}: world {world}, {len(rows)} metric rows, latest {latest}, "
                     f"code {m.get('code_version')}")
    return lines


def compare_build_manifests(a: dict, b: dict) -> str:
    for key in ("python_packages", "system_packages", "torch", "base_image"):
        if a[key] != b[key]:
            diff = {k: (a[key].get(k), b[key].get(k)) for k in set(a[key]) | set(b[key])
                    if a[key].get(k) != b[key].get(k)} if isinstance(a[key], dict) \
                else (a[key], b[key])
            raise Failed(f"two builds differ in {key}: {diff}")
    return (f"identical: {len(a['python_packages'])} Python packages, "
            f"{len(a['system_packages'])} distro packages")


def layers_line(first: tuple[str, list[str]], second: tuple[str, list[str]]) -> str:
    """How far two builds' layers (file metadata included) and image IDs agree."""
    (id_a, a), (id_b, b) = first, second
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
    image = "the same" if id_a == id_b else "different"
    return (f"layers: {len(a) - len(differ)} of {len(a)} identical to the byte, numbers "
            f"{differ} differ (file metadata: a layer reused from the cache keeps the times "
            f"of the build that made it); image IDs: {image} (an ID also covers the config: "
            "podman 4.3 writes intermediate image IDs into its history)")


def shm_warned(doctor_output: str) -> bool:
    """doctor mentions /dev/shm and warns that 64 MB is too small."""
    lines = [ln for ln in doctor_output.splitlines() if "shm" in ln.lower()]
    return any(re.search(r"warn|below|small|bus error", ln, re.I) for ln in lines)


def wheelhouse_stamp(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_sbom(sbom: dict, pip_list: list[dict], dpkg_rows: str,
               locked: dict[str, set[str]], manifest: dict | None = None) -> str:
    """The image's CycloneDX SBOM lists exactly what is installed: every distribution of
    ``pip list`` (in /opt/venv) at its version with a pkg:pypi purl, every ``dpkg-query -W``
    package at its version with a pkg:deb purl, the base image; every Python component
    that a hash lock (``locked``: name -> allowed SHA-256s) holds carries one of the
    lock's hashes; and the build manifest names this SBOM's packages too."""
    comps = sbom.get("components", [])
    pypi = {_norm(c["name"]): c for c in comps if c.get("purl", "").startswith("pkg:pypi/")}
    deb = {c["name"]: c for c in comps if c.get("purl", "").startswith("pkg:deb/")}
    problems = []
    if sbom.get("bomFormat") != "CycloneDX" or "serialNumber" in sbom:
        problems.append("not a reproducible CycloneDX document")
    want_py = {_norm(p["name"]): p["version"] for p in pip_list}
    got_py = {n: c.get("version") for n, c in pypi.items()}
    if want_py != got_py:
        problems.append("Python: " + _diff(want_py, got_py))
    rows = [r.split("\t") for r in dpkg_rows.splitlines() if r.strip()]
    want_deb = {r[1]: r[2] for r in rows if len(r) == 3 and r[0].startswith("ii")}
    got_deb = {n: c.get("version") for n, c in deb.items()}
    if want_deb != got_deb:
        problems.append("dpkg: " + _diff(want_deb, got_deb))
    for name, allowed in locked.items():
        comp = pypi.get(name)
        digests = {h["content"] for h in (comp or {}).get("hashes", []) if h["alg"] == "SHA-256"}
        if comp is not None and not digests & allowed:
            problems.append(f"{name}: SHA-256 {sorted(digests)} is not one of its lock's")
    if not any(c.get("type") == "container" for c in comps):
        problems.append("no base image component")
    if manifest is not None:
        if {_norm(k): v for k, v in manifest.get("python_packages", {}).items()} != want_py:
            problems.append("the build manifest's python_packages differ from pip list")
        if manifest.get("system_packages") != want_deb:
            problems.append("the build manifest's system_packages differ from dpkg")
    if problems:
        raise Failed("SBOM /app/sbom.cdx.json: " + "; ".join(problems))
    hashed = sum(1 for c in pypi.values() if c.get("hashes"))
    return (f"SBOM ok: {len(pypi)} Python distributions (= pip list; {hashed} with their "
            f"wheel's SHA-256, every hash-locked one among its lock's), {len(deb)} Debian "
            "packages (= dpkg-query), the base image")


def _diff(want: dict[str, str], got: dict[str, str]) -> str:
    keys = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    return ", ".join(f"{k}: installed {want.get(k, '-')}, SBOM {got.get(k, '-')}"
                     for k in keys[:10])


def size_line(sizes: dict[str, int], shares: dict[str, int]) -> str:
    """Each image's size and what each optional client (boto3, torchft: each with the
    dependencies only it brings) adds."""
    each = ", ".join(f"{tag} {size / 1e9:.2f} GB" for tag, size in sizes.items())
    adds = ", ".join(f"{name} and its dependencies add {n / 1e6:.1f} MB"
                     for name, n in shares.items())
    return f"image sizes: {each}; {adds}"
