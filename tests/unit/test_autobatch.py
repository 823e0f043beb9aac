"""micro_batch_size=auto: the search logic (the GPU probe itself runs in scripts/gpu-check)."""

import pytest
import torch

from train.core.errors import CannotRunHere
from train.models.autobatch import divisors_descending, largest_fitting


def test_divisors_descending():
    assert divisors_descending(12) == [12, 6, 4, 3, 2, 1]
    assert divisors_descending(7) == [7, 1]


@pytest.mark.parametrize("limit,expect", [(64, 32), (20, 16), (5, 4), (1, 1)])
def test_largest_fitting_divisor_below_the_memory_limit(limit, expect):
    tried = []

    def fits(m):
        tried.append(m)
        if m > limit:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return True

    assert largest_fitting(32, fits) == expect
    assert tried == [m for m in (32, 16, 8, 4, 2, 1) if m >= expect]


def test_a_size_that_leaves_no_room_counts_as_not_fitting():
    assert largest_fitting(8, lambda m: m <= 2) == 2


def test_nothing_fits_is_exit_3():
    with pytest.raises(CannotRunHere, match="not even a micro-batch of 1"):
        largest_fitting(8, lambda m: False)


def test_library_allocation_failures_count_as_out_of_memory_other_errors_propagate():
    def cublas(m):
        if m > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
        return True

    assert largest_fitting(8, cublas) == 2

    def bug(m):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        largest_fitting(8, bug)
