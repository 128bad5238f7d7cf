"""Config loading: defaults, YAML layering, overrides, validation and the shipped configs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from jaxpar.config import Config, RulesConfig, load_config, to_dict
from jaxpar.config_reference import choices

CHOICES = choices()  # every key with a Literal type, read from the declarations
REPO = Path(__file__).resolve().parent.parent
CONFIG_FILES = sorted(p.resolve() for p in REPO.glob("configs/**/*.yaml"))


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------- layering


def test_defaults():
    assert load_config([]) == Config()
    assert load_config() == Config()
    assert load_config([], []) == Config()


def test_yaml_layering_later_file_wins(tmp_path):
    first = _write(
        tmp_path / "a.yaml",
        {
            "train": {"steps": 7, "batch_size": 4},
            "model": {"d_model": 48},
            "rules": {"mlp": "tensor", "batch": "data"},
        },
    )
    second = _write(
        tmp_path / "b.yaml",
        {
            "train": {"steps": 11},
            "optim": {"lr": 0.5},
            "rules": {"batch": ["data", "fsdp"], "preset": "fsdp"},
        },
    )
    cfg = load_config([first, second])
    assert cfg.train.steps == 11  # the later file wins
    assert cfg.train.batch_size == 4  # keys only in the earlier file survive
    assert cfg.model.d_model == 48
    assert cfg.optim.lr == 0.5
    assert cfg.rules.preset == "fsdp"
    assert dict(cfg.rules.overrides) == {"mlp": ("tensor",), "batch": ("data", "fsdp")}
    # untouched keys keep their defaults
    assert cfg.model.n_heads == Config().model.n_heads
    # a later file that changes the layout names the run dir (runs/gpt_tiny-b)
    assert cfg.run == dataclasses.replace(Config().run, dir=Config().run.dir + "-b")
    # order matters
    assert load_config([second, first]).train.steps == 7
    assert dict(load_config([second, first]).rules.overrides)["batch"] == ("data",)


def test_overrides_win_over_files(tmp_path):
    path = _write(
        tmp_path / "a.yaml",
        {"train": {"steps": 7}, "mesh": {"fsdp": 2}, "rules": {"mlp": "tensor"}},
    )
    cfg = load_config([path], ["train.steps=3", "rules.mlp=null"])
    assert cfg.train.steps == 3
    assert cfg.mesh.fsdp == 2
    assert dict(cfg.rules.overrides) == {"mlp": ()}
    # later overrides win over earlier ones
    assert load_config([path], ["train.steps=3", "train.steps=5"]).train.steps == 5


def test_config_is_frozen():
    cfg = load_config([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3


def test_to_dict_round_trip(tmp_path):
    cfg = load_config(
        [],
        [
            "train.steps=17",
            "optim.lr=2.5e-4",
            "optim.eps=1e-7",
            "model.tie_embeddings=true",
            "model.remat=save_dots",
            "mesh.fsdp=2",
            "data.path=some/file.txt",
            "run.dir=/tmp/x y",
            "rules.preset=fsdp",
            "rules.batch=data,fsdp",
            "rules.mlp=tensor",
            "rules.kv=null",
        ],
    )
    assert cfg != Config()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    again = load_config([path])
    assert again == cfg
    assert dict(again.rules.overrides) == {"batch": ("data", "fsdp"), "mlp": ("tensor",), "kv": ()}
    # the default config round-trips too
    path.write_text(yaml.safe_dump(to_dict(Config())))
    assert load_config([path]) == Config()


def test_to_dict_is_plain_yaml():
    out = to_dict(load_config([], ["rules.batch=data,fsdp", "rules.kv=none"]))
    assert set(out) == {f.name for f in dataclasses.fields(Config)}
    assert out["rules"] == {"preset": "auto", "batch": ["data", "fsdp"], "kv": None}
    yaml.safe_dump(out)  # only plain types: safe_dump refuses tuples of tuples etc.


# ---------------------------------------------------------------- unknown keys


def test_unknown_key_suggests_closest():
    with pytest.raises(ValueError) as err:
        load_config([], ["model.n_head=3"])
    msg = str(err.value)
    assert "model.n_head" in msg
    assert "did you mean 'model.n_heads'" in msg


def test_unknown_key_in_yaml_file(tmp_path):
    path = _write(tmp_path / "a.yaml", {"train": {"setps": 3}})
    with pytest.raises(ValueError, match=r"train\.setps.*did you mean 'train\.steps'"):
        load_config([path])


def test_unknown_section_suggests_closest():
    with pytest.raises(ValueError) as err:
        load_config([], ["optimizer.lr=1"])
    msg = str(err.value)
    assert "optimizer" in msg
    assert "did you mean 'optim'" in msg


@pytest.mark.parametrize(
    "override,key", [("eval.every=5", "train.eval_every"), ("eval.batches=2", "train.eval_batches")]
)
def test_a_section_that_is_another_sections_key_names_that_key(override, key):
    """``eval.every`` (no ``eval`` section) points at ``train.eval_every``, not at the
    closest section's name (it said ``model``)."""
    with pytest.raises(ValueError) as err:
        load_config([], [override])
    assert str(err.value).startswith(f"unknown config section 'eval': did you mean '{key}'?")


def test_section_must_be_mapping(tmp_path):
    path = _write(tmp_path / "a.yaml", {"train": 3})
    with pytest.raises(ValueError, match="train"):
        load_config([path])
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config([path])


# ---------------------------------------------------------------- types


@pytest.mark.parametrize(
    "override, key, typ",
    [
        ("train.steps=abc", "train.steps", "int"),
        ("train.steps=1.5", "train.steps", "int"),
        ("train.steps=true", "train.steps", "int"),
        ("model.tie_embeddings=3", "model.tie_embeddings", "bool"),
        ("optim.lr=fast", "optim.lr", "float"),
        ("optim.lr=true", "optim.lr", "float"),
    ],
)
def test_wrong_type_names_key_and_type(override, key, typ):
    with pytest.raises(ValueError) as err:
        load_config([], [override])
    msg = str(err.value)
    assert key in msg
    assert typ in msg


def test_float_parsing():
    cfg = load_config([], ["optim.lr=1e-3"])  # YAML 1.1 reads '1e-3' as a string
    assert isinstance(cfg.optim.lr, float)
    assert cfg.optim.lr == pytest.approx(0.001)
    cfg = load_config([], ["optim.lr=2", "optim.weight_decay=0"])  # ints are fine for floats
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 2.0
    assert isinstance(cfg.optim.weight_decay, float) and cfg.optim.weight_decay == 0.0
    assert load_config([], ["optim.eps=1.0e-6"]).optim.eps == pytest.approx(1e-6)


def test_float_parsing_in_yaml_file(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("optim:\n  lr: 3e-4\n  clip_norm: 1\n")
    cfg = load_config([path])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.clip_norm == 1.0 and isinstance(cfg.optim.clip_norm, float)


def test_bools_and_ints():
    cfg = load_config([], ["model.tie_embeddings=true", "train.progress=false", "train.steps=12"])
    assert cfg.model.tie_embeddings is True
    assert cfg.train.progress is False
    assert cfg.train.steps == 12 and isinstance(cfg.train.steps, int)


# ---------------------------------------------------------------- choices


def test_bad_choice_lists_choices():
    with pytest.raises(ValueError) as err:
        load_config([], ["model.remat=sometimes"])
    msg = str(err.value)
    assert "model.remat" in msg and "sometimes" in msg
    for choice in ("none", "full", "save_dots"):
        assert choice in msg


def _model_choices():
    """Every model family's keys with choices, declared once in its config class."""
    from jaxpar.models import families

    return [
        (name, key.split(".")[1], values)
        for name in sorted(families())
        for key, values in choices(name).items()
    ]


@pytest.mark.parametrize(
    "family,key,choices", _model_choices(), ids=lambda x: x if isinstance(x, str) else None
)
def test_every_model_choice_is_accepted(family, key, choices):
    for choice in choices:
        cfg = load_config([], [f"model.name={family}", f"model.{key}={choice}"])
        assert getattr(cfg.model, key) == choice
    wrong = 999 if isinstance(choices[0], int) else "not_a_choice"
    with pytest.raises(ValueError, match=rf"model\.{key}' must be one of"):
        load_config([], [f"model.name={family}", f"model.{key}={wrong}"])


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_choice_is_accepted(key):
    for choice in CHOICES[key]:
        cfg = load_config([], [f"{key}={choice}"])
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == choice
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config([], [f"{key}=not_a_choice"])


# ---------------------------------------------------------------- rules


def _rules(*overrides: str) -> RulesConfig:
    return load_config([], list(overrides)).rules


def test_rules_parsing():
    assert dict(_rules("rules.batch=data,fsdp").overrides) == {"batch": ("data", "fsdp")}
    assert dict(_rules("rules.batch=data, fsdp").overrides) == {"batch": ("data", "fsdp")}
    assert dict(_rules("rules.batch=[data, fsdp]").overrides) == {"batch": ("data", "fsdp")}
    assert dict(_rules("rules.mlp=tensor").overrides) == {"mlp": ("tensor",)}
    assert dict(_rules("rules.mlp=null").overrides) == {"mlp": ()}
    assert dict(_rules("rules.mlp=none").overrides) == {"mlp": ()}
    assert dict(_rules("rules.mlp=").overrides) == {"mlp": ()}
    assert _rules("rules.preset=fsdp").preset == "fsdp"
    assert _rules("rules.preset=fsdp").overrides == ()
    assert _rules().preset == Config().rules.preset


def test_rules_accumulate_and_are_sorted():
    rules = _rules("rules.mlp=tensor", "rules.batch=data", "rules.mlp=fsdp")
    assert rules.overrides == (("batch", ("data",)), ("mlp", ("fsdp",)))


def test_rules_overrides_mapping_in_yaml(tmp_path):
    path = _write(tmp_path / "a.yaml", {"rules": {"overrides": {"mlp": "tensor", "kv": None}}})
    assert dict(load_config([path]).rules.overrides) == {"mlp": ("tensor",), "kv": ()}


@pytest.mark.parametrize("value", ["3", "[1, 2]", "{a: b}", "true"])
def test_bad_rule_value_names_rule(value):
    with pytest.raises(ValueError, match=r"rules\.mlp"):
        load_config([], [f"rules.mlp={value}"])


def test_bad_rule_preset_type(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rules:\n  preset: 3\n")
    with pytest.raises(ValueError, match=r"rules\.preset"):
        load_config([path])


def test_string_fields_keep_override_text_verbatim():
    """A string key is never re-typed by YAML: run.dir=2024 and data.path=on stay text."""
    cfg = load_config([], ["run.dir=2024", "data.path=on", "model.name=mlp"])
    assert (cfg.run.dir, cfg.data.path, cfg.model.name) == ("2024", "on", "mlp")


@pytest.mark.parametrize(
    "override,bound",
    [
        ("train.log_every=0", r"in \[1, "),
        ("train.grad_accum=0", r"in \[1, "),
        ("train.batch_size=0", r"in \[1, "),
        ("model.n_layers=0", "≥ 1"),
        ("run.devices=-1", r"in \[0, "),
        ("optim.lr=.inf", "finite"),
    ],
)
def test_out_of_range_values_name_the_key(override, bound):
    with pytest.raises(ValueError, match=f"'{override.split('=')[0]}' must be .*{bound}"):
        load_config([], [override])


def test_settings_without_effect_warn():
    from jaxpar.unused import unused_settings

    cfg = load_config([], ["model.name=convnet", "model.d_model=64", "optim.momentum=0.5"])
    assert unused_settings(cfg) == ["model.d_model", "optim.momentum"]
    assert unused_settings(load_config([])) == []
    import warnings

    from jaxpar.unused import warn_unused

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_unused(cfg)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "'model.d_model' has no effect with model.name=convnet" in messages[0]
    assert "'optim.momentum' has no effect" in messages[1]


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize("override", ["mesh.fsdp", "fsdp=8", "a.b.c=1", "=3", ".fsdp=2", "mesh.=2"])
def test_malformed_override(override):
    with pytest.raises(ValueError, match="section.key"):
        load_config([], [override])


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope" / "missing.yaml"
    with pytest.raises(ValueError) as err:
        load_config([missing])
    assert str(missing) in str(err.value)


def test_empty_yaml_file_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert load_config([path]) == Config()


# ---------------------------------------------------------------- the declarations


def _keys():
    """(section, key, section class, family name) of every declared key, each built-in
    model family's included."""
    import typing

    from jaxpar.models import families

    found = []
    for section, cls in typing.get_type_hints(Config).items():
        found += [
            (section, key, cls, "")
            for key in cls.__pydantic_fields__
            if (section, key) != ("rules", "overrides")
        ]
    for name, family in sorted(families().items()):
        if family.config.__module__.startswith("jaxpar.models."):
            found += [("model", key, family.config, name) for key in family.keys()]
    return found


def _outside(cls, key):
    """Values just outside a key's declared bounds (none when it declares none)."""
    from annotated_types import Ge, Gt, Le, Lt

    info = cls.__pydantic_fields__[key]
    step = 1 if info.annotation is int else 0.5
    limits = {Ge: lambda b: b - step, Gt: lambda b: b, Le: lambda b: b + step, Lt: lambda b: b}
    names = {Ge: "ge", Gt: "gt", Le: "le", Lt: "lt"}
    return [limits[type(m)](getattr(m, names[type(m)])) for m in info.metadata if type(m) in limits]


def _load_one(tmp_path, section, key, family, value):
    body = {key: value, **({"name": family} if family else {})}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: body}))
    return load_config([path])


@pytest.mark.parametrize(
    "section,key,cls,family", _keys(), ids=lambda x: x if isinstance(x, str) else None
)
def test_every_bad_value_is_one_line_naming_the_key(section, key, cls, family, tmp_path):
    """A value of the wrong type, outside a key's choices or beyond its bounds is one
    ConfigError line naming the key."""
    from jaxpar.errors import ConfigError

    wrong = [[{"a": 1}]] + _outside(cls, key)  # no key takes a list of mappings
    if f"{section}.{key}" in (choices(family) if family else CHOICES):
        wrong.append("not_a_choice")
    for value in wrong:
        with pytest.raises(ConfigError) as err:
            _load_one(tmp_path, section, key, family, value)
        message = str(err.value)
        assert "\n" not in message and f"{section}.{key}" in message, (value, message)


@pytest.mark.parametrize(
    "section", [f.name for f in dataclasses.fields(Config) if f.name not in ("rules", "model")]
)
def test_a_misspelt_key_of_every_section_names_the_closest(section):
    key = dataclasses.fields(getattr(Config(), section))[0].name
    with pytest.raises(
        ValueError,
        match=rf"unknown config key '{section}\.{key}x': did you "
        rf"mean '{section}\.{key}'\? valid keys: ",
    ):
        load_config([], [f"{section}.{key}x=1"])


def test_a_section_built_in_python_is_validated():
    """Not only the loader: a section built in Python, or replaced, is checked the same way,
    and stays frozen."""
    from jaxpar.errors import ConfigError
    from jaxpar.optim import OptimConfig

    with pytest.raises(ConfigError, match=r"^config key 'optim\.lr' must be > 0, got -1"):
        OptimConfig(lr=-1)
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'optim\.rl': did you mean "
        r"'optim\.lr'\?",
    ):
        OptimConfig(rl=1)
    cfg = OptimConfig(lr=1)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    with pytest.raises(ConfigError, match=r"'optim\.b1' must be in \[0, 1\), got 1"):
        dataclasses.replace(cfg, b1=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 2.0
    assert dataclasses.asdict(cfg)["lr"] == 1.0


def test_yaml_keys_given_twice_and_tags_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(
        ValueError,
        match=r"line 3, column 3: key 'steps' appears twice in one "
        r"mapping \(lines 2 and 3\)",
    ):
        load_config([path])
    path.write_text("train:\n  steps: !!python/int 3\n")
    with pytest.raises(ValueError, match=r"unknown YAML tag .*: jaxpar configs are plain YAML"):
        load_config([path])


def test_a_key_of_another_family_is_kept_for_a_later_model_name(tmp_path):
    """model.depth is the ResNet's: with the default GPT it only warns (no effect), and a
    later model.name=resnet takes it."""
    path = _write(tmp_path / "a.yaml", {"model": {"depth": 18}})
    from jaxpar.unused import unused_settings

    assert unused_settings(load_config([path])) == ["model.depth"]
    assert load_config([path], ["model.name=resnet"]).model.depth == 18


def test_the_config_reference_is_current(capsys):
    """docs/config.md is `jaxpar train --help-config`: regenerate it when a key changes."""
    from jaxpar.cli import main

    assert main(["train", "--help-config"]) == 0
    assert (REPO / "docs" / "config.md").read_text() == capsys.readouterr().out, (
        "docs/config.md is stale: run `jaxpar train --help-config > docs/config.md`"
    )


# ---------------------------------------------------------------- shipped configs


def _header(path: Path) -> list[str]:
    """The leading comment lines of a file."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def _header_files(path: Path) -> list[Path]:
    """The YAML files named by the command on a config's first line, in order."""
    words = path.read_text().splitlines()[0].lstrip("#").split()
    return [
        (REPO / w).resolve() if not Path(w).is_absolute() else Path(w)
        for w in words
        if w.endswith(".yaml")
    ]


def test_configs_exist():
    assert CONFIG_FILES, f"no YAML config files under {REPO / 'configs'} (glob configs/**/*.yaml)"


# When configs/ is empty the parameter list holds one sentinel, so the test fails
# instead of being skipped silently.
_PARAMS = [pytest.param(p, id=str(p.relative_to(REPO))) for p in CONFIG_FILES] or [
    pytest.param(None, id="no-config-files")
]


@pytest.mark.parametrize("path", _PARAMS)
def test_config_file_header(path):
    assert path is not None, f"no YAML config files under {REPO / 'configs'}"
    lines = path.read_text().splitlines()
    assert lines and lines[0].startswith("#"), (
        f"{path} must start with a '#' comment giving the command"
    )
    assert "jaxpar" in "\n".join(_header(path)), (
        f"{path}: the leading comment must show the jaxpar command"
    )
    files = _header_files(path)
    assert path in files, f"{path}: the command in its first line should name the file itself"
    for file in files:
        assert file.is_file(), f"{path}: its command names {file}, which does not exist"
    load_config(files)


@pytest.mark.parametrize("path", _PARAMS)
def test_config_file_loads_and_builds(path, monkeypatch):
    assert path is not None, f"no YAML config files under {REPO / 'configs'}"
    monkeypatch.chdir(REPO)  # relative data paths in configs are relative to the repo root
    cfg = load_config([path])
    assert isinstance(cfg, Config)
    raw = yaml.safe_load(path.read_text()) or {}
    assert isinstance(raw, dict) and raw, f"{path} holds no settings"
    from jaxpar.loop import (
        build,  # abstract: builds even the GPU-sized configs on the CPU
    )

    run = build(load_config([path], ["run.devices=8"]))
    assert len(run.devices) == 8
    assert run.config.model == cfg.model
    # the command in the header (e.g. a layout on top of gpt_tiny.yaml) builds too
    files = _header_files(path)
    if files != [path]:
        build(load_config(files, ["run.devices=8"]))


def test_default_config_is_gpt_tiny():
    """`jaxpar train` with no CONFIG runs exactly configs/gpt_tiny.yaml."""
    root = Path(__file__).resolve().parent.parent
    assert load_config([root / "configs" / "gpt_tiny.yaml"]) == load_config([])


# "step-1 loss 5.5675 (JAX 0.12: 5.5559)": JAX 0.12 draws other initial weights from the
# same seed than 0.10, so a config states both when they differ
_STEP_ONE = re.compile(r"step-1 loss (\d+\.\d+)(?: \(JAX 0\.12: (\d+\.\d+)\))?")


def _stated_loss(match: re.Match) -> str:
    import jax

    newer = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 12)
    return match.group(2) if newer and match.group(2) else match.group(1)


def stated_step_one_loss(path: Path) -> str | None:
    """The step-1 loss ``path``'s leading comment states for this JAX (None: it states none)."""
    m = _STEP_ONE.search(" ".join(_header(path)))
    return _stated_loss(m) if m else None


# The step-1 check is one mechanism (build the config, one step, compare with its comment),
# so the suite checks it on the configs that compile in about a second (convnet, digits,
# mlp) and on the default gpt_tiny (the README's first number). The configs whose one step
# takes 5-11 s (the other transformer families, resnet_digits and the layouts over
# gpt_tiny) are `exhaustive`; a config added later lands in the suite.
_STEP_ONE_EXTENDED = {
    "configs/llama_tiny.yaml",
    "configs/qwen3_tiny.yaml",
    "configs/gemma_tiny.yaml",
    "configs/bert_tiny.yaml",
    "configs/resnet_digits.yaml",
    "configs/layouts/fp8.yaml",
    "configs/layouts/offload.yaml",
}
_STATED = [
    pytest.param(
        p,
        loss,
        id=name,
        marks=[pytest.mark.exhaustive] if name in _STEP_ONE_EXTENDED else [],
    )
    for p in CONFIG_FILES
    if (loss := stated_step_one_loss(p)) and (name := str(p.relative_to(REPO)))
]


def test_cpu_configs_state_their_step_one_loss():
    """Every config meant for this machine says what its first step logs."""
    stated = {str(p.values[0].relative_to(REPO)) for p in _STATED}
    for name in (
        "gpt_tiny",
        "llama_tiny",
        "bert_tiny",
        "resnet_digits",
        "convnet",
        "mlp",
        "digits",
    ):
        assert f"configs/{name}.yaml" in stated, f"configs/{name}.yaml states no step-1 loss"


@pytest.mark.parametrize("path,loss", _STATED)
def test_config_step_one_loss_is_what_it_says(path, loss, monkeypatch):
    """One step of the config (its own layout, batch and data): the loss its comment
    states, to the digits it states. Update the comment when a change moves it."""
    pytest.importorskip("sklearn")  # the digits configs
    monkeypatch.chdir(REPO)
    from jaxpar.run import build

    run = build(load_config(_header_files(path), ["train.steps=1"]))
    state = run.trainer.init()
    batch = run.trainer.shard_batch(run.data.batch(0, run.config.train.batch_size))
    _, metrics = run.trainer.step(state, batch)
    digits = len(loss.split(".")[1])
    assert f"{float(metrics['loss']):.{digits}f}" == loss, path


@pytest.mark.parametrize(
    "files,overrides,run_dir",
    [
        ([], [], "runs/gpt_tiny"),
        ([], ["optim.lr=0.1", "mesh.data=-1"], "runs/gpt_tiny"),  # the config's own layout
        ([], ["mesh.fsdp=8"], "runs/gpt_tiny-fsdp8"),
        ([], ["mesh.data=4", "mesh.tensor=2"], "runs/gpt_tiny-data4-tensor2"),
        (["configs/gpt_tiny.yaml", "configs/layouts/tp.yaml"], [], "runs/gpt_tiny-tp"),
        # a layout file alone (it shared the default run's directory, and resumed that run)
        (["configs/layouts/pipeline.yaml"], [], "runs/gpt_tiny-pipeline"),
        (["configs/layouts/tp.yaml", "configs/gpt_tiny.yaml"], [], "runs/gpt_tiny"),  # its own
        (
            [],
            ["mesh.stage=4", "pipeline.schedule=zb_h1", "pipeline.microbatches=8"],
            "runs/gpt_tiny-stage4-zb_h1-m8",
        ),
        (
            ["configs/resnet_digits.yaml"],
            ["mesh.data=2", "mesh.tensor=4"],
            "runs/resnet_digits-data2-tensor4",
        ),
        ([], ["mesh.fsdp=8", "run.dir=mine"], "mine"),  # given: kept
        # an override that leaves its key's value as it was names nothing
        (
            ["configs/bert_tiny.yaml"],
            ["mesh.context=4", "mesh.data=-1", "mesh.fsdp=1"],
            "runs/bert_tiny-context4",
        ),
    ],
)
def test_each_layout_gets_a_run_dir_of_its_own(files, overrides, run_dir, monkeypatch):
    """Layouts tried one after another (README's Quickstart) never resume each other's run."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert load_config(files, overrides).run.dir == run_dir


def test_a_users_task_names_its_run_dir_with_the_layout():
    from jaxpar.config import run_dir_for

    assert run_dir_for(load_config([], ["mesh.fsdp=8"]), "TASK").run.dir == "runs/TASK-fsdp8"
    assert run_dir_for(load_config([], []), "TASK").run.dir == "runs/TASK"
    assert run_dir_for(load_config([], ["run.dir=x"]), "TASK").run.dir == "x"


# ---------------------------------------------------------------- bounds (issue 34, item 7)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _alias_bomb(levels: int) -> list[str]:
    """Anchors whose aliases multiply: level ``i`` stands for 9**(i+1) strings."""
    names = "abcdefghij"
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"{names[i]}: &{names[i]} [{', '.join([f'*{names[i - 1]}'] * 9)}]")
    return lines


@pytest.mark.parametrize(
    "override,bound",
    [
        ("train.steps=99999999999999999999999999999", "in [1, 1_000_000_000_000]"),
        ("train.batch_size=4294967296", "in [1, 2_147_483_648]"),
        ("train.eval_every=10000000000000", "in [0, 1_000_000_000_000]"),
        ("mesh.fsdp=2097152", "≤ 1_048_576"),
        ("data.seq_len=100000000", "in [1, 16_777_216]"),
        ("run.devices=99999999999999999999", "in [0, 1_048_576]"),
    ],
)
def test_integer_keys_are_bounded_where_a_huge_value_is_meaningless(override, bound):
    from jaxpar.errors import ConfigError

    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config([], [override])
    assert str(err.value) == (f"config key '{key}' must be {bound}, got {override.split('=')[1]}")


def test_yaml_nested_5000_deep_is_one_line_naming_the_file_and_line(tmp_path):
    from jaxpar.errors import ConfigError

    path = tmp_path / "deep.yaml"
    path.write_text(f"train:\n  hooks: {_nested(5000)}\n")
    with pytest.raises(ConfigError) as err:
        load_config([path])
    # the document, train's mapping and 62 lists are 64 levels: the 63rd list is refused
    assert str(err.value) == (
        f"config file '{path}', line 2, column 72: values nested deeper "
        "than 64 levels; a config needs a few"
    )
    with pytest.raises(
        ConfigError,
        match=r"^override 'train\.hooks=\[\[\[.*….*\]\]\]', line 1, "
        r"column 65: values nested deeper than 64 levels",
    ):
        load_config([], [f"train.hooks={_nested(5000)}"])
    path.write_text(f"train:\n  hooks: {_nested(62)}\n")  # 64 levels: read, then checked
    with pytest.raises(ConfigError, match="'train.hooks' expects a list of strings"):
        load_config([path])


def test_alias_bombs_and_recursive_aliases_are_refused_at_once(tmp_path):
    """The issue's 330-byte bomb (9 levels: 387 million strings) in train.hooks, in a file
    and as an override, is refused while it is read: in well under a second, in one short
    line. Anchors and merges that stay small keep working."""
    import time

    from jaxpar.errors import ConfigError

    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join([*_alias_bomb(9), "train:", "  hooks: *i"]) + "\n")
    assert len(path.read_bytes()) < 400
    flow = ", ".join(line.split(": ", 1)[1] for line in _alias_bomb(6))  # &a [...], &b [...]
    for files, overrides in (([path], []), ([], [f"train.hooks=[{flow}, *f]"])):
        start = time.perf_counter()
        with pytest.raises(ConfigError) as err:
            load_config(files, overrides)
        assert time.perf_counter() - start < 1.0
        message = str(err.value)
        assert "more than 100,000 values with its aliases expanded" in message, message
        assert len(message) < 600 and "\n" not in message
    with pytest.raises(ConfigError, match=r"alias \*a is inside its own anchor &a"):
        load_config([], ["train.hooks=&a [*a]"])
    merged = tmp_path / "merge.yaml"
    merged.write_text("base: &b {steps: 3, batch_size: 8}\n")
    with pytest.raises(ConfigError, match="unknown config section 'base'"):  # read, then checked
        load_config([merged])
    small = tmp_path / "small.yaml"
    small.write_text("train: &t {steps: 3, batch_size: 8}\ncheckpoint: {every_steps: 2}\n")
    assert load_config([small]).train.steps == 3


def test_a_config_file_over_1_mib_and_a_huge_integer_are_one_line(tmp_path):
    from jaxpar.errors import ConfigError

    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 120_000)
    with pytest.raises(
        ConfigError,
        match=rf"^config file '{re.escape(str(big))}' is larger "
        r"than 1,048,576 bytes \(1 MiB\)",
    ):
        load_config([big])
    digits = tmp_path / "digits.yaml"
    digits.write_text(f"train:\n  steps: {'9' * 5000}\n")
    with pytest.raises(ConfigError, match=r"line 2, column 10: an integer of 5,000 digits"):
        load_config([digits])


def test_a_run_dir_too_long_for_the_file_system_is_refused_on_load(tmp_path):
    from jaxpar.errors import ConfigError

    one_name = tmp_path / ("a" * 3990)
    with pytest.raises(ConfigError) as err:
        load_config([], [f"run.dir={one_name}"])
    message = str(err.value)
    assert message.startswith("File name too long: run.dir '") and "…" in message
    assert message.endswith(
        f"({len(str(one_name)):,} characters; a path component may have "
        "at most 255): choose a shorter run.dir"
    )
    deep = tmp_path.joinpath(*["b" * 200] * 19)
    with pytest.raises(
        ConfigError,
        match=r"characters as an absolute path, with the files "
        r"jaxpar writes inside it; a path may have at most",
    ):
        load_config([], [f"run.dir={deep}"])


def test_the_model_name_help_names_every_built_in_family():
    """``model.name``'s description (in --help-config and docs/config.md) lists every
    built-in family: it once left out llama."""
    import re

    from jaxpar.models import families
    from jaxpar.models.family import ModelConfig

    text = ModelConfig.__dataclass_fields__["name"].metadata["description"]
    builtin = [
        name
        for name, family in families().items()
        if family.config.__module__.startswith("jaxpar.models.")
    ]
    assert builtin and not [n for n in builtin if not re.search(rf"\b{n}\b", text)], text


def test_a_section_takes_its_keys_by_keyword_only():
    """A key added to or moved in a section never shifts what a positional value means."""
    from jaxpar.mesh import MeshConfig

    assert MeshConfig(data=2).data == 2
    with pytest.raises(TypeError, match="MeshConfig takes its keys by keyword only"):
        MeshConfig(2)


def test_a_changed_setting_is_shown_as_written():
    """The resume notice's ``old → new``: a fraction key's whole float as its integer (it
    said ``optim.warmup_steps: 20 → 0.0``), a fraction as it is."""
    from jaxpar.rundir import config_differences

    old = {"optim": {"warmup_steps": 20, "lr": 0.001}, "run": {"dir": "a"}}
    new = {"optim": {"warmup_steps": 0.0, "lr": 0.002}, "run": {"dir": "b"}}
    assert config_differences(old, new) == [
        "optim.lr: 0.001 → 0.002",
        "optim.warmup_steps: 20 → 0",
    ]


def test_a_key_the_family_never_reads_is_unused():
    """``context.balance`` reorders a causal model's sequences: BERT (bidirectional) never
    reads it, and says so where GPT does not."""
    from jaxpar.unused import unused_settings

    over = ["mesh.context=4", "context.balance=false"]
    assert "context.balance" in unused_settings(
        load_config([REPO / "configs/bert_tiny.yaml"], over)
    )
    assert "context.balance" not in unused_settings(load_config([], over))
    # each with its own reason: the family's, or (any family) mesh.context=1
    from jaxpar.unused import warn_unused

    for files, overrides, reason in (
        ([REPO / "configs/bert_tiny.yaml"], over, "model.name=bert"),
        ([], ["context.balance=false"], "mesh.context=1"),
    ):
        with pytest.warns(UserWarning) as caught:
            warn_unused(load_config(files, overrides))
        said = [str(w.message) for w in caught if "'context.balance'" in str(w.message)]
        assert said == [f"config key 'context.balance' has no effect with {reason}"]
