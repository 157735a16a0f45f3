"""The distributed merge at scale: ``report(all_ranks=True)`` on a ~4,000-node graph over 4 ranks.

Not a test: figures for docs/distributed.md.

    python3 tools/bench_distributed.py                    # 4 gloo CPU processes, ~4,000 nodes
    python3 tools/bench_distributed.py --nodes 8000 --world 4
    python3 tools/bench_distributed.py --simulate         # no processes: the merge of 4 copies of one rank's data
    python3 tools/bench_distributed.py --ddp 700          # issue 33: DDP of a 700-layer chain, 3 steps, the merge

Each rank instruments the same chain of ``Linear -> ReLU`` cells with ``NaNCheck`` and ``StatCollector``,
runs two forward calls, then times (CPU seconds of that process, ``time.process_time``) the parts of
``report(all_ranks=True)``: the local report, the per-channel maxima (one host copy of each state table),
the barrier + single ``all_gather_object``, and the merge of the gathered rows. The whole call is timed
as well. Every rank prints one line; rank 0 prints the table.

``--ddp N``: each rank wraps a chain of ``N`` leaf layers (``Linear(16, 16)`` / ``ReLU`` alternating, as
``tools/bench_scale.py``'s ``chain-N``) in ``DistributedDataParallel``, instruments it with the default frontend,
runs 3 training steps (SGD) and ``report(all_ranks=True)``; each rank's wall and CPU seconds of each phase, and the
wall time of the whole run from the parent (process start and imports included). Issue 33's bar: <= 60 s at 700
layers, 4 ranks, gloo, on this 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxdebug  # noqa: E402
from fxdebug.passes import NaNCheck, StatCollector  # noqa: E402
from fxdebug.report import distributed as D  # noqa: E402


def chain(nodes: int) -> nn.Module:
    """A ``Sequential`` of ``Linear(8, 8) -> ReLU`` pairs: about ``nodes`` observed nodes."""
    layers: list[nn.Module] = []
    for _ in range(max(1, nodes // 2)):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    return nn.Sequential(*layers)


def build(nodes: int) -> tuple[object, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    dbg = fxdebug.instrument(chain(nodes), [NaNCheck(), StatCollector()], example_inputs=(x,))
    for _ in range(2):
        dbg(x)
    return dbg, x


def merge(rows: list, maxima: list, columns: list) -> object:
    """The merge of the gathered rows (with the column declarations where this version takes them)."""
    try:
        return D._merge_rows(rows, maxima, columns)
    except TypeError:
        return D._merge_rows(rows, maxima)


def cpu(fn, *args):
    t0, w0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, time.process_time() - t0, time.perf_counter() - w0


def rank_main(nodes: int, repeat: int, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    dbg, _ = build(nodes)
    figures: dict[str, list[float]] = {"report_all_ranks": [], "report_all_ranks_wall": [], "local_report": [],
                                       "channel_maxima": [], "merge": []}
    rows = 0
    for _ in range(repeat):
        dist.barrier()
        merged, c, w = cpu(dbg.report, True)  # the whole call, as users make it
        rows = len(merged.rows)
        figures["report_all_ranks"].append(c)
        figures["report_all_ranks_wall"].append(w)
        local, c, _ = cpu(dbg.report)
        figures["local_report"].append(c)
        maxima, c, _ = cpu(D.channel_maxima, dbg)
        figures["channel_maxima"].append(c)
        per_rank = [local.rows] * world  # the merge itself, on this rank's rows as every rank's
        _, c, _ = cpu(merge, per_rank, [maxima] * world, list(local.columns))
        figures["merge"].append(c)
    med = {k: statistics.median(v) for k, v in figures.items()}
    spread = {k: (min(v), max(v)) for k, v in figures.items()}
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rows": rows, "median": med, "spread": spread}))
    dist.barrier()
    dist.destroy_process_group()


def ddp_main(layers: int, steps: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(16, 16) if i % 2 == 0 else nn.ReLU()
                                                    for i in range(layers)]))
    x = torch.randn(2, 16)
    figures: dict[str, tuple[float, float]] = {}
    dist.barrier()
    dbg, c, w = cpu(fxdebug.instrument, model, [NaNCheck(), StatCollector()], (x,))
    figures["instrument"] = (c, w)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train() -> None:
        for _ in range(steps):
            opt.zero_grad()
            dbg(x).square().mean().backward()
            opt.step()

    _, c, w = cpu(train)
    figures["steps"] = (c, w)
    merged, c, w = cpu(dbg.report, True)
    figures["report_all_ranks"] = (c, w)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rows": len(merged.rows), "figures": figures,
                                                      "frontend": dbg.trace_info.frontend}))
    dist.barrier()
    dist.destroy_process_group()


def spawn(nodes: int, world: int, repeat: int, ddp: int = 0) -> list[dict]:
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-worker", "--nodes", str(nodes), "--repeat",
                                   str(repeat), "--ddp", str(ddp), "--out", tmp],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(world)]
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def simulate(nodes: int, world: int, repeat: int) -> None:
    dbg, _ = build(nodes)
    times: dict[str, list[float]] = {"local_report": [], "channel_maxima": [], "merge": []}
    for _ in range(repeat):
        local, c, _ = cpu(dbg.report)
        times["local_report"].append(c)
        maxima, c, _ = cpu(D.channel_maxima, dbg)
        times["channel_maxima"].append(c)
        _, c, _ = cpu(merge, [local.rows] * world, [maxima] * world, list(local.columns))
        times["merge"].append(c)
    print(f"simulated merge of {world} rank tables, {len(local.rows)} rows, median of {repeat} (CPU s):")
    for k, v in times.items():
        print(f"  {k:16s} {statistics.median(v):7.3f}   spread {min(v):.3f}-{max(v):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--ddp", type=int, default=0, metavar="LAYERS", help="DDP of a chain of LAYERS leaf layers")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.rank_worker:
        if args.ddp:
            ddp_main(args.ddp, 3, args.out)
        else:
            rank_main(args.nodes, args.repeat, args.out)
        return
    if args.ddp:
        start = time.perf_counter()
        results = spawn(0, args.world, 0, args.ddp)
        total = time.perf_counter() - start
        print(f"DDP of a {args.ddp}-layer chain, {args.world} gloo CPU processes: instrument() + 3 steps + "
              f"report(all_ranks=True); {total:.1f} s wall from spawn to the last rank's exit")
        print("rank  frontend  rows  instrument CPU (wall)  3 steps CPU (wall)  report(all_ranks) CPU (wall)")
        for r in results:
            f = r["figures"]
            cells = "  ".join(f"{f[k][0]:7.2f} ({f[k][1]:6.2f})" for k in ("instrument", "steps", "report_all_ranks"))
            print(f"{r['rank']:4d}  {r['frontend']:>8s}  {r['rows']:4d}  {cells}")
        return
    if args.simulate:
        simulate(args.nodes, args.world, args.repeat)
        return
    results = spawn(args.nodes, args.world, args.repeat)
    print(f"report(all_ranks=True): {results[0]['rows']} rows, {args.world} gloo CPU processes, "
          f"median of {args.repeat} per rank (CPU s of that rank; spread min-max)")
    keys = ["report_all_ranks", "report_all_ranks_wall", "local_report", "channel_maxima", "merge"]
    print("rank  " + "  ".join(f"{k:>24s}" for k in keys))
    for r in results:
        cells = [f"{r['median'][k]:7.3f} ({r['spread'][k][0]:.3f}-{r['spread'][k][1]:.3f})" for k in keys]
        print(f"{r['rank']:4d}  " + "  ".join(f"{c:>24s}" for c in cells))


if __name__ == "__main__":
    main()
