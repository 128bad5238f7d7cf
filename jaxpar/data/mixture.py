"""Weighted mixtures of text sources (``data.mixture``): one stream, exact shares, resumable.

A mixture of ``K`` sources with integer weights ``w_k`` (``W = Σ w_k``, see
:func:`integer_weights`) is an endless sequence: example ``i`` comes from source
``pattern[i mod W]``, where ``pattern`` holds each ``k`` exactly ``w_k`` times, spread by
Tijdeman's chairman-assignment rule so that EVERY prefix of ``n`` examples holds
``c_k(n)`` examples of source ``k`` with ``|c_k(n) - n·w_k/W| ≤ 1 - 1/(2K-2)`` (Tijdeman
1980; exact shares at every multiple of ``W``). Within a source the examples are its
training windows, read in full passes, each pass in a fresh permutation fixed by the run
seed (grain's ``shuffle(...).repeat()``); a source that runs out wraps around this way,
whatever the others hold. The sequence depends only on the seed, the weights and the
sources, so the loader reads it in order (no further shuffle), shards it over processes
and resumes it exactly like any other source.

Eval data is each source's held-out tail, read in order (wrapping) with the same pattern.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

import grain
import numpy as np
from pydantic import BeforeValidator

from jaxpar.data.loader import Loader, TokenWindows
from jaxpar.errors import ConfigError, DataError

#: the length the loader sees: the mixture never ends in practice (2**48 examples)
LENGTH = 2**48
#: the longest pattern; weights whose ratios need more are rounded to 1/MAX_PERIOD
MAX_PERIOD = 2**14
_EXAMPLE = "e.g. data.mixture=web.tokens:0.7,code.tokens:0.3"

Entries = tuple[tuple[str, float], ...]


# ---------------------------------------------------------------- the config value


def _entry(index: int, item: Any) -> tuple[str, float]:
    """One ``(path, weight)`` from a mapping, a ``[path, weight]`` pair or ``path:weight``."""
    where = f"data.mixture entry {index + 1} ({item!r})"
    if isinstance(item, dict):
        extra = set(item) - {"path", "weight"}
        if extra or "path" not in item or "weight" not in item:
            raise ConfigError(
                f"{where} must have the keys path and weight only, "
                "e.g. {path: web.tokens, weight: 0.7}"
            )
        path, weight = item["path"], item["weight"]
    elif isinstance(item, (list, tuple)) and len(item) == 2:
        path, weight = item
    elif isinstance(item, str) and ":" in item:
        path, weight = item.rsplit(":", 1)  # the weight is a number: the last ':' splits
    else:
        raise ConfigError(f"{where} must be path:weight; {_EXAMPLE}")
    return _path(where, path), _weight(where, weight)


def _path(where: str, path: Any) -> str:
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{where}: the path must be a non-empty string; {_EXAMPLE}")
    return path.strip()


def _weight(where: str, weight: Any) -> float:
    try:
        value = float(weight.strip() if isinstance(weight, str) else weight)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: the weight must be a number; {_EXAMPLE}") from None
    if isinstance(weight, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{where}: the weight must be a finite number > 0; drop the "
            "source or give it a positive weight"
        )
    return value


def parse_mixture(value: Any) -> Entries | None:
    """``data.mixture`` as ``((path, weight), …)``: from a YAML list of ``{path, weight}``
    mappings (or ``path:weight`` strings, or ``[path, weight]`` pairs), a mapping
    ``{path: weight}``, or the command line's ``path:weight,path:weight``. None: no mixture.

    Raises:
      ConfigError: an empty list, or an entry without a path or a positive weight — one
        line naming the entry.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    elif isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"config key 'data.mixture' must be a list of sources, got {value!r}; {_EXAMPLE}"
        )
    if not value:
        raise ConfigError(
            f"config key 'data.mixture' is empty; name at least one source, "
            f"{_EXAMPLE} (or leave it unset to read data.path)"
        )
    return tuple(_entry(i, item) for i, item in enumerate(value))


def source_names(paths: Sequence[str]) -> list[str]:
    """A short name per source for the metrics (``tokens/<name>``): the file name without
    its extensions, or the path itself where two would share a name."""
    stems = [Path(p).name.split(".")[0] or p for p in paths]
    return [s if stems.count(s) == 1 else p for s, p in zip(stems, paths)]


# ---------------------------------------------------------------- the pattern


def integer_weights(weights: Sequence[float], names: Sequence[str]) -> list[int]:
    """The smallest integers in the weights' ratios (exact for ratios of small fractions,
    e.g. 0.7 : 0.3 → 7 : 3), else the nearest shares of ``MAX_PERIOD`` (largest remainder).

    Raises:
      DataError: a weight below 1/MAX_PERIOD of the total, naming its source.
    """
    fractions = [Fraction(w).limit_denominator(10**6) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    if sum(ints) > MAX_PERIOD:
        exact = [w / sum(weights) * MAX_PERIOD for w in weights]
        ints = [int(x) for x in exact]
        order = sorted(range(len(exact)), key=lambda k: ints[k] - exact[k])
        for k in order[: MAX_PERIOD - sum(ints)]:
            ints[k] += 1
    for name, w, n in zip(names, weights, ints):
        if n == 0:
            raise DataError(
                f"data.mixture: '{name}' has weight {w:g}, below 1/{MAX_PERIOD} "
                "of the total; raise it or drop the source"
            )
    g = math.gcd(*ints)
    return [n // g for n in ints]


def chairman_pattern(weights: Sequence[int]) -> np.ndarray:
    """Source ids, ``weights[k]`` of each, in Tijdeman's order: at step ``t`` the eligible
    source (one ``≥ 1/(2K-2)`` behind its share) whose deadline comes first."""
    w = np.asarray(weights, dtype=np.int64)
    total = int(w.sum())
    k = len(w)
    if k == 1:
        return np.zeros(total, np.int32)
    m = 2 * k - 2
    counts = np.zeros(k, np.int64)
    out = np.empty(total, np.int32)
    for t in range(1, total + 1):
        eligible = m * (t * w - counts * total) >= total
        deadline = np.where(eligible, (m * (counts + 1) - 1) / w, np.inf)
        chosen = int(np.argmin(deadline))
        assert eligible[chosen], "Tijdeman's rule always has an eligible source"
        counts[chosen] += 1
        out[t - 1] = chosen
    return out


class Schedule(grain.transforms.DatasetSelectionMap):
    """Mixture example ``i`` → ``(source k, its example index)`` (see the module docstring).

    Stateless and picklable, as grain requires; ``counts(n)`` is exact for any ``n``.
    """

    def __init__(self, weights: Sequence[int]):
        self.weights = np.asarray(weights, dtype=np.int64)
        self.pattern = chairman_pattern(weights)
        # the index of each pattern slot among the earlier slots of its source
        self._key = np.zeros(len(self.pattern), np.int64)
        seen = np.zeros(len(weights), np.int64)
        for slot, k in enumerate(self.pattern):
            self._key[slot], seen[k] = seen[k], seen[k] + 1

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> tuple[int, int]:
        period, slot = divmod(int(index), len(self.pattern))
        k = int(self.pattern[slot])
        return k, period * int(self.weights[k]) + int(self._key[slot])

    def counts(self, n: int) -> np.ndarray:
        """Examples of each source among mixture examples ``[0, n)``."""
        period, slot = divmod(int(n), len(self.pattern))
        return period * self.weights + np.bincount(self.pattern[:slot], minlength=len(self.weights))


# ---------------------------------------------------------------- the source


def _source_seed(seed: int, k: int) -> int:
    return int(np.random.SeedSequence([seed, k]).generate_state(1, dtype=np.uint32)[0])


class Mixed:
    """A random-access source (``len`` = :data:`LENGTH`) of the mixture of ``windows``.

    Args:
      windows: each source's windows (its training or held-out split).
      weights: integer weights (:func:`integer_weights`).
      names: each source's name (metrics, messages).
      seed: the run seed: each pass over a source is a fresh permutation; None reads
        each source in order (evaluation).
    """

    def __init__(
        self,
        windows: Sequence[TokenWindows],
        weights: Sequence[int],
        names: Sequence[str],
        seed: int | None,
    ):
        self.names = tuple(names)
        self.sizes = tuple(len(w) for w in windows)
        self.schedule = Schedule(weights)
        parents = []
        for k, source in enumerate(windows):
            ds = grain.MapDataset.source(source)
            if seed is not None:
                ds = ds.shuffle(seed=_source_seed(seed, k))
            parents.append(ds.repeat())  # each pass reshuffled (grain reseeds per epoch)
        self._mixed = grain.MapDataset.select_from_datasets(parents, self.schedule)

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Mixture example ``index``; its ``index`` entry (the example's id, which keys its
        random draws: :mod:`jaxpar.models.dropout`), where the windows carry one, made
        unique across the sources (``id · sources + k``): window ``i`` of two sources are
        two examples."""
        item = self._mixed[index]
        if "index" not in item:
            return item
        k = self.schedule[index][0]
        return {**item, "index": np.int32(int(item["index"]) * len(self.names) + k)}

    def fingerprint(self) -> list[list[Any]]:
        """What fixes the sequence besides the seed: names, weights, windows (JSON)."""
        return [[n, int(w), s] for n, w, s in zip(self.names, self.schedule.weights, self.sizes)]

    def warn_wraps(self) -> None:
        """One warning per source that runs out before the roomiest one is read once."""
        shares = self.schedule.weights / self.schedule.weights.sum()
        lasts = [size / share for size, share in zip(self.sizes, shares)]
        roomiest = int(np.argmax(lasts))
        for k, name in enumerate(self.names):
            if lasts[k] < lasts[roomiest]:
                warnings.warn(
                    f"data.mixture: '{name}' ({self.sizes[k]:,} training windows, share "
                    f"{shares[k]:.3g}) runs out after {math.ceil(lasts[k]):,} mixture "
                    f"examples, before '{self.names[roomiest]}' has been read once; it wraps "
                    f"around, reshuffled ({lasts[roomiest] / lasts[k]:.3g} passes per pass "
                    f"of '{self.names[roomiest]}')",
                    stacklevel=2,
                )


class MixtureLoader(Loader):
    """The :class:`Loader` over a :class:`Mixed` source, read in its own order
    (``shuffle=False``); its state also names the mixture, which a restore must match."""

    def __init__(self, source: Mixed, **kwargs: Any):
        super().__init__(source, shuffle=False, **kwargs)
        self._mixture = source.fingerprint()

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "mixture": self._mixture}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("mixture")
        if saved != self._mixture:
            raise DataError(
                f"loader state comes from another data.mixture — saved "
                f"{saved!r}, here {self._mixture!r} ([name, weight, windows]); "
                "resume with the run's own data.mixture"
            )
        super().set_state(state)


def check_tokenizers(paths: Sequence[str], tokenizers: Sequence[Any]) -> None:
    """Raises unless every source was tokenized alike (a token file's ``tokenizer``
    metadata: ``byte``, or a tokenizer file, compared by its sha256)."""

    def key(described: Any) -> str:
        return described.get("sha256", "") if isinstance(described, dict) else str(described)

    for path, tok in zip(paths, tokenizers):
        if key(tok) != key(tokenizers[0]):
            raise DataError(
                f"data.mixture: '{path}' and '{paths[0]}' were tokenized with "
                "different tokenizers; prepare every source with the same one"
            )


def mix_splits(
    entries: Entries, train: Sequence[TokenWindows], held_out: Sequence[TokenWindows], seed: int
) -> tuple[Mixed, Mixed]:
    """The training mixture (each pass over a source reshuffled by ``seed``; a warning per
    source that wraps early) and the held-out one (each source in order)."""
    names = source_names([path for path, _ in entries])
    weights = integer_weights([w for _, w in entries], names)
    mixed = Mixed(train, weights, names, seed)
    mixed.warn_wraps()
    return mixed, Mixed(held_out, weights, names, None)


def tokens_by_source(data: Any, examples: int, tokens_per_example: int) -> dict[str, int]:
    """``{"tokens/<name>": tokens}`` read from each source in the first ``examples``
    training examples of a mixture (empty for any other data)."""
    source = getattr(data, "train", None)
    if not isinstance(source, Mixed):
        return {}
    counts = source.schedule.counts(examples)
    return {f"tokens/{name}": int(c) * tokens_per_example for name, c in zip(source.names, counts)}


#: The type of ``data.mixture``: read by :func:`parse_mixture`.
Setting = Annotated[Entries | None, BeforeValidator(parse_mixture)]
