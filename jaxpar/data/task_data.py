"""A Task's own data: a batch function or a grain dataset, as a resumable stream.

``Task.data`` (and ``Task.eval_data``) is one of:

* a function ``(step, global_batch_size) -> {name: numpy array}``: the batch of the step
  that follows ``step`` steps, pure in ``step``, so a run resumes by step number and the
  stream's state is just the step. With several processes each process keeps only the
  rows its devices hold, share ``i`` of ``n``: ``[i·B/n, (i+1)·B/n)`` of every global
  batch (:class:`jaxpar.data.loader.RowShare`; processes split along ``stage``,
  ``context`` or ``tensor`` hold the same rows); a function with a ``rows`` parameter is
  called with ``rows=slice(...)`` and returns only those rows, so each process computes
  only its own.
* a ``grain.MapDataset`` of examples (dicts of arrays): read by jaxpar's loader
  (``jaxpar/data/loader.py``) — shuffled per epoch by ``run.seed``, each process fetching
  only its rows, resumed by position under any process count.
* a ``grain.IterDataset`` of examples: read in order, ``B`` examples a step, resumed from
  grain's own iterator state (``get_state``/``set_state``); only where every process
  loads every row (one process, or processes split along ``stage``, ``context`` or
  ``tensor`` alone).

Every batch is checked against the task's ``batch_axes`` (its entries), the expected
number of rows and the first batch's shapes and dtypes: a mismatch is an error naming
the entry and the fix, not a recompilation or a crash inside the step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grain
import jax
import numpy as np

from jaxpar.data.data_config import DataConfig
from jaxpar.data.loader import Loader, RowShare, fixed_batches
from jaxpar.errors import (
    DataError,
    JaxparError,
    RestoreError,
    UserCodeFailed,
    code_name,
)

BatchFn = Callable[..., Mapping[str, Any]]


def _takes_rows(fn: BatchFn) -> bool:
    try:
        return "rows" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return False


@dataclass
class BatchCheck:
    """Checks each batch a task's data yields: its entries, rows, and stable shapes."""

    what: str
    keys: frozenset[str]
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = field(default_factory=dict)

    def __call__(self, batch: Any, rows: int, where: str) -> dict[str, np.ndarray]:
        if not isinstance(batch, Mapping):
            raise DataError(
                f"{self.what}{where} returned {type(batch).__name__}; it must "
                "return a dict of numpy arrays, one per batch entry"
            )
        if set(batch) != self.keys:
            raise DataError(
                f"{self.what}{where} returned entries {sorted(batch)}, but the "
                f"task's batch_axes name {sorted(self.keys)}; return exactly "
                "those entries (or change Task.batch_axes)"
            )
        out = {}
        for key, value in batch.items():
            array = np.asarray(value)
            if array.ndim == 0 or array.shape[0] != rows:
                got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
                raise DataError(
                    f"{self.what}{where} returned '{key}' with {got} (shape "
                    f"{array.shape}); it must have {rows} rows"
                )
            seen = self.shapes.setdefault(key, (array.shape, array.dtype))
            if seen != (array.shape, array.dtype):
                raise DataError(
                    f"{self.what}{where} returned '{key}' of shape {array.shape} "
                    f"{array.dtype}, but earlier batches had {seen[0]} {seen[1]}; every "
                    "batch must have the same shapes and dtypes (the step is compiled once)"
                )
            out[key] = array
        return out


class FunctionStream(Iterator[dict[str, np.ndarray]]):
    """The stream of a batch function: batch ``k`` is ``fn(k, B)``, this process's rows
    (``share`` ``(i, n)``: part ``i`` of ``n``; None: the process's own index and count).

    Up to ``prefetch`` batches are computed ahead on ``threads`` threads (the function is
    pure in its step, so computing ahead changes nothing). The state is the number of
    batches consumed.
    """

    def __init__(
        self,
        fn: BatchFn,
        global_batch_size: int,
        check: BatchCheck,
        *,
        share: tuple[int, int] | None = None,
        threads: int = 1,
        prefetch: int = 2,
    ):
        index, count = share or (jax.process_index(), jax.process_count())
        if global_batch_size % count:
            raise DataError(
                f"train.batch_size={global_batch_size} must be a multiple of the "
                f"{count} shares of its rows the processes load"
            )
        self.fn = fn
        self.global_batch_size = global_batch_size
        self.check = check
        rows = global_batch_size // count
        self.rows = slice(index * rows, (index + 1) * rows)
        self.takes_rows = _takes_rows(fn)
        self.batches_consumed = 0
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(threads, "jaxpar-data")
            if threads and prefetch
            else None
        )
        self._ahead: collections.deque = collections.deque()
        self._depth = prefetch

    def batch_at(self, index: int) -> dict[str, np.ndarray]:
        """This process's rows of batch ``index`` (what the ``index+1``-th ``next`` gives)."""
        where = f"(step={index}, global_batch_size={self.global_batch_size})"
        if self.takes_rows:
            batch = self._call(index, rows=self.rows)
            return self.check(
                batch, self.rows.stop - self.rows.start, f"{where[:-1]}, rows={self.rows})"
            )
        batch = self.check(self._call(index), self.global_batch_size, where)
        if self.rows.stop - self.rows.start == self.global_batch_size:
            return batch
        return {k: v[self.rows] for k, v in batch.items()}

    def _call(self, index: int, **rows: Any) -> Any:
        """The function's batch ``index``; an exception it raises names it and the step."""
        try:
            return self.fn(index, self.global_batch_size, **rows)
        except JaxparError:
            raise
        except Exception as err:
            raise UserCodeFailed(
                f"{self.check.what} ({code_name(self.fn)})",
                err,
                f"for batch {index} (step {index + 1})",
            ) from err

    def __next__(self) -> dict[str, np.ndarray]:
        index = self.batches_consumed
        if self._pool is None:
            batch = self.batch_at(index)
        else:
            while len(self._ahead) < self._depth:
                ahead = index + len(self._ahead)
                self._ahead.append(self._pool.submit(self.batch_at, ahead))
            batch = self._ahead.popleft().result()
        self.batches_consumed += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "kind": "function",
            "global_batch_size": self.global_batch_size,
            "batches_consumed": self.batches_consumed,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        _check_kind(state, "function", self.global_batch_size)
        self._drop_ahead()
        self.batches_consumed = int(state["batches_consumed"])

    def _drop_ahead(self) -> None:
        for future in self._ahead:
            future.cancel()
        self._ahead.clear()

    def close(self) -> None:
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class IterStream(Iterator[dict[str, np.ndarray]]):
    """A ``grain.IterDataset`` of examples read in order, ``B`` a step; its state is
    grain's iterator state plus the number of batches consumed."""

    def __init__(
        self,
        dataset: grain.IterDataset,
        global_batch_size: int,
        check: BatchCheck,
        share: tuple[int, int] = (0, 1),
    ):
        if share[1] > 1:
            raise DataError(
                f"{check.what} is a grain.IterDataset, which jaxpar reads whole, in order; with "
                "processes that load different rows give a grain.MapDataset (random access: "
                "each process reads only its rows of every batch) or a batch function"
            )
        self.global_batch_size = global_batch_size
        self.check = check
        self._iter = iter(dataset.batch(global_batch_size, drop_remainder=True))
        self.batches_consumed = 0

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            batch = next(self._iter)
        except StopIteration:
            raise DataError(
                f"{self.check.what} (a grain.IterDataset) ran out after {self.batches_consumed} "
                f"batches of {self.global_batch_size}; repeat it (e.g. "
                "MapDataset.repeat() before to_iter_dataset()) or lower train.steps"
            ) from None
        except JaxparError:
            raise
        except Exception as err:
            raise UserCodeFailed(
                f"{self.check.what} (a grain.IterDataset)",
                err,
                f"for batch {self.batches_consumed} (step {self.batches_consumed + 1})",
            ) from err
        batch = self.check(batch, self.global_batch_size, f" (batch {self.batches_consumed})")
        self.batches_consumed += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "kind": "grain_iter",
            "global_batch_size": self.global_batch_size,
            "batches_consumed": self.batches_consumed,
            "iterator": self._iter.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        _check_kind(state, "grain_iter", self.global_batch_size)
        self._iter.set_state(state["iterator"])
        self.batches_consumed = int(state["batches_consumed"])

    def close(self) -> None:
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()


def _check_kind(state: dict[str, Any], kind: str, global_batch_size: int) -> None:
    saved = (state.get("kind"), state.get("global_batch_size"))
    if saved != (kind, global_batch_size):
        raise RestoreError(
            f"loader state comes from another stream — saved {saved[0]} data with "
            f"batch size {saved[1]}, here {kind} data with batch size "
            f"{global_batch_size}"
        )


class _CheckedLoader(Loader):
    """jaxpar's grain loader over a ``grain.MapDataset``, checking each batch."""

    def __init__(self, source: grain.MapDataset, check: BatchCheck, **kwargs: Any):
        super().__init__(source, **kwargs)
        self.check = check

    def __next__(self) -> dict[str, np.ndarray]:
        index = self.batches_consumed
        return self.check(super().__next__(), self.local_batch_size, f" (batch {index})")

    def batch_at(self, index: int) -> dict[str, np.ndarray]:
        return self.check(super().batch_at(index), self.local_batch_size, f" (batch {index})")


def _kind(source: Any, what: str) -> str:
    if isinstance(source, grain.MapDataset):
        return "map"
    if isinstance(source, grain.IterDataset):
        return "iter"
    if callable(source):
        return "function"
    raise DataError(
        f"{what} is a {type(source).__name__}; give a function (step, "
        "global_batch_size) -> dict of numpy arrays, a grain.MapDataset or a "
        "grain.IterDataset of examples"
    )


@dataclass
class TaskData(RowShare):
    """A task's own data, with the interface of :class:`jaxpar.data.Data`: a resumable
    training stream (:meth:`loader`) and batches by index (:meth:`batch`)."""

    name: str
    train: Any
    eval: Any
    seed: int
    keys: frozenset[str]
    _eval_cache: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    _by_index: dict[int, Any] = field(default_factory=dict)

    @property
    def has_eval(self) -> bool:
        return self.eval is not None

    def _check(self, what: str) -> BatchCheck:
        return BatchCheck(what, self.keys)

    def _forget(self) -> None:
        self._eval_cache, self._by_index = {}, {}

    def loader(self, batch_size: int, cfg: DataConfig | None = None) -> Any:
        """A fresh training stream of global batches of ``batch_size`` rows (this process's)."""
        cfg = cfg or DataConfig()
        kind = _kind(self.train, "Task.data")
        if kind == "function":
            return FunctionStream(
                self.train,
                batch_size,
                self._check("Task.data"),
                share=self.share,
                threads=min(cfg.threads, 1),
                prefetch=cfg.prefetch,
            )
        if kind == "iter":
            return IterStream(self.train, batch_size, self._check("Task.data"), self.share)
        return _CheckedLoader(
            self.train,
            self._check("Task.data"),
            global_batch_size=batch_size,
            seed=self.seed,
            process_index=self.share[0],
            process_count=self.share[1],
            threads=cfg.threads,
            prefetch=cfg.prefetch,
            workers=cfg.workers,
        )

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, np.ndarray]:
        """Training batch ``index`` or the ``index``-th fixed held-out batch (this
        process's rows)."""
        if split == "eval":
            return self._eval_batches(index + 1, batch_size)[index]
        if batch_size not in self._by_index:
            kind = _kind(self.train, "Task.data")
            if kind == "iter":  # no random access: the first batches of a fresh iterator
                self._by_index[batch_size] = _FirstBatches(self.loader(batch_size))
            else:
                self._by_index[batch_size] = self.loader(
                    batch_size, DataConfig(threads=0, prefetch=0)
                )
        return self._by_index[batch_size].batch_at(index)

    def _eval_batches(self, n: int, batch_size: int) -> list[dict[str, np.ndarray]]:
        cached = self._eval_cache.get(batch_size, [])
        if len(cached) >= n:
            return cached
        check = self._check("Task.eval_data")
        kind = _kind(self.eval, "Task.eval_data")
        if kind == "function":
            stream = FunctionStream(self.eval, batch_size, check, share=self.share, threads=0)
            cached = [stream.batch_at(i) for i in range(n)]
        elif kind == "map":
            rows = batch_size // self.share[1]
            cached = [
                check(b, rows, f" (batch {i})")
                for i, b in enumerate(fixed_batches(self.eval, batch_size, n, *self.share))
            ]
        else:
            stream = IterStream(self.eval, batch_size, check, self.share)
            cached = [next(stream) for _ in range(n)]
        self._eval_cache[batch_size] = cached
        return cached


class _FirstBatches:
    """Random access to the first batches of a stream that has none (an IterDataset)."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.seen = []

    def batch_at(self, index: int) -> dict[str, np.ndarray]:
        while len(self.seen) <= index:
            self.seen.append(next(self.stream))
        return self.seen[index]


def task_data(task: Any, seed: int) -> TaskData | None:
    """The task's own data, or None when it brings none (the config's data applies)."""
    if task.data is None:
        if task.eval_data is not None:
            raise DataError(
                "the task has eval_data but no data; give Task.data too, or "
                "neither to use the config's data section"
            )
        return None
    _kind(task.data, "Task.data")
    if task.eval_data is not None:
        _kind(task.eval_data, "Task.eval_data")
    name = f"{task.name or 'the task'}'s own data"
    return TaskData(name, task.data, task.eval_data, seed, frozenset(task.batch_axes))
