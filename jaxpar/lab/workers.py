"""Many layouts compiled at once, for reading (``jaxpar plan``, ``jaxpar sweep --steps 0``).

Compiling dominates: a layout's step is lowered in Python (holding the GIL) and then
compiled by XLA (which releases it). Two ways to overlap them:

* **worker processes** (the default for a built-in model on the CPU backend, with at
  least :data:`MIN_FOR_PROCESSES` layouts): each worker (``python -m jaxpar.lab.workers``)
  imports JAX once and measures one layout after another, lowering and compiling in
  parallel with the others. A layout on which the compiler aborts the process (an XLA
  ``Check failed``) costs its row, not the plan: its worker is replaced;
* **threads** (a user's ``--task``, which a worker cannot import by name; an accelerator,
  where each process would claim the device's memory; a few layouts, where a worker's
  start-up of about 2.5 s costs more than it saves): this process lowers one layout after
  another while a thread pool compiles those already lowered.

``python benchmarks/plan_time.py`` times the ways against each other.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import jax

from jaxpar.config import Config
from jaxpar.environ import force_device_count
from jaxpar.errors import JaxparError
from jaxpar.lab.hardware import Hardware
from jaxpar.lab.measure import Lowered, Row, compile_lowered, lower, measure, read
from jaxpar.task import Task

#: Fewest layouts for which worker processes are started (each costs ~2.5 s to start).
MIN_FOR_PROCESSES = 8
#: The worker's command line (a test replaces it with one that dies).
WORKER = [sys.executable, "-m", "jaxpar.lab.workers"]


def default_workers() -> int:
    """One worker per CPU core this process may use, at most 8 (each holds a JAX)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def measure_all(
    config: Config,
    layouts: list[str],
    hw: Hardware,
    memory_bytes: float | None = None,
    task: Task | None = None,
    workers: int | None = None,
    processes: bool | None = None,
    done: Callable[[Row], None] | None = None,
    steps: int = 0,
) -> list[Row]:
    """:func:`~jaxpar.lab.measure.measure` of every layout, in the order given, ``workers``
    at a time; ``processes`` chooses worker processes or threads (None: see the module
    docstring); ``done`` is called with each row as it completes. With ``steps`` > 0 the
    steps are timed: one layout at a time, each in a worker process on the CPU backend
    (a layout on which XLA aborts costs its row, not the sweep), else in this one."""
    done = done or (lambda row: None)
    if steps:
        if task is not None or jax.default_backend() != "cpu":
            return [_timed_here(config, x, hw, steps, memory_bytes, task, done) for x in layouts]
        return _in_processes(config, layouts, hw, memory_bytes, 1, done, steps)
    workers = workers or default_workers()
    if processes is None:
        processes = (
            task is None
            and jax.default_backend() == "cpu"
            and len(layouts) >= MIN_FOR_PROCESSES
            and workers > 1
        )
    if processes and task is not None:
        raise ValueError("worker processes cannot import a Task object; use threads")
    order = _heaviest_first(layouts)
    ordered = [layouts[i] for i in order]
    if processes:
        rows = _in_processes(config, ordered, hw, memory_bytes, workers, done)
    else:
        rows = _in_threads(config, ordered, hw, memory_bytes, task, workers, done)
    return [rows[order.index(i)] for i in range(len(layouts))]


def _timed_here(
    config: Config,
    layout: str,
    hw: Hardware,
    steps: int,
    memory: float | None,
    task: Task | None,
    done: Callable[[Row], None],
) -> Row:
    row = measure(config, layout, hw, steps, memory, task)
    done(row)
    return row


def _heaviest_first(layouts: list[str]) -> list[int]:
    """Indices of ``layouts``, pipelines first (their step is a program of every tick,
    several times longer to compile), so that the last to finish is a short one."""
    stages = [_stages(x) for x in layouts]
    return sorted(range(len(layouts)), key=lambda i: -stages[i])


def _stages(layout: str) -> int:
    """The ``stage=N`` degree a layout string names (1 without one)."""
    found = re.search(r"\bstage=(\d+)", layout)
    return int(found.group(1)) if found else 1


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Tracing makes millions of short-lived objects: with the objects alive now frozen
    out of the collector's sight and collections rarer, a layout lowers ~20% faster (3
    rounds of 4 gpt_tiny layouts, alternated with the defaults)."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


# ---- threads ---------------------------------------------------------------------------------
def _in_threads(
    config: Config,
    layouts: list[str],
    hw: Hardware,
    memory: float | None,
    task: Task | None,
    workers: int,
    done: Callable[[Row], None],
) -> list[Row]:
    """Lowers here, one layout after another; compiles in a pool of ``workers`` threads."""
    rows: list[Row | None] = [None] * len(layouts)
    pending: dict[Future, tuple[int, Lowered]] = {}

    def collect(block: bool) -> None:
        finished, _ = wait(pending, timeout=None if block else 0)
        for future in finished:
            i, lowered = pending.pop(future)
            try:
                rows[i] = read(lowered, *future.result(), hw, memory)
            except JaxparError as err:
                lowered.row.error = str(err)
                rows[i] = lowered.row
            done(rows[i])

    pool = ThreadPoolExecutor(workers)
    try:
        with _fewer_collections():
            for i, layout in enumerate(layouts):
                lowered = lower(config, layout, hw, task)
                if isinstance(lowered, Row):
                    rows[i] = lowered
                    done(lowered)
                else:
                    pending[pool.submit(compile_lowered, lowered)] = (i, lowered)
                collect(block=False)
            while pending:
                collect(block=True)
    except BaseException:  # Ctrl-C, SIGTERM, a bug: not after the compilations in flight
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return rows


# ---- processes -------------------------------------------------------------------------------
class _Worker:
    """One worker process: sends it a layout, reads back its row (pickles over pipes)."""

    def __init__(self, setup: tuple):
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        force_device_count(env, jax.device_count())
        # this process's import path (as multiprocessing gives its children): the same jaxpar
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path)
        self.proc = subprocess.Popen(
            WORKER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env
        )
        self._send(setup)

    def _send(self, message: Any) -> None:
        try:
            pickle.dump(message, self.proc.stdin)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: the read that follows says how

    def measure(self, layout: str) -> tuple[Row | str | None, list[str]]:
        """The worker's row of ``layout`` (or the traceback of a bug) and its warnings;
        (None, []) when it died."""
        self._send(layout)
        try:
            return pickle.load(self.proc.stdout)
        except (EOFError, pickle.UnpicklingError):
            return None, []

    def why_it_died(self) -> str:
        """Why the process ended: the compiler's fatal line (``Check failed: …``), else
        its last line on stderr and its exit status."""
        code = self.proc.wait()
        self.stderr.seek(0)
        lines = [
            x.strip() for x in self.stderr.read().decode(errors="replace").splitlines() if x.strip()
        ]
        fatal = [x for x in lines if "Check failed" in x]
        if fatal:
            return (
                f"the XLA compiler aborted compiling this layout ({fatal[-1][:240]}): a "
                "compiler bug, not a setting; plan the other layouts, or report it"
            )
        status = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        last = f": {lines[-1][:240]}" if lines else ""
        return f"its worker process died ({status}{last})"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def _in_processes(
    config: Config,
    layouts: list[str],
    hw: Hardware,
    memory: float | None,
    workers: int,
    done: Callable[[Row], None],
    steps: int = 0,
) -> list[Row]:
    """Each of ``workers`` threads keeps a worker process busy until no layout is left."""
    setup = (config, hw, memory, steps)
    todo: queue.Queue = queue.Queue()
    for item in enumerate(layouts):
        todo.put(item)
    results: queue.Queue = queue.Queue()

    live: set[_Worker] = set()

    def feed() -> None:
        worker = None
        try:
            while True:
                try:
                    i, layout = todo.get_nowait()
                except queue.Empty:
                    return
                if worker is None:
                    worker = _Worker(setup)
                    live.add(worker)
                row, caught = worker.measure(layout)
                if row is None:  # the worker died: the row says why; the next layout
                    row = Row(layout, hardware=hw.key, error=worker.why_it_died())
                    worker.close()  # gets a new worker
                    live.discard(worker)
                    worker = None
                results.put((i, row, caught))
        finally:
            if worker is not None:
                worker.close()

    threads = [
        threading.Thread(target=feed, daemon=True) for _ in range(min(workers, len(layouts)))
    ]
    for t in threads:
        t.start()
    rows: list[Row | None] = [None] * len(layouts)
    try:
        for _ in layouts:
            i, row, caught = results.get()
            if isinstance(row, str):  # a bug in a worker is a bug here too
                raise RuntimeError(f"measuring '{layouts[i]}' in a worker process failed:\n{row}")
            for message in caught:
                warnings.warn(message, stacklevel=2)
            rows[i] = row
            done(row)
    except BaseException:  # Ctrl-C, a bug: the workers stop now, not after their layout
        _drain(todo)
        for worker in list(live):
            worker.proc.kill()
        raise
    finally:
        _drain(todo)  # the feeders stop after their current layout
        for t in threads:
            t.join()
    return rows


def _drain(todo: queue.Queue) -> None:
    while True:
        try:
            todo.get_nowait()
        except queue.Empty:
            return


def _serve() -> None:
    """The worker's loop: the setup, then a row (and its warnings) for each layout read."""
    reply = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not garble replies
    _fewer_collections().__enter__()  # for good: this process does nothing else
    config, hw, memory, steps = pickle.load(sys.stdin.buffer)
    while True:
        try:
            layout = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                row = measure(config, layout, hw, steps, memory_bytes=memory)
            except Exception:  # a bug: the parent raises it with this traceback
                row = traceback.format_exc()
        pickle.dump((row, [str(w.message) for w in caught]), reply)
        reply.flush()


if __name__ == "__main__":
    _serve()
