"""``python -m fxdebug`` / ``fxdebug``: the demo, rendering a model, checking a model in CI.

Commands::

    fxdebug demo [-o demo.svg]
    fxdebug render TARGET --input 1,3,224,224 [--depth K] [-o graph.svg] [--html]
    fxdebug check  TARGET --input 1,3,224,224 [--nan] [--shapes] [--stats] [--devices]
                   [--batches N] [--data batches.pt] [--json out.json] [-o graph.svg]

``TARGET`` is ``pkg.module:attr`` or ``path/to/file.py:attr`` naming an ``nn.Module`` instance,
class, or zero-argument factory. Exit status: 0 nothing found (or only warnings, printed as WARNINGS), 1 the model has a problem (a
non-finite value, a failed shape/device check, an input it rejects), 2 the command could not run
(bad arguments, unloadable target, graphviz missing), 3 an unexpected internal error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Sequence

import torch

from fxdebug.errors import FxDebugError, TraceError, UsageError

__all__ = ["main"]

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_CRASH = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxdebug", description="Graph-level debugging for PyTorch models.",
                                epilog="Exit status: 0 no NaN/Inf and no failed check (warnings such as dead units are printed "
                                "as WARNINGS), 1 problem found, 2 could not run, 3 internal error.")
    from fxdebug import __version__

    p.add_argument("--version", action="version", version=f"fxdebug {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{demo,render,check}")

    d = sub.add_parser("demo", help="instrument a bundled model with planted problems and show what fxdebug finds")
    d.add_argument("-o", "--output", default="demo.svg", help="where to write the annotated graph (default demo.svg)")
    d.add_argument("--batches", type=int, default=4, help="batches to run (default 4)")

    def target_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("target", metavar="TARGET", help="pkg.module:attr or path/to/file.py:attr")
        sp.add_argument("--input", action="append", default=[], metavar="SHAPE",
                        help="input shape, e.g. 1,3,224,224 (repeat for several inputs)")
        sp.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16", "int64"],
                        help="dtype of random inputs (int64 draws from 0..1)")
        sp.add_argument("--depth", type=int, default=None, help="collapse modules at this depth (default: automatic)")

    r = sub.add_parser("render", help="draw a model's graph as an annotated SVG")
    target_args(r)
    r.add_argument("-o", "--output", default="graph.svg", help="output picture (default graph.svg)")
    r.add_argument("--show-instrumentation", action="store_true", help="draw fxdebug's own observer nodes")
    r.add_argument("--html", action="store_true",
                   help="write the interactive viewer (one offline HTML file; -o defaults to graph.html)")

    c = sub.add_parser("check", help="run observe passes over batches; exit 1 if a problem is found")
    target_args(c)
    c.add_argument("--nan", action="store_true", help="record NaN/Inf per node (NaNCheck)")
    c.add_argument("--shapes", action="store_true", help="assert every node keeps its shape (ShapeAssert)")
    c.add_argument("--stats", action="store_true", help="collect statistics and dead fractions (StatCollector)")
    c.add_argument("--devices", action="store_true", help="check op inputs share a device (DeviceCheck)")
    c.add_argument("--grads", action="store_true",
                   help="also run a backward (of the sum of the outputs' means): gradient statistics per node and "
                        "per module's parameters, NaN/Inf in gradients, vanishing/exploding findings")
    c.add_argument("--batches", type=int, default=None,
                   help="batches to run (default: 4 random ones; with --data: every batch in the file)")
    c.add_argument("--data", help="torch.save file with input batches instead of random ones")
    c.add_argument("--json", help="also write the report as JSON here")
    c.add_argument("-o", "--output", help="also draw the annotated graph here")
    c.add_argument("--seed", type=int, default=0, help="seed for random inputs (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    try:
        _check_output_dirs(args)
        if args.command == "demo":
            from fxdebug.cli.demo import run_demo

            return run_demo(args.output, batches=args.batches)
        if args.command == "render":
            return _render(args)
        return _check(args)
    except FxDebugError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted.")
        return EXIT_USAGE
    except Exception:
        _err("internal error (please report it with the traceback below):\n" + traceback.format_exc())
        return EXIT_CRASH


def _check_output_dirs(args: argparse.Namespace) -> None:
    """Refuse an output path in a missing directory before any work is done (exit 2)."""
    import os

    from fxdebug.cli.support import CliError

    for flag in ("output", "json"):
        path = getattr(args, flag, None)
        folder = os.path.dirname(path) if path else ""
        if folder and not os.path.isdir(folder):
            raise CliError(f"--{flag if flag == 'json' else 'output'} {path!r}: the directory {folder!r} does not exist; "
                           "create it first or pick another path.")


def _err(text: str) -> None:
    print(f"fxdebug: {text}", file=sys.stderr)


def _inputs(args: argparse.Namespace, n: int) -> list[Any]:
    from fxdebug.cli.support import CliError, load_data, parse_shape, random_inputs

    if getattr(args, "data", None):
        batches = load_data(args.data)
        return batches[:n] if n is not None and n > 0 else batches
    if not args.input:
        raise CliError(f"{args.command} needs the input shape: --input 1,3,224,224 (or --data FILE for check).")
    shapes = [parse_shape(s) for s in args.input]
    gen = torch.Generator().manual_seed(getattr(args, "seed", 0))
    return [random_inputs(shapes, args.dtype, generator=gen) for _ in range(max(4 if n is None else n, 1))]


def _rejected(model: Any, exc: FxDebugError, out: str | None, depth: int | None) -> int:
    """The model rejected its input: say where, draw the failing node if asked, exit 1."""
    from fxdebug.api import render

    _err(f"the model rejected the input: {exc}")
    if out and exc.node is not None:
        try:
            path = render(model, out, depth=depth, failed=exc)
            print(f"wrote {path} with the failing node '{exc.node}' highlighted")
        except FxDebugError as draw_exc:
            _err(str(draw_exc))
    return EXIT_FOUND


def _render(args: argparse.Namespace) -> int:
    from fxdebug.cli.support import load_target
    from fxdebug.api import render

    model = load_target(args.target)
    example = _inputs(args, 1)[0]
    if args.html and not args.output.lower().endswith((".html", ".htm")):
        args.output = os.path.splitext(args.output)[0] + ".html"
    try:
        path = render(model, args.output, example, depth=args.depth, show_instrumentation=args.show_instrumentation)
    except FxDebugError as exc:
        return _rejected_or_raise(model, exc, args)
    print(f"wrote {path}")
    return EXIT_OK


def _rejected_or_raise(model: Any, exc: FxDebugError, args: argparse.Namespace) -> int:
    """An error naming a node means the model rejected the input: report and draw it; else re-raise."""
    if isinstance(exc, TraceError) or exc.node is None:
        raise exc
    return _rejected(model, exc, args.output, args.depth)


def _passes(args: argparse.Namespace) -> list[Any]:
    import fxdebug.passes as lib  # lazily: the core never imports the pass library at import time

    from fxdebug.cli.support import CliError

    wanted = [name for flag, name in (("nan", "NaNCheck"), ("shapes", "ShapeAssert"), ("stats", "StatCollector"),
                                      ("devices", "DeviceCheck")) if getattr(args, flag)]
    wanted = wanted or ["NaNCheck", "ShapeAssert", "StatCollector"]
    passes = []
    for name in wanted:
        try:
            cls = getattr(lib, name)
        except (ImportError, AttributeError) as exc:
            raise CliError(f"the {name} pass is not available in this installation ({exc}).") from exc
        grads = bool(getattr(args, "grads", False))
        if name == "NaNCheck":
            passes.append(cls(mode="record", backward=grads))
        else:
            passes.append(cls(grads=True) if name == "StatCollector" and grads else cls())
    if getattr(args, "grads", False):
        passes.append(lib.ParamGrads())
    return passes


def _output_loss(outputs: Any, batch: Any) -> Any:
    """``check --grads``: the sum of the means of the floating outputs, so every output gets a gradient."""
    flat = [outputs] if isinstance(outputs, torch.Tensor) else (
        list(outputs.values()) if isinstance(outputs, dict) else list(outputs) if isinstance(outputs, (tuple, list)) else [])
    terms = [t.float().mean() for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not terms:
        from fxdebug.cli.support import CliError

        raise CliError("check --grads: the model's outputs carry no gradient (no floating-point output that "
                       "depends on a parameter or a float input).")
    return sum(terms)


def _check(args: argparse.Namespace) -> int:
    import fxdebug

    from fxdebug.cli.support import CliError, check_batches, findings, load_target

    model = load_target(args.target)
    batches = _inputs(args, args.batches)
    if args.data:
        check_batches(model, batches, args.data)  # a batch that cannot be the forward's arguments: exit 2
    passes = _passes(args)
    first = batches[0]
    try:
        dbg = fxdebug.instrument(model, passes, example_inputs=first if isinstance(first, dict) else tuple(first))
    except FxDebugError as exc:
        return _rejected_or_raise(model, exc, args)
    # Each --data / random batch holds the forward's own arguments (no targets): a tuple of
    # positional inputs is passed as ((inputs...),) so collect() reads it as the inputs.
    loader = [b if isinstance(b, dict) else (tuple(b),) for b in batches]
    try:
        report = fxdebug.collect(dbg, loader, loss_fn=_output_loss if args.grads else None)
    except UsageError as exc:  # the batch, not the model: wrong shape for the capture, wrong arguments
        where = getattr(exc, "batch_index", None)
        which = f"batch {where + 1} of {len(batches)}" if where is not None else "a batch"
        raise CliError(f"{which} does not fit the model: {exc}") from exc
    failed: FxDebugError | None = report.failure
    print(report)
    found = findings(report, dbg)  # report.findings() with the graph's input figures
    from fxdebug.report.findings import find

    warned = sorted({f.kind for f in find(report, gm=dbg) if f.severity != "error"})
    if found:
        print("\nfindings:")
        for line in found:
            print(f"  - {line}")
    if args.json:
        payload = json.loads(report.to_json())
        payload["failed"] = None if failed is None else {
            "error": type(failed).__name__, "node": failed.node, "module": failed.module, "message": str(failed)}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
    if args.output:
        path = dbg.render(args.output, depth=args.depth, failed=failed)
        print(f"wrote {path}")
    problem = failed is not None or not report.ok
    verdict = "PROBLEM FOUND" if problem else f"WARNINGS ({', '.join(warned)}; see findings)" if warned else "ok"
    print(f"\nresult: {verdict} ({len(batches)} batch(es) checked)")
    return EXIT_FOUND if problem else EXIT_OK
