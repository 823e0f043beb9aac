"""The launch plan as golden argv/env for each launch convention, and its error paths.

plan() is pure, so every machine here is made up: Hardware/TorchBuild records and an
environment mapping.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from launcher.detection.hardware import Gpu, Hardware, TorchBuild
from launcher.planning import environ
from tests.harness.plans import (
    BASE_ENV,
    CPU_HW,
    CPU_TORCH,
    CUDA_TORCH,
    LOOPBACK_ENV,
    NCCL_ENV,
    PY,
    ROCM_TORCH,
    SHUTDOWN,
    STANDALONE,
    gpus,
    make,
    torchrun,
)
from train.core.config import load_config
from train.core.errors import CannotRunHere, ConfigError

# How OpenMP threads wait, on every device (train/core/machine/threads.py says why)
WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}

# ------------------------------------------------------------------------ golden plans

def test_single_process_on_cpu_runs_the_worker_directly(cfg_file):
    path = cfg_file()
    p = make(path, ["optim.lr=0.01"])
    assert p.mode == "direct" and p.device == "cpu" and p.backend == "gloo"
    assert list(p.argv) == [PY, "-m", "train.worker", path, "optim.lr=0.01", "device=cpu",
                            "distributed.backend=gloo"]
    assert p.env == {**BASE_ENV, "OMP_NUM_THREADS": "8", **WAIT, **LOOPBACK_ENV, "RANK": "0",
                     "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
                     "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert p.world_sizes == (1,) and p.log_dir is None


def test_two_cpu_processes_use_standalone_torchrun(cfg_file):
    path = cfg_file()
    p = make(path, ["distributed.nproc_per_node=2"])
    assert list(p.argv) == torchrun(*STANDALONE, nproc=2) + [
        path, "distributed.nproc_per_node=2", "device=cpu", "distributed.backend=gloo"]
    # Restarts after a lost worker need the unshared rendezvous store (a new round).
    assert p.env == {**BASE_ENV, "OMP_NUM_THREADS": "4", **WAIT,
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **LOOPBACK_ENV, **SHUTDOWN}


def test_single_node_gpus_one_process_each_with_nccl(cfg_file):
    path = cfg_file()
    p = make(path, ["deterministic=true"], hw=gpus(4), tb=CUDA_TORCH)
    assert p.device == "gpu" and p.backend == "nccl" and p.nproc_per_node == 4
    assert list(p.argv) == torchrun(*STANDALONE, nproc=4) + [
        path, "deterministic=true", "device=gpu", "distributed.backend=nccl"]
    assert p.env == {**BASE_ENV, "OMP_NUM_THREADS": "8", **WAIT, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                     "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **NCCL_ENV, **LOOPBACK_ENV,
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **SHUTDOWN}


def test_rocm_gpus_use_nccl_which_is_rccl(cfg_file):
    p = make(cfg_file(), hw=gpus(2, "amd", "gfx942"), tb=ROCM_TORCH)
    assert (p.device, p.backend, p.nproc_per_node) == ("gpu", "nccl", 2)
    assert "CUDA_DEVICE_ORDER" not in p.env and p.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_torchrun_pet_variables_elastic_c10d(cfg_file):
    path = cfg_file()
    env = {"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "rdzv.ns.svc:29400",
           "PET_RDZV_ID": "job-123", "PET_MAX_RESTARTS": "10", "PET_NPROC_PER_NODE": "2"}
    p = make(path, hw=gpus(2), tb=CUDA_TORCH, env=env)
    assert p.convention == "torchrun-env" and p.nnodes == (1, 4)
    assert list(p.argv) == torchrun(
        "--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "rdzv.ns.svc:29400",
        "--rdzv-id", "job-123", "--rdzv-conf",
        "join_timeout=600,last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=10",
        nproc=2, restarts=10) + [path, "device=gpu", "distributed.backend=nccl"]
    assert p.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert p.rdzv_host == "rdzv.ns.svc" and p.world_sizes == (2, 4, 6, 8)
    assert p.max_restarts == 10


def test_pet_rdzv_conf_entries_win_over_defaults(cfg_file):
    env = {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "store:29400", "PET_RDZV_ID": "x",
           "PET_RDZV_CONF": "is_host=false,keep_alive_interval=7"}
    p = make(cfg_file(), env=env)
    conf = p.argv[p.argv.index("--rdzv-conf") + 1]
    assert conf == ("join_timeout=600,last_call_timeout=3,keep_alive_interval=7,"
                    "keep_alive_max_attempt=10,is_host=false")


def test_kubeflow_v1_static_rendezvous(cfg_file):
    path = cfg_file()
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3",
           "RANK": "2"}
    p = make(path, hw=gpus(8), tb=CUDA_TORCH, env=env)
    assert p.convention == "kubeflow-v1" and p.nnodes == (3, 3) and p.world_sizes == (24,)
    assert list(p.argv) == torchrun(
        "--nnodes", "3", "--node-rank", "2", "--rdzv-backend", "static",
        "--master-addr", "job-master-0", "--master-port", "23456", "--rdzv-conf", "timeout=600",
        nproc=8, restarts=0) + [
        path, "device=gpu", "distributed.backend=nccl"]
    assert p.rdzv_host == "job-master-0"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in p.env


def test_kubeflow_v1_master_pod_does_not_wait_for_its_own_name(cfg_file):
    env = {"MASTER_ADDR": "job-master-0", "WORLD_SIZE": "2", "RANK": "0"}
    assert make(cfg_file(), env=env).rdzv_host is None


def test_indexed_job_with_standalone_store(cfg_file):
    path = cfg_file()
    env = {"JOB_COMPLETION_INDEX": "1", "TRAIN_RDZV_ENDPOINT": "train-rdzv:29400",
           "TRAIN_NNODES": "2:4", "TRAIN_RDZV_ID": "0b7c-uid", "TRAIN_LOCAL_ADDR": "10.0.0.7",
           "TRAIN_SOCKET_IFNAME": "eth0"}
    p = make(path, ["distributed.nproc_per_node=2"], env=env)
    assert p.convention == "indexed-job" and p.nnodes == (2, 4)
    assert list(p.argv) == torchrun(
        "--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "train-rdzv:29400",
        "--rdzv-id", "0b7c-uid", "--rdzv-conf",
        "is_host=false,join_timeout=600,last_call_timeout=3,keep_alive_interval=2,"
        "keep_alive_max_attempt=10",
        "--local-addr", "10.0.0.7", nproc=2) + [
        path, "distributed.nproc_per_node=2", "device=cpu", "distributed.backend=gloo"]
    assert p.env == {**BASE_ENV, "OMP_NUM_THREADS": "4", **WAIT, "NCCL_SOCKET_IFNAME": "eth0",
                     "GLOO_SOCKET_IFNAME": "eth0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                     **SHUTDOWN}
    assert p.world_sizes == (4, 6, 8) and p.rdzv_host == "train-rdzv"


def test_a_store_endpoint_alone_selects_the_standalone_store(cfg_file):
    """TRAIN_RDZV_ENDPOINT on a node that is no Indexed Job pod (a VM, a StatefulSet):
    it meets the others at the store, rather than training alone as a single node."""
    env = {"TRAIN_RDZV_ENDPOINT": "store:29400", "TRAIN_NNODES": "2", "TRAIN_RDZV_ID": "r1"}
    p = make(cfg_file(), env=env)
    assert p.convention == "indexed-job" and p.nnodes == (2, 2) and p.rdzv_host == "store"
    assert "--rdzv-endpoint" in p.argv and "store:29400" in p.argv
    assert any("(TRAIN_RDZV_ENDPOINT)" in n for n in p.notes)


def test_user_set_variables_are_kept_and_reported(cfg_file):
    p = make(cfg_file(), ["distributed.nproc_per_node=2"],
             env={"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE", "PYTHONPATH": "/extra"})
    assert "OMP_NUM_THREADS" not in p.env and p.env["PYTHONPATH"] == "/app:/extra"
    assert "OMP_WAIT_POLICY" not in p.env
    assert any("OMP_NUM_THREADS=3" in w for w in p.warnings)
    assert any("OMP_WAIT_POLICY=ACTIVE" in w and "PASSIVE" in w for w in p.warnings)


def test_a_users_spin_count_chooses_the_wait_instead_of_the_launchers_policy(cfg_file):
    """GOMP_SPINCOUNT replaces any policy's spin in GNU OpenMP: the launcher adds none."""
    p = make(cfg_file(), env={"GOMP_SPINCOUNT": "10000"})
    assert "OMP_WAIT_POLICY" not in p.env and "GOMP_SPINCOUNT" not in p.env
    assert any("GOMP_SPINCOUNT=10000 (set by you" in w for w in p.warnings)


@pytest.mark.parametrize("cpus,nproc,threads", [(8, 1, "8"), (8, 3, "2"), (1, 2, "1")])
def test_threads_are_the_nodes_cpus_shared_by_its_processes(cfg_file, cpus, nproc, threads):
    """hw.cpus is the affinity mask capped by the cgroup quota (train/core/machine/host.py)."""
    p = make(cfg_file(), [f"distributed.nproc_per_node={nproc}"], hw=Hardware(cpus=cpus))
    assert p.env["OMP_NUM_THREADS"] == threads and p.env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_debug_switch(cfg_file):
    p = make(cfg_file(), hw=gpus(1), tb=CUDA_TORCH, env={"TRAIN_DEBUG": "1"})
    assert p.env["NCCL_DEBUG"] == "INFO" and p.env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"


def test_debug_and_interface_from_config_node_variable_wins(cfg_file):
    p = make(cfg_file(distributed={"debug": True, "socket_ifname": "eth1"}), hw=gpus(1),
             tb=CUDA_TORCH)
    assert p.env["NCCL_DEBUG"] == "INFO" and p.env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert p.env["NCCL_SOCKET_IFNAME"] == p.env["GLOO_SOCKET_IFNAME"] == "eth1"
    p = make(cfg_file(distributed={"socket_ifname": "eth1"}), env={"TRAIN_SOCKET_IFNAME": "ib0"})
    assert p.env["GLOO_SOCKET_IFNAME"] == "ib0"


def test_device_cpu_ignores_gpus_and_an_unusable_build(cfg_file):
    p = make(cfg_file(), ["device=cpu"], hw=gpus(4),
             tb=CPU_TORCH)
    assert (p.device, p.backend, p.nproc_per_node) == ("cpu", "gloo", 1)
    assert any("ignoring 4 GPU" in n for n in p.notes)


def test_dp_is_one_process_over_all_gpus(cfg_file):
    p = make(cfg_file(), ["distributed.strategy=dp"], hw=gpus(4), tb=CUDA_TORCH)
    assert p.mode == "direct" and p.nproc_per_node == 1 and p.world_sizes == (1,)


# ------------------------------------------------------------------------ error paths

@pytest.mark.parametrize("overrides, env, key", [
    (["distributed.nproc_per_node=5"], {}, "train.global_batch_size"),        # 48 % 5
    ([], {"PET_NNODES": "1:5", "PET_RDZV_ENDPOINT": "h:1", "PET_RDZV_ID": "x"},
     "train.global_batch_size"),                                                 # 48 % 5 at 5 nodes
    (["train.micro_batch_size=16", "distributed.nproc_per_node=2"], {}, "train.micro_batch_size"),
    (["device=cpu", "distributed.backend=nccl"], {}, "distributed.backend"),
    (["device=cpu", "distributed.strategy=dp"], {}, "distributed.strategy"),
    (["distributed.strategy=single", "distributed.nproc_per_node=2"], {},
     "distributed.nproc_per_node"),
    ([], {"PET_NNODES": "4:2"}, "PET_NNODES"),
    ([], {"PET_NNODES": "two"}, "PET_NNODES"),
    ([], {"JOB_COMPLETION_INDEX": "0", "TRAIN_RDZV_ENDPOINT": "s:1", "TRAIN_NNODES": "2"},
     "TRAIN_RDZV_ID"),
    ([], {"JOB_COMPLETION_INDEX": "0", "TRAIN_RDZV_ENDPOINT": "s:1", "TRAIN_RDZV_ID": "u"},
     "TRAIN_NNODES"),
    ([], {"JOB_COMPLETION_INDEX": "0", "TRAIN_RDZV_ENDPOINT": "s:99999", "TRAIN_RDZV_ID": "u",
          "TRAIN_NNODES": "2"}, "TRAIN_RDZV_ENDPOINT"),
    ([], {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "s:1", "PET_RDZV_CONF": "is_host=false"},
     "PET_RDZV_ID"),
    ([], {"MASTER_ADDR": "m", "WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
    ([], {"PET_NNODES": "2", "PET_RDZV_BACKEND": "c10d"}, "PET_RDZV_ENDPOINT"),
    ([], {"TRAIN_RDZV_ENDPOINT": "s:1", "TRAIN_RDZV_ID": "u", "TRAIN_NNODES": "2:1"},
     "TRAIN_NNODES"),
    ([], {"TRAIN_RDZV_ENDPOINT": "s:1", "TRAIN_RDZV_ID": "u", "TRAIN_NNODES": "abc"},
     "TRAIN_NNODES"),
])
def test_bad_input_is_exit_2_naming_the_key(cfg_file, overrides, env, key):
    with pytest.raises(ConfigError) as err:
        make(cfg_file(), overrides, env=env)
    assert err.value.key == key and err.value.exit_code == 2
    assert "\n" not in err.value.one_line()


def test_bad_environment_value_is_exit_2():
    from launcher import conventions
    with pytest.raises(ConfigError) as err:
        conventions.resolve(environ.read({"JOB_COMPLETION_INDEX": "x"}))
    assert err.value.one_line().startswith("error: environment: JOB_COMPLETION_INDEX: ")


@pytest.mark.parametrize("overrides, hw, tb, env, words", [
    (["device=gpu"], CPU_HW, CPU_TORCH, {}, "no usable GPU"),
    (["distributed.backend=nccl"], CPU_HW, CPU_TORCH, {}, "nccl needs GPUs"),
    (["distributed.backend=mpi"], CPU_HW, CPU_TORCH, {}, "without mpi"),
    (["distributed.backend=nccl"], gpus(1), TorchBuild(version="x", cuda="13.0", gloo=True),
     {}, "without nccl"),
    ([], gpus(2), CPU_TORCH, {}, "CPU-only build"),
    ([], gpus(2, arch="sm_70"), CUDA_TORCH, {}, "sm_70"),
    ([], Hardware(vendor="nvidia", listed=1, cuda_driver_version="12.2", driver_version="535",
                  gpus=(Gpu(index=0, name="G", arch="sm_90"),)), CUDA_TORCH, {}, "R580"),
    (["distributed.nproc_per_node=4"], gpus(2), CUDA_TORCH, {}, "4 processes per node need 4"),
    (["distributed.strategy=dp"], CPU_HW, CPU_TORCH, {}, "dp needs GPUs"),
    (["distributed.strategy=single"], CPU_HW, CPU_TORCH,
     {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "h:1"}, "launches 2:2 nodes"),
    (["distributed.strategy=fsdp", "memory.cpu_offload=true"], CPU_HW, CPU_TORCH, {},
     "cpu_offload"),
])
def test_valid_but_not_here_is_exit_3(cfg_file, overrides, hw, tb, env, words):
    with pytest.raises(CannotRunHere) as err:
        make(cfg_file(), overrides, hw=hw, tb=tb, env=env)
    assert err.value.exit_code == 3 and words in str(err.value)


def test_plan_reads_only_what_it_is_given(cfg_file, monkeypatch, tmp_path):
    """Pure: the process environment and the file system do not enter the plan."""
    out = tmp_path / "out"
    path = cfg_file(output={"dir": str(out)})
    given = make(path, ["distributed.nproc_per_node=2"])
    for name, value in {"OMP_NUM_THREADS": "99", "OMP_WAIT_POLICY": "ACTIVE",
                        "PET_NNODES": "bad", "CUDA_VISIBLE_DEVICES": "",
                        "TRAIN_DEBUG": "1", "RANK": "3", "WORLD_SIZE": "9"}.items():
        monkeypatch.setenv(name, value)
    again = make(path, ["distributed.nproc_per_node=2"])
    assert again == given and given.env["OMP_NUM_THREADS"] == "4"
    assert given.env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "NCCL_DEBUG" not in given.env and given.convention == "single"
    assert not out.exists()  # nothing created (--dry-run relies on it)


C10D = {"PET_NNODES": "1", "PET_RDZV_ENDPOINT": "h:1"}


@pytest.mark.parametrize("var, value, base", [
    ("PET_MAX_RESTARTS", "gpu", C10D), ("PET_NPROC_PER_NODE", "many", C10D),
    ("PET_NODE_RANK", "auto", {"PET_NNODES": "2", "PET_MASTER_ADDR": "m"})])
def test_pet_words_are_accepted_only_where_torchrun_takes_them(cfg_file, var, value, base):
    env = {**base, var: value}
    with pytest.raises(ConfigError) as err:
        make(cfg_file(), env=env)
    assert err.value.key == var


def test_pet_nproc_per_node_auto_lets_the_plan_choose(cfg_file):
    p = make(cfg_file(), hw=gpus(3), tb=CUDA_TORCH,
             env={"PET_NNODES": "1", "PET_RDZV_ENDPOINT": "h:1", "PET_NPROC_PER_NODE": "auto"})
    assert p.nproc_per_node == 3


def test_batch_error_over_a_node_range_names_the_node_count(cfg_file):
    with pytest.raises(ConfigError) as err:
        make(cfg_file(), ["distributed.nproc_per_node=2"],
             env={"PET_NNODES": "2:5", "PET_RDZV_ENDPOINT": "h:1", "PET_RDZV_ID": "x"})
    assert err.value.one_line().endswith(
        "48 is not divisible by world size 10; use a multiple of 10 (at 5 of 2:5 nodes x 2 "
        "process(es); every world size in the range must divide it)")


def test_torchrun_gives_the_stop_checkpoint_the_platforms_grace(cfg_file):
    p = make(cfg_file(), ["distributed.nproc_per_node=2", "distributed.grace_period_s=45"])
    assert p.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "40"
    mine = make(cfg_file(), ["distributed.nproc_per_node=2"],
                env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "200"})
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in mine.env  # the user's own value stays
    assert "kept TORCH_ELASTIC_SHUTDOWN_TIMEOUT=200 (set by you; the launcher would set " \
           "115)" in mine.warnings


# ------------------------------------------------------------- the model's own memory

@pytest.mark.parametrize("overrides", [
    ["model.kind=gpt", "data.kind=text", "data.path=/usr", "model.depth=2", "model.width=48",
     "model.heads=4", "model.context_length=16"],
    ["model.kind=gpt", "data.kind=tokens", "data.path={tokens}", "data.vocab_size=1000",
     "model.depth=1", "model.width=32", "model.heads=2", "model.context_length=8",
     "model.tie_weights=false"],
    ["model.kind=mlp", "model.depth=3", "model.width=20", "data.shape=[3, 5]",
     "data.num_classes=7"],
    ["model.kind=mlp", "model.depth=1", "data.shape=[6]"],
])
def test_the_parameter_count_from_the_config_is_the_built_models(cfg_file, tmp_path, overrides):
    import numpy as np

    from train.core.config import kinds
    from train.models import build_model, count_parameters
    tokens = tmp_path / "t.bin"
    (np.arange(4000) % 1000).astype(np.uint16).tofile(tokens)
    cfg = load_config(cfg_file(), [o.format(tokens=tokens) for o in overrides])
    vocab = kinds.TEXT_VOCAB if cfg.data.kind == "text" else cfg.data.vocab_size
    built = build_model(cfg.model, input_shape=tuple(cfg.data.shape),
                        num_classes=vocab if cfg.model.kind == "gpt" else cfg.data.num_classes)
    assert kinds.model_kind(cfg).parameters(cfg) == count_parameters(built)


def _wide_mlp(cfg_file, *extra: str, hw=CPU_HW, tb=CPU_TORCH):
    # 4 x 4096 + 4096 x 4096 + 4096 x 10 weights and biases: 16.84 M parameters, AdamW's
    # 16 B each = 257 MiB in all
    return make(cfg_file(), ["model.width=4096", "model.depth=2", *extra], hw=hw, tb=tb)


def test_a_model_whose_state_cannot_fit_is_exit_3_with_the_numbers_before_any_worker(cfg_file):
    small = Hardware(cpus=8, memory_available=400 << 20)  # 200 MiB per process at 2
    assert _wide_mlp(cfg_file, hw=small).nproc_per_node == 1  # 257 MiB < 400 MiB: fits
    with pytest.raises(CannotRunHere) as err:
        _wide_mlp(cfg_file, "distributed.nproc_per_node=2", hw=small)
    text = str(err.value)
    assert "0.02 G parameters" in text and "257.0 GiB" not in text
    assert "take 0.3 GiB per process (16 B a parameter)" in text
    assert "than the 0.2 GiB of host memory available to each of the 2 process(es)" in text
    # FSDP shards the state over the processes: 128 MiB each fits in 200 MiB
    assert _wide_mlp(cfg_file, "distributed.nproc_per_node=2", "distributed.strategy=fsdp",
                     hw=small).nproc_per_node == 2
    sgd = Hardware(cpus=8, memory_available=420 << 20)  # 12 B a parameter: 193 MiB
    assert _wide_mlp(cfg_file, "distributed.nproc_per_node=2", "optim.name=sgd",
                     hw=sgd).nproc_per_node == 2


def test_on_gpus_the_state_must_fit_one_gpu_unless_offloaded(cfg_file):
    tiny_gpus = replace(gpus(2), gpus=tuple(replace(g, memory_bytes=100 << 20, name="T4")
                                            for g in gpus(2).gpus),
                        memory_available=64 << 30)
    with pytest.raises(CannotRunHere) as err:
        _wide_mlp(cfg_file, "distributed.strategy=fsdp", "distributed.nproc_per_node=1",
                  hw=tiny_gpus, tb=CUDA_TORCH)
    assert "memory of one T4" in str(err.value) and "memory.cpu_offload=true" in str(err.value)
    # offloaded, the state lives in host memory, which has room
    assert _wide_mlp(cfg_file, "distributed.strategy=fsdp", "distributed.nproc_per_node=1",
                     "memory.cpu_offload=true", hw=tiny_gpus, tb=CUDA_TORCH).nproc_per_node == 1
