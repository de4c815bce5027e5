"""The DDP MNIST recipe people copy today, kept as the baseline (do not improve it).

torch DataLoader over a map-style dataset, batch 64, SGD lr 0.01, Linear-ReLU-Linear,
``loss.item()`` every step, rank 0 evaluates the whole test set. Same offline data as the
reference trainer (scikit-learn digits upsampled to 28x28), so only the loops differ.

    torchrun --standalone --nproc-per-node 2 benchmarks/seed_recipe.py --epochs 40
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ptcluster.examples.mnist.data import load_digits

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=40)
ap.add_argument("--batch-size", type=int, default=64)
ap.add_argument("--lr", type=float, default=0.01)
args = ap.parse_args()

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
data = load_digits()
train = TensorDataset(data.train_x, data.train_y)
sampler = DistributedSampler(train)
loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)))
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
loss_fn = nn.CrossEntropyLoss()
samples, train_time = 0, 0.0
t_start = time.perf_counter()  # instrumentation for the benchmark, not part of the recipe
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    t0 = time.perf_counter()
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        running = loss.item()
        samples += len(y) * dist.get_world_size()
    train_time += time.perf_counter() - t0
    if rank == 0:
        with torch.no_grad():
            acc = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
        print(f"epoch {epoch + 1} loss={running:.4f} test_accuracy={acc:.4f} "
              f"elapsed={time.perf_counter() - t_start:.2f}s", flush=True)
if rank == 0:
    print(f"final epochs={args.epochs} samples_per_s={samples / train_time:.1f}", flush=True)
dist.destroy_process_group()
