"""The torchvision transforms examples/run_image_classification.py uses, for a machine whose torch has no matching
torchvision build (PyPI's torchvision wheels link CUDA's torch; the CPU torch on disk has none): PIL does the
resizing (bilinear, as torchvision does for PIL images), torch's generator the random draws, in torchvision's order
(RandomResizedCrop.get_params: up to 10 tries of a uniform scale and a log-uniform ratio, then a uniform position;
a centre crop of the clamped ratio otherwise), so a run seeded alike draws the same crops and flips.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image


class Compose:
    def __init__(self, transforms: list[Callable]) -> None:
        self.transforms = transforms

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


def _size_pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


class RandomResizedCrop:
    def __init__(self, size: int | tuple[int, int], scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0)) -> None:
        self.size, self.scale, self.ratio = _size_pair(size), scale, ratio

    def params(self, image: Image.Image) -> tuple[int, int, int, int]:
        width, height = image.size
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image: Image.Image) -> Image.Image:
        i, j, h, w = self.params(image)
        return image.crop((j, i, j + w, i + h)).resize((self.size[1], self.size[0]), Image.BILINEAR)


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: Image.Image) -> Image.Image:
        return image.transpose(Image.FLIP_LEFT_RIGHT) if torch.rand(1) < self.p else image


class Resize:
    """An int resizes the shorter side to it (the ratio kept); a pair is the exact (height, width)."""

    def __init__(self, size: int | tuple[int, int]) -> None:
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        if isinstance(self.size, int):
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.size, int(self.size * long / short)
            new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        else:
            new_h, new_w = _size_pair(self.size)
        return image.resize((new_w, new_h), Image.BILINEAR)


class CenterCrop:
    def __init__(self, size: int | tuple[int, int]) -> None:
        self.size = _size_pair(size)

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        th, tw = self.size
        top, left = int(round((height - th) / 2.0)), int(round((width - tw) / 2.0))
        return image.crop((left, top, left + tw, top + th))


class ToTensor:
    def __call__(self, image: Image.Image) -> torch.Tensor:
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


class Normalize:
    def __init__(self, mean: list[float], std: list[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std
