"""The benchmarks' own arithmetic: bench/throughput.py's model FLOPs per token against
torch's FLOP counter on a real forward and backward, and its GPU peak lookup;
bench/replica_faults.py's p95 and its reading of a ledger as it grows; bench/replicas_rig.py's
pods, as the launcher plans them, and its verdict on the goal."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import oversubscribe, replica_faults, replicas_rig, throughput
from tests.harness.runs import ROOT
from tests.unit import test_replica_plan as one_machine
from train.core.config import load_config
from train.core.run.replica_contract import ADDR_VAR, LIGHTHOUSE_VAR
from train.models import build_model

config, torchft_here = one_machine.config, one_machine.torchft_here  # its fixtures


@pytest.mark.parametrize("depth,width,heads,context", [(2, 64, 4, 32), (3, 96, 6, 48)])
def test_flops_per_token_match_torchs_count_of_a_forward_and_backward(depth, width, heads,
                                                                       context):
    cfg = load_config(ROOT / "configs/gpt-small.yaml", [
        "device=cpu", f"model.depth={depth}", f"model.width={width}", f"model.heads={heads}",
        f"model.context_length={context}"])
    model = build_model(cfg.model, input_shape=(context,), num_classes=256)
    x = torch.randint(0, 256, (2, context))
    # the math kernel: attention as the matmuls torch's counter sees (the fused CPU kernel
    # it does not count)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).float().sum().backward()
    counted = counter.get_total_flops() / x.numel()
    parameters = sum(p.numel() for p in model.parameters())
    estimate = throughput.flops_per_token(cfg.model, parameters)
    # the estimate also counts biases and norms (no matmul): a few percent at most
    assert counted <= estimate <= counted * 1.05, (counted, estimate)


def test_gpu_peaks_take_the_most_specific_name():
    assert throughput.gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert throughput.gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert throughput.gpu_peak_flops("NVIDIA L40S") == 362e12
    assert throughput.gpu_peak_flops("AMD Instinct MI300X") == 1307e12
    assert throughput.gpu_peak_flops("Some Future GPU") is None


def test_oversubscribe_counts_a_step_only_inside_one_phase_and_the_fair_ratio():
    """A step that straddles a switch between alone and beside counts for neither; on an
    idle 2-CPU machine (2 runnable threads alone, 5 beside 3 busy) a fair share is 2.5x."""
    phases = [(False, 10.0), (True, 20.0), (False, 30.0)]
    steps = [(9.0, 11.0), (11.0, 12.0), (12.0, 14.0), (19.0, 21.0), (21.0, 25.0),
             (29.5, 30.5), (31.0, 32.0)]
    assert oversubscribe._split(steps, phases) == {False: [1.0, 2.0, 1.0], True: [4.0]}
    run = oversubscribe.Run(steps={False: [0.2, 0.2], True: [0.5, 0.6]},
                            runnable={False: [2, 2], True: [5, 5]})
    assert run.fair(cpus=2) == 2.5 and run.ratio() == pytest.approx(2.75)
    busy = oversubscribe.Run(runnable={False: [20, 20], True: [23, 23]})
    assert busy.fair(cpus=2) == pytest.approx(23 / 20)  # "alone" was not idle


def test_p95_is_the_nearest_rank():
    assert replica_faults.p95([3.0, 1.0, 2.0, 5.0, 4.0]) == 5.0  # of 5: the largest
    assert replica_faults.p95([float(i) for i in range(1, 21)]) == 19.0
    assert replica_faults.p95([float(i) for i in range(1, 101)]) == 95.0
    assert replica_faults.p95([7.0]) == 7.0


def _line(step: int, groups: list[int]) -> bytes:
    return (f'{{"step": {step}, "samples": [[0, 8], [8, 16]], "replicas": {groups}}}\n'
            ).encode()


def test_the_ledger_watch_counts_whole_lines_and_keeps_when_it_saw_each(tmp_path):
    path = tmp_path / "ledger.jsonl"
    watch = replica_faults.LedgerWatch(path)
    assert watch.poll() == 0  # no file yet
    path.write_bytes(_line(1, [0, 1]) + _line(2, [0, 2])[:10])  # the second one torn
    assert watch.poll() == 1 and watch.groups == [(0, 1)]
    first = watch.seen[0]
    with open(path, "ab") as f:
        f.write(_line(2, [0, 2])[10:] + _line(3, [0, 0]))
    assert watch.poll() == 3 and watch.groups == [(0, 1), (0, 2), (0, 0)]
    assert watch.seen[0] == first <= watch.seen[1] == watch.seen[2]
    # replaced by a new file (a new writer dropped a torn line: write_atomic); the old
    # one held open, so that the new one cannot reuse its inode
    with open(path, "rb"):
        new = tmp_path / "ledger.tmp"
        new.write_bytes(b"".join(_line(i, [0, 1]) for i in range(1, 5)))
        new.replace(path)
        assert watch.poll() == 4 and watch.groups[-1] == (0, 1)
    assert watch.seen[0] == first and watch.seen[3] >= watch.seen[2]
    path.write_bytes(_line(1, [0, 1]))  # rewritten in place, shorter
    assert watch.poll() == 1 and watch.seen == [first]


@pytest.mark.parametrize("groups", [2, 3])
def test_the_rigs_pods_are_the_groups_of_an_indexed_job(config, torchft_here, groups):
    """Each host's launcher plans its own group alone, the Lighthouse on another host at
    the address given, its group reached at its host's address, one job for every pod."""
    lighthouse = "198.18.0.1:29514"
    for g in range(groups):
        addr = f"198.18.0.{g + 2}"
        env = replicas_rig.pod_env(g, groups, "spare-0b7c", addr, lighthouse)
        p = one_machine.prepare("train", config, "distributed.replicas=2",
                                f"distributed.spares={groups - 2}", env=env)
        plan = p.plan.replica_groups
        assert plan.here == (g,) and plan.groups == groups
        assert plan.at == lighthouse and not plan.serve  # no pod starts the Lighthouse
        assert plan.envs[0][ADDR_VAR] == addr
        assert plan.envs[0][LIGHTHOUSE_VAR] == f"http://{lighthouse}"
        assert p.plan.job == "spare-0b7c" and p.plan.store is None  # no store used


def test_the_goal_is_met_by_a_p95_at_most_5_s():
    assert replicas_rig.verdict([0.5, 4.9, 5.0]) == "met (5.00 s)"
    assert replicas_rig.verdict([0.5] * 19 + [9.0]) == "met (0.50 s)"  # 19 of 20 at 0.5
    assert replicas_rig.verdict([0.5] * 18 + [5.1, 9.0]) == "missed (5.10 s)"
