"""``fxdebug.collect``: run an instrumented model over a whole data set, with a progress bar.

What every debugging guide writes by hand around its hooks: a loop over a DataLoader that unpacks
each batch, runs the forward (and the backward of a loss, for gradient statistics), and shows how
far it got. ``collect`` is that loop, once: the report it returns then describes the data set
rather than one batch.

A batch may be a tensor (the model's one input), an ``(inputs, targets...)`` tuple or list (the
inputs a tensor, a tuple of positional inputs, or a dict of keyword inputs), or a dict (keys that
name forward arguments go to the model, the rest — ``labels`` — stay for ``loss_fn``). Tensors are
used as they come: nothing is moved to the model's device (a batch on the wrong device is exactly
what ``DeviceCheck`` is there to name).

With ``loss_fn(outputs, batch)`` each batch also runs ``loss.backward()``; the parameters'
``.grad`` are put back as they were before ``collect`` started (it never steps an optimizer, and
does not leave the data set's summed gradients behind). Without it the forward runs under
``torch.no_grad()``. The model's train/eval mode is left as the caller set it.

A batch that fails a check (a ``ShapeMismatchError``, a ``DeviceMismatchError``, ``NaNCheck`` in
raise mode) stops the loop: the error is kept on the report (``report.failure``), printed under the
progress bar, and ``report.findings()`` lists it with its node. Any other exception propagates.
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any, Callable, Iterable, Protocol, TextIO

import torch
from torch import Tensor, nn

from fxdebug.errors import ArgumentTypeError, FxDebugError, UsageError

__all__ = ["collect", "split_batch"]

_REFRESH_S = 0.5  # how often the running NaN/dead counts are read (each read syncs the device)


def collect(
    dbg: Any,
    loader: Iterable[Any],
    *,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    batches: int | None = None,
    progress: bool | str = True,
    reset: bool = True,
) -> Any:
    """Run ``dbg`` over ``loader`` and return its report.

    Args:
        dbg: an instrumented module (``fxdebug.instrument(...)``).
        loader: any iterable of batches — a ``DataLoader``, a list of tensors, a generator.
        loss_fn: ``loss_fn(outputs, batch) -> scalar tensor``; when given, each batch also runs the
            backward, so gradient statistics (``StatCollector(grads=True)``, ``ParamGrads``,
            ``NaNCheck`` on gradients) describe the data set too.
        batches: read at most this many batches (default: every batch).
        progress: ``True`` draws a progress bar on stderr with the running NaN/Inf and dead-unit
            counts (tqdm, else rich, else a plain line); ``"tqdm"`` / ``"rich"`` / ``"plain"`` pick
            one; ``False`` draws nothing.
        reset: forget the statistics collected before (default), so the report describes exactly
            these batches; ``False`` adds to them.

    Returns the ``Report``; ``report.failure`` holds the check that stopped the loop, if one did.
    """
    if not hasattr(dbg, "report"):
        raise ArgumentTypeError(f"collect() needs an instrumented module (fxdebug.instrument(model, passes, ...)); "
                         f"got {type(dbg).__name__}.")
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
        raise UsageError(f"collect(batches={batches!r}): give a positive number of batches, or None for all.")
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"collect(loss_fn={loss_fn!r}): loss_fn is called as loss_fn(outputs, batch).")
    total = _length(loader, batches)
    bar = make_progress(progress, total)
    if reset:
        dbg.reset()
    start = 0 if reset else dbg.report().calls  # forward calls before these batches
    params: list[Tensor] = [p for p in dbg.parameters() if p.requires_grad] if loss_fn is not None else []
    saved_grads = [p.grad for p in params]
    failure: FxDebugError | None = None
    done = 0
    last_read = time.monotonic()
    try:
        for i, batch in enumerate(loader):
            if batches is not None and i >= batches:
                break
            try:
                _step(dbg, batch, loss_fn, params)
            except UsageError as exc:
                exc.batch_index = i  # type: ignore[attr-defined]  # callers can say which batch
                raise  # a mistake in the call (a bad batch form, a non-scalar loss), not a finding
            except FxDebugError as exc:
                failure = exc
                bar.message(f"batch {i + 1} failed a check: {exc}")
                break
            done += 1
            now = time.monotonic()
            if now - last_read >= _REFRESH_S:
                bar.update(done, running_counts(dbg.report()))
                last_read = now
            else:
                bar.update(done, None)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    report = dbg.report()
    bar.close(done, running_counts(report))
    report.failure = failure
    report.origin_batch = _origin_batch(report, start, done)
    kind = "forward + backward" if loss_fn is not None else "forward"
    report.notes.append(f"collect: {done} batch(es), {kind}" + (f"; stopped at batch {done + 1}" if failure else "")
                        + (f"; the first NaN/Inf came in batch {report.origin_batch}" if report.origin_batch is not None else ""))
    return report


def _origin_batch(report: Any, start: int, done: int) -> int | None:
    """Which batch of the loader (0-based) held the first NaN/Inf: the origin's earliest bad
    forward call, counted in batches (each batch runs the same number of forward calls)."""
    from fxdebug.runtime.columns import ORIGIN

    row = next((r for r in report.rows if r["node"] == report.first_nonfinite), None)
    calls = [row.get(c.key) for c in report.columns_with(ORIGIN, "forward")] if row is not None else []
    calls = [c for c in calls if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if not calls or not done:
        return None
    per_batch: int = max(1, (report.calls - start) // done)
    return int(min(calls) - start) // per_batch


def _length(loader: Any, batches: int | None) -> int | None:
    try:
        n = len(loader)
    except TypeError:
        return batches
    return n if batches is None else min(n, batches)


class _Loss(Protocol):
    """A scalar loss as ``_step`` uses it (torch leaves ``Tensor.backward`` unannotated)."""

    def backward(self) -> None: ...


def _step(dbg: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], Tensor] | None, params: list[Tensor]) -> None:
    args, kwargs = split_batch(batch, dbg)
    if loss_fn is None:
        with torch.no_grad():
            dbg(*args, **kwargs)
        return
    for p in params:
        p.grad = None  # one batch's gradient at a time: memory stays flat, nothing sums up
    out = dbg(*args, **kwargs)
    loss = loss_fn(out, batch)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise UsageError(f"loss_fn(outputs, batch) must return a scalar tensor; got "
                         f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}.")
    if loss.requires_grad:
        scalar: _Loss = loss
        scalar.backward()


# -- unpacking a batch ----------------------------------------------------------------------------
def _forward_params(dbg: nn.Module) -> tuple[list[str], int, bool]:
    """(argument names, how many are required positionally, whether it takes ``**kwargs``).

    The model's own ``forward`` signature when the instrumented module knows its model: a graph
    captured from example inputs has placeholders for those inputs only, and a batch key the
    example lacked (``labels``) is still an input of the model (the capture follows the new call).
    """
    from fxdebug.instrumented.face import model_of

    model = model_of(dbg)
    if model is not None and model is not dbg:
        return _signature_params(model)
    graph = getattr(dbg, "graph", None)
    if graph is not None:
        names, required, var_kw = [], 0, False
        for n in graph.nodes:
            if n.op != "placeholder":
                continue
            target = str(n.target)
            if target.startswith("**"):
                var_kw = True
            elif target.startswith("*"):
                continue
            else:
                names.append(target)
                if not n.args:
                    required += 1
        return names, required, var_kw
    return _signature_params(dbg)


def _signature_params(module: nn.Module) -> tuple[list[str], int, bool]:
    sig = inspect.signature(module.forward)
    names = [k for k, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = sum(1 for p in sig.parameters.values()
                   if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names, required, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def split_batch(batch: Any, dbg: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the model from one batch (see the module docstring for the forms)."""
    names, required, var_kw = _forward_params(dbg)
    if isinstance(batch, Tensor):
        return (batch,), {}
    if isinstance(batch, dict):
        return (), _model_kwargs(batch, names, var_kw)
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        if isinstance(first, dict):
            return (), _model_kwargs(first, names, var_kw)
        if isinstance(first, (tuple, list)):
            return tuple(first), {}
        take = max(required, 1)
        if len(batch) < take:
            raise UsageError(f"a batch of {len(batch)} item(s) cannot fill the model's {required} required inputs "
                             f"({', '.join(names[:required])}).")
        return tuple(batch[:take]), {}
    raise UsageError(f"collect() cannot read a batch of type {type(batch).__name__}: give tensors, "
                     "(inputs, targets) tuples or dicts of keyword inputs.")


def _model_kwargs(batch: dict[str, Any], names: list[str], var_kw: bool) -> dict[str, Any]:
    if var_kw:
        return dict(batch)
    picked = {k: v for k, v in batch.items() if k in names}
    if not picked:
        raise UsageError(f"no key of the batch ({', '.join(map(str, batch))}) names an input of the model "
                         f"({', '.join(names)}).")
    return picked


# -- running counts -------------------------------------------------------------------------------
def running_counts(report: Any) -> dict[str, int]:
    """``{"nan": nodes that saw NaN/Inf (forward or backward), "dead": rows a declared finding rule
    flags (``StatCollector``: activations mostly dead)}``."""
    from fxdebug.report.findings import declared_rows

    nan = sum(1 for r in report.rows if report.nonfinite_in(r))
    flagged = {r["node"] for c in getattr(report, "columns", None) or [] if c.finding is not None
               for r in declared_rows(report, c)}
    return {"nan": nan, "dead": len(flagged)}


# -- progress bars --------------------------------------------------------------------------------
class _Bar:
    """The progress interface ``collect`` uses: update, message, close."""

    def update(self, done: int, counts: dict[str, int] | None) -> None: ...

    def message(self, text: str) -> None: ...

    def close(self, done: int, counts: dict[str, int]) -> None: ...


class _Silent(_Bar):
    pass


def _postfix(counts: dict[str, int]) -> str:
    return f"NaN/Inf nodes {counts['nan']} · dead {counts['dead']}"


class _Tqdm(_Bar):
    def __init__(self, total: int | None, stream: TextIO) -> None:
        from tqdm.auto import tqdm

        self.stream = stream
        self.bar = tqdm(total=total, unit="batch", desc="fxdebug.collect", file=stream, dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} batches "
                                   "[{elapsed}<{remaining}{postfix}]" if total else None)

    def update(self, done: int, counts: dict[str, int] | None) -> None:
        self.bar.update(done - self.bar.n)
        if counts is not None:
            self.bar.set_postfix_str(_postfix(counts), refresh=False)

    def message(self, text: str) -> None:
        self.bar.write(f"fxdebug: {text}", file=self.stream)

    def close(self, done: int, counts: dict[str, int]) -> None:
        self.update(done, counts)
        self.bar.close()


class _Rich(_Bar):
    def __init__(self, total: int | None, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("fxdebug.collect"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[counts]}"),
                                 console=Console(file=stream), transient=False)
        self.progress.start()
        self.task = self.progress.add_task("collect", total=total, counts="")

    def update(self, done: int, counts: dict[str, int] | None) -> None:
        if counts is not None:
            self.progress.update(self.task, completed=done, counts=_postfix(counts))
        else:
            self.progress.update(self.task, completed=done)

    def message(self, text: str) -> None:
        self.progress.console.print(f"fxdebug: {text}", markup=False)

    def close(self, done: int, counts: dict[str, int]) -> None:
        self.update(done, counts)
        self.progress.stop()


class _Plain(_Bar):
    """No progress library: one line per refresh (rewritten in place on a terminal)."""

    def __init__(self, total: int | None, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.counts: dict[str, int] | None = None

    def update(self, done: int, counts: dict[str, int] | None) -> None:
        if counts is None and not self.tty:
            return  # in a log, one line per refresh is plenty
        self.counts = counts or self.counts
        self._line(done, end="")

    def _line(self, done: int, end: str) -> None:
        of = f"/{self.total}" if self.total else ""
        tail = f" · {_postfix(self.counts)}" if self.counts else ""
        text = f"fxdebug.collect: {done}{of} batches{tail}"
        self.stream.write(("\r" + text + end) if self.tty else (text + "\n"))
        self.stream.flush()

    def message(self, text: str) -> None:
        self.stream.write(("\n" if self.tty else "") + f"fxdebug: {text}\n")

    def close(self, done: int, counts: dict[str, int]) -> None:
        self.counts = counts
        self._line(done, end="\n")


_KINDS = ("tqdm", "rich", "plain")


def make_progress(progress: bool | str, total: int | None, stream: TextIO | None = None) -> _Bar:
    """The progress bar ``progress`` asks for (see ``collect``), drawing on ``stream`` (stderr)."""
    stream = stream if stream is not None else sys.stderr
    if progress is False or progress is None:
        return _Silent()
    if progress is True:
        for kind in ("tqdm", "rich"):
            try:
                return _Tqdm(total, stream) if kind == "tqdm" else _Rich(total, stream)
            except ImportError:
                continue
        stream.write("fxdebug.collect: no progress library found (pip install tqdm, or rich); "
                     "printing plain progress lines.\n")
        return _Plain(total, stream)
    if progress not in _KINDS:
        raise UsageError(f"collect(progress={progress!r}): use True, False, or one of {', '.join(_KINDS)}.")
    if progress == "plain":
        return _Plain(total, stream)
    try:
        return _Tqdm(total, stream) if progress == "tqdm" else _Rich(total, stream)
    except ImportError:
        raise ImportError(f"collect(progress={progress!r}) needs {progress}: pip install {progress} "
                          "(or progress=True to use whichever is installed).") from None
