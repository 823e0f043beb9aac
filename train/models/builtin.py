"""Pure models: a config dataclass in, an ``nn.Module`` out. No I/O, no distributed code.

Every model maps a batch of inputs to logits; the trainer owns the loss. Layers are
chosen so that results do not depend on how a batch is split across ranks (no
BatchNorm): world size 1 and world size N then follow the same trajectory. The user's
own model (``model.kind: custom``) comes from its factory; the same rule serves it
(BatchNorm statistics would differ with the world size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from train.core.config import ModelConfig
from train.core.config.kinds import MODEL_KINDS, load_builder
from train.core.errors import ConfigError
from train.core.user import usercode


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, in_features: int, num_classes: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(cfg.depth):
            layers += [nn.Linear(width, cfg.width), nn.GELU(), nn.Dropout(cfg.dropout)]
            width = cfg.width
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """Conv blocks (conv, GroupNorm, GELU, 2x2 pooling while the image allows) + a linear head."""

    def __init__(self, cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        if len(in_shape) != 3:
            raise ValueError(f"model.kind cnn needs samples shaped [channels, height, width], "
                             f"got {list(in_shape)}")
        channels, size = in_shape[0], min(in_shape[1:])
        blocks: list[nn.Module] = []
        for i in range(cfg.depth):
            out = cfg.width * 2 ** min(i, 3)
            blocks += [nn.Conv2d(channels, out, 3, padding=1), nn.GroupNorm(1, out), nn.GELU()]
            if size >= 2:
                blocks.append(nn.MaxPool2d(2))
                size //= 2
            channels = out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout),
                                  nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(),
                                 nn.Linear(4 * cfg.width, cfg.width), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer (pre-norm, learned positions, optional weight tying)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.context_length = cfg.context_length
        self.tok = nn.Embedding(vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.context_length, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual outputs
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.depth))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# The builders model.kind names (train.core.config.kinds): a config in, a module out.

def mlp(cfg: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int,
        source: str) -> nn.Module:
    return MLP(cfg, math.prod(input_shape), num_classes)


def cnn(cfg: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int,
        source: str) -> nn.Module:
    return ConvNet(cfg, input_shape, num_classes)


def gpt(cfg: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int,
        source: str) -> nn.Module:
    return GPT(cfg, num_classes)


def from_factory(cfg: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int,
                 source: str) -> nn.Module:
    """custom: the user's factory, called with model.args (train.core.user.usercode)."""
    model = usercode.call(cfg.factory, cfg.args, "model", source)
    if not isinstance(model, nn.Module):
        raise ConfigError(source, "model.factory", f"{cfg.factory} returned "
                                                   f"{type(model).__name__}, not a "
                                                   "torch.nn.Module")
    return model


def build_model(cfg: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int,
                source: str = "config") -> nn.Module:
    """The model of ``cfg.kind``; num_classes is the vocabulary size for token models."""
    build = load_builder(MODEL_KINDS[cfg.kind].builder)
    return build(cfg, input_shape=input_shape, num_classes=num_classes, source=source)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
