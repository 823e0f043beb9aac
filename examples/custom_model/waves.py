"""Noisy sine waves: each sample is a window of 32 values and the 8 values that follow."""

import math

import torch
from torch.utils.data import Dataset

from train.data import remote


class Waves(Dataset):
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]


def make_waves(samples: int = 2048, window: int = 32, horizon: int = 8, noise: float = 0.05,
               seed: int = 0):
    """(train, validation): the last eighth of the waves is held out."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(window + horizon, dtype=torch.float32)
    freq = 0.1 + 0.4 * torch.rand(samples, 1, generator=g)
    phase = 2 * math.pi * torch.rand(samples, 1, generator=g)
    waves = torch.sin(freq * t + phase) + noise * torch.randn(samples, window + horizon,
                                                              generator=g)
    cut = samples - samples // 8
    x, y = waves[:, :window], waves[:, window:]
    return Waves(x[:cut], y[:cut]), Waves(x[cut:], y[cut:])


def stored_waves(url: str, window: int = 32):
    """(train, validation) from waves kept in object storage: a tensor [N, window + 8]
    saved with torch.save and uploaded (``aws s3 cp waves.pt s3://BUCKET/waves.pt``),
    named by ``data.args: {url: s3://BUCKET/waves.pt}``. Fetched once per node into
    data.cache_dir and checked (docs/object-storage.md, "Objects in your own data code")."""
    waves = torch.load(remote.fetch(url), weights_only=True)
    cut = len(waves) - len(waves) // 8
    x, y = waves[:, :window], waves[:, window:]
    return Waves(x[:cut], y[:cut]), Waves(x[cut:], y[cut:])
