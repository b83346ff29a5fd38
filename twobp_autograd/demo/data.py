"""What the demo trains on, and what it trains: scikit-learn's bundled digits (nothing is
downloaded) and torchvision's ResNet, built alike on every rank from the seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["IMAGE_SIZE", "MODELS", "TRAIN_SAMPLES", "DigitsSplit", "load_digits_32", "build_resnet"]

IMAGE_SIZE = 32
#: Training digits: 1797, less the quarter (rounded up) held out for testing.
TRAIN_SAMPLES = 1347
#: --model choices -> the name printed.
MODELS = {"resnet152": "ResNet-152", "resnet18": "ResNet-18"}


@dataclass
class DigitsSplit:
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor

    def to(self, device: torch.device) -> DigitsSplit:
        return DigitsSplit(
            self.train_x.to(device), self.train_y.to(device), self.test_x.to(device), self.test_y.to(device)
        )


def load_digits_32(seed: int) -> DigitsSplit:
    """scikit-learn's 1797 8x8 grey digits as 3x32x32 images, normalised with the training
    split's statistics; a stratified 75/25 train/test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=IMAGE_SIZE, mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=0.25, random_state=seed, stratify=labels.numpy()
    )
    train_x, test_x = images[train_idx], images[test_idx]
    mean, std = train_x.mean(), train_x.std()

    # ResNet's stem wants 3 channels; the grey digit is repeated.
    def prepare(x: Tensor) -> Tensor:
        return ((x - mean) / std).expand(-1, 3, -1, -1).contiguous()

    return DigitsSplit(prepare(train_x), labels[train_idx], prepare(test_x), labels[test_idx])


def build_resnet(name: str, seed: int) -> nn.Module:
    """torchvision's ResNet for the 10 digit classes, from ``seed`` (every rank builds the same).

    torchvision's own zero_init_residual starts every block as the identity (Goyal et al.):
    the default init's stem gradients explode on 8x8-pixel digits with small micro-batches."""
    import torchvision

    torch.manual_seed(seed)
    return getattr(torchvision.models, name)(num_classes=10, zero_init_residual=True)
