"""Reference run with torch DistributedDataParallel (gloo), started by mpirun, fed our data shards.

Usage, in the repository's root (whose ``tests`` package it imports):

    mpirun -n N python -m tests.helpers.ddp_reference OUT.pt PORT STEPS BATCH OVERRIDES...
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.conftest import checked_config


def main() -> None:
    out, port, steps, batch, *overrides = sys.argv[1:]
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = checked_config(overrides)
    torch.manual_seed(cfg.train.seed)
    model = DistributedDataParallel(cfg.model.build())
    data = cfg.data.build()
    optimizer = cfg.optim.build(model.parameters())
    loader = data.train_loader(rank, world, int(batch), cfg.train.seed)
    loader.sampler.set_epoch(0)
    for _, (x, y) in zip(range(int(steps)), loader, strict=False):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    if rank == 0:
        torch.save(model.module.state_dict(), out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
