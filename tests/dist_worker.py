"""One rank of the two-process tests in test_distributed.py (run as a script, like torchrun would).

Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (torchrun's contract),
runs the scenario named on the command line, and writes its results with torch.save to
``<out>/rank<r>.pt``. Any exception is written there too, so the parent can show it.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxdebug  # noqa: E402
from fxdebug.passes import NaNCheck, StatCollector  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(self.act(h) * torch.sqrt(h + 10.0))  # NaN once some |h| > 10


def data(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 6, generator=g)


def train(module: nn.Module, steps: int, rank: int, plant: tuple[int, int] | None = None) -> nn.Module:
    """SGD steps on per-rank data; ``plant=(rank, step)`` scales that rank's batch by 1e4 at that step."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(steps):
        x = data(rank, step)
        if plant == (rank, step):
            x = x * 1e4  # fc1's outputs reach thousands: sqrt(h + 10) of a negative number
        opt.zero_grad()
        module(x).square().mean().backward()
        opt.step()
    return module


def scenario_ddp(rank: int, world: int) -> dict:
    """DDP over the instrumented module vs plain DDP, same seeds: parameters bitwise equal; merged stats."""
    torch.manual_seed(0)
    plain = Net()
    inner = copy.deepcopy(plain)
    dbg = fxdebug.instrument(inner, [StatCollector(), NaNCheck()], example_inputs=(data(rank, 0),))
    train(DDP(plain), 3, rank)
    train(DDP(dbg), 3, rank)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), inner.parameters()))
    merged = dbg.report(all_ranks=True)
    local = dbg.report()
    traced = fxdebug.trace(DDP(copy.deepcopy(plain)))
    return {"bitwise": same, "merged_rows": merged.rows, "local_rows": local.rows, "world": merged.world_size,
            "calls": merged.calls, "origin": merged.origin, "traced_notes": traced.trace_info.notes,
            "traced_keys": list(traced.state_dict())}


def scenario_nan(rank: int, world: int) -> dict:
    """A NaN planted on rank 1 only, at call 2: named as (call 2, rank 1, node sqrt).

    The NaN gradients are all-reduced, so from call 3 on rank 0's weights are NaN too and its own
    report says fc1 at call 3; the merged origin still finds the earliest call.
    """
    torch.manual_seed(0)
    model = Net()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(data(rank, 0),))
    train(DDP(dbg), 4, rank, plant=(1, 2))
    report = dbg.report(all_ranks=True)
    return {"origin": report.origin, "first": report.first_nonfinite, "per_rank": report.per_rank,
            "local_first": dbg.report().first_nonfinite}


def scenario_fail(rank: int, world: int) -> dict:
    """Rank 1 dies in the middle of a DDP step (after its forward, before its backward).

    Rank 0's backward all-reduce then fails instead of hanging (gloo sees the closed connection,
    or the process-group timeout expires), and report(all_ranks=True) raises a DistributedError.
    """
    torch.manual_seed(0)
    dbg = fxdebug.instrument(Net(), [StatCollector()], example_inputs=(data(rank, 0),))
    ddp = DDP(dbg)
    out: dict = {"step_error": None}
    for step in range(3):
        loss = ddp(data(rank, step)).square().mean()
        if rank == 1 and step == 1:
            raise SystemExit(3)  # dies mid-step
        try:
            loss.backward()
        except RuntimeError as exc:
            out["step_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            break
    try:
        dbg.report(all_ranks=True, timeout=3.0)
    except fxdebug.DistributedError as exc:
        return {**out, "error": str(exc), "type": type(exc).__name__}
    return {**out, "error": None}


def scenario_fsdp(rank: int, world: int) -> dict:
    """FSDP2 (fully_shard) over the instrumented module on CPU / gloo vs plain fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    plain = Net()
    inner = copy.deepcopy(plain)
    dbg = fxdebug.instrument(inner, [StatCollector(), NaNCheck()], example_inputs=(data(rank, 0),))
    fully_shard(plain, mesh=mesh)
    fully_shard(dbg, mesh=mesh)
    losses = []
    for module in (plain, dbg):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        run = []
        for step in range(3):
            opt.zero_grad()
            loss = module(data(rank, step)).square().mean()
            loss.backward()
            opt.step()
            run.append(loss.detach())
        losses.append(run)
    full = [p.full_tensor() for p in plain.parameters()]
    full_dbg = [p.full_tensor() for p in dbg.parameters()]
    report = dbg.report(all_ranks=True)
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(full, full_dbg)),
            "losses": all(torch.equal(a, b) for a, b in zip(*losses)), "count": report.row("fc1")["count"]}


def scenario_collect(rank: int, world: int) -> dict:
    """fxdebug.collect per rank over a DistributedSampler; the merged count covers the whole data set."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    xs = torch.randn(20, 6)
    xs[:, 0] = -5.0
    xs[3, 0] = 5.0  # sample 3 goes to rank 1: only there does fc1's channel 1 turn positive
    ds = TensorDataset(xs)
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False))
    model = Net()
    with torch.no_grad():  # channel 0 dead everywhere; channel 1 alive only where x[:, 0] > 1 (sample 3)
        model.fc1.bias[0] = -100.0
        model.fc1.weight[1].zero_()
        model.fc1.weight[1, 0] = 1.0
        model.fc1.bias[1] = -1.0
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(xs[:2],))
    fxdebug.collect(dbg, [b[0] for b in loader], progress=False)
    merged = dbg.report(all_ranks=True)
    with torch.no_grad():
        h = dbg.fc1(xs)
        act = torch.relu(h)
    row = merged.row("fc1")
    return {"count": row["count"], "mean": row["mean"], "true_mean": float(h.double().mean()),
            "true_std": float(h.double().std(unbiased=False)), "std": row["std"], "min": row["min"],
            "true_min": float(h.min()), "max": row["max"], "true_max": float(h.max()),
            "dead": merged.row("act")["dead_frac"], "true_dead": float((act.amax(0) <= 0).double().mean()),
            "local_dead": dbg.report().row("act")["dead_frac"]}


SCENARIOS = {"ddp": scenario_ddp, "nan": scenario_nan, "fail": scenario_fail, "fsdp": scenario_fsdp,
             "collect": scenario_collect}


def main() -> None:
    names, out = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("FXDEBUG_TEST_TIMEOUT", "20"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](rank, world)
        except SystemExit:
            torch.save({"exit": True, **results}, os.path.join(out, f"rank{rank}.pt"))
            os._exit(3)  # no clean shutdown: the other rank must cope with a vanished peer
        except BaseException:
            results[name] = {"traceback": traceback.format_exc()}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: FSDP's gloo threads can abort or linger there


if __name__ == "__main__":
    main()
