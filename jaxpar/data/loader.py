"""A grain loader: deterministic, sharded per process, resumable.

The loader turns a random-access source into a stream of GLOBAL batches whose
order depends only on ``(source, seed, global_batch_size, shuffle)`` — never on
the process count — and hands each process only its share of each batch's rows.

Rules (every ``Loader`` follows all three):

* **Epoch order.** Epoch ``e`` visits the ``N = len(source)`` items in a
  permutation determined by ``(seed, e)``: grain's global index shuffle with
  seed ``(h(seed) + e) mod 2**32``, where ``h`` hashes the user seed through
  ``np.random.SeedSequence`` so that seed ``s + 1`` does not replay the epoch-1
  order of seed ``s``. With ``shuffle=False`` every epoch is ``0, 1, …, N-1``.
* **Drop remainder, per epoch.** Each epoch holds ``N // B`` global batches:
  global batch ``b`` is positions ``[k*B, (k+1)*B)`` of epoch ``e``'s order,
  with ``e, k = divmod(b, N // B)``. The last ``N % B`` items of each epoch's
  order are skipped, so no global batch straddles an epoch or holds an item
  twice, and (because each epoch is reshuffled) no item is skipped every epoch.
* **Sharding.** With ``P`` shares and ``L = B // P`` rows each, share ``p``
  (``process_index``) receives rows ``[p*L, (p+1)*L)`` of every global batch, as
  ``{name: array[L, …]}``, and fetches only those items from the source.
  Concatenating the ``P`` shares of a step in order gives exactly what one
  process with ``B`` rows would see. A process loads the share its devices hold
  (:class:`RowShare`, :attr:`jaxpar.plan.Plan.row_share`): processes that hold
  the same rows (split along ``stage``, ``context`` or ``tensor``) load the same
  share, and shares may differ in size between processes.

Layouts: a global batch is ``tokens[B_P, T+1]`` (or ``images[B_P, H, W, C]``,
``labels[B_P]``) — batch dim sharded contiguously over the shares.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, Self

import grain
import jax
import numpy as np

from jaxpar.data.windows import ArrayExamples, TokenWindows, window_segments
from jaxpar.errors import DataError

__all__ = [
    "ArrayExamples",
    "Loader",
    "RandomAccessSource",
    "RowShare",
    "TokenWindows",
    "fixed_batches",
    "window_segments",
]

_STATE_VERSION = 2
# Fields of the state dict that must match the restoring loader: they fix the global batch
# sequence. The process count and index, `workers`, `threads`, `prefetch` and `num_epochs`
# do not (they change who reads which rows, how fast, or where the stream ends).
_STATE_MUST_MATCH = ("global_batch_size", "seed", "shuffle", "num_items")


class RandomAccessSource(Protocol):
    """What ``Loader`` reads: a length and items by index (grain's data-source protocol)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...


class RowShare:
    """Which rows of each batch this process loads: ``share`` ``(i, n)``, part ``i`` of
    ``n`` equal, consecutive parts. By default the process's own (index, count); a run
    loads its plan's (:attr:`jaxpar.plan.Plan.row_share`: processes split along ``stage``,
    ``context`` or ``tensor`` hold the same rows, so they load the same share, and must
    make the same rows of it: a batch function pure in its step, a seeded source)."""

    _share: tuple[int, int] | None = None

    @property
    def share(self) -> tuple[int, int]:
        """This process's share ``(i, n)`` of each batch's rows."""
        return self._share or (jax.process_index(), jax.process_count())

    def with_share(self, share: tuple[int, int]) -> Self:
        """This data loading share ``share`` of every batch: itself where that is its
        share, else a copy (without the batches cached for another)."""
        if tuple(share) == self.share:
            return self
        other = copy.copy(self)
        other._share = tuple(share)
        other._forget()
        return other

    def _forget(self) -> None:
        """Drops (unshares) the batches cached for another share."""


# ---------------------------------------------------------------- sharding rule


def _check_batch(
    num_items: int, global_batch_size: int, process_index: int, process_count: int
) -> int:
    """Validates the batch against the shares and the source; returns rows per share."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(
            f"process_index={process_index} must be in [0, {process_count}) "
            f"with process_count={process_count} >= 1"
        )
    if global_batch_size < 1 or global_batch_size % process_count:
        raise DataError(
            f"train.batch_size={global_batch_size} must be a positive multiple of the "
            f"{process_count} shares of its rows the processes load (each loads "
            f"batch_size / {process_count} rows); change train.batch_size"
        )
    if num_items < global_batch_size:
        raise DataError(
            f"the data source has {num_items} items, fewer than one global batch of "
            f"train.batch_size={global_batch_size}; lower train.batch_size or use more data "
            "(data.num_examples, for synthetic data)"
        )
    return global_batch_size // process_count


class _ProcessRows(grain.MapDataset):
    """Row ``i`` of this process's stream → its item in the flat, epoch-ordered parent.

    ``parent`` is the repeated (and shuffled) source: position ``e*N + j`` is the
    ``j``-th item of epoch ``e``'s order. See the module docstring for the rule.
    """

    def __init__(
        self,
        parent: grain.MapDataset,
        *,
        num_items: int,
        global_batch_size: int,
        process_index: int,
        process_count: int,
        num_epochs: int | None,
    ):
        super().__init__(parent)
        self._n = num_items
        self._b = global_batch_size
        self._rows = global_batch_size // process_count
        self._first_row = process_index * self._rows
        self._steps_per_epoch = num_items // global_batch_size
        per_epoch = self._steps_per_epoch * self._rows
        # Infinite: the largest whole number of local batches, so batching never sees a tail.
        self._len = (
            sys.maxsize // per_epoch * per_epoch if num_epochs is None else num_epochs * per_epoch
        )

    def __len__(self) -> int:
        return self._len

    def _position(self, index: int) -> int:
        step, row = divmod(index, self._rows)
        epoch, step_in_epoch = divmod(step, self._steps_per_epoch)
        return epoch * self._n + step_in_epoch * self._b + self._first_row + row

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[self._position(index)]

    def _getitems(self, indices: Sequence[int]) -> Sequence[Any]:
        return self._parent._getitems([self._position(i) for i in indices])

    def __str__(self) -> str:
        return (
            f"_ProcessRows(rows=[{self._first_row}, {self._first_row + self._rows}) of {self._b})"
        )


def _let_grain_read_its_flags() -> None:
    """Marks absl flags parsed (at their defaults) unless the program parsed them itself.

    grain 0.2.18's ``mp_prefetch`` reads an absl flag once JAX's profiler is loaded and
    raises ``UnparsedFlagAccessError`` in programs that do not use ``absl.app``
    (google/grain#1355, fixed upstream by #1362). Marking is a no-op when flags are parsed.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _workers_ignore_ctrl_c(worker_index: int, worker_count: int) -> None:
    """In each grain worker process: a Ctrl-C at a terminal reaches the whole process
    group, but only the trainer acts on it (it finishes the step and checkpoints); a
    worker that died of it would print a traceback and starve that step of data."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def shuffle_seed(seed: int) -> int:
    """The 32-bit grain shuffle seed for a user seed (epoch ``e`` uses this ``+ e``)."""
    if seed < 0:
        raise DataError(f"seed={seed} must be a non-negative integer")
    return int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint32)[0])


def _local_batches(
    source: RandomAccessSource,
    global_batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
    shuffle: bool,
    num_epochs: int | None,
) -> grain.MapDataset:
    """This process's batches as a random-access grain dataset (the rules above)."""
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=shuffle_seed(seed))
    ds = _ProcessRows(
        ds.repeat(),
        num_items=len(source),
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        num_epochs=num_epochs,
    )
    return ds.batch(global_batch_size // process_count, drop_remainder=True)


# ---------------------------------------------------------------- loader


class Loader(Iterator[dict[str, np.ndarray]]):
    """This process's rows of a deterministic stream of global batches, via grain.

    See the module docstring for the epoch-order, drop-remainder and sharding rules.

    State rule: ``get_state()`` after ``k`` batches is the position ``k`` in the
    global batch sequence plus what fixes that sequence (batch size, seed,
    shuffle, source length), as a JSON-serialisable dict that is the same on
    every process. ``set_state`` of it on a NEW loader over the same sequence
    makes its next batch this process's rows of global batch ``k + 1`` — also
    under another process count or index, or other ``threads``, ``prefetch``,
    ``workers`` or ``num_epochs`` (the reading restarts at batch ``k`` by random
    access, so no reader-internal state is needed). A state of another
    sequence is a ``ValueError`` naming what differs.

    Args:
      source: random-access items (``__len__``/``__getitem__``) of dicts of arrays.
      global_batch_size: ``B``, rows of a global batch over all processes.
      seed: non-negative shuffle seed.
      process_index: this process, ``p`` in ``[0, process_count)``.
      process_count: ``P``; ``B`` must be divisible by it.
      shuffle: reshuffle every epoch; ``False`` reads items in order.
      num_epochs: epochs before ``StopIteration``; ``None`` runs forever.
      threads: grain reader threads (``0``: read in the calling thread).
      prefetch: local batches grain reads ahead (``0``: no read-ahead).
      workers: grain worker processes (``mp_prefetch``); ``0`` uses none.

    Raises:
      DataError: ``B`` not divisible by ``P``, fewer items than ``B``, or a bad argument.
    """

    def __init__(
        self,
        source: RandomAccessSource,
        *,
        global_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
        num_epochs: int | None = None,
        threads: int = 2,
        prefetch: int = 4,
        workers: int = 0,
    ):
        n = len(source)
        rows = _check_batch(n, global_batch_size, process_index, process_count)
        if num_epochs is not None and num_epochs < 1:
            raise DataError(f"num_epochs={num_epochs} must be >= 1, or None to run forever")
        if min(threads, prefetch, workers) < 0:
            raise DataError(
                f"threads={threads}, prefetch={prefetch} and workers={workers} must be >= 0"
            )
        self.local_batch_size = rows
        self.steps_per_epoch = n // global_batch_size
        self._meta = {
            "version": _STATE_VERSION,
            "global_batch_size": global_batch_size,
            "seed": seed,
            "shuffle": shuffle,
            "num_items": n,
        }
        self._batches = _local_batches(
            source, global_batch_size, seed, process_index, process_count, shuffle, num_epochs
        )
        self._read = (threads, prefetch, workers)
        self._iter = self._stream(0)
        self.batches_consumed = 0

    def _stream(self, first: int) -> Iterator[dict[str, np.ndarray]]:
        """grain's iterator over this process's batches from batch ``first`` on."""
        threads, prefetch, workers = self._read
        batches = self._batches[first:] if first else self._batches
        ids = batches.to_iter_dataset(
            grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        )
        if workers > 0:
            _let_grain_read_its_flags()
            ids = ids.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=workers),
                worker_init_fn=_workers_ignore_ctrl_c,
            )
        return iter(ids)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iter)
        self.batches_consumed += 1
        # Worker processes hand back shared-memory arrays; give callers plain ndarrays.
        return {k: np.asarray(v) for k, v in batch.items()}

    def batch_at(self, index: int) -> dict[str, np.ndarray]:
        """Batch ``index`` (0-based) of this process's stream, by random access: what the
        ``index + 1``-th ``next`` returns, without moving the iterator."""
        return dict(self._batches[index])

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.batches_consumed // self.steps_per_epoch

    def get_state(self) -> dict[str, Any]:
        """The position in the global batch sequence, JSON-serialisable (see the class
        docstring): the same on every process."""
        return {**self._meta, "batches_consumed": self.batches_consumed}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues after the ``batches_consumed`` global batches of a saved state.

        Raises:
          DataError: the state comes from a loader with another global batch sequence.
        """
        differ = [
            f"{k}: saved {state.get(k)!r}, here {self._meta[k]!r}"
            for k in ("version", *_STATE_MUST_MATCH)
            if state.get(k) != self._meta[k]
        ]
        if differ:
            raise DataError("loader state comes from another batch sequence — " + "; ".join(differ))
        self._iter.close()
        self.batches_consumed = int(state["batches_consumed"])
        self._iter = self._stream(self.batches_consumed)

    def close(self) -> None:
        """Stops grain's threads and worker processes."""
        self._iter.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stack(items: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([item[k] for item in items]) for k in items[0]}


def fixed_batches(
    source: RandomAccessSource,
    global_batch_size: int,
    n: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """The first ``n`` global batches in source order, this process's rows — for evaluation.

    Global batch ``b`` is items ``(b*B + j) mod len(source)`` for ``j < B`` (the flat
    source wraps around, nothing is dropped); share ``p`` (``process_index``) of ``P``
    gets rows ``[p*B/P, (p+1)*B/P)`` and fetches only those items.
    """
    rows = _check_batch(len(source), global_batch_size, process_index, process_count)
    first = process_index * rows
    return [
        _stack([source[(b * global_batch_size + first + r) % len(source)] for r in range(rows)])
        for b in range(n)
    ]
