"""The grain loader: global batch order independent of process count, per-process reads, resume."""

from __future__ import annotations

import itertools
import json
import pickle
import time

import numpy as np
import pytest

from jaxpar.data.loader import ArrayExamples, Loader, TokenWindows, fixed_batches

SEQ = 10


def windows(n: int) -> TokenWindows:
    """``n`` windows whose first token is ``SEQ * i``, so a batch's ids are
    ``tokens[:, 0] // SEQ``."""
    return TokenWindows(np.arange(n * SEQ + 1, dtype=np.uint32), SEQ)


def ids(batch: dict[str, np.ndarray]) -> list[int]:
    return (batch["tokens"][:, 0] // SEQ).tolist()


def flat(lists) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def take(loader: Loader, k: int) -> list[list[int]]:
    return [ids(next(loader)) for _ in range(k)]


class Recording:
    """A source that records every index it is asked for."""

    def __init__(self, source):
        self.source, self.fetched = source, []

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        self.fetched.append(int(index))
        return self.source[index]


# ---------------------------------------------------------------- order


def test_same_seed_same_batches_and_another_seed_differs():
    src = windows(40)
    a = take(Loader(src, global_batch_size=8, seed=3), 5)
    assert a == take(Loader(src, global_batch_size=8, seed=3), 5)
    assert a != take(Loader(src, global_batch_size=8, seed=4), 5)
    assert a[0] != list(range(8)), "shuffle=True should not read items in order"


def test_each_epoch_is_a_fresh_permutation():
    loader = Loader(windows(24), global_batch_size=8, seed=0, num_epochs=3)
    epochs = [flat(take(loader, 3)) for _ in range(3)]
    assert loader.epoch == 3
    with pytest.raises(StopIteration):
        next(loader)
    for order in epochs:
        assert sorted(order) == list(range(24))  # every window exactly once
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]


def test_remainder_of_each_epoch_is_dropped():
    # 27 items, B=8: 3 batches per epoch; each epoch's last 3 positions are skipped.
    loader = Loader(windows(27), global_batch_size=8, seed=0, shuffle=False)
    assert loader.steps_per_epoch == 3
    assert take(loader, 4) == [
        list(range(8)),
        list(range(8, 16)),
        list(range(16, 24)),
        list(range(8)),
    ]
    shuffled = Loader(windows(27), global_batch_size=8, seed=0)
    for _ in range(4):
        epoch = flat(take(shuffled, 3))
        assert len(set(epoch)) == 24  # no item twice within an epoch


# ---------------------------------------------------------------- sharding


@pytest.mark.parametrize("count", [2, 4])
def test_process_shares_concatenate_to_the_single_process_batch(count):
    src, steps = windows(26), 6  # 3 batches of 8 per epoch, 2 epochs, remainder 2
    whole = take(Loader(src, global_batch_size=8, seed=5), steps)
    shares = [
        take(Loader(src, global_batch_size=8, seed=5, process_index=p, process_count=count), steps)
        for p in range(count)
    ]
    for step in range(steps):
        assert all(len(s[step]) == 8 // count for s in shares)
        assert flat(s[step] for s in shares) == whole[step]
    for epoch in range(2):
        per_process = [set(flat(s[3 * epoch : 3 * epoch + 3])) for s in shares]
        assert sum(len(s) for s in per_process) == 24
        assert len(set().union(*per_process)) == 24  # disjoint, and 24 of 26 covered
    # The other seed really does differ, so the equalities above are not vacuous.
    assert whole != take(Loader(src, global_batch_size=8, seed=6), steps)


def test_a_process_fetches_only_its_rows():
    src, count, index = windows(64), 4, 1
    global_ids = take(Loader(src, global_batch_size=8, seed=2), 8)  # all of epoch 0
    mine = {i for b in global_ids for i in b[2 * index : 2 * index + 2]}

    exact = Recording(src)  # no read-ahead: fetched is exactly what was returned
    loader = Loader(
        exact,
        global_batch_size=8,
        seed=2,
        process_index=index,
        process_count=count,
        threads=0,
        prefetch=0,
    )
    got = take(loader, 3)
    assert sorted(exact.fetched) == sorted(flat(got))
    assert got == [b[2 * index : 2 * index + 2] for b in global_ids[:3]]

    ahead = Recording(src)  # with read-ahead: more is fetched, but only this process's rows
    with Loader(
        ahead,
        global_batch_size=8,
        seed=2,
        process_index=index,
        process_count=count,
        num_epochs=1,
        threads=2,
        prefetch=4,
    ) as loader:
        take(loader, 3)
        deadline = time.monotonic() + 5.0
        while len(ahead.fetched) <= 6 and time.monotonic() < deadline:
            time.sleep(0.01)  # let the reader threads run ahead
    assert len(ahead.fetched) > 6
    assert set(ahead.fetched) <= mine


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("threads,prefetch", [(0, 0), (2, 4)])
@pytest.mark.parametrize("k", [2, 3, 4])  # 3 batches per epoch: before, at and after a boundary
def test_restored_state_continues_the_stream(k, threads, prefetch):
    kw = {
        "global_batch_size": 4,
        "seed": 7,
        "process_index": 1,
        "process_count": 2,
        "threads": threads,
        "prefetch": prefetch,
    }
    src = windows(14)
    reference = take(Loader(src, **kw), k + 4)
    first = Loader(src, **kw)
    take(first, k)
    state = json.loads(json.dumps(first.get_state()))
    resumed = Loader(src, **kw)
    resumed.set_state(state)
    assert resumed.batches_consumed == k
    assert take(resumed, 4) == reference[k:]
    assert take(first, 4) == reference[k:]  # get_state did not disturb the original


def _global(src, k, n, count, **kw):
    """Global batches k … k+n-1 as the concatenation of ``count`` processes' rows."""
    shares = []
    for p in range(count):
        loader = Loader(src, process_index=p, process_count=count, **kw)
        loader.set_state({**loader.get_state(), "batches_consumed": k})
        shares.append(take(loader, n))
    return [[row for share in shares for row in share[i]] for i in range(n)]


@pytest.mark.parametrize("saved_count,restored_count", [(2, 1), (1, 4), (4, 2)])
def test_state_restores_under_another_process_count(saved_count, restored_count):
    """The state is a position in the global sequence: a state saved by process 1 of
    ``saved_count`` puts every process of ``restored_count`` at its rows of the next batch."""
    src = windows(40)
    kw = {"global_batch_size": 8, "seed": 3, "threads": 0, "prefetch": 0}
    saved = Loader(src, process_index=saved_count - 1, process_count=saved_count, **kw)
    take(saved, 5)
    state = json.loads(json.dumps(saved.get_state()))
    reference = _global(src, 0, 8, 1, **kw)
    resumed = []
    for p in range(restored_count):
        loader = Loader(src, process_index=p, process_count=restored_count, **kw)
        loader.set_state(state)
        resumed.append(take(loader, 3))
    assert [[row for share in resumed for row in share[i]] for i in range(3)] == reference[5:]


def test_state_from_another_sequence_is_refused():
    src = windows(16)
    saved = Loader(src, global_batch_size=8, seed=0, process_count=2)
    next(saved)
    state = saved.get_state()
    with pytest.raises(ValueError, match=r"seed: saved 0, here 1"):
        Loader(src, global_batch_size=8, seed=1, process_count=2).set_state(state)
    with pytest.raises(ValueError, match=r"global_batch_size: saved 8, here 4"):
        Loader(src, global_batch_size=4, seed=0, process_count=2).set_state(state)
    with pytest.raises(ValueError, match=r"num_items: saved 16, here 12"):
        Loader(windows(12), global_batch_size=8, seed=0, process_count=2).set_state(state)
    # Other threads/epochs/process counts restore fine.
    Loader(src, global_batch_size=8, seed=0, process_count=4, threads=0, num_epochs=3).set_state(
        state
    )


@pytest.mark.slow  # ~6 s on 2 cores: each grain worker is a spawned interpreter importing jax
def test_worker_processes_give_the_same_batches_and_resume():
    src = windows(40)
    kw = {"global_batch_size": 8, "seed": 1, "process_index": 0, "process_count": 2}
    reference = take(Loader(src, **kw), 8)
    with Loader(src, workers=2, **kw) as loader:
        assert take(loader, 3) == reference[:3]
        state = json.loads(json.dumps(loader.get_state()))
    with Loader(src, workers=2, **kw) as resumed:
        resumed.set_state(state)
        assert take(resumed, 5) == reference[3:]
    without = Loader(src, **kw)  # the position does not depend on the readers
    without.set_state(state)
    assert take(without, 5) == reference[3:]


# ---------------------------------------------------------------- errors


def test_user_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"train.batch_size=6 .* the 4 shares of its rows"):
        Loader(windows(24), global_batch_size=6, seed=0, process_count=4)
    with pytest.raises(ValueError, match=r"has 7 items, fewer than .* train.batch_size=8"):
        Loader(windows(7), global_batch_size=8, seed=0)
    with pytest.raises(ValueError, match=r"data.seq_len=10 .* holds 10 tokens"):
        TokenWindows(np.arange(10, dtype=np.uint8), 10)
    with pytest.raises(ValueError, match=r"train.batch_size=6"):
        fixed_batches(windows(24), 6, 1, 0, 4)


# ---------------------------------------------------------------- sources and eval


def test_token_windows_are_slices_sharing_one_boundary_token(tmp_path):
    tokens = (np.arange(1000) * 61 % 65536).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    mapped = np.memmap(path, dtype=np.uint16, mode="r")
    src = TokenWindows(mapped, 16, start=100, end=900)
    assert len(src) == (900 - 100 - 1) // 16
    for i in (0, 7, len(src) - 1):
        lo = 100 + 16 * i
        window = src[i]["tokens"]
        assert window.dtype == np.int32
        np.testing.assert_array_equal(window, tokens[lo : lo + 17].astype(np.int32))
    assert window.max() > 255  # uint16 values survive the widening
    np.testing.assert_array_equal(src[0]["tokens"][-1], src[1]["tokens"][0])
    with pytest.raises(IndexError):
        src[len(src)]
    # Worker processes get the file name, not the contents.
    copy = pickle.loads(pickle.dumps(src))
    assert isinstance(copy.tokens, np.memmap) and len(pickle.dumps(src)) < 1000
    np.testing.assert_array_equal(copy[7]["tokens"], src[7]["tokens"])


def test_array_examples_items_and_batches():
    images = np.arange(10 * 4 * 4, dtype=np.uint8).reshape(10, 4, 4)
    labels = np.arange(10) % 3
    src = ArrayExamples(images, labels, start=2)
    assert len(src) == 8
    item = src[1]
    assert item["images"].shape == (4, 4, 1) and item["images"].dtype == np.float32
    np.testing.assert_array_equal(item["images"][..., 0], images[3])
    assert item["labels"] == 0 and item["labels"].dtype == np.int32
    batch = next(Loader(src, global_batch_size=4, seed=0, process_index=1, process_count=2))
    assert batch["images"].shape == (2, 4, 4, 1) and batch["labels"].shape == (2,)


def test_fixed_batches_are_in_order_wrap_and_shard():
    src = windows(20)
    whole = [ids(b) for b in fixed_batches(src, 8, 3)]
    assert whole == [list(range(8)), list(range(8, 16)), [16, 17, 18, 19, 0, 1, 2, 3]]
    shares = [[ids(b) for b in fixed_batches(src, 8, 3, p, 4)] for p in range(4)]
    assert [flat(s[i] for s in shares) for i in range(3)] == whole
