"""``jaxpar sample``: KV-cache generation from a run's checkpoint (jaxpar/sample.py)."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from jaxpar import sample as sampling
from jaxpar.cli import main
from jaxpar.config import load_config, to_dict
from jaxpar.data.tokenizers import ByteTokenizer
from jaxpar.loop import train
from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.resume import restore_state
from jaxpar.run import build
from tests.helpers import decode_stepwise, grid

TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_ff=64",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "train.batch_size=8",
    "train.steps=2",
    "train.eval_every=0",
    "train.log_every=1",
    "train.progress=false",
    "optim.warmup_steps=0",
    "optim.lr=1e-2",
    "checkpoint.async_save=false",
]


def _train(run_dir, *overrides: str) -> None:
    train(load_config([], [*TINY, *overrides, f"run.dir={run_dir}"]), echo=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step run of a tiny byte-level GPT on one device (half the compile time of 8;
    layouts are the business of test_sharded_run_samples_as_on_one_device)."""
    path = tmp_path_factory.mktemp("sample") / "run"
    _train(path, "run.devices=1")
    return path


@pytest.mark.parametrize(
    "positions,attn_bias",
    grid(
        [
            pytest.param(p, b, id=f"{p}-{b}")
            for p, b in (("learned", False), ("rotary", False), ("learned", True))
        ],
        # every suite: rotary positions, and learned ones with GPT-2's projection biases
        # (made nonzero): learned-True decodes through the same cache and position rows as
        # learned-False, the biases added; learned positions without biases decode in
        # every suite in test_greedy_with_kv_cache_equals_argmax_loop_without (the fixture
        # run's GPT). learned-False is extended
        {"rotary-False", "learned-True"},
    ),
)
def test_decode_with_cache_matches_forward(positions, attn_bias):
    cfg = GPTConfig(
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_seq_len=16,
        positions=positions,
        attn_bias=attn_bias,
    )
    with nnx.use_eager_sharding(False):
        model = GPT(cfg, rngs=nnx.Rngs(0))
    if attn_bias:  # GPT-2's projection biases (zero at init): made nonzero to count
        for i, name in enumerate(("bq", "bk", "bv", "bo")):
            bias = getattr(model.blocks, name)
            bias.value = jax.random.normal(jax.random.key(10 + i), bias.value.shape)
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
    np.testing.assert_allclose(decode_stepwise(model, tokens, 6), jax.jit(model)(tokens), atol=1e-5)


def _restored(run_dir, *overrides: str):
    run = build(sampling.load_run_config(run_dir, overrides))
    return run, restore_state(run, None, "test"), sampling.Generator(run, vocab_limit=256)


@pytest.fixture(scope="module")
def restored(run_dir):
    """The fixture run's model, its checkpoint's state and its compiled generator."""
    return _restored(run_dir)


PROMPT = np.array([list(b"The ")] * 2)


@pytest.fixture(scope="module")
def greedy(restored):
    """40 greedy tokens after "The ": more than the 32-position cache holds."""
    _, state, generator = restored
    return generator.generate(state, PROMPT, 40, temperature=0)


def _argmax_loop(run, state, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens without a cache: the whole forward pass (``__call__``) per token, on
    the window :func:`jaxpar.sample.generate` documents (the last S/2 tokens once S are
    exceeded)."""
    S = 32
    graphdef = run.plan.model.graphdef

    @jax.jit
    def last_logits(params, model_state, tokens_1S, length):
        logits = nnx.merge(graphdef, params, model_state)(tokens_1S)  # causal: padding after
        return logits[0, length - 1]  # `length` is unseen

    seq, start = list(prompt), 0
    for _ in range(n):
        context = seq[start:]
        padded = np.zeros((1, S), np.int32)
        padded[0, : len(context)] = context
        seq.append(
            int(
                jnp.argmax(last_logits(state.params, state.model_state, padded, len(context))[:256])
            )
        )
        if len(seq) - start > S:
            start = len(seq) - S // 2
    return seq[len(prompt) :]


def test_greedy_with_kv_cache_equals_argmax_loop_without(restored, greedy):
    run, state, _ = restored
    assert greedy.shape == (2, 40)
    assert greedy[0].tolist() == greedy[1].tolist() == _argmax_loop(run, state, list(b"The "), 40)


def test_sampling_is_deterministic_for_a_seed(restored, greedy):
    _, state, generator = restored

    def draw(seed, top_k=0):
        return generator.generate(state, PROMPT, 12, temperature=1.0, top_k=top_k, seed=seed)

    first = draw(0)
    np.testing.assert_array_equal(first, draw(0))
    assert not np.array_equal(first, draw(1))
    assert not np.array_equal(first[0], first[1])  # rows draw independently
    np.testing.assert_array_equal(draw(5, top_k=1), greedy[:, :12])  # top-1 is greedy


def _stopped(free: np.ndarray, stop: list[int]) -> np.ndarray:
    """``free`` (tokens drawn without stops) as rows that end at their first id of
    ``stop``, the first stop id after it, as wide as the longest row."""
    out = free.copy()
    ends = [next((j for j, t in enumerate(row) if t in stop), None) for row in free]
    for row, end in zip(out, ends):
        if end is not None:
            row[end + 1 :] = stop[0]
    wide = free.shape[1] if None in ends else max(ends) + 1
    return out[:, :wide]


def test_stop_ids_end_each_row_where_its_own_draws_reach_one(restored):
    """Rows drawn at temperature 1 end independently, one of them in the second window of
    the 32-position cache; a row's tokens up to its stop are those it draws without stops,
    and generation ends when every row has."""
    _, state, generator = restored
    prompt = np.array([list(b"The ")] * 3)
    free = generator.generate(state, prompt, 40, temperature=1.0, seed=4)
    late = next(t for j, t in enumerate(free[0]) if j >= 30 and t not in free[0, :j])
    early = next(t for t in free[1, :3] if t not in free[0, :31])
    for stop in ([int(late), int(early)], [int(t) for t in set(free[:, 0])]):
        got = generator.generate(state, prompt, 40, temperature=1.0, seed=4, stop=stop)
        np.testing.assert_array_equal(got, _stopped(free, stop))
    assert got.shape == (3, 1)  # every row's first token stops it


def test_sharded_run_samples_as_on_one_device(run_dir, restored):
    """The fixture's run restored onto data=2, fsdp=2, tensor=2 (its checkpoint laid out
    over 8 devices, the generator's cache and matmuls sharded) draws the tokens it draws on
    one device, greedy and sampled. (A run trained on 8 devices would only add its training
    to compile: sampling reads the restored state whatever layout wrote it.)"""
    sharded = _restored(run_dir, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "run.devices=8")
    single = restored
    assert len(single[0].devices) == 1 and dict(sharded[0].plan.mesh.shape)["tensor"] == 2
    assert len(sharded[0].devices) == 8
    for settings in ({"temperature": 0}, {"temperature": 0.8, "top_k": 20, "seed": 3}):
        a, b = (g.generate(state, PROMPT, 10, **settings) for _, state, g in (sharded, single))
        np.testing.assert_array_equal(a, b)


def test_sample_command_prints_the_text(run_dir, greedy, capsys):
    assert (
        main(
            [
                "--devices",
                "1",
                "sample",
                str(run_dir),
                "--prompt",
                "The ",
                "--tokens",
                "6",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out == "The " + bytes(greedy[0, :6].tolist()).decode(errors="replace") + "\n"
    assert "step 2 of" in err


def _one_line_error(capsys, argv: list[str], *expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("jaxpar: error: "), err
    for text in expected:
        assert text in err, err


def test_sample_errors_are_one_line(run_dir, tmp_path, capsys):
    _one_line_error(capsys, ["sample", str(tmp_path / "nope"), "--prompt", "a"], "does not exist")
    _one_line_error(capsys, ["sample", str(tmp_path), "--prompt", "a"], "no config.yaml")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "config.yaml", bare / "config.yaml")
    _one_line_error(capsys, ["sample", str(bare), "--prompt", "a"], "holds no checkpoints")
    _one_line_error(
        capsys, ["sample", str(run_dir), "--prompt", "x" * 33], "33 tokens", "max_seq_len=32"
    )
    _one_line_error(capsys, ["sample", str(run_dir), "--prompt", ""], "--prompt is empty")
    _one_line_error(
        capsys,
        ["sample", str(run_dir), "--prompt", "a", "--step", "7"],
        "no complete checkpoint 7",
        "have: [2]",
    )
    _one_line_error(
        capsys, ["sample", str(run_dir), "--prompt", "a", "--temperature", "-1"], "--temperature"
    )


def test_sample_needs_a_language_model(tmp_path, capsys):
    config = load_config([], ["model.name=mlp", f"run.dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    (tmp_path / "checkpoints").mkdir()
    _one_line_error(
        capsys,
        ["sample", str(tmp_path), "--prompt", "a"],
        f"jaxpar sample needs a language model; {tmp_path} trains model.name=mlp",
    )


def test_prompt_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="token id 195 .* outside the 128 tokens"):
        sampling._encode(ByteTokenizer(), "é", 128, 32, "gpt")
