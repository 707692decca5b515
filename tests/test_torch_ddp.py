"""A tecc-compiled model under DistributedDataParallel (gloo, two CPU processes) trains with the
same losses as the eager model under DDP, on every rank (dynamo's DDP optimizer splits the graph
at the gradient buckets' boundaries; each piece is compiled by tecc on its own)."""

from __future__ import annotations

import copy
import json
import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

WORLD = 2
STEPS = 3


def _train(model, data, device):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for idx, targets in data:
        loss = model(idx.to(device), targets.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, init_file: str, out_dir: str, backend: str) -> None:
    import logging

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_models import GPT, batches

    logging.getLogger("tecc.torch").setLevel(logging.ERROR)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    try:
        torch.manual_seed(0)
        model = GPT(layers=1).to(device)
        ids = [rank] if backend == "nccl" else None
        eager = DDP(copy.deepcopy(model), device_ids=ids)
        compiled = torch.compile(DDP(copy.deepcopy(model), device_ids=ids), backend="tecc")
        data = batches(STEPS, seed=10 + rank)                   # each rank its own batches
        result = {"eager": _train(eager, data, device), "tecc": _train(compiled, data, device)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _ddp_losses(tmp_path, backend: str) -> None:
    import torch.multiprocessing as mp

    init_file = tmp_path / "rendezvous"
    mp.spawn(_worker, args=(str(init_file), str(tmp_path), backend), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, result in enumerate(results):
        diffs = [abs(a - b) for a, b in zip(result["eager"], result["tecc"])]
        assert len(diffs) == STEPS and max(diffs) <= 1e-4, (rank, result)
    # each rank trained on its own batches (so the all-reduce of the gradients mattered)
    assert results[0]["eager"][0] != results[1]["eager"][0]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch without gloo")
def test_ddp_losses_match_eager_ddp_on_every_rank(tmp_path):
    _ddp_losses(tmp_path, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs two GPUs and NCCL")
def test_ddp_on_two_gpus_with_nccl_matches_eager_ddp(tmp_path):
    _ddp_losses(tmp_path, "nccl")
