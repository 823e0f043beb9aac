"""The micro-batches of replica groups' steps loaded ahead by DataLoader workers
(train/data/prefetch.py): what the workers are asked for (a prediction, re-pointed when a
step reads something else), and that whatever a step asks for, in whichever order faults
make it ask, it gets exactly the samples the in-process reader (``data.num_workers: 0``)
gives. Real workers (2 processes) on a dataset that says which process loaded each
sample. Whole runs with workers against runs without: tests/e2e/test_replica_runs.py."""

from __future__ import annotations

import os

import pytest
import torch

from train.data.order import GlobalOrder, RankBatchSampler
from train.data.prefetch import Plan, Prefetcher, StepReader, open_reader
from train.distributed.replica_slots import micro_spans

G, REPLICAS, STEPS = 8, 2, 12  # global batch 8 in 2 slots of 4, read 2 a micro-batch
END = STEPS * G


def spans(first: int, slots: list[int]) -> list[tuple[int, int]]:
    """What rank 0 of a group of one reads of ``slots``, 2 samples a micro-batch."""
    return micro_spans(first, G, REPLICAS, slots, rank=0, world_size=1, micro=2)


class WhoLoads(torch.utils.data.Dataset):
    """Sample i is i; its label, the process that loaded it."""

    def __len__(self) -> int:
        return 20

    def __getitems__(self, indices: list[int]):
        return torch.tensor(indices), torch.full((len(indices),), os.getpid())


@pytest.fixture
def readers():
    """(the prefetcher, predicting slot 0 from step 0; the in-process reader)"""
    order = GlobalOrder(20, seed=3)
    ahead = open_reader(WhoLoads(), order, spans, step_size=G, first=0, end=END, slots=[0],
                        num_workers=2, pin_memory=False, prefetch_factor=2, seed=0)
    assert isinstance(ahead, Prefetcher)
    yield ahead, StepReader(WhoLoads(), GlobalOrder(20, seed=3), spans)
    assert ahead.close(lambda: 10.0) is None  # the workers ended when asked


def read(ahead: Prefetcher, exact: StepReader, step: int, slots: list[int]) -> set[int]:
    """One step's reads from both, compared sample for sample; who loaded them."""
    first = step * G
    got = ahead.step(first, slots, END)
    assert got == exact.step(first, slots, END) == spans(first, slots)
    loaders = set()
    for span in got:
        x, who = ahead.batch(span)
        assert torch.equal(x, exact.batch(span)[0]), (step, slots, span)
        loaders |= set(who.tolist())
    return loaders


@pytest.mark.parametrize("world_size,micro", [(1, 8), (1, 2), (2, 2), (4, 1)])
def test_micro_spans_are_the_slices_a_plain_run_of_replicas_x_w_ranks_reads(world_size,
                                                                           micro):
    """Logical rank s*W + r of a plain run of 2 x W processes reads the same samples, in
    the same micro-batches, as rank r of group s."""
    order = GlobalOrder(50, seed=1)
    plain = RankBatchSampler(order, global_batch_size=16, rank=0, world_size=2 * world_size,
                             micro_batch_size=micro, start_step=3, end_step=4)
    for slot in (0, 1):
        for rank in range(world_size):
            plain.rank = slot * world_size + rank
            got = [order.take(lo, hi - lo) for lo, hi in
                   micro_spans(48, 16, 2, [slot], rank, world_size, micro)]
            assert got == list(plain)


def test_the_plan_yields_its_slots_step_after_step_to_the_end():
    plan = Plan(spans, G, first=8, end=32, slots=[1])
    assert list(iter(lambda: next(plan, None), None)) == \
        spans(8, [1]) + spans(16, [1]) + spans(24, [1]) == [(12, 14), (14, 16), (20, 22),
                                                            (22, 24), (28, 30), (30, 32)]
    assert list(iter(lambda: next(Plan(spans, G, 0, 32, []), None), None)) == []


def test_a_plan_covers_the_steps_it_has_not_passed_on_its_slots():
    plan = Plan(spans, G, first=8, end=32, slots=[0])
    assert plan.covers(8, 32, [0])
    assert not plan.covers(8, 32, [0, 1]) and not plan.covers(8, 40, [0])
    assert not plan.covers(0, 32, [0]) and not plan.covers(12, 32, [0])  # before, off step
    for _ in range(3):  # into step 16
        next(plan)
    assert plan.covers(16, 32, [0]) and plan.covers(8, 32, [0])  # step 8 again: a retry
    assert not plan.covers(24, 32, [0]), "behind a step asked for: a jump re-points it"
    assert Plan(spans, G, first=8, end=32, slots=[]).covers(24, 32, []), "a spare, idle"


def test_steps_as_predicted_come_from_the_workers(readers):
    ahead, exact = readers
    for step in range(4):
        assert os.getpid() not in read(ahead, exact, step, [0])
    assert ahead.here == 0 and ahead.repointed == 0 and ahead.served == 8


def test_a_retried_step_is_loaded_again_by_the_workers(readers):
    """A step that failed is trained again on the same samples: the micro-batches the
    first attempt used are gone (a model may have changed them in place), the workers
    load them again, and what they had loaded for the next steps is kept."""
    ahead, exact = readers
    read(ahead, exact, 0, [0])
    read(ahead, exact, 1, [0])
    assert os.getpid() not in read(ahead, exact, 1, [0])
    assert ahead.repointed == 1
    assert os.getpid() not in read(ahead, exact, 2, [0])
    assert ahead.repointed == 1 and ahead.here == 0


def test_a_slot_taken_over_on_a_retry_and_after(readers):
    """A survivor's retry computes the lost slot too, then every step until the group is
    back: the prediction follows, and then goes back."""
    ahead, exact = readers
    read(ahead, exact, 0, [0])
    read(ahead, exact, 1, [0])
    read(ahead, exact, 1, [0, 1])
    assert ahead.repointed == 1
    for step in (2, 3):
        assert os.getpid() not in read(ahead, exact, step, [0, 1])
    assert ahead.repointed == 1
    read(ahead, exact, 4, [0])
    read(ahead, exact, 5, [0])
    assert ahead.repointed == 2 and ahead.here == 0


def test_a_retry_on_the_other_slot_then_a_heal_jump(readers):
    """Group 1 of the faulty run: its step fails, the retry gives it slot 0 (the other
    group's); later it is left behind and heals to a step far ahead."""
    ahead, exact = readers
    read(ahead, exact, 0, [0])
    read(ahead, exact, 0, [1])
    read(ahead, exact, 1, [1])
    read(ahead, exact, 9, [0])
    assert os.getpid() not in read(ahead, exact, 10, [0])
    assert ahead.repointed == 2 and ahead.here == 0
    assert all(span[0] >= 10 * G for span in ahead.held), "nothing kept from before"


def test_a_spare_predicts_nothing_until_it_takes_a_slot(readers):
    _, exact = readers
    spare = open_reader(WhoLoads(), GlobalOrder(20, seed=3), spans, step_size=G, first=16,
                        end=END, slots=[], num_workers=2, pin_memory=False,
                        prefetch_factor=2, seed=0)
    try:
        assert not spare.stream.issued
        assert read(spare, exact, 2, []) == set() == read(spare, exact, 3, [])
        assert not spare.stream.issued and spare.repointed == 0
        read(spare, exact, 4, [1])
        assert os.getpid() not in read(spare, exact, 5, [1])
        assert spare.served == 4 and spare.here == 0 and spare.repointed == 1
    finally:
        spare.close(lambda: 10.0)


def test_nothing_is_asked_past_the_last_step(readers):
    ahead, exact = readers
    read(ahead, exact, STEPS - 3, [0])
    for step in (STEPS - 2, STEPS - 1):
        read(ahead, exact, step, [0])
    assert not ahead.stream.issued and ahead.stream.plan.at == END - G


def test_no_workers_reads_in_this_process():
    reader = open_reader(WhoLoads(), GlobalOrder(20, seed=3), spans, step_size=G, first=0,
                         end=END, slots=[0], num_workers=0, pin_memory=False,
                         prefetch_factor=2, seed=0)
    assert type(reader) is StepReader
    x, who = reader.batch(reader.step(8, [1], END)[0])
    assert who.tolist() == [os.getpid()] * 2 and x.tolist() == GlobalOrder(20, 3).take(12, 2)
