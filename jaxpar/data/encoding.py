"""Documents encoded in batches: on the tokenizer library's threads in this process, or on
worker processes (``workers > 1``, a Hugging Face tokenizer), results in input order.

Worker processes overlap what one process does in series — reading and parsing records,
turning each encoding's id list into an array, writing — with the encoding itself, and
run each its own single-threaded copy of the tokenizer (``TOKENIZERS_PARALLELISM=false``
there), so the machine's cores encode all the time. A batch holds about ``BATCH_BYTES``
of text (``WORKER_BATCH_BYTES`` for a worker); at most ``2 × workers`` batches are in
flight, so memory holds a few batches, not the corpus. The workers are forked in the
jaxpar command, else started by a fork server. Stop signals are the parent's: the workers
ignore Ctrl-C and SIGTERM (sent to the whole process group by a terminal or a scheduler),
and the parent kills them when it stops for any reason, so a stop is never held up by a
batch in flight.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from jaxpar.data.tokenizers import HFTokenizer, Separators, Tokenizer, load_hf
from jaxpar.signals import is_command

#: text encoded together in this process: enough for every thread, little memory
BATCH_BYTES = 4 * 2**20
#: text one worker encodes at a time: small enough that the workers finish together
WORKER_BATCH_BYTES = 2**20


def default_workers() -> int:
    """The CPU cores this process may run on (its affinity where the platform says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Encoded(NamedTuple):
    """A batch of documents encoded: each one's stored length and all their ids, wrapped
    in the separators and concatenated, in the token file's dtype."""

    docs: list[Any]
    lengths: np.ndarray
    ids: np.ndarray


def _encode(
    tok: Tokenizer, datas: list[bytes], names: list[str], seps: Separators, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, ids)`` of a batch (see :class:`Encoded`)."""
    many = getattr(tok, "encode_many", None)
    parts = (
        many(datas, names) if many is not None else [tok.encode(d, n) for d, n in zip(datas, names)]
    )
    sizes = np.fromiter((a.size for a in parts), np.int64, len(parts))
    body = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    ends = np.cumsum(sizes)
    marks = [
        (at, mark) for at, mark in ((ends - sizes, seps.bos), (ends, seps.eos)) if mark is not None
    ]  # bos before, eos after each document
    if not marks or not parts:
        return sizes, body
    where = np.stack([at for at, _ in marks], 1).ravel()
    values = np.tile(np.array([mark for _, mark in marks], dtype), len(parts))
    # stable: where a document ends and the next begins, its eos comes before their bos
    return sizes + len(marks), np.insert(body, where, values)


def _batches(docs: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch, held = [], 0
    for doc in docs:
        batch.append(doc)
        held += len(doc.data)
        if held >= size:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def encode_batches(
    docs: Iterable[Any],
    tok: Tokenizer,
    seps: Separators,
    dtype: np.dtype,
    progress: bool | None = False,
    workers: int = 1,
) -> Iterator[Encoded]:
    """The documents (``.data``: their bytes, ``.name``) encoded a batch at a time, in
    input order, each wrapped in ``seps``, stored as ``dtype``.

    Args:
      docs: the documents, read lazily.
      tok: the tokenizer; worker processes are used for a Hugging Face one only (the
        byte tokenizer is a copy of the bytes).
      progress: a bar of the text encoded (None: when stderr is a terminal).
      workers: processes that encode (1: this one, on the library's threads).

    Raises:
      DataError: for a document the tokenizer cannot encode (from a worker too).
    """
    off = {False: True, None: None, True: False}[progress]  # tqdm's `disable`
    parallel = workers > 1 and isinstance(tok, HFTokenizer)
    batches = _batches(docs, WORKER_BATCH_BYTES if parallel else BATCH_BYTES)
    settings = (seps, np.dtype(dtype).str)
    with tqdm(
        unit="B", unit_scale=True, desc="tokenizing", disable=off, leave=False, mininterval=0.5
    ) as bar:
        encoded = (
            _in_workers(batches, tok, workers, settings)
            if parallel
            else (Encoded(b, *_encode(tok, *_texts(b), *settings)) for b in batches)
        )
        for batch in encoded:
            yield batch
            bar.update(sum(len(d.data) for d in batch.docs))


def _texts(batch: list[Any]) -> tuple[list[bytes], list[str]]:
    return [d.data for d in batch], [d.name for d in batch]


# ---------------------------------------------------------------- worker processes

_WORKER_TOKENIZER: list[HFTokenizer] = []


def _start_worker(file: str, sha256: str) -> None:
    """A worker's start: one thread of the tokenizer library; stop signals are the
    parent's to handle (it kills the workers when it stops)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    _WORKER_TOKENIZER[:] = [load_hf(file, sha256)]


def _encode_in_worker(
    datas: list[bytes], names: list[str], seps: Separators, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    return _encode(_WORKER_TOKENIZER[0], datas, names, seps, dtype)


_STOPS = {signal.SIGINT, signal.SIGTERM}


def _start_method() -> str:
    """``fork`` in the jaxpar command (fast, nothing imported again; it has initialized no
    JAX backend, whose threads a fork would copy mid-lock), else ``forkserver`` (a Python
    session may have), else ``spawn``."""
    methods = multiprocessing.get_all_start_methods()
    if is_command() and "fork" in methods:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


@contextmanager
def _pool(tok: HFTokenizer, workers: int) -> Iterator[ProcessPoolExecutor]:
    """``workers`` processes, killed when the block ends however it ends. A stop signal
    arriving while they start is held until they all ignore it, then raised here."""
    context = multiprocessing.get_context(_start_method())
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload([__name__])  # imported once, not by each worker
    blocked = hasattr(signal, "pthread_sigmask")
    pool = None
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        pool = ProcessPoolExecutor(workers, context, _start_worker, (tok.file, tok.sha256))
        # every worker started now, inside the blocked window (one task each at once)
        wait([pool.submit(time.sleep, 0.05) for _ in range(workers)])
        if blocked:  # a signal held meanwhile is raised here, inside the block
            blocked = False
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
        yield pool
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
        if pool is not None:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.kill()  # a stop must not wait for the batches in flight
            pool.shutdown(wait=True, cancel_futures=True)


def _in_workers(
    batches: Iterator[list[Any]], tok: HFTokenizer, workers: int, settings: tuple[Separators, str]
) -> Iterator[Encoded]:
    """Each batch encoded on ``workers`` processes, in order.

    Raises:
      WorkerDied: when a worker process ended without its result (killed from outside).
    """
    with _pool(tok, workers) as pool:
        pending: deque = deque()
        for batch in batches:
            future = pool.submit(_encode_in_worker, *_texts(batch), *settings)
            pending.append((batch, future))
            if len(pending) >= 2 * workers:
                yield _collect(*pending.popleft())
        while pending:
            yield _collect(*pending.popleft())


class WorkerDied(RuntimeError):
    """A worker process ended without its result: killed from outside (the kernel's
    out-of-memory killer, say)."""


def _collect(batch: list[Any], future: Any) -> Encoded:
    try:
        return Encoded(batch, *future.result())  # a worker's DataError is raised here
    except BrokenProcessPool:
        raise WorkerDied(
            "a tokenizing worker process ended without its result (killed "
            "from outside: out of memory?)"
        ) from None
