"""pytest's hooks and fixtures for the whole suite; what tests share otherwise lives in
tests/harness (tests/harness/runs.py: configs, environments, real runs). The tiers are
folders: tests/static, tests/unit (``make test``) and tests/e2e (``make test-slow``);
see tests/README.md.

Tests marked ``gpu`` need a usable GPU and are skipped without one; scripts/gpu-check
runs them on GPU machines.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.harness.checkpoints import reference_run
from tests.harness.examples import copy_project
from tests.harness.plans import plan_config
from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    TINY_MLP,
    limit,
    merge,
    usable_gpus,
    wait_for,
    write_config,
)

E2E = ROOT / "tests" / "e2e"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """The path decides the tier: every test under tests/e2e/ is marked ``slow`` (so that
    ``-m slow`` and ``-m "not slow"`` still select the tiers), and a test elsewhere that
    says ``slow`` fails its file's collection: a slow test belongs in tests/e2e/."""
    report = yield
    if not report.passed:
        return report
    items = [node for node in report.result if isinstance(node, pytest.Item)]
    if E2E in collector.path.resolve().parents:
        for item in items:
            item.add_marker(pytest.mark.slow)
    elif misplaced := [item.name for item in items if item.get_closest_marker("slow")]:
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid}: marked slow outside tests/e2e/ (the slow tier "
                           f"is a path: move them there, or drop the mark): "
                           f"{', '.join(misplaced)}")
        report.result = []
    return report


# The slow tier's files, longest first (their tests' seconds summed: the longest tests
# from CI's --durations of 2026-12-04, 2 idle cores, TEST_TIME_SCALE=2; the short files
# measured alone). pytest-xdist hands a whole file to the first free worker, in
# collection order (the Makefile turns off its own reordering by test count), so the
# longest start first and the tier ends on files of seconds, not on one worker still
# running a long file while the others have nothing left. Every file is named (a static
# test checks): a new one goes where its time puts it.
E2E_LONGEST_FIRST = (
    "test_vanish", "test_slurm", "test_slurm_replicas", "test_k8s_sim_runs",
    "test_k8s_replicas",
    "test_replica_runs", "test_sharded_checkpoints", "test_replica_fsdp_runs",
    "test_hangs", "test_trackers_runs", "test_strategies_runs", "test_hf_models_runs",
    "test_training_runs", "test_credentials_runs", "test_object_storage_runs",
    "test_liveness", "test_safety_runs", "test_multinode_runs", "test_preflight_runs",
    "test_checkpoint_runs", "test_stragglers", "test_node_local_runs", "test_run_files_runs",
    "test_your_code_runs", "test_slow_nodes", "test_slow_link_midrun", "test_binding_runs",
    "test_install", "test_token_objects_runs", "test_entrypoint_runs", "test_grace",
    "test_restarts", "test_slurm_preflight", "test_tools_runs", "test_tokenize_runs",
    "test_replica_launch", "test_launcher_supervise_runs", "test_run_lease_runs",
    "test_slurm_cluster",
)


def _e2e_order(item: pytest.Item) -> int:
    path = Path(str(item.path)).resolve()
    if E2E not in path.parents:
        return -1  # the other tiers keep their order, ahead of the slow one
    stem = path.stem
    return E2E_LONGEST_FIRST.index(stem) if stem in E2E_LONGEST_FIRST \
        else len(E2E_LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_e2e_order)  # stable: within a file and among the rest, as collected
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and not usable_gpus():
        skip = pytest.mark.skip(reason="needs a usable GPU (scripts/gpu-check runs these)")
        for item in gpu_tests:
            item.add_marker(skip)


@pytest.fixture
def tiny_gpt(tmp_path: Path) -> Path:
    runs = {"output": {"dir": str(tmp_path / "runs")}}
    return write_config(tmp_path / "tiny.yaml", merge(TINY_GPT, runs))


@pytest.fixture
def tiny_mlp(tmp_path: Path) -> Path:
    runs = {"output": {"dir": str(tmp_path / "runs")}}
    return write_config(tmp_path / "mlp.yaml", merge(TINY_MLP, runs))


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory) -> tuple[Path, Path]:
    """(config, run directory) of a finished 20-step run with a checkpoint every 5 steps
    (tests/harness/checkpoints.py), trained once per test module; copy it before changing it."""
    return reference_run(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def cfg_file(tmp_path: Path):
    """``cfg_file(**sections)``: a small config file for golden plans
    (tests/harness/plans.py), its path."""
    return lambda **tree: plan_config(tmp_path, **tree)


@pytest.fixture
def project(tmp_path) -> Path:
    """examples/custom_model copied (tests/harness/examples.py): the user's folder, the
    working directory."""
    return copy_project(tmp_path)


@pytest.fixture
def sim(tmp_path):
    """The k8s/cpu manifests' objects, ready to start their pods
    (tests/harness/kubesim.py); every pod is gone after the test."""
    from tests.harness.kubesim import CPU_VARIANT, Cluster
    cluster = Cluster(CPU_VARIANT, tmp_path)
    yield cluster
    cluster.close()


@pytest.fixture
def net(tmp_path):
    """Hosts in network namespaces (tests/harness/netns.py); ``net.procs``: processes a
    test started on them, killed after it, before the namespaces go."""
    from tests.harness import netns
    why = netns.available()
    if why:
        pytest.skip(f"hosts in network namespaces need root: {why}")
    network = netns.Network(tmp_path)
    network.procs = []
    yield network
    for p in network.procs:
        if p.running:
            p.kill()
    network.close()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A real SLURM cluster (tests/harness/slurmcluster.py) of two nodes, one per test
    module; a skip saying why where this machine cannot run one."""
    yield from _slurm_cluster(tmp_path_factory, nodes=2)


@pytest.fixture(scope="module")
def slurm_cluster3(tmp_path_factory):
    """The same of three nodes (jobs of two, and a third node to leave out or to spare)."""
    yield from _slurm_cluster(tmp_path_factory, nodes=3)


@pytest.fixture(scope="module")
def slurm_cluster4(tmp_path_factory):
    """The same of four nodes (two replica groups of two nodes each)."""
    yield from _slurm_cluster(tmp_path_factory, nodes=4)


def _slurm_cluster(tmp_path_factory, nodes: int):
    from tests.harness import slurmcluster
    why = slurmcluster.available()
    if why:
        pytest.skip(f"a SLURM cluster on this machine needs slurm, munge and root: {why}")
    with slurmcluster.SlurmCluster(tmp_path_factory.mktemp(f"slurm{nodes}"), nodes=nodes,
                                   cpus_per_node=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS on 127.0.0.1: tests/harness/s3server.py), one per test
    module; a skip saying why without boto3 and weed (``make s3``)."""
    from tests.harness import s3server
    if s3server.missing():
        pytest.skip(s3server.missing())
    with s3server.s3_server(tmp_path_factory.mktemp("s3")) as running:
        yield running


@pytest.fixture
def aws(s3_server, monkeypatch):
    """This process's AWS variables reach the module's S3 server (boto3's default chain);
    the server itself, for its ``client()`` and ``env()``."""
    s3_server.reach_in_process(monkeypatch)
    return s3_server


@pytest.fixture
def lighthouse():
    """A real torchft Lighthouse on 127.0.0.1 with the default replica timeouts, its
    ``http://HOST:PORT``; stopped after the test (needs ``make ft``: the test skips)."""
    from launcher.detection.system import free_port
    from launcher.detection.torchft_tools import lighthouse_binary
    from launcher.running.lighthouse import reachable
    from train.core.config import Config
    from train.core.run.replica_contract import Timeouts, lighthouse_argv
    port = free_port()
    timeouts = Timeouts.of(Config().distributed.replica_timeout_s)
    proc = subprocess.Popen(lighthouse_argv(lighthouse_binary(), f"127.0.0.1:{port}", timeouts),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: reachable(f"127.0.0.1:{port}"), limit(30), "the Lighthouse's port")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
