"""Models of `flashsgd train`: ResNet-50/18 (ImageNet layout), ResNet-20 (CIFAR), the MNIST-1D CNN.

Papers: He et al. 2016, "Deep Residual Learning for Image Recognition" (arXiv 1512.03385): the
ImageNet ResNets (7x7 stem, max-pool, four stages, stride on the 3x3 conv of a bottleneck as in
the torchvision/"v1.5" layout used by Goyal et al. and MLPerf) and the CIFAR ResNet-20 (3 stages of
3 basic blocks, 16/32/64 channels, parameter-free "option A" shortcuts). ResNet-50 has 161
parameter tensors and 25,557,032 parameters (as torchvision's resnet50 and the gTop-k paper's
25.6 M-gradient figure), checked in the tests.

Parameter names, shapes and order are torchvision's (``torchvision/models/resnet.py``, pytorch/vision:
``conv1 bn1 maxpool layer1..layer4 fc``; blocks ``conv1 bn1 conv2 bn2 [conv3 bn3] downsample``, the
projection shortcut ``downsample = Sequential(1x1 conv, BN)``; every conv without bias, 3x3 convs with
padding 1, the 7x7 stem with padding 3), so a torchvision ResNet-18/50 state_dict loads into the
same-named flashsgd model with ``strict=True`` and back. The CIFAR ResNet-20 (not in torchvision)
names its blocks the same way. Checkpoints of the earlier names (``last_bn``, ``shortcut``) are
renamed on load (:func:`flashsgd.train.records.checkpoint.rename_legacy_keys`).

Every residual block exposes its last BatchNorm as the read-only property ``last_bn`` (``bn2`` or
``bn3``; a property, so no second module name is registered), which
:func:`flashsgd.optim.plan.apply_model_tweaks` (Goyal et al.: gamma = 0 for the last BN of each
residual block) reads. BatchNorm is plain ``nn.BatchNorm2d``: statistics per worker, never
SyncBatchNorm (Goyal et al. sec. 5.1).

Example::

    >>> model = build_model("resnet20", num_classes=10)
    >>> sum(p.numel() for p in model.parameters())
    269722
    >>> build_model("rn50", num_classes=10)
    Traceback (most recent call last):
    ValueError: unknown model 'rn50'; known: mnist1d_cnn, resnet18, resnet20, resnet50
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flashsgd.registry import Registry
from flashsgd.train.data.mnist1d import MNIST1DCNN

MODELS: Registry[Callable[..., nn.Module]] = Registry("model")


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout)


class BasicBlock(nn.Module):
    """Two 3x3 convs; projection (1x1 conv + BN) ``downsample`` when the shape changes (ImageNet)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, width, 3, stride)
        self.conv2, self.bn2 = _conv_bn(width, width, 3)
        self.downsample = None
        if stride != 1 or cin != width:
            self.downsample = nn.Sequential(*_conv_bn(cin, width, 1, stride))

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        """The block's last BN (zero-gamma init, Goyal et al. sec. 5.1)."""
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand (x4); projection ``downsample`` on shape change."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 1)
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = _conv_bn(width, cout, 1)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride))

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        """The block's last BN (zero-gamma init, Goyal et al. sec. 5.1)."""
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ImageNetResNet(nn.Module):
    """Stem (7x7/2 conv, BN, ReLU, 3x3/2 max-pool), 4 stages (64..512 wide), avg-pool, linear."""

    def __init__(self, block: type, layers: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 64, 7, 2)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, cin = [], 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), layers)):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 3, H, W)
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CifarBlock(nn.Module):
    """CIFAR basic block with He et al.'s option-A shortcut: stride-2 subsample + zero channels."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3)
        self.stride, self.pad = stride, cout - cin

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        """The block's last BN (zero-gamma init, Goyal et al. sec. 5.1)."""
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        short = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.pad:
            short = F.pad(short, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + short)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 inputs: 3x3 stem (16), 3 stages of n blocks (16/32/64), linear."""

    def __init__(self, n: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 16, 3)
        blocks, cin = [], 16
        for i, width in enumerate((16, 32, 64)):
            for j in range(n):
                blocks.append(CifarBlock(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 3, 32, 32)
        x = self.blocks(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@MODELS.register("mnist1d_cnn")
def mnist1d_cnn(num_classes: int = 10, channels: int = 32) -> nn.Module:
    """The MNIST-1D proxy CNN (input (N, 40))."""
    return MNIST1DCNN(channels=channels, num_classes=num_classes)


@MODELS.register("resnet18")
def resnet18(num_classes: int = 1000, **_: object) -> nn.Module:
    """ResNet-18, ImageNet layout (11.7M parameters at 1000 classes)."""
    return ImageNetResNet(BasicBlock, (2, 2, 2, 2), num_classes)


@MODELS.register("resnet20")
def resnet20(num_classes: int = 10, **_: object) -> nn.Module:
    """ResNet-20, CIFAR layout (0.27M parameters)."""
    return CifarResNet(3, num_classes)


@MODELS.register("resnet50")
def resnet50(num_classes: int = 1000, **_: object) -> nn.Module:
    """ResNet-50, ImageNet layout (25,557,032 parameters in 161 tensors at 1000 classes)."""
    return ImageNetResNet(Bottleneck, (3, 4, 6, 3), num_classes)


def build_model(name: str, num_classes: int, channels: int = 32) -> nn.Module:
    """A model by registry name, or ``torchvision:NAME`` where torchvision imports (never required).

    Zero-gamma of each residual block's last BN (Goyal et al.) is a recipe step:
    :func:`flashsgd.optim.plan.apply_model_tweaks`.
    """
    if name.startswith("torchvision:"):
        try:
            import torchvision  # noqa: PLC0415 - optional
        except Exception as exc:  # noqa: BLE001 - torchvision fails with many error types on CPU builds
            raise ValueError(f"model {name!r} needs torchvision, which does not import here "
                             f"({type(exc).__name__}); use one of {', '.join(MODELS.names())}") from None
        model = torchvision.models.get_model(name.split(":", 1)[1], num_classes=num_classes)
    else:
        model = MODELS.get(name)(num_classes=num_classes, channels=channels)
    return model


@torch.no_grad()
def check_input(name: str, channels: int, data, dataset: str) -> None:
    """ValueError (one line naming model, dataset and shapes) unless model ``name`` maps two of
    ``data``'s training samples to ``(2, data.num_classes)`` logits.

    Run before any process starts, so that a model/dataset mismatch is a bad input (exit 2), not a
    failure of every rank at step 0 (the trainer runs it inside :func:`flashsgd.launch.one_thread`:
    no intra-op pool is alive at the fork).
    """
    model = build_model(name, data.num_classes, channels).eval()
    x, _ = data.train.batch(torch.arange(min(2, len(data.train))), train=False)
    try:
        out = model(x)
    except Exception as exc:  # noqa: BLE001 - any failure means the model cannot take this input
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"model {name!r} does not accept dataset {dataset!r}: its samples have shape "
                         f"{tuple(x.shape[1:])} (batch {tuple(x.shape)}); the model says: {reason}; "
                         f"choose a model for this input (config keys model.model, data.dataset, "
                         f"data.image_shape)") from None
    if tuple(out.shape) != (len(x), data.num_classes):
        raise ValueError(f"model {name!r} maps dataset {dataset!r}'s input of shape {tuple(x.shape)} to "
                         f"output shape {tuple(out.shape)}, expected {(len(x), data.num_classes)} "
                         f"({data.num_classes} classes); choose another model.model")
