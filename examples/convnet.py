"""A small residual conv net: the non-transformer example (BatchNorm buffers, in-place ReLU, pooling).

    from examples.convnet import convnet_tiny
    model, inputs = convnet_tiny()               # images (4, 3, 32, 32)
    loss = model.loss_fn(model(*inputs), inputs)

Module tree::

    ConvNet
      stem: ConvBNReLU
      stages.<i>: Stage (down: ConvBNReLU, res: ResidualBlock(conv1, conv2, relu))
      pool, flatten, drop, head
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ConvNetConfig",
    "ConvNet",
    "ConvBNReLU",
    "ResidualBlock",
    "Stage",
    "convnet_loss",
    "build_convnet",
    "convnet_tiny",
]


@dataclass(frozen=True, kw_only=True)
class ConvNetConfig:
    """Shape of the conv net."""

    in_channels: int = 3
    """Channels of the input images."""
    image_size: int = 32
    """Height and width of the (square) input images."""
    widths: tuple[int, ...] = (16, 32, 64)
    """Channels of the stem and of each following stage; every stage after the first halves H, W."""
    num_classes: int = 10
    """Outputs of the linear head."""
    dropout: float = 0.2
    """Dropout before the head."""

    def __post_init__(self) -> None:
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"ConvNetConfig.widths must be non-empty positive ints, got {self.widths}")
        if min(self.in_channels, self.image_size, self.num_classes) < 1:
            raise ValueError("ConvNetConfig.in_channels, image_size and num_classes must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ConvNetConfig.dropout must be in [0, 1), got {self.dropout}")


class ConvBNReLU(nn.Module):
    """3x3 conv (no bias: BatchNorm has one) -> BatchNorm -> ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        # In place: exercises the estimators' handling of ops that overwrite their input.
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.bn(self.conv(x)))


class ResidualBlock(nn.Module):
    """x + BN(conv(ConvBNReLU(x))), then ReLU: a ResNet basic block at constant width."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = ConvBNReLU(channels, channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(x + self.bn2(self.conv2(self.conv1(x))))


class Stage(nn.Module):
    """Strided ConvBNReLU (halves H and W, changes width) followed by a residual block."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.down = ConvBNReLU(c_in, c_out, stride=2)
        self.res = ResidualBlock(c_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.res(self.down(x))


class ConvNet(nn.Module):
    """Images (B, C, H, W) -> class logits (B, num_classes)."""

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.config = config
        self.example_batch_size = 4
        """Batch size of :meth:`example_inputs` when none is given."""
        w = config.widths
        self.stem = ConvBNReLU(config.in_channels, w[0])
        self.stages = nn.ModuleList(Stage(c_in, c_out) for c_in, c_out in zip(w[:-1], w[1:]))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.drop = nn.Dropout(config.dropout)
        self.head = nn.Linear(w[-1], config.num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images)  # (B, w0, H, W)
        for stage in self.stages:
            x = stage(x)  # (B, w_i, H / 2^i, W / 2^i)
        x = self.flatten(self.pool(x))  # (B, w_last)
        return self.head(self.drop(x))  # (B, num_classes)

    def example_inputs(
        self, batch_size: int | None = None, *, device: torch.device | str | None = None
    ) -> tuple[Tensor]:
        """``(images,)``: standard-normal images (batch_size, C, H, W) on the model's device."""
        batch_size = self.example_batch_size if batch_size is None else batch_size
        device = self.head.weight.device if device is None else device
        c, s = self.config.in_channels, self.config.image_size
        return (torch.randn(batch_size, c, s, s, device=device),)

    def loss_fn(self, output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
        """Cross-entropy against fixed labels; same contract as :func:`convnet_loss`."""
        return convnet_loss(output, inputs)


def convnet_loss(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Cross-entropy of logits (B, num_classes) against the fixed label ``i % num_classes`` of sample i.

    The inputs carry no labels; fixed synthetic ones give the real cross-entropy backward graph
    without data-dependent code (it works on meta and fake tensors).
    """
    batch, num_classes = output.shape
    labels = torch.arange(batch, device=output.device) % num_classes  # (B,)
    return F.cross_entropy(output, labels)


def build_convnet(
    config: ConvNetConfig,
    batch_size: int,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[ConvNet, tuple[Tensor]]:
    """Build a ConvNet and its example inputs, deterministically, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device or "cpu"):
            model = ConvNet(config)
        model.example_batch_size = batch_size
        inputs = model.example_inputs()
    return model, inputs


def convnet_tiny(*, device: torch.device | str | None = None) -> tuple[ConvNet, tuple[Tensor]]:
    """Widths 16/32/64, 10 classes, batch 4 of 3 x 32 x 32 images: milliseconds per step on CPU."""
    return build_convnet(ConvNetConfig(), batch_size=4, device=device)


def convnet_demo(*, device: torch.device | str | None = None) -> tuple[ConvNet, tuple[Tensor]]:
    """The tiny widths at batch 32: activations dominate the step's memory, as in real training."""
    return build_convnet(ConvNetConfig(), batch_size=32, device=device)
