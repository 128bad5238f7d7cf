"""``jaxpar export``: a run's checkpoint written out as an ``.npz`` of its parameters or as
a Hugging Face folder (:mod:`jaxpar.hf`), with the run's tokenizer beside it; nothing is
overwritten unless asked, nothing written inside the run directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar import config as config_lib
from jaxpar import hf
from jaxpar import sharding as shd
from jaxpar.config import Config
from jaxpar.data.sources import text_path
from jaxpar.data.token_file import open_tokens, tokenizer_of
from jaxpar.data.tokenizers import HFTokenizer
from jaxpar.errors import ConfigError, PathError
from jaxpar.files import check_output_file, ensure_dir, with_path
from jaxpar.optim import schedule_unread
from jaxpar.outputs import check_new_file, check_new_folder
from jaxpar.resume import restore_state
from jaxpar.run import build, host_value


def export_params(
    config: Config,
    out: str | Path,
    step: int | None = None,
    task: Any = None,
    format: str = "npz",
    overwrite: bool = False,
) -> tuple[Path, int]:
    """Writes the parameters of a checkpoint of ``config``'s run (of ``task``, a user's
    task, when given).

    ``format``: ``npz``, one ``.npz`` file whose keys are parameter paths
    (``'blocks/w_in'``) and values whole numpy arrays; or ``hf``, a directory of
    ``config.json`` + safetensors in the family's Hugging Face layout (:mod:`jaxpar.hf`),
    with the run's tokenizer beside them when it has one (:func:`run_tokenizer`).

    Nothing is overwritten unless ``overwrite`` (``--overwrite``): an existing ``.npz``
    file or a non-empty directory is refused; with it, the file, or the directory's model
    files (:func:`jaxpar.hf.files.model_files`), are replaced. Nothing is ever written
    inside the run directory, whose files the run owns.

    Raises:
      RestoreError, ConfigError: when the run has no such checkpoint or it does not fit
        the model, or its model cannot be written in the format.
      PathError: an ``out`` inside the run directory, or one that exists without
        ``overwrite``.
    """
    if format not in ("npz", "hf"):
        raise ConfigError(f"--format must be npz or hf, got {format!r}")
    check_export_target(Path(out), Path(config.run.dir), format, overwrite)
    tokenizer = None
    if format == "hf":
        family = "" if task is not None else config.family.name
        hf.check_exportable(family, None if task is not None else config.model)
        tokenizer = run_tokenizer(config)  # a missing or changed file fails before writing
        out = ensure_dir(out, "--out", "choose another --out directory")
    else:
        out = check_output_file(out, "--out")
    config = _without_init_from(config) if task is None else config
    with schedule_unread():
        run = build(config, task, fit_memory=True)
    state = restore_state(run, step, "jaxpar export")
    params = jax.tree.map(host_value, state.params)
    if jax.process_index() == 0:
        if format == "hf":
            earlier = hf.files.model_file_ids(out)  # none, or --overwrite: replaced
            hf.write(out, params, config.model)
            if tokenizer is not None:
                hf.files.write_tokenizer(out, *tokenizer)
            hf.files.remove_stale(earlier)  # only once the new model is whole
        else:
            _write_npz(
                out,
                {
                    shd.path_str(path): leaf
                    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                },
            )
    return out, int(host_value(state.step))


def check_export_target(out: Path, run_dir: Path, format: str, overwrite: bool) -> None:
    """Raises a one-line PathError when ``out`` lies inside the run directory, is another
    run's own file or lies in a running run's directory, or exists (a file, or a folder
    holding files) and ``overwrite`` is not set (:mod:`jaxpar.outputs`)."""
    inside = out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents
    if inside:
        raise PathError(
            f"--out '{out}' lies inside the run directory '{run_dir}', whose "
            "files the run owns; write the export elsewhere"
        )
    if format == "hf":
        check_new_folder(
            out, "--out", "model files (config.json, safetensors, tokenizer)", overwrite
        )
    else:
        check_new_file(out, "--out", overwrite)


def run_tokenizer(config: Config) -> tuple[Path, dict[str, str], dict[str, int]] | None:
    """The ``tokenizers`` JSON file a run's token file was made with, its special tokens
    as transformers names them (``{"bos_token": …, "eos_token": …}``, those the token
    file's metadata names) and their ids (``{"bos_token_id": …, "eos_token_id": …}``);
    None for a run without one (bytes, random ids, images).

    Raises:
      DataError: the tokenizer file is missing or changed since the token file was made.
    """
    data, path = config.data, text_path(config.data)  # a mixture's: its first source's
    if data.dataset != "auto" or not path or not Path(f"{path}.json").is_file():
        return None
    token_file = open_tokens(path)
    tokenizer = tokenizer_of(token_file)
    if not isinstance(tokenizer, HFTokenizer):
        return None
    entries = {
        which: entry
        for which in ("bos", "eos")
        if isinstance(entry := token_file.meta.get(which), dict) and entry.get("token")
    }
    special = {f"{which}_token": entry["token"] for which, entry in entries.items()}
    ids = {f"{which}_token_id": int(entry["id"]) for which, entry in entries.items()}
    return Path(tokenizer.file), special, ids


def _without_init_from(config: Config) -> Config:
    """The weights a run started from play no part in exporting its checkpoint: its
    ``model.init_from`` directory need not be there any more."""
    if "init_from" not in config.family.keys() or not config.model.init_from:
        return config
    return config_lib.apply_overrides(config, ["model.init_from="])


def _write_npz(out: Path, flat: dict[str, np.ndarray]) -> None:
    tmp = out.with_name(out.name + ".tmp.npz")
    try:
        np.savez(tmp, **flat)
        os.replace(tmp, out)
    except OSError as err:
        if err.filename:
            raise
        raise with_path(err, out) from err  # a full disk's error names no file
    finally:
        tmp.unlink(missing_ok=True)
