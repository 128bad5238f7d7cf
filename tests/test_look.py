"""Look before you train (issue 41, items 3 and 4): ``jaxpar sample FOLDER`` gives
transformers' greedy tokens; ``jaxpar eval`` of a folder and of a run dir gives the training
step's loss on the same batch, on one device and on ``data=2, fsdp=2, tensor=2``; an export
carries the run's tokenizer, which ``AutoTokenizer`` loads beside ``AutoModelForCausalLM``.
Nothing is written to the folder or the run dir.

The folder is a tiny Qwen3 saved by transformers (every weight perturbed) with a byte-level
BPE ``tokenizer.json`` built with ``tokenizers``. Needs torch and transformers (``pip install
-e ".[test,reference]"``); skipped without them."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from jaxpar import sample as sampling
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.data.prepare import prepare_data
from jaxpar.errors import ConfigError
from jaxpar.evaluation import evaluate_model
from jaxpar.loop import train
from jaxpar.resume import restore_state
from jaxpar.run import build
from jaxpar.sample import sample
from jaxpar.weights import load_run_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ONE = ["run.devices=1", "mesh.data=1"]
SPREAD = ["run.devices=8", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
DATA = ["data.seq_len=16", "train.batch_size=8"]
TEXT = " ".join(
    [
        "the quick brown fox jumps over the lazy dog;",
        "a stitch in time saves nine, they say.",
        "hello world, the end.",
    ]
    * 60
)
PROMPT = "the quick brown"


def _tokenizer(bos: bool = False):
    """A byte-level BPE of 300 ids (with ``bos``: its post-processor adds ``<s>``, as
    Llama's does)."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    if bos:
        tok.add_special_tokens(["<s>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


def _save_model(folder) -> None:
    """A tiny Qwen3 (vocab 320 > the tokenizer's 300) with every weight perturbed."""
    config = transformers.Qwen3Config(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)


def _files(path) -> dict[str, tuple[int, int]]:
    """Every file below ``path`` with its size and modification time."""
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """``folder`` (model + tokenizer), ``bos`` (the same with a BOS-adding tokenizer),
    ``bare`` (model only), ``tokens`` (a token file made with the folder's tokenizer) and
    ``text``."""
    root = tmp_path_factory.mktemp("look")
    _save_model(root / "bare")
    for name, bos in (("folder", False), ("bos", True)):
        shutil.copytree(root / "bare", root / name)
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=_tokenizer(bos),
            eos_token="<|endoftext|>",
            bos_token="<s>" if bos else None,
        ).save_pretrained(root / name)
    (root / "text.txt").write_text(TEXT)
    prepare_data(
        [str(root / "text.txt")], str(root / "text.tokens"), str(root / "folder" / "tokenizer.json")
    )
    return root


@pytest.fixture(scope="module")
def run_dir(root):
    """One step of fine-tuning the folder on the token file, on one device."""
    path = root / "run"
    train(
        load_config(
            [],
            [
                f"model.init_from={root / 'folder'}",
                *DATA,
                *ONE,
                f"data.path={root / 'text.tokens'}",
                "train.steps=1",
                "optim.warmup_steps=0",
                "train.eval_every=0",
                "train.progress=false",
                "checkpoint.async_save=false",
                f"run.dir={path}",
            ],
        ),
        echo=False,
    )
    return path


def _hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---- sample FOLDER ------------------------------------------------------------------------
# the suite: the folder whose tokenizer adds <s> (a post-processor, as Llama's): its
# prompt ids, 20 greedy tokens and text against transformers', the same decoding of the
# same model the plain folder runs; the plain folder's greedy tokens against transformers'
# generate (up to an end-of-text) stay in the suite in
# test_a_folder_stops_at_its_generation_configs_end_of_text_as_transformers: `exhaustive`
@pytest.mark.parametrize(
    "name", [pytest.param("folder", marks=pytest.mark.exhaustive), pytest.param("bos")]
)
def test_greedy_tokens_of_a_folder_are_transformers_greedy_decoding(root, name):
    folder = root / name
    before = _files(folder)
    out = sample(folder, PROMPT, tokens=20, temperature=0, overrides=ONE)
    ids = transformers.AutoTokenizer.from_pretrained(folder)(PROMPT).input_ids
    np.testing.assert_array_equal(out.prompt_tokens, ids)
    assert (ids[0] == 300) == (name == "bos")  # the post-processor's <s>, as transformers
    model = _hf_model(folder)
    model.generation_config.eos_token_id = None  # the folder names none: all 20 drawn
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=20, pad_token_id=0
        )[0, len(ids) :].numpy()
    np.testing.assert_array_equal(out.tokens[0], expected)
    assert out.step is None and out.texts[0] == tokenizers.Tokenizer.from_file(
        str(folder / "tokenizer.json")
    ).decode(expected.tolist(), skip_special_tokens=False)
    assert _files(folder) == before


def test_a_folder_stops_at_its_generation_configs_end_of_text_as_transformers(root, capsys):
    """``stop="auto"`` reads the folder's ``generation_config.json`` (a list of ids here),
    and the tokens, their padding and the output's length are transformers' greedy
    ``generate`` with that config."""
    free = sample(root / "folder", PROMPT, tokens=20, temperature=0, overrides=ONE)
    ends = [int(free.tokens[0, 7]), 319]  # met by step 7 at the latest; 319 never drawn
    folder = root / "ends"
    shutil.copytree(root / "folder", folder)
    transformers.GenerationConfig(eos_token_id=ends, pad_token_id=ends[0]).save_pretrained(folder)
    out = sample(folder, PROMPT, tokens=20, temperature=0, overrides=ONE)
    with torch.no_grad():
        expected = (
            _hf_model(folder)
            .generate(
                torch.tensor([out.prompt_tokens.tolist()]), do_sample=False, max_new_tokens=20
            )[0, len(out.prompt_tokens) :]
            .numpy()
        )
    np.testing.assert_array_equal(out.tokens[0], expected)
    assert out.stop == tuple(ends) and len(expected) <= 8 and expected[-1] == ends[0]
    np.testing.assert_array_equal(expected, free.tokens[0, : len(expected)])
    assert out.lengths.tolist() == [len(expected)]
    decode = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).decode
    assert out.texts[0] == decode(expected[:-1].tolist(), skip_special_tokens=False)
    argv = ["sample", str(folder), "--prompt", PROMPT, "--tokens", "20", "--temperature", "0"]
    for stop, text in (([], out.texts[0]), (["--stop", "none"], free.texts[0])):
        assert main([*argv, *stop, "--devices", "1", "mesh.data=1"]) == 0
        assert capsys.readouterr().out == PROMPT + text + "\n"
    _one_line_error(
        capsys,
        [*argv, "--stop", "400", *ONE],
        "--stop holds token id 400",
        "0 to 319",
        "--stop none",
    )


def test_rows_of_a_batch_end_and_pad_as_transformers_batch(root):
    """Two prompts decoded as one batch end apart: the padding is ``pad_token_id`` and the
    width the longer row's, as transformers' ``generate``; the ids come from
    ``generation_config.json`` alone when the folder has one, else from ``config.json``;
    ``--stop`` ids keep the folder's padding."""
    from jaxpar.decoding import generate
    from jaxpar.sample import folder_defaults
    from jaxpar.weights import build_source, open_source, state_of

    prompts = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    source = open_source(root / "folder", ONE, defaults=folder_defaults)
    run = build_source(source)
    free = generate(run, state_of(run, source, None, "test"), prompts, 20, temperature=0)
    end = int(free[0, 5])
    assert end not in free[1, :8]  # the second row ends later, or not at all
    folder = root / "config_ends"
    shutil.copytree(root / "folder", folder)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "eos_token_id": end, "pad_token_id": 3})
    )
    source = open_source(folder, ONE, defaults=folder_defaults)
    ends, pad = sampling._stop_ids(source, "auto", 320)
    assert (ends, pad) == ((end,), 3)
    assert sampling._stop_ids(source, [7], 320) == ((7,), 3)
    bad = (
        ({"pad_token_id": 999}, "token id 999"),
        ({"eos_token_id": "x"}, "x"),
        (
            {"pad_token_id": True},
            "pad_token_id True",
        ),
    )
    for keys, words in bad:
        (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": end, **keys}))
        with pytest.raises(ConfigError, match=f"config.json.*{words}.*--stop"):
            sampling._stop_ids(source, "auto", 320)
    (folder / "config.json").write_text(
        json.dumps({**config, "eos_token_id": end, "pad_token_id": 3})
    )
    generation = folder / "generation_config.json"  # when present, it alone decides
    for keys, want in (({"eos_token_id": [end]}, ((end,), None)), ({}, ((), None))):
        generation.write_text(json.dumps(keys))
        assert sampling._stop_ids(source, "auto", 320) == want
    generation.unlink()
    run = build_source(source)
    got = generate(
        run, state_of(run, source, None, "test"), prompts, 20, temperature=0, stop=ends, pad=pad
    )
    with torch.no_grad():
        want = _hf_model(folder).generate(torch.tensor(prompts), do_sample=False, max_new_tokens=20)
    np.testing.assert_array_equal(got, want[:, 4:].numpy())
    assert got.shape[1] > 6 and (got[0, 6:] == 3).all()
    # through sample(): two drawn rows, the first ended early and padded with the folder's 3
    drawn = dict(prompt_ids=[5, 6], tokens=12, temperature=1.0, seed=1, samples=2, overrides=ONE)
    free = sample(folder, stop="none", **drawn).tokens
    at, stop = next((j, t) for j, t in enumerate(free[0]) if t not in free[1] and t != 3)
    out = sample(folder, stop=[int(stop)], **drawn)
    assert out.lengths.tolist() == [at + 1, 12] and (out.tokens[0, at + 1 :] == 3).all()
    np.testing.assert_array_equal(out.tokens[1], free[1])


def test_a_run_dir_stops_at_its_token_files_end_and_its_export_names_it(root, run_dir, tmp_path):
    end = json.loads((root / "text.tokens.json").read_text())["eos"]["id"]
    assert sample(run_dir, PROMPT, tokens=2, temperature=0, overrides=ONE).stop == (end,)
    assert (
        main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"), *ONE]) == 0
    )
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == end
    assert sample(tmp_path / "hf", PROMPT, tokens=2, temperature=0, overrides=ONE).stop == (end,)


def test_sample_command_of_a_folder_prints_text_and_ids(root, capsys):
    folder, bare = root / "folder", root / "bare"
    assert (
        main(
            [
                "sample",
                str(folder),
                "--prompt",
                PROMPT,
                "--tokens",
                "5",
                "--temperature",
                "0",
                "--devices",
                "1",
                "mesh.data=1",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    text = sample(folder, PROMPT, tokens=5, temperature=0, overrides=ONE).texts[0]
    assert out == PROMPT + text + "\n" and str(folder) in err
    ids = sample(folder, prompt_ids=[5, 6, 7], tokens=5, temperature=0, overrides=ONE)
    assert (
        main(
            [
                "sample",
                str(bare),
                "--prompt-ids",
                "5,6,7",
                "--tokens",
                "5",
                "--temperature",
                "0",
                "--devices",
                "1",
                "mesh.data=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out == ",".join(str(t) for t in [5, 6, 7, *ids.tokens[0]]) + "\n"


def _one_line_error(capsys, argv, *expected):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("jaxpar: error: "), err
    for text in expected:
        assert text in err, err


def test_look_errors_are_one_line(root, tmp_path, capsys):
    bare = str(root / "bare")
    _one_line_error(
        capsys, ["sample", bare, "--prompt", "a", *ONE], "no tokenizer.json", "--prompt-ids 1,2,3"
    )
    _one_line_error(
        capsys,
        ["sample", str(tmp_path), "--prompt", "a"],
        "no config.yaml",
        "no config.json",
        "Hugging Face folder",
    )
    _one_line_error(capsys, ["eval", str(tmp_path)], "no config.yaml", "no config.json")
    _one_line_error(capsys, ["eval", bare, *ONE], "needs data", "data.path=")
    _one_line_error(
        capsys,
        ["eval", str(root / "folder"), *ONE, f"data.path={root / 'text.txt'}"],
        "not a token file",
        "prepare-data",
    )
    _one_line_error(capsys, ["sample", bare, "--prompt-ids", "5,999", *ONE], "999", "below 320")
    with pytest.raises(SystemExit) as exit_:
        main(["sample", bare, "--prompt-ids", "5,x"])
    assert exit_.value.code == 2 and "token ids separated by commas" in capsys.readouterr().err
    _one_line_error(
        capsys, ["sample", bare, "--prompt-ids", "5", "--step", "1", *ONE], "drop --step"
    )


# ---- eval -----------------------------------------------------------------------------------
def _step_loss(config, checkpoint: bool) -> float:
    """The training step's loss of the config's run on its first held-out batch, on one
    device: from the run dir's latest checkpoint, or else from the folder's weights."""
    run = build(config)
    state = restore_state(run, None, "test") if checkpoint else run.trainer.init()
    batch = run.trainer.shard_batch(run.data.batch(0, config.train.batch_size, "eval"))
    return float(run.trainer.step(state, batch)[1]["loss"])


# eval on each layout from each kind of source, once: a folder spread over data × fsdp ×
# tensor (its one-device eval: test_eval_of_a_folder_is_transformers_loss) and a run dir on
# one device (restoring onto another layout: tests/test_checkpoint.py); the other two are
# `exhaustive`
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(ONE, id="one-device", marks=pytest.mark.exhaustive),
        pytest.param(SPREAD, id="data2-fsdp2-tensor2"),
    ],
)
def test_eval_of_a_folder_is_the_training_step_loss(root, layout):
    folder = root / "folder"
    data = [*DATA, f"data.path={root / 'text.tokens'}"]
    before = _files(folder)
    got = evaluate_model(folder, [*data, *layout], batches=1)
    config = load_config([], [f"model.init_from={folder}", *data, *ONE])
    np.testing.assert_allclose(got.loss, _step_loss(config, checkpoint=False), rtol=2e-6)
    assert got.perplexity == pytest.approx(math.exp(got.loss)) and got.step is None
    assert _files(folder) == before


def test_eval_of_a_folder_is_transformers_loss(root):
    """An outside reference: transformers' mean next-token cross entropy of the batch."""
    folder = root / "folder"
    config = load_config(
        [], [f"model.init_from={folder}", *DATA, *ONE, f"data.path={root / 'text.tokens'}"]
    )
    tokens = build(config).data.batch(0, 8, "eval")["tokens"]
    with torch.no_grad():
        logits = _hf_model(folder)(torch.tensor(tokens[:, :-1], dtype=torch.long)).logits
        expected = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.tensor(tokens[:, 1:]).reshape(-1).long()
        )
    got = evaluate_model(folder, [*DATA, *ONE, f"data.path={root / 'text.tokens'}"], batches=1)
    np.testing.assert_allclose(got.loss, float(expected), rtol=1e-5)


def test_eval_warns_of_a_token_file_made_with_another_tokenizer(root):
    with pytest.warns(UserWarning, match="made with tokenizer .* not .*bos/tokenizer.json"):
        evaluate_model(root / "bos", [*DATA, *ONE, f"data.path={root / 'text.tokens'}"], batches=1)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(ONE, id="one-device"),
        pytest.param(SPREAD, id="data2-fsdp2-tensor2", marks=pytest.mark.exhaustive),
    ],
)
def test_eval_of_a_run_dir_is_the_training_step_loss(run_dir, layout):
    before = _files(run_dir)
    got = evaluate_model(run_dir, layout, batches=1)
    expected = _step_loss(load_run_config(run_dir, ONE), checkpoint=True)
    np.testing.assert_allclose(got.loss, expected, rtol=2e-6)
    assert got.step == 1 and got.batches == 1 and got.seq_len == 16
    assert _files(run_dir) == before


def test_eval_command_prints_one_line_and_json(run_dir, capsys):
    assert main(["eval", str(run_dir), "--batches", "2", "--devices", "1", "mesh.data=1"]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith(f"eval of step 1 of {run_dir}: loss ")
    assert "perplexity" in line and "2 batches of 8 × 16 tokens" in line
    assert (
        main(["eval", str(run_dir), "--batches", "2", "--json", "--devices", "1", "mesh.data=1"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    assert got["batches"] == 2 and got["perplexity"] == pytest.approx(math.exp(got["loss"]))


# ---- the tokenizer travels ------------------------------------------------------------------
@pytest.mark.parametrize("mixture", [False, True])
def test_export_carries_the_tokenizer(run_dir, root, tmp_path, capsys, mixture):
    """A mixture's sources share one tokenizer: its first source's travels."""
    out, data = tmp_path / "hf", []
    if mixture:
        for suffix in ("", ".json"):
            shutil.copy(root / f"text.tokens{suffix}", tmp_path / f"more.tokens{suffix}")
        data = ["data.path=", f"data.mixture={tmp_path / 'more.tokens'}:1,{root / 'text.tokens'}:1"]
    assert main(["export", str(run_dir), *data, "--format", "hf", "--out", str(out), *ONE]) == 0
    assert "Qwen3ForCausalLM" in (message := capsys.readouterr().out)
    assert "with the tokenizer" in message and "tokenizer.json" in message
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "the lazy dog says hello"
    assert tok.decode(tok(text).input_ids) == text and tok.eos_token == "<|endoftext|>"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_a_byte_level_export_writes_no_tokenizer_and_says_so(run_dir, root, tmp_path, capsys):
    out = tmp_path / "hf"
    assert (
        main(
            [
                "export",
                str(run_dir),
                f"data.path={root / 'text.txt'}",
                "--format",
                "hf",
                "--out",
                str(out),
                "--devices",
                "1",
                "mesh.data=1",
            ]
        )
        == 0
    )
    assert "no tokenizer written" in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists() and (out / "config.json").exists()


def test_the_docs_sample_and_eval_commands_parse():
    import shlex
    from pathlib import Path

    from jaxpar.cli.parser import parse

    page = (Path(__file__).resolve().parent.parent / "docs" / "commands.md").read_text()
    lines = [
        line.strip()
        for line in page.splitlines()
        if line.startswith(("    jaxpar sample ", "    jaxpar eval "))
    ]
    assert len(lines) >= 4
    for line in lines:
        args = parse(shlex.split(line)[1:])
        assert args.command in ("sample", "eval") and args.run_dir, line
