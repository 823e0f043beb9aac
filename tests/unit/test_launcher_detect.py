"""GPU detection without GPUs: an NVML substitute, the real pynvml without its library,
fake amd-smi/rocm-smi executables printing real outputs, and fake /dev + sysfs trees."""

from __future__ import annotations

import pynvml
import pytest

from launcher.detection import amd, compat, detect, nvidia
from launcher.detection.hardware import Gpu, Hardware, TorchBuild
from launcher.planning import environ, variables
from tests.fakes.fake_nvml import FakeNvml, h100s
from tests.harness.plans import kfd_tree
from tests.harness.runs import FAKES

OUTPUTS = FAKES / "outputs"


def env_of(**values: str) -> variables.Environ:
    return environ.read({"PATH": "/nonexistent", **values})


def nv(gpus=None, **vis) -> Hardware:
    return nvidia.detect(variables.Visibility(**vis), nvml=FakeNvml(h100s() if gpus is None
                                                                  else gpus), root="/nonexistent")


# ------------------------------------------------------------------------------ NVML

def test_nvml_lists_every_gpu_with_details():
    hw = nv()
    assert hw.vendor == "nvidia" and hw.source == "nvml" and hw.listed == 4
    assert [g.index for g in hw.gpus] == [0, 1, 2, 3]
    g = hw.gpus[0]
    assert g.name == "NVIDIA H100 80GB HBM3" and g.arch == "sm_90"
    assert g.memory_bytes == 80 * 1024 ** 3 and g.uuid.startswith("GPU-00000000")
    assert g.bus_id == "00000000:10:00.0"
    assert hw.driver_version == "580.65.06" and hw.cuda_driver_version == "13.0"


def nvml_library_loads() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return False
    except pynvml.NVMLError:
        return True  # the library is there (the driver may not be)
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(nvml_library_loads(), reason="this host has libnvidia-ml.so.1")
def test_real_pynvml_without_library_is_a_note_not_an_error(tmp_path):
    hw = nvidia.detect(variables.Visibility(), nvml=None, root=str(tmp_path))
    assert hw.vendor is None and not hw.warnings
    assert "libnvidia-ml.so.1" in hw.notes[0]


def test_device_nodes_without_nvml_warn_about_the_toolkit(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    hw = nvidia.detect(variables.Visibility(),
                       nvml=FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
                       root=str(tmp_path))
    assert "--gpus all" in hw.warnings[0] and "nvidia0" in hw.warnings[0]


def test_driver_not_loaded_is_a_note():
    hw = nvidia.detect(variables.Visibility(),
                       nvml=FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED),
                       root="/nonexistent")
    assert hw.vendor is None and "driver not loaded" in hw.notes[0]


@pytest.mark.parametrize("cvd, physical", [
    (None, [0, 1, 2, 3]),
    ("", []),
    ("-1", []),
    ("2,0", [2, 0]),
    (" 3 , 1 ", [3, 1]),
    ("GPU-00000002-1111-2222-3333-444455556666", [2]),
    ("GPU-00000001", [1]),                       # unique prefix, as CUDA accepts
    ("1,7,2", [1]),                              # an invalid entry ends the list
    ("1,1", [1]),                                # a repeat ends it too
    ("GPU-0000000", []),                         # ambiguous prefix
])
def test_cuda_visible_devices_filters_nvml_like_cuda(cvd, physical):
    hw = nv(cuda_visible_devices=cvd)
    assert [g.physical_index for g in hw.gpus] == physical
    assert [g.index for g in hw.gpus] == list(range(len(physical)))
    warned = bool(hw.warnings)
    assert warned == (cvd in ("1,7,2", "1,1", "GPU-0000000"))


@pytest.mark.parametrize("value", ["none", "void", "NONE"])
def test_nvidia_visible_devices_none_means_no_gpus(value):
    fake = FakeNvml(h100s())
    hw = nvidia.detect(variables.Visibility(nvidia_visible_devices=value), nvml=fake)
    assert hw.vendor is None and "NVIDIA_VISIBLE_DEVICES" in hw.notes[0]
    assert fake.calls == []  # NVML not even asked


def test_mig_instances_replace_their_gpu_and_only_one_is_used():
    gpus = h100s(2)
    gpus[0]["mig"] = ["MIG-aaaa0000-0000", "MIG-bbbb0000-0000"]
    hw = nv(gpus)
    assert len(hw.gpus) == 1 and hw.gpus[0].mig and hw.gpus[0].uuid == "MIG-aaaa0000-0000"
    assert any("MIG" in w for w in hw.warnings)
    one = nv(gpus, cuda_visible_devices="MIG-bbbb")
    assert [g.uuid for g in one.gpus] == ["MIG-bbbb0000-0000"] and not one.warnings
    assert one.gpus[0].memory_bytes == 80 * 1024 ** 3 // 7


def test_mig_mode_without_instances_warns():
    gpus = h100s(1)
    gpus[0]["mig"] = []
    hw = nv(gpus)
    assert hw.gpus == () and "no MIG instances" in hw.warnings[0]


def test_detect_prefers_nvidia_and_counts_cpus():
    hw = detect.detect(env_of(), nvml=FakeNvml(h100s(2)))
    assert hw.vendor == "nvidia" and len(hw.gpus) == 2 and hw.cpus >= 1


def test_detect_without_gpus_is_cpu_only_with_a_note(tmp_path):
    hw = detect.detect(env_of(NVIDIA_VISIBLE_DEVICES="void", TRAIN_HW_ROOT=str(tmp_path)))
    assert hw.vendor is None and hw.gpus == () and hw.cpus >= 1
    assert any("NVIDIA_VISIBLE_DEVICES=void" in n for n in hw.notes)


# ------------------------------------------------------------------------------- AMD

def amd_env(monkeypatch, rocm: str | None = None, amd_list: str | None = None) -> str:
    if rocm:
        monkeypatch.setenv("FAKE_ROCM_SMI_OUTPUT", str(OUTPUTS / rocm))
    if amd_list:
        monkeypatch.setenv("FAKE_AMD_SMI_LIST", str(OUTPUTS / amd_list))
    return str(FAKES)


def test_gfx_names():
    assert amd.gfx_name(90010) == "gfx90a" and amd.gfx_name(90402) == "gfx942"
    assert amd.gfx_name(110000) == "gfx1100" and amd.gfx_name(0) is None


def test_rocm_smi_fixture_parses():
    import json
    cards = amd.rocm_smi_cards(json.loads((OUTPUTS / "rocm-smi-showproductname-mi250x.json")
                                          .read_text()))
    assert len(cards) == 1 and cards[0].name.startswith("AMD INSTINCT MI200")
    assert cards[0].node == 7


def test_rocm_smi_lists_host_gpus_the_container_cannot_open(monkeypatch, tmp_path):
    path = amd_env(monkeypatch, rocm="rocm-smi-showproductname-mi250x.json")
    hw = amd.detect(variables.Visibility(), path, root=str(tmp_path))  # no /dev/kfd, no sysfs
    assert hw.vendor == "amd" and hw.source == "rocm-smi" and hw.listed == 1
    assert hw.gpus == ()
    assert "--device /dev/kfd" in hw.warnings[0] and "missing" in hw.warnings[0]


def test_rocm_smi_names_the_usable_kfd_node(monkeypatch, tmp_path):
    path = amd_env(monkeypatch, rocm="rocm-smi-showproductname-mi250x.json")
    kfd_tree(tmp_path, {7: (31896, 128, 90010)}, present=[128])
    hw = amd.detect(variables.Visibility(), path, root=str(tmp_path))
    assert len(hw.gpus) == 1
    g = hw.gpus[0]
    assert g.name.startswith("AMD INSTINCT MI200") and g.arch == "gfx90a" and g.physical_index == 7


def test_only_render_nodes_present_in_the_container_count(monkeypatch, tmp_path):
    path = amd_env(monkeypatch, rocm="rocm-smi-7900xt-2cards.json")
    kfd_tree(tmp_path, {1: (111, 128, 110000), 2: (222, 129, 110000)}, present=[129])
    hw = amd.detect(variables.Visibility(), path, root=str(tmp_path))
    assert hw.listed == 2 and len(hw.gpus) == 1
    assert hw.gpus[0].physical_index == 2 and hw.gpus[0].memory_bytes == 21458059264
    assert hw.gpus[0].name == "Radeon RX 7900 XT"


def test_amd_smi_list_maps_kfd_ids(monkeypatch, tmp_path):
    path = amd_env(monkeypatch, amd_list="amd-smi-list-2gpus.json",
                   rocm="rocm-smi-7900xt-2cards.json")
    kfd_tree(tmp_path, {8: (31896, 128, 90402), 9: (45667, 136, 90402)}, present=[128, 136])
    hw = amd.detect(variables.Visibility(), path, root=str(tmp_path))
    assert hw.source == "amd-smi"
    assert [g.bus_id for g in hw.gpus] == ["0000:03:00.0", "0000:26:00.0"]
    assert [g.arch for g in hw.gpus] == ["gfx942", "gfx942"]
    assert hw.gpus[1].uuid.startswith("f5ff74a1")


@pytest.mark.parametrize("vis, nodes, warn", [
    ({}, [1, 2, 3, 4], None),
    ({"rocr_visible_devices": "1,3"}, [2, 4], None),
    ({"hip_visible_devices": "2"}, [3], None),
    ({"cuda_visible_devices": "0"}, [1], None),               # HIP honours it too
    ({"rocr_visible_devices": "2,3", "hip_visible_devices": "1"}, [4], "both"),
    ({"rocr_visible_devices": "1", "hip_visible_devices": "1"}, [], "both"),  # hides all
    ({"rocr_visible_devices": "GPU-000000000000ABC3"}, [3], None),
    ({"rocr_visible_devices": "0,9,1"}, [1], "matches none"),
    ({"hip_visible_devices": ""}, [], None),
])
def test_rocm_visibility_variables(monkeypatch, tmp_path, vis, nodes, warn):
    path = amd_env(monkeypatch, rocm="rocm-smi-7900xt-2cards.json")
    kfd_tree(tmp_path, {n: (100 + n, 127 + n, 90010) for n in (1, 2, 3, 4)},
             present=[128, 129, 130, 131])
    hw = amd.detect(variables.Visibility(**vis), path, root=str(tmp_path))
    assert [g.physical_index for g in hw.gpus] == nodes
    assert [g.index for g in hw.gpus] == list(range(len(nodes)))
    if warn:
        assert any(warn in w for w in hw.warnings)
    else:
        assert not hw.warnings


def test_detect_falls_back_to_amd_when_nvml_is_absent(monkeypatch, tmp_path):
    amd_env(monkeypatch, rocm="rocm-smi-showproductname-mi250x.json")
    kfd_tree(tmp_path, {7: (31896, 128, 90010)}, present=[128])
    absent = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)  # also on an NVIDIA host
    hw = detect.detect(env_of(PATH=str(FAKES), TRAIN_HW_ROOT=str(tmp_path)), nvml=absent)
    assert hw.vendor == "amd" and len(hw.gpus) == 1
    assert any("libnvidia-ml" in n for n in hw.notes)


def test_broken_tool_output_is_ignored(monkeypatch, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("WARNING: something\nnot json at all")
    monkeypatch.setenv("FAKE_ROCM_SMI_OUTPUT", str(bad))
    hw = amd.detect(variables.Visibility(), str(FAKES), root=str(tmp_path))
    assert hw.vendor is None and hw.gpus == () and not hw.warnings


# ------------------------------------------------------------------------ build checks

CUDA13 = TorchBuild(version="2.13.0+cu130", cuda="13.0", nccl=True,
                    arch_list=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120",
                               "compute_120"))
ROCM = TorchBuild(version="2.13.0+rocm7.2", hip="7.2.0", nccl=True,
                  arch_list=("gfx90a", "gfx942", "gfx1100"))
CPU = TorchBuild(version="2.13.0+cpu")


def hw_of(vendor: str, arch: str, cuda: str | None = "13.0", n: int = 1) -> Hardware:
    return Hardware(vendor=vendor, source="test", listed=n, cuda_driver_version=cuda,
                    driver_version="580.65.06" if cuda else None,
                    gpus=tuple(Gpu(index=i, name="GPU", arch=arch) for i in range(n)))


@pytest.mark.parametrize("hw, tb, expect", [
    (hw_of("nvidia", "sm_90"), CUDA13, None),
    (hw_of("nvidia", "sm_89"), CUDA13, None),            # sm_86 cubin runs on 8.9
    (hw_of("nvidia", "sm_121"), CUDA13, None),           # compute_120 PTX JIT
    (hw_of("nvidia", "sm_70"), CUDA13, "arch"),          # Volta: dropped by CUDA 13
    (hw_of("nvidia", "sm_90", cuda="12.4"), CUDA13, "driver"),
    (hw_of("nvidia", "sm_90"), CPU, "CPU-only build"),
    (hw_of("nvidia", "sm_90"), ROCM, "ROCm build"),
    (hw_of("amd", "gfx90a", cuda=None), ROCM, None),
    (hw_of("amd", "gfx1030", cuda=None), ROCM, "arch"),
    (hw_of("amd", "gfx90a", cuda=None), CUDA13, "CUDA build"),
    (hw_of("amd", "gfx90a", cuda=None), CPU, "CPU-only build"),
    (Hardware(), CPU, None),
])
def test_check_build(hw, tb, expect):
    fails = [f for f in compat.check_build(hw, tb) if f.level == "fail"]
    if expect is None:
        assert fails == []
    else:
        assert len(fails) == 1 and fails[0].exit_code == 3
        text = fails[0].topic + " " + fails[0].message
        assert expect in text
        assert fails[0].fix


def test_driver_minor_older_is_only_a_warning():
    found = compat.check_build(hw_of("nvidia", "sm_90", cuda="13.0"),
                               TorchBuild(version="x", cuda="13.2", nccl=True))
    assert [f.level for f in found] == ["warn"]


def test_hsa_override_skips_the_gfx_check():
    assert compat.check_build(hw_of("amd", "gfx1030", cuda=None), ROCM, "10.3.0") == []


def test_torch_build_reads_the_installed_torch_without_starting_cuda():
    import torch
    tb = detect.torch_build()
    assert tb.kind == ("rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu")
    assert tb.gloo and tb.version == torch.__version__
    assert tb.nccl == (tb.kind != "cpu")  # the CUDA and ROCm wheels ship NCCL / RCCL
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------- nvidia-smi (no pynvml)

def test_nvidia_smi_stands_in_when_pynvml_is_missing(monkeypatch):
    monkeypatch.setenv("FAKE_NVIDIA_SMI_CSV", str(OUTPUTS / "nvidia-smi-query-2gpus.csv"))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_L", str(OUTPUTS / "nvidia-smi-L-2gpus.txt"))
    hw = nvidia.detect(variables.Visibility(cuda_visible_devices="MIG-b1b2,1"), nvml=None,
                       load=False, root="/nonexistent", path=str(FAKES))
    assert hw.source == "nvidia-smi" and hw.listed == 2
    assert [g.uuid for g in hw.gpus] == ["MIG-b1b2c3d4-0000-5111-8222-333344445555"]
    assert hw.gpus[0].mig and any("only the first" in w for w in hw.warnings)
    assert hw.driver_version == "580.65.06" and hw.cuda_driver_version == "13.0"
    assert "nvidia-smi instead" in hw.notes[0]
    plain = nvidia.detect(variables.Visibility(cuda_visible_devices="1"), nvml=None, load=False,
                          path=str(FAKES))
    g = plain.gpus[0]
    assert (g.name, g.arch, g.memory_bytes, g.bus_id) == (
        "NVIDIA H100 80GB HBM3", "sm_90", 81559 * 1024 ** 2, "00000000:3B:00.0")


def test_nvidia_smi_failing_means_no_nvidia(monkeypatch, tmp_path):
    monkeypatch.delenv("FAKE_NVIDIA_SMI_CSV", raising=False)
    hw = nvidia.detect(variables.Visibility(), nvml=None, load=False, root=str(tmp_path),
                       path=str(FAKES))
    assert hw.vendor is None and "pynvml" in hw.notes[0]


# ------------------------------------------------------- CUDA forward compatibility

# NVIDIA_REQUIRE_CUDA as the nvidia/cuda:13.0.2 base image sets it (read on a real machine).
REQUIRE_CUDA_13 = (FAKES / "outputs" / "nvidia-require-cuda-13.0.2-base.txt").read_text().strip()
CU126 = TorchBuild(version="2.13.0+cu126", cuda="12.6", nccl=True,
                   arch_list=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"))


def detected(tmp_path, brand: int, driver: str, cuda: int, compat_lib: bool = True,
             require: str | None = REQUIRE_CUDA_13) -> Hardware:
    """Detection through the NVML substitute, with the image's compat library or not."""
    if compat_lib:
        lib = tmp_path / "usr/local/cuda/compat"
        lib.mkdir(parents=True)
        (lib / f"libcuda.so.{driver}").touch()
        (lib / "libcuda.so.1").symlink_to(f"libcuda.so.{driver}")
    extra = {"NVIDIA_REQUIRE_CUDA": require} if require else {}
    env = env_of(TRAIN_HW_ROOT=str(tmp_path), **extra)
    return detect.detect(env, nvml=FakeNvml(h100s(2, brand=brand), driver=driver, cuda=cuda))


def test_data_center_gpus_on_a_listed_older_branch_run_through_forward_compatibility(tmp_path):
    hw = detected(tmp_path, pynvml.NVML_BRAND_NVIDIA, "570.124.06", 12080)
    assert [g.brand for g in hw.gpus] == ["nvidia", "nvidia"] and hw.cuda_compat
    found = compat.check_build(hw, CUDA13)
    assert [f.level for f in found] == ["warn"], found
    assert "forward compatibility" in found[0].message and "R570" in found[0].message


@pytest.mark.parametrize("brand, driver, cuda, compat_lib, require, why", [
    (pynvml.NVML_BRAND_GEFORCE_RTX, "570.124.06", 12080, True, REQUIRE_CUDA_13, "GeForce"),
    (pynvml.NVML_BRAND_TESLA, "560.35.03", 12060, True, REQUIRE_CUDA_13, "branch not listed"),
    (pynvml.NVML_BRAND_TESLA, "570.124.06", 12080, False, REQUIRE_CUDA_13, "no compat library"),
    (pynvml.NVML_BRAND_TESLA, "570.124.06", 12080, True, None, "no NVIDIA_REQUIRE_CUDA"),
])
def test_older_driver_without_forward_compatibility_is_exit_3(tmp_path, brand, driver, cuda,
                                                              compat_lib, require, why):
    hw = detected(tmp_path, brand, driver, cuda, compat_lib, require)
    fails = [f for f in compat.check_build(hw, CUDA13) if f.level == "fail"]
    assert len(fails) == 1 and fails[0].exit_code == 3 and fails[0].topic == "driver", why


def test_cu126_on_an_older_12x_driver_runs_by_minor_version_compatibility(tmp_path):
    """The case the cu126 variant exists for: a GeForce host on R535 (CUDA 12.2)."""
    hw = detected(tmp_path, pynvml.NVML_BRAND_GEFORCE_RTX, "535.183.01", 12020, compat_lib=False)
    found = compat.check_build(hw, CU126)
    assert [f.level for f in found] == ["warn"] and "minor-version" in found[0].message
