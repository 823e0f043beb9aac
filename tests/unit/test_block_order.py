"""``data.shuffle: blocks`` (train/data/order.py, BlockOrder): the contracts of the global
order still hold (a permutation per epoch, the same whatever the world size, a resume at
any step boundary continuing at the next sample), and the samples of a group of files
train together, so that a cache of two groups reads each file once per epoch."""

from __future__ import annotations

import random

import pytest

from tests.unit.test_data import steps_seen
from train.data.order import BlockOrder

# 23 files of 3-17 samples, one of them far bigger than a group; 2 bytes a sample
SIZES = [random.Random(5).randint(3, 17) for _ in range(22)] + [60]
FILES = [(n, 2 * n) for n in SIZES]
TOTAL = sum(SIZES)
TRAIN = TOTAL - 9  # the last file's tail is validation
GROUP = 40  # bytes: groups of 1-6 files


def order(seed: int = 3) -> BlockOrder:
    return BlockOrder(TRAIN, seed, FILES, group_bytes=GROUP)


def file_of(sample: int) -> int:
    at = 0
    for k, n in enumerate(SIZES):
        if sample < at + n:
            return k
        at += n
    raise AssertionError(sample)


def test_each_epoch_is_a_permutation_of_the_training_samples_and_epochs_differ():
    o = order()
    first, second = o.take(0, TRAIN), o.take(TRAIN, TRAIN)
    assert sorted(first) == list(range(TRAIN)) == sorted(second)
    assert first != second and order(seed=4).take(0, TRAIN) != first


@pytest.mark.parametrize("world,micro", [(2, 2), (3, 1), (4, 3)])
def test_the_batches_do_not_depend_on_the_world_size(world, micro):
    g = 12  # TRAIN is no multiple of 12: batches straddle epochs
    single = steps_seen(order(), 1, g, g, 0, 40)
    assert steps_seen(order(), world, micro, g, 0, 40) == single


def test_a_resume_at_every_step_boundary_continues_at_the_next_sample():
    g = 12
    whole = steps_seen(order(), 1, g, g, 0, 30)
    for stop in range(1, 30):
        assert steps_seen(order(), 1, g, g, 0, stop) + \
            steps_seen(order(), 2, 6, g, stop, 30) == whole, stop


def test_a_groups_samples_train_together_and_its_files_fit_the_group_bytes():
    o = order()
    for epoch in range(3):
        groups = o.groups(epoch)
        assert sorted(k for group in groups for k in group) == list(range(len(FILES)))
        assert all(sum(FILES[k][1] for k in group) <= GROUP or len(group) == 1
                   for group in groups)
        samples = o.take(epoch * TRAIN, TRAIN)
        at = 0
        for group in groups:
            count = sum(min(FILES[k][0], TRAIN - sum(SIZES[:k])) for k in group)
            assert {file_of(s) for s in samples[at:at + count]} == set(group)
            at += count
        assert at == TRAIN


def cache_reads(samples: list[int], groups: list[list[int]], capacity: int) -> int:
    """Files read by a cache of ``capacity`` bytes evicting the oldest file, which fetches
    the next group when a sample of a group is first needed (the read-ahead) and a file
    on demand otherwise."""
    held: list[int] = []
    reads = 0

    def fetch(k: int) -> None:
        nonlocal reads
        if k in held:
            return
        while held and sum(FILES[h][1] for h in held) + FILES[k][1] > capacity:
            held.pop(0)
        held.append(k)
        reads += 1
    group_of = {k: i for i, group in enumerate(groups) for k in group}
    for s in samples:
        k = file_of(s)
        fetch(k)
        for ahead in groups[group_of[k] + 1] if group_of[k] + 1 < len(groups) else []:
            fetch(ahead)
    return reads


def test_a_cache_of_two_groups_reads_each_file_once_an_epoch_where_windows_reread():
    o = order()
    largest = max(size for _, size in FILES)
    capacity = max(2 * GROUP, 2 * largest)
    samples = o.take(0, TRAIN)
    assert cache_reads(samples, o.groups(0), capacity) == len(FILES)
    from train.data.order import GlobalOrder
    everything = GlobalOrder(TRAIN, 3).take(0, TRAIN)
    per_file = [[k] for k in range(len(FILES))]
    assert cache_reads(everything, per_file, capacity) > 2 * len(FILES), \
        "the full permutation rereads files from a cache this small"
