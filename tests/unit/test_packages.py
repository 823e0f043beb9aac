"""doctor's package check (launcher/commands/packages.py), on real files in temporary folders and
this environment's real installed packages: a version moved from its pin and a module
of the project named like a locked package are each reported; a folder without
``__init__.py`` (which hides nothing) and the project's other modules are not."""

from __future__ import annotations

import json
from importlib import metadata

from launcher.commands import packages
from tests.harness.runs import entry

YAML_VERSION = metadata.version("pyyaml")

LOCK = f"""#
# a pip-compile lock
#
pyyaml=={YAML_VERSION} \\
    --hash=sha256:00
    # via -r dev.in
Jinja2[i18n]==3.1.0 ; python_version >= "3.8"
torch==2.13.0
"""


def test_pins_are_read_from_a_lock_with_hashes_comments_and_extras(tmp_path):
    (tmp_path / "dev.lock").write_text(LOCK)
    assert packages.pins(tmp_path / "dev.lock") == {"pyyaml": YAML_VERSION, "jinja2": "3.1.0",
                                                    "torch": "2.13.0"}
    assert packages.pins(tmp_path / "missing.lock") == {}


def test_a_version_moved_from_its_pin_is_reported_and_a_build_label_is_not(tmp_path):
    have = packages.installed()
    locked = {"pyyaml": "0.0.1", "torch": have["torch"][0].split("+")[0],
              "not-installed-here": "1.0"}
    assert packages.moved(locked, have) == [f"pyyaml {YAML_VERSION} (pinned 0.0.1)"]
    assert packages.moved({"pyyaml": YAML_VERSION}, have) == []


def test_modules_of_the_project_named_like_locked_packages_are_reported(tmp_path):
    (tmp_path / "yaml.py").write_text("")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "numpy").mkdir()                  # no __init__.py: hides nothing
    (tmp_path / "nets.py").write_text("")         # the user's own module
    have = packages.installed()
    assert sorted(packages.shadowing(tmp_path, {"pyyaml": YAML_VERSION, "numpy": "2"},
                                     have)) == [
        "./torch/ (hides torch)", "./yaml.py (hides pyyaml)"]


def test_a_pythonpath_folder_is_checked_too_and_the_checkout_is_not(tmp_path):
    project, extra, app = tmp_path / "project", tmp_path / "opt-project", tmp_path / "app"
    for folder in (project, extra, app):
        folder.mkdir()
        (folder / "yaml.py").write_text("")
    (tmp_path / "constraints.txt").write_text(f"pyyaml=={YAML_VERSION}\n")
    report, found = packages.findings(app, project, prefix=tmp_path,
                                      pythonpath=f"{app}:{extra}::{tmp_path / 'missing'}")
    assert report["shadowed"] == ["./yaml.py (hides pyyaml)", f"{extra}/yaml.py (hides pyyaml)"]
    assert [f.level for f in found] == ["warn"]


def test_findings_name_the_pins_source_and_what_to_do(tmp_path):
    venv, project = tmp_path / "venv", tmp_path / "project"
    venv.mkdir()
    project.mkdir()
    (venv / "constraints.txt").write_text("pyyaml==0.0.1\n")
    report, found = packages.findings(tmp_path / "no-checkout", project, prefix=venv)
    assert report == {"locks": [str(venv / "constraints.txt")],
                      "moved": [f"pyyaml {YAML_VERSION} (pinned 0.0.1)"], "shadowed": []}
    assert [(f.level, f.topic) for f in found] == [("warn", "packages")]
    assert f"pip install -c {venv / 'constraints.txt'} PACKAGE" in found[0].fix
    (venv / "constraints.txt").write_text(f"pyyaml=={YAML_VERSION}\n")
    _, found = packages.findings(tmp_path / "no-checkout", project, prefix=venv)
    assert [f.level for f in found] == ["ok"]


def test_doctor_reports_a_project_module_hiding_a_package_and_still_passes(tmp_path):
    (tmp_path / "yaml.py").write_text("raise ImportError('the project's own yaml')\n")
    out = entry("doctor", "--json", cwd=tmp_path)
    report = json.loads(out.stdout)
    assert out.returncode == 0, out.stderr
    assert report["packages"]["shadowed"] == ["./yaml.py (hides pyyaml)"]
    warned = [f for f in report["findings"] if f["topic"] == "packages"]
    assert len(warned) == 1 and warned[0]["level"] == "warn"
    assert "./yaml.py (hides pyyaml)" in warned[0]["message"]
