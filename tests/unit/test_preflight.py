"""The preflight check's rule (train/core/nodes/verdict.py): every rank's measurements in,
the lines rank 0 prints out; when a run checks at all; its config keys; what it
records; ``doctor --comm`` judging its probes alike; and one rank's measurement for real
(a process group of one, in a subprocess). Real multi-node runs:
tests/e2e/test_preflight_runs.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from tests.harness.runs import QUICKSTART, TINY_MLP, limit, worker_env
from train.core.config import load_config
from train.core.errors import ConfigError
from train.core.nodes.verdict import RankResult, judge
from train.core.run import protocol, rundir
from train.core.run.identity import WorkerIdentity

MIB = 1 << 20


def rank(r: int, node: int, gflops: float | None = 15.0, **kw) -> RankResult:
    return RankResult(rank=r, node=node, host=f"host-{'abcdefgh'[node]}", gflops=gflops,
                      allreduce_ms=2.2, allreduce_bytes=MIB, seconds=1.2, **kw)


def two_per_node(nodes: int, **by_rank: dict) -> list[RankResult]:
    """``nodes`` nodes of two ranks each; by_rank: {"r3": {"gflops": 3.1}, ...}."""
    return [rank(r, r // 2, **{"gflops": 14.0 + r % 2, **by_rank.get(f"r{r}", {})})
            for r in range(2 * nodes)]


def test_one_slow_node_is_named_with_its_ratio_to_the_median():
    results = two_per_node(2, r2={"gflops": 3.1}, r3={"gflops": 3.2})
    verdict = judge(results, 0.5)
    assert verdict.slow == ["preflight: node 1 (host-b) matmul 0.36x the median "
                            "(3.1 vs 8.6 GFLOP/s)"]
    assert verdict.failures == [] and verdict.summary is None and not verdict.ok


def test_one_slow_rank_of_a_node_is_named_as_the_rank():
    verdict = judge(two_per_node(3, r3={"gflops": 3.1}), 0.5)
    assert verdict.lines == ["preflight: rank 3 (node 1, host-b) matmul 0.22x the median "
                             "(3.1 vs 14 GFLOP/s)"]


def test_the_nodes_to_leave_out_are_those_of_the_ranks_named_by_their_scheduler_name():
    results = two_per_node(3, r3={"gflops": 3.1}, r4={"nonfinite": "NaN"})
    results = [RankResult(**{**r.__dict__, "scheduler_node": f"gpu0{r.node}"})
               if r.node == 1 else r for r in results]
    verdict = judge(results, 0.5)
    assert verdict.hosts == ["gpu01", "host-c"]  # SLURM's name where it is known
    assert judge(two_per_node(3), 0.5).hosts == []


def test_uniform_slowness_and_spread_above_the_ratio_are_silent():
    slow = [rank(r, r, gflops=1.5) for r in range(4)]
    assert judge(slow, 0.5).ok
    spread = [rank(r, r, gflops=g) for r, g in enumerate((8.0, 14.0, 15.0, 16.0))]
    verdict = judge(spread, 0.5)  # 8 is 0.55x the median 14.5: not far below
    assert verdict.ok and verdict.lines == [verdict.summary]


def test_nan_inf_a_wrong_sum_and_an_error_are_named_and_never_counted_as_slow():
    results = [rank(0, 0), rank(1, 1, nonfinite="NaN"), rank(2, 2, gflops=None,
               error="RuntimeError: CUDA error: an illegal memory access was encountered"),
               rank(3, 3, allreduce_ok=False), rank(4, 4, gflops=0.1, nonfinite="inf"),
               rank(5, 5)]
    verdict = judge(results, 0.5)
    assert verdict.failures == [
        "preflight: node 1 (host-b) matmul gave NaN",
        "preflight: node 2 (host-c) failed: RuntimeError: CUDA error: an illegal memory "
        "access was encountered",
        "preflight: node 3 (host-d) all-reduce gave a wrong sum",
        "preflight: node 4 (host-e) matmul gave inf"]
    assert verdict.slow == []  # rank 4's 0.1 GFLOP/s: already named for its inf
    assert verdict.one_line() == (
        "preflight: node 1 (host-b) matmul gave NaN; node 2 (host-c) failed: RuntimeError: "
        "CUDA error: an illegal memory access was encountered; node 3 (host-d) all-reduce "
        "gave a wrong sum; node 4 (host-e) matmul gave inf")


def test_ranks_of_one_node_failing_alike_share_a_line():
    results = two_per_node(2, r0={"nonfinite": "NaN"}, r1={"nonfinite": "NaN"},
                           r3={"nonfinite": "NaN"})
    assert judge(results, 0.5).failures == ["preflight: node 0 (host-a) matmul gave NaN",
                                            "preflight: rank 3 (node 1, host-b) matmul gave NaN"]


def test_a_single_rank_and_a_single_node_are_fine_and_summarised():
    assert judge([rank(0, 0)], 0.5).lines == [
        "preflight: 1 rank on 1 node in 1.2 s: matmul 15 GFLOP/s, all-reduce 1 MiB 2.2 ms"]
    one_node = [rank(r, 0, gflops=g) for r, g in enumerate((15.0, 3.0, 14.0))]
    assert judge(one_node, 0.5).lines == [  # one node: the rank, never "node 0"
        "preflight: rank 1 (node 0, host-a) matmul 0.21x the median (3.0 vs 14 GFLOP/s)"]


def test_the_summary_gives_ranges_nodes_and_the_slowest_rank_s_time():
    results = [RankResult(rank=r, node=r // 2, host="h", gflops=g, allreduce_ms=ms,
                          allreduce_bytes=64 * MIB, seconds=s)
               for r, (g, ms, s) in enumerate([(400e3, 2.1, 1.1), (420e3, 2.4, 1.2),
                                               (410e3, 2.2, 0.9), (415e3, 2.3, 1.0)])]
    assert judge(results, 0.5).summary == (
        "preflight: 4 ranks on 2 nodes in 1.2 s: matmul 400-420 TFLOP/s, all-reduce 64 MiB "
        "2.1-2.4 ms")


def test_the_check_runs_on_multi_node_starts_unless_off():
    from train.guards.preflight import wanted
    cfg = load_config(QUICKSTART)
    assert cfg.distributed.preflight == "warn" and cfg.distributed.preflight_slow_ratio == 0.5
    two_nodes = WorkerIdentity.from_environ({"RANK": "3", "WORLD_SIZE": "4",
                                             "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                                             "GROUP_WORLD_SIZE": "2"})
    assert two_nodes.node == 1 and two_nodes.nodes == 2 and wanted(cfg, two_nodes)
    one_node = WorkerIdentity.from_environ({"RANK": "1", "WORLD_SIZE": "2",
                                            "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"})
    assert not wanted(cfg, one_node) and not wanted(cfg, WorkerIdentity())
    off = load_config(QUICKSTART, ["distributed.preflight=off"])
    assert not wanted(off, two_nodes)
    # without GROUP_RANK (a launch that does not say it), nodes hold equal shares
    assert WorkerIdentity(rank=5, local_world_size=4).node == 1


def test_off_unquoted_in_yaml_is_off_and_bad_values_are_one_line(tmp_path):
    config = tmp_path / "c.yaml"  # YAML 1.1 reads a bare off as false
    config.write_text(yaml.safe_dump(TINY_MLP) + "distributed:\n  preflight: off\n")
    assert load_config(config).distributed.preflight == "off"
    for override, words in (("distributed.preflight=on", "expected one of off, warn, fail"),
                            ("distributed.preflight_slow_ratio=0", "must be > 0.0"),
                            ("distributed.preflight_slow_ratio=1.5", "must be <= 1.0")):
        with pytest.raises(ConfigError) as err:
            load_config(QUICKSTART, [override])
        assert words in err.value.one_line() and "\n" not in err.value.one_line()


def test_each_check_is_appended_to_preflight_json_keeping_the_last_ones(tmp_path):
    from train.guards.preflight import KEEP, record
    cfg = load_config(QUICKSTART)
    results = two_per_node(2, r3={"gflops": 1.0})
    for _ in range(KEEP + 2):
        record(tmp_path, cfg, list(reversed(results)), judge(results, 0.5))
    checks = json.loads((tmp_path / rundir.PREFLIGHT).read_text())["checks"]
    assert len(checks) == KEEP
    assert checks[-1]["mode"] == "warn" and checks[-1]["slow_ratio"] == 0.5
    assert checks[-1]["problems"] == [judge(results, 0.5).slow[0]]
    assert [r["rank"] for r in checks[-1]["ranks"]] == [0, 1, 2, 3]
    (tmp_path / rundir.PREFLIGHT).write_text("garbage")  # unreadable: starts again
    record(tmp_path, cfg, results, judge(results, 0.5))
    assert len(json.loads((tmp_path / rundir.PREFLIGHT).read_text())["checks"]) == 1


def probe_report(folder, r: int, gflops: float, nonfinite: str | None = None) -> None:
    ident = WorkerIdentity(rank=r, local_rank=r, status_dir=str(folder))
    protocol.Reporter(ident, protocol.COMM).stage("done", probe=protocol.Probe(
        world_size=3, ok=True, seconds=0.002, bytes=MIB, bus_gb_s=1.0, gflops=gflops,
        nonfinite=nonfinite, host="gpu-7", node=0, check_s=0.5))


def test_doctor_comm_judges_its_probes_as_training_does(tmp_path):
    from launcher.commands import comm
    for r, g in enumerate((300e3, 80e3, 310e3)):
        probe_report(tmp_path, r, g)
    result = comm.summarise(str(tmp_path), 3, [], ["", "", ""], "gpu", "nccl", 30)
    assert result["ok"] and result["problems"] == []
    assert result["slow"] == result["preflight"] == [
        "preflight: rank 1 (node 0, gpu-7) matmul 0.27x the median (80 vs 300 TFLOP/s)"]
    probe_report(tmp_path, 1, 300e3, nonfinite="NaN")
    result = comm.summarise(str(tmp_path), 3, [], ["", "", ""], "gpu", "nccl", 30)
    assert not result["ok"]
    assert result["problems"] == ["preflight: rank 1 (node 0, gpu-7) matmul gave NaN"]


def test_one_rank_measures_for_real():
    """A process group of one (gloo): the matmul's rate, its finite result, the
    all-reduce's time and sum, as training and doctor --comm measure them."""
    code = textwrap.dedent("""\
        import datetime, json, dataclasses
        import torch, torch.distributed as dist
        from train.core.run.identity import WorkerIdentity
        from train.guards import preflight
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        stages, parts = [], []
        r = preflight.measure(WorkerIdentity(), torch.device("cpu"), lambda: parts.append(1),
                              stages.append)
        print(json.dumps({**dataclasses.asdict(r), "stages": stages, "parts": len(parts)}))
        dist.destroy_process_group()
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=worker_env(), timeout=limit(120))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["gflops"] > 0 and got["nonfinite"] is None and got["error"] is None
    assert got["allreduce_ok"] and got["allreduce_ms"] > 0 and got["allreduce_bytes"] == MIB
    assert got["stages"] == ["matmul", "allreduce"] and got["parts"] == 12  # 2 x (1 + 5)
    assert got["node"] == 0 and got["seconds"] > 0


@pytest.mark.parametrize(("mode", "level", "code"), [("warn", "warn", 0), ("fail", "fail", 3)])
def test_doctor_comm_warns_of_a_slow_rank_or_fails_as_training_would(monkeypatch, mode, level,
                                                                     code):
    """What the probes measured stood in for (a slow GPU this machine does not have)."""
    from launcher.commands import comm, doctor
    from launcher.planning import environ
    line = "preflight: rank 1 (node 0, gpu-7) matmul 0.27x the median (80 vs 300 TFLOP/s)"
    monkeypatch.setattr(comm, "run", lambda *a, **kw: {
        "ok": True, "device": "gpu", "backend": "nccl", "processes": 2, "seconds": 0.002,
        "bus_gb_s": 90.0, "problems": [], "slow": [line], "preflight": [line], "ranks": []})
    report = {"plan": {"device": "gpu", "backend": "nccl", "nproc_per_node": 2, "env": {}},
              "hardware": {"gpus": [{}, {}]}, "findings": [], "exit_code": 0,
              "preflight": {"mode": mode, "slow_ratio": 0.5}}
    doctor.add_comm(report, environ.read({"PATH": "/usr/bin"}), 30)
    assert report["exit_code"] == code
    assert [(f["level"], f["message"]) for f in report["findings"]] == [(level, line)]
    assert doctor._comm_lines(report["comm"]) == [
        "comm       matmul and all-reduce over 2 process(es), gpu/nccl: ok; all-reduce 2.0 ms, "
        "bus bandwidth 90.0 GB/s"]


@pytest.mark.parametrize(("bus_gb_s", "shown"), [
    (90.0, "90.0 GB/s"), (0.858, "858 MB/s"), (0.0012, "1.2 MB/s"), (1e-9, "under 0.01 MB/s")])
def test_doctor_comm_shows_a_small_bandwidth_in_mb_s_not_as_zero(bus_gb_s, shown):
    """CPU processes over gloo on a busy machine reach MB/s: never "0.0 GB/s"."""
    from launcher.commands import doctor
    head, = doctor._comm_lines({"ok": True, "device": "cpu", "backend": "gloo", "processes": 2,
                                "seconds": 0.0012, "bus_gb_s": bus_gb_s, "problems": []})
    assert head.endswith(f"all-reduce 1.2 ms, bus bandwidth {shown}"), head
