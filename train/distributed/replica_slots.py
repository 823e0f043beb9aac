"""Who trains which samples of a step when replica groups share a fixed global batch.

The global batch of every step is that of the fault-free run: ``train.global_batch_size``
samples, at positions ``[first, first + G)`` of the run's sample order
(:mod:`train.data.order`), cut into ``distributed.replicas`` equal *slots*. Slot ``s``
is what replica group ``s`` computes when all groups live; group rank ``r`` of a group
of ``W`` takes the r-th contiguous part of its slot, so logical rank ``s * W + r`` trains
exactly what rank ``s * W + r`` of a plain run of ``replicas * W`` processes would.

When the quorum of a step has fewer participants than slots, the survivors take the
lost slots (slot ``s`` goes to participant ``s % P``) and accumulate them: the batch
never shrinks. When it has more (a spare joined), the participants past the slots
compute nothing that step and follow the others' update. Torch-free and pure.
"""

from __future__ import annotations


def slots_of(participant: int, participants: int, replicas: int) -> list[int]:
    """The slots a participant computes: ``[s for s in range(replicas) if s % P == p]``."""
    if not 0 <= participant < participants:
        raise ValueError(f"participant {participant} of {participants}")
    return list(range(participant, replicas, participants))


def slot_span(first: int, global_batch_size: int, replicas: int, slot: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of the run's sample order that slot ``slot`` of the step
    whose batch starts at ``first`` holds."""
    if global_batch_size % replicas:
        raise ValueError(f"global batch {global_batch_size} does not split into "
                         f"{replicas} slots")
    size = global_batch_size // replicas
    return first + slot * size, first + (slot + 1) * size


def rank_span(span: tuple[int, int], rank: int, world_size: int) -> tuple[int, int]:
    """The part of a slot rank ``rank`` of its group trains (contiguous, equal parts)."""
    lo, hi = span
    if (hi - lo) % world_size:
        raise ValueError(f"a slot of {hi - lo} samples does not split over {world_size} ranks")
    size = (hi - lo) // world_size
    return lo + rank * size, lo + (rank + 1) * size


def merged(spans: list[tuple[int, int]]) -> list[list[int]]:
    """Spans sorted and joined where they touch: the ledger's form of a step's samples."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return out


def micro_spans(first: int, global_batch_size: int, replicas: int, slots: list[int], rank: int,
                world_size: int, micro: int) -> list[tuple[int, int]]:
    """The micro-batches rank ``rank`` of its group reads for ``slots`` of the step whose
    batch starts at ``first``, in the order it reads them: positions ``[lo, hi)`` of at
    most ``micro`` samples each, slot after slot."""
    out = []
    for slot in slots:
        lo, hi = rank_span(slot_span(first, global_batch_size, replicas, slot), rank, world_size)
        out += [(i, min(i + micro, hi)) for i in range(lo, hi, micro)]
    return out
