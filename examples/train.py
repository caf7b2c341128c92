"""Train on whatever the sync daemon has cached, rebuilding the data every epoch.

    epochcache demo                          # once: generates the demo remote
    epochcache sync --config config.yaml &   # the daemon fills and rotates the cache
    python examples/train.py                 # this script
"""

import argparse

import torch
from torch import nn

from epochcache import EpochCachedLoader

parser = argparse.ArgumentParser()
parser.add_argument("--config", default="config.yaml")
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()

model = nn.Sequential(
    nn.Conv2d(3, 16, kernel_size=4, stride=4), nn.ReLU(),
    nn.Conv2d(16, 32, kernel_size=3, stride=2), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

with EpochCachedLoader.from_config(args.config) as loader:
    for epoch in range(args.epochs):
        for batch in loader:  # one epoch over the shards cached when it started
            images = batch["image"].float().div_(255.0)  # uint8 (B, 3, 64, 64), no per-sample decoding
            loss = nn.functional.cross_entropy(model(images), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        info = loader.last_epoch
        print(f"epoch {info.epoch}: {info.shards} shards, {info.samples} samples, loss {loss.item():.3f}")
