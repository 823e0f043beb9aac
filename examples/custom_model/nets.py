"""A residual MLP: its `blocks` are what FSDP shards and activation checkpointing recomputes."""

from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ResidualMLP(nn.Module):
    def __init__(self, inputs: int, outputs: int, width: int = 64, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(inputs: int, outputs: int, width: int = 64, depth: int = 2) -> nn.Module:
    return ResidualMLP(inputs, outputs, width, depth)
