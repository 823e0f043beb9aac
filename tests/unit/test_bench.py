"""The benchmarks' own arithmetic: bench/throughput.py's model FLOPs per token against
torch's FLOP counter on a real forward and backward, and its GPU peak lookup."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import throughput
from tests.harness.runs import ROOT
from train.core.config import load_config
from train.models import build_model


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
