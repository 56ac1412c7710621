"""A ResNet-18-shaped image classifier, torchvision-free and tiny: a convolution + batch norm + max-pool stem, four
stages of two basic blocks (two 3x3 convolutions each followed by batch norm, bias-free convolutions), a 1x1
convolution + batch norm shortcut where a block halves the map (stride 2) or widens the channels, an adaptive average
pool and a linear classifier trained with cross entropy.  Every batch norm runs in training mode, so each example's
output depends on every other example of the batch.

At 16x16 images the last stages' maps are 1x1: their batch norms see 4 values per channel, and training amplifies
rounding so much that one device in fp32 is 1e-4 (losses) and 1e-2 of the update (parameters) off itself in float64
after 3 AdamW steps: ``fxshard verify --dp 2`` fails on rounding alone, and ``--fp64`` judges it
(fxshard/check/fp64.py; tests/check/test_verify_fp64.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 5


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class TinyResNet(nn.Module):
    def __init__(self, widths=(8, 16, 32, 64), classes=CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            blocks += [BasicBlock(cin, w, stride), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, pixel_values, labels):
        x = self.maxpool(F.relu(self.bn1(self.conv1(pixel_values))))
        x = self.avgpool(self.layers(x)).flatten(1)
        return F.cross_entropy(self.fc(x), labels)


def make_model():
    return TinyResNet()


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.randint(0, CLASSES, (4,))}
