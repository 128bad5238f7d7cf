"""Mixtures (``data.mixture``): the config forms, the shares of each source against the
bound the pattern guarantees, exact resume on another layout, seeds, wrapping, evaluation,
the metrics, and one-line errors for bad entries.

The bound. Example ``i`` of a mixture comes from ``pattern[i mod W]`` (Tijdeman's chairman
assignment, ``jaxpar/data/mixture.py``): every prefix of ``n`` examples holds ``c_k(n)``
examples of source ``k`` with ``|c_k(n) - n·p_k| ≤ 1 - 1/(2K-2)`` for ``K ≥ 2`` sources
(Tijdeman 1980). The sources are not sampled at random, so no binomial spread applies —
``n·p_k ± 4.5·sqrt(n·p_k(1-p_k))`` would be a far looser bound than this one, and the tests
assert this one, on every prefix, token counts included.
"""

from __future__ import annotations

import dataclasses
import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from jaxpar.config import DataConfig, load_config
from jaxpar.data import load_data, prepare_data
from jaxpar.data.mixture import (
    MixtureLoader,
    chairman_pattern,
    integer_weights,
    parse_mixture,
    tokens_by_source,
)
from jaxpar.errors import ConfigError, DataError
from jaxpar.task import DataNeeds

TEXT = DataNeeds("text", vocab_size=256)
SEQ = 8
#: each source's text uses bytes no other one uses, so a window names its source
ALPHABETS = {"web": b"abcdefghij", "code": b"0123456789", "books": b"KLMNOPQRST"}


def _write(folder, name: str, size: int, seed: int) -> str:
    """A prepared token file of ``size`` bytes drawn from ``name``'s alphabet."""
    rng = np.random.default_rng(seed)
    text = bytes(rng.choice(list(ALPHABETS[name]), size).astype(np.uint8).tolist())
    (folder / f"{name}.txt").write_bytes(text)
    out = folder / f"{name}.tokens"
    prepare_data([folder / f"{name}.txt"], out)
    return str(out)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixture")
    return {
        name: _write(folder, name, size, i)
        for i, (name, size) in enumerate([("web", 8000), ("code", 1500), ("books", 4000)])
    }


def _mixture(sources, weights: dict[str, float], seed: int = 0, **kw):
    entries = tuple((sources[name], w) for name, w in weights.items())
    cfg = dataclasses.replace(DataConfig(), mixture=entries, seq_len=SEQ, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the smaller sources wrap: tested below
        return load_data(cfg, TEXT, seed)


def _source_of(rows: np.ndarray) -> list[str]:
    """The source of each window (its first byte's alphabet)."""
    return [next(n for n, a in ALPHABETS.items() if r[0] in a) for r in rows]


def _batches(data, batch_size: int, n: int) -> list[np.ndarray]:
    with data.loader(batch_size, DataConfig(threads=0, prefetch=0)) as loader:
        return [next(loader)["tokens"] for _ in range(n)]


# ---------------------------------------------------------------- the config value


def test_the_yaml_and_command_line_forms_give_the_same_mixture(tmp_path):
    expected = (("a.tokens", 0.7), ("b.jsonl", 0.3))
    assert (
        parse_mixture([{"path": "a.tokens", "weight": 0.7}, {"path": "b.jsonl", "weight": 0.3}])
        == expected
    )
    assert parse_mixture(["a.tokens:0.7", "b.jsonl:0.3"]) == expected
    assert parse_mixture({"a.tokens": 0.7, "b.jsonl": 0.3}) == expected
    assert parse_mixture([["a.tokens", 0.7], ["b.jsonl", 0.3]]) == expected  # config.yaml
    cli = load_config([], ["data.mixture=a.tokens:0.7,b.jsonl:0.3"])
    assert cli.data.mixture == expected
    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        "data:\n  mixture:\n    - {path: a.tokens, weight: 0.7}\n"
        "    - {path: b.jsonl, weight: 0.3}\n"
    )
    assert load_config([yaml]).data.mixture == expected
    assert load_config([]).data.mixture is None


@pytest.mark.parametrize(
    "value, says",
    [
        ("a.tokens:0.7,b.jsonl:0", "entry 2 ('b.jsonl:0'): the weight must be a finite number > 0"),
        ("a.tokens:-1", "entry 1 ('a.tokens:-1'): the weight must be a finite number > 0"),
        ("a.tokens:0.5,b.jsonl:x", "entry 2 ('b.jsonl:x'): the weight must be a number"),
        ("a.tokens:0.5,b.jsonl", "entry 2 ('b.jsonl') must be path:weight"),
        ("[]", "'data.mixture' is empty; name at least one source"),
        ("[{path: a.tokens}]", "entry 1 ({'path': 'a.tokens'}) must have the keys path and weight"),
    ],
)
def test_bad_entries_are_one_line_naming_the_entry(value, says):
    with pytest.raises(ConfigError) as err:
        load_config([], [f"data.mixture={value}"])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_missing_source_or_another_tokenizer_is_one_line(sources, tmp_path):
    missing = str(tmp_path / "nowhere.tokens")
    cfg = DataConfig(mixture=((sources["web"], 1.0), (missing, 1.0)), seq_len=SEQ)
    with pytest.raises(
        DataError,
        match=r"^data.mixture entry 2 '.*nowhere.tokens' does not "
        r"exist; fix the path or drop the entry$",
    ):
        load_data(cfg, TEXT, 0)
    with pytest.raises(DataError, match="unset data.path and data.dataset"):
        load_data(dataclasses.replace(cfg, path=sources["web"]), TEXT, 0)
    meta = json.loads(Path(sources["code"] + ".json").read_text())
    other = tmp_path / "other.tokens"
    other.write_bytes(Path(sources["code"]).read_bytes())
    other.with_name("other.tokens.json").write_text(
        json.dumps({**meta, "tokenizer": {"file": "/t.json", "sha256": "0" * 64}})
    )
    with pytest.raises(DataError, match="were tokenized with different tokenizers"):
        load_data(DataConfig(mixture=((sources["web"], 1.0), (str(other), 1.0))), TEXT, 0)


# ---------------------------------------------------------------- shares


def _max_deviation(pattern: np.ndarray, weights: list[int]) -> float:
    counts = np.cumsum(np.eye(len(weights))[pattern], axis=0)
    n = np.arange(1, len(pattern) + 1)[:, None]
    return float(np.abs(counts - n * np.asarray(weights) / sum(weights)).max())


def test_every_prefix_of_the_pattern_is_within_tijdemans_bound():
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(2, 6)
        weights = [rng.randint(1, 40) for _ in range(k)]
        pattern = chairman_pattern(weights)
        assert np.bincount(pattern).tolist() == weights
        assert _max_deviation(pattern, weights) <= 1 - 1 / (2 * k - 2) + 1e-12


def test_weights_are_exact_ratios_or_the_nearest_shares_of_the_period():
    assert integer_weights([0.7, 0.3], "ab") == [7, 3]
    assert integer_weights([2, 1, 1], "abc") == [2, 1, 1]
    assert integer_weights([1 / 3, 2 / 3], "ab") == [1, 2]
    rounded = integer_weights([0.1234567, 0.8765433], "ab")
    assert abs(rounded[0] / sum(rounded) - 0.1234567) < 1 / 2**14
    with pytest.raises(DataError, match="'b' has weight 1e-06, below 1/16384 of the total"):
        integer_weights([1.0, 1e-6, 0.5], "abc")


def test_per_source_token_shares_match_the_weights_within_the_bound(sources):
    """The windows read, by source, over every prefix of 30 global batches of 10: within
    ``1 - 1/(2K-2)`` examples (``SEQ`` times that in tokens) of the weights' shares; the
    metrics' ``tokens/<name>`` count exactly what was read."""
    weights = {"web": 0.5, "code": 0.3, "books": 0.2}
    data = _mixture(sources, weights)
    read = [name for batch in _batches(data, 10, 30) for name in _source_of(batch)]
    bound = 1 - 1 / (2 * len(weights) - 2)
    for n in range(1, len(read) + 1):
        for name, w in weights.items():
            assert abs(read[:n].count(name) - n * w) <= bound + 1e-9, (n, name)
    metrics = tokens_by_source(data, len(read), SEQ)
    assert metrics == {f"tokens/{k}": read.count(k) * SEQ for k in weights}
    assert sum(metrics.values()) == len(read) * SEQ


def test_a_source_that_runs_out_wraps_reshuffled_with_a_warning(sources):
    """'code' (0.5 of the examples, 168 training windows) runs out long before 'web' is
    read once: it says so, and each pass holds each of its windows once, in a new order."""
    entries = ((sources["web"], 0.5), (sources["code"], 0.5))
    with pytest.warns(
        UserWarning,
        match=r"'code' \(168 training windows, share 0.5\) runs "
        r"out after 336 mixture examples, before 'web' has been read once",
    ):
        data = load_data(DataConfig(mixture=entries, seq_len=SEQ), TEXT, 0)
    code = [
        r.tobytes() for b in _batches(data, 12, 56) for r, s in zip(b, _source_of(b)) if s == "code"
    ]
    passes = [code[:168], code[168:336]]
    assert all(len(set(p)) == 168 for p in passes) and set(passes[0]) == set(passes[1])
    assert passes[0] != passes[1]


# ---------------------------------------------------------------- determinism and resume


def test_same_seed_same_mixture_another_seed_another(sources):
    weights = {"web": 0.6, "code": 0.4}
    first = _batches(_mixture(sources, weights, seed=3), 8, 5)
    again = _batches(_mixture(sources, weights, seed=3), 8, 5)
    other = _batches(_mixture(sources, weights, seed=4), 8, 5)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_resume_from_a_middle_step_continues_on_another_layout(sources, processes):
    """A state saved after 7 batches on one process, restored (through JSON, as a
    checkpoint stores it) on ``processes`` processes: their rows of the next batches
    concatenate to the uninterrupted stream's."""
    data = _mixture(sources, {"web": 0.5, "code": 0.3, "books": 0.2})
    whole = _batches(data, 8, 12)
    with data.loader(8, DataConfig(threads=0, prefetch=0)) as loader:
        for _ in range(7):
            next(loader)
        state = json.loads(json.dumps(loader.get_state()))
    shares = []
    for p in range(processes):
        with MixtureLoader(
            data.train,
            global_batch_size=8,
            seed=data.seed,
            threads=1,
            prefetch=2,
            process_index=p,
            process_count=processes,
        ) as loader:
            loader.set_state(state)
            shares.append([next(loader)["tokens"] for _ in range(5)])
    for step in range(5):
        assert np.array_equal(np.concatenate([s[step] for s in shares]), whole[7 + step])


def test_a_state_of_another_mixture_is_refused(sources):
    data = _mixture(sources, {"web": 0.5, "code": 0.5})
    state = data.loader(8).get_state()
    other = _mixture(sources, {"web": 0.6, "code": 0.4})
    with pytest.raises(DataError, match="loader state comes from another data.mixture"):
        other.loader(8).set_state(state)


# ---------------------------------------------------------------- evaluation


def test_eval_mixes_each_sources_held_out_tail_in_order(sources):
    data = _mixture(sources, {"web": 0.5, "code": 0.5})
    rows = np.concatenate([data.batch(i, 8, "eval")["tokens"] for i in range(3)])
    assert _source_of(rows) == ["web", "code"] * 12
    web = load_data(DataConfig(path=sources["web"], seq_len=SEQ), TEXT, 0)
    assert np.array_equal(rows[0::2], np.stack([web.eval[i]["tokens"] for i in range(12)]))
    again = _mixture(sources, {"web": 0.5, "code": 0.5}, seed=9)
    assert np.array_equal(rows[:8], again.batch(0, 8, "eval")["tokens"])


# ---------------------------------------------------------------- end to end


def test_training_logs_tokens_per_source_and_resumes_exactly(sources, tmp_path):
    """A GPT on a 0.75 : 0.25 mixture: each logged row counts every source's tokens (they
    add up to ``tokens``); 4 steps, exit, resume to 6 gives the straight run's losses."""
    from jaxpar.loop import train
    from tests.helpers import GPT_SMALL

    mixture = f"data.mixture={sources['web']}:0.75,{sources['code']}:0.25"

    def run(folder, steps):
        cfg = load_config(
            [],
            [
                *GPT_SMALL,
                mixture,
                f"train.steps={steps}",
                "train.log_every=1",
                "train.eval_every=0",
                "train.progress=false",
                "mesh.data=2",
                "mesh.fsdp=4",
                f"run.dir={tmp_path / folder}",
                "optim.decay_steps=6",
                "checkpoint.every_steps=2",
            ],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return train(cfg, echo=False).train_rows

    straight = run("straight", 6)
    for row in straight:
        assert row["tokens/web"] == row["step"] * 12 * 16
        assert row["tokens/web"] + row["tokens/code"] == row["tokens"]
    run("resumed", 4)
    resumed = run("resumed", 6)
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[4:]]


def test_example_ids_are_unique_across_the_sources(sources):
    """A model that keys its draws by example id (dropout, BERT's masks) sees window i of
    two sources as two examples: the mixture's ids are ``id · sources + k``."""
    ids = dataclasses.replace(TEXT, example_ids=True)
    entries = tuple((sources[name], 1.0) for name in ("web", "code", "books"))
    cfg = dataclasses.replace(DataConfig(), mixture=entries, seq_len=SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = load_data(cfg, ids, 0)
    items = [data.train[i] for i in range(60)]
    names = _source_of(np.stack([it["tokens"] for it in items]))
    assert [int(it["index"]) % 3 for it in items] == [list(ALPHABETS).index(n) for n in names]
    assert len({int(it["index"]) for it in items}) == len(items)
