"""The ledger of replica groups and the split of a fixed global batch into slots."""

from __future__ import annotations

import pytest

from train.distributed.replica_slots import merged, rank_span, slot_span, slots_of
from train.observe.ledger import Entry, Ledger, check_exactly_once, read


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("participants", [1, 2, 3, 4, 5])
def test_every_slot_is_computed_by_exactly_one_participant(replicas, participants):
    owners = [p for p in range(participants) for _ in slots_of(p, participants, replicas)]
    slots = sorted(s for p in range(participants) for s in slots_of(p, participants, replicas))
    assert slots == list(range(replicas))
    assert len(owners) == replicas
    if participants >= replicas:  # a spare beyond the slots computes nothing
        assert all(slots_of(p, participants, replicas) == [p] for p in range(replicas))
        assert all(not slots_of(p, participants, replicas)
                   for p in range(replicas, participants))


def test_slots_and_ranks_tile_the_global_batch_like_a_plain_run_of_replicas_x_ranks():
    first, g, replicas, world = 96, 24, 3, 2
    spans = [rank_span(slot_span(first, g, replicas, s), r, world)
             for s in range(replicas) for r in range(world)]
    per_rank = g // (replicas * world)  # logical rank s*W+r: the plain run's slice
    assert spans == [(first + k * per_rank, first + (k + 1) * per_rank)
                     for k in range(replicas * world)]
    assert merged([slot_span(first, g, replicas, s) for s in (2, 0, 1)]) == [[96, 120]]
    assert merged([(0, 4), (8, 12)]) == [[0, 4], [8, 12]]


def test_a_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError):
        slot_span(0, 10, 3, 0)
    with pytest.raises(ValueError):
        rank_span((0, 5), 0, 2)
    with pytest.raises(ValueError):
        slots_of(2, 2, 3)


def entry(step, g=4):
    return Entry(step, [[(step - 1) * g, step * g]], [0, 1])


def test_a_writer_that_takes_over_writes_only_the_lines_the_file_lacks(tmp_path):
    path = tmp_path / "ledger.jsonl"
    first, second = Ledger(path), Ledger(path)
    for step in (1, 2, 3):
        first.committed(entry(step))
        second.committed(entry(step))
        if step < 3:
            first.write()  # the writer is lost after committing step 3, before its line
    second.committed(entry(4))
    second.write()
    assert [e.step for e in read(path)] == [1, 2, 3, 4]
    assert check_exactly_once(read(path)) == []


def test_a_torn_last_line_is_dropped_and_the_next_line_follows_whole(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.committed(entry(1))
    ledger.write()
    with open(path, "a") as f:
        f.write('{"step": 2, "sam')  # killed mid-line
    assert [e.step for e in read(path)] == [1]
    other = Ledger(path)
    other.committed(entry(2))
    other.write()
    assert [e.step for e in read(path)] == [1, 2]
    assert path.read_text().count("\n") == 2


def test_a_restart_from_a_checkpoint_drops_the_steps_it_trains_again(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    for step in range(1, 6):
        ledger.committed(entry(step))
    ledger.write(durable=True)
    again = Ledger(path)  # every group restarted from the checkpoint of step 3
    again.restart_at(3)
    for step in (4, 5, 6):
        again.committed(entry(step))
    again.write()
    assert [e.step for e in read(path)] == [1, 2, 3, 4, 5, 6]
    assert check_exactly_once(read(path)) == []


def test_the_check_names_samples_missing_or_trained_twice():
    assert check_exactly_once([entry(1), entry(3)]) == [
        "step 3 follows step 1", "step 3: positions 4..8 missing"]
    assert check_exactly_once([entry(1), Entry(2, [[2, 8]], [0])]) == [
        "step 2: positions 2..4 trained twice"]


def test_a_step_only_the_peer_committed_reaches_the_ledger_through_the_heal(tmp_path):
    """The writer's all-reduce failed at step 3 while its peer's went through: the peer
    committed 3, the writer did not, healed from the peer, and writes on from step 4."""
    path = tmp_path / "ledger.jsonl"
    writer, peer = Ledger(path), Ledger(path)
    for step in (1, 2):
        writer.committed(entry(step))
        peer.committed(entry(step))
        writer.write()
    peer.committed(entry(3))  # not the writer: it only remembers it
    peer.step_down()
    writer.adopt(peer.recent_entries())  # what the heal carries, as plain values
    writer.committed(entry(4))
    writer.write()
    assert [e.step for e in read(path)] == [1, 2, 3, 4]
    assert check_exactly_once(read(path)) == []


def test_a_writer_left_out_of_a_step_does_not_write_it_again_when_back(tmp_path):
    """The writer (group 0) was still saving a checkpoint when the next quorum formed
    without it: group 1 trained and wrote step 3. Group 0 heals (adopting step 3) and is
    the writer again: the file holds step 3 once."""
    path = tmp_path / "ledger.jsonl"
    group0, group1 = Ledger(path), Ledger(path)
    for step in (1, 2):
        group0.committed(entry(step))
        group1.committed(entry(step))
        group0.write(durable=True)
        group1.step_down()
    group1.committed(entry(3))
    group1.write()  # the first participant of step 3's quorum
    group0.adopt(group1.recent_entries())
    group0.committed(entry(4))
    group0.write()
    assert [e.step for e in read(path)] == [1, 2, 3, 4]
    assert check_exactly_once(read(path)) == []
