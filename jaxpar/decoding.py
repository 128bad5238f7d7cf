"""Text generation by a language model with a KV cache (what ``jaxpar sample`` runs).

Generation keeps a KV cache, K/V[L, B_batch, S, N_heads, H] with S = the model's
longest sequence: the prompt runs through the model once, filling it; then each token
is one step of a jitted ``lax.while_loop`` — choose a token from the last logits
(greedy at temperature 0, else a draw from softmax(logits / temperature), over the
``top_k`` largest when set), run it through the model at its position. When the cache
is full the window slides: the last S/2 tokens run again as a fresh prompt (positions
from 0), so every token is predicted from between S/2 and S tokens before it.

Token j of a generation draws with ``fold_in(PRNGKey(seed), j)``: a seed gives the same
text however the generation is cut into windows, and on any layout.

Given ``stop`` ids (a model's end-of-text tokens), a row that chooses one is finished: its
later positions hold ``pad`` (else the first stop id), as transformers' ``generate`` pads
them, and generation ends, early, once every row is finished, so the result is as long as
its longest row. A row's tokens up to its stop are those it draws without stops.

A model samples here when its module has ``init_cache(batch)`` and
``decode(tokens_BT, cache, start) -> (logits_BTV, cache)`` and ``cfg.max_seq_len``
(the GPT and Llama families).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.logical import ACT_SEQ, BATCH, SEQ, Rules, activation_rules
from jaxpar.run import Run, host_value

__all__ = ["Generator", "choose_token", "generate"]


def model_shapes(run: Run) -> nnx.Module:
    """The run's model with shapes for arrays (what it can do, not its values)."""
    model = run.plan.model
    return nnx.merge(model.graphdef, model.params, model.state)


def generate(
    run: Run,
    state: Any,
    prompt_BP: np.ndarray,
    tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    vocab_limit: int | None = None,
    stop: Sequence[int] = (),
    pad: int | None = None,
) -> np.ndarray:
    """``tokens`` ids [B, tokens] continuing each row of ``prompt_BP`` (see the module
    docstring) by ``run``'s model with ``state``'s parameters, on ``run``'s mesh.
    ``vocab_limit``: draw only ids below it (those the tokenizer can decode). ``stop``:
    ids that end a row; with them the result is [B, ≤ tokens], a finished row's later
    positions ``pad`` (None: the first stop id)."""
    return Generator(run, vocab_limit).generate(
        state,
        prompt_BP,
        tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        stop=stop,
        pad=pad,
    )


class Generator:
    """The jitted prefill and decode loop of a run's model, compiled once for every
    temperature, top-k and seed (they are traced), and once per prompt length.

    Args:
      run: the built run (its model, mesh, rules and state shardings).
      vocab_limit: draw only ids below it (None: any id of the model's vocabulary).
    """

    def __init__(self, run: Run, vocab_limit: int | None = None):
        self.plan = plan = run.plan
        self.graphdef = plan.model.graphdef
        self.mesh = plan.mesh
        self.rules = plan.rules
        self.vocab_limit = vocab_limit
        self.max_len = model_shapes(run).cfg.max_seq_len
        shardings = plan.state_shardings
        self._prefill = jax.jit(
            self._prefill_fn, in_shardings=(shardings.params, shardings.model_state, None)
        )
        self._decode = jax.jit(
            self._decode_fn, in_shardings=(shardings.params, shardings.model_state, *[None] * 11)
        )

    def generate(
        self,
        state: Any,
        prompt_BP: np.ndarray,
        tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Sequence[int] = (),
        pad: int | None = None,
    ) -> np.ndarray:
        """:func:`generate` with this run's compiled functions."""
        params = state.params
        model_state = state.model_state
        B, S = prompt_BP.shape[0], self.max_len
        keep = max(1, S // 2)
        stop_K = jnp.asarray([*stop] or [-1], jnp.int32)  # -1: no id ends a row
        filler = jnp.int32(pad if pad is not None else stop_K[0])
        settings = (jnp.float32(temperature), jnp.int32(top_k), jax.random.key(seed), stop_K)
        prompt_BP = np.asarray(prompt_BP, np.int32)
        out = np.zeros((B, tokens), np.int32)
        finished_B = jnp.zeros((B,), bool)
        window = prompt_BP
        done = 0
        while done < tokens and not bool(host_value(finished_B.all())):
            logits_BV, cache = self._prefill(params, model_state, window)
            filled = window.shape[1]
            # this window's tokens: the first from the prompt's logits, one more per
            # position left in the cache; the last one is not run (the next window has it)
            count = min(tokens - done, S - filled + 1)
            got, made, finished_B = self._decode(
                params,
                model_state,
                cache,
                logits_BV,
                finished_B,
                filler,
                jnp.int32(filled),
                jnp.int32(count),
                jnp.int32(done),
                *settings,
            )
            made = int(host_value(made))
            out[:, done : done + made] = host_value(got)[:, :made]
            done += made
            window = np.concatenate([prompt_BP, out[:, :done]], axis=1)[:, -keep:]
        return out[:, :done]

    def _model(self, params: Any, model_state: Any) -> Any:
        model = nnx.merge(self.graphdef, params, model_state)
        model.eval()
        return model

    def _rules(self, batch: int) -> Rules:
        """The run's rules, except that a batch the ``batch`` axes do not divide (one
        sample on data=8) is replicated, and the sequence is never split: generation writes
        one position at a time into a KV cache that every device of a ``context`` group
        holds whole (a run trained with context parallelism samples so)."""
        rules = {**self.rules, SEQ: (), ACT_SEQ: ()}
        return rules if batch % self.plan.batch_ways() == 0 else {**rules, BATCH: ()}

    def _prefill_fn(
        self, params: Any, model_state: Any, tokens_BP: jax.Array
    ) -> tuple[jax.Array, Any]:
        """The logits [B, V] after the prompt, and the cache it filled."""
        with activation_rules(self.mesh, self._rules(tokens_BP.shape[0])):
            model = self._model(params, model_state)
            cache = model.init_cache(tokens_BP.shape[0])
            logits_BPV, cache = model.decode(tokens_BP, cache, jnp.int32(0))
        return logits_BPV[:, -1], cache

    def _decode_fn(
        self,
        params: Any,
        model_state: Any,
        cache: Any,
        logits_BV: jax.Array,
        finished_B: jax.Array,
        pad: jax.Array,
        start: jax.Array,
        count: jax.Array,
        first: jax.Array,
        temperature: jax.Array,
        top_k: jax.Array,
        key: jax.Array,
        stop_K: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Up to ``count`` tokens [B, S] (the first columns), how many were made, and which
        rows are finished. Each token is chosen from the logits (a finished row's is
        ``pad``), then run at position ``start`` + its index to give the next logits
        — all but the last. Token i draws with ``fold_in(key, first + i)``. Making stops
        early once every row has chosen an id of ``stop_K``."""
        B = logits_BV.shape[0]

        def choose(logits_BV: jax.Array, i: jax.Array, finished_B: jax.Array):
            token_B = choose_token(
                logits_BV[:, : self.vocab_limit],
                temperature,
                top_k,
                jax.random.fold_in(key, first + i),
            )
            token_B = jnp.where(finished_B, pad, token_B)
            return token_B, finished_B | jnp.isin(token_B, stop_K)

        with activation_rules(self.mesh, self._rules(B)):
            model = self._model(params, model_state)

            def more(carry):
                i, _, _, _, finished_B = carry
                return (i < count - 1) & ~finished_B.all()

            def body(carry):
                i, out_BS, cache, logits_BV, finished_B = carry
                token_B, finished_B = choose(logits_BV, i, finished_B)
                logits_B1V, cache = model.decode(token_B[:, None], cache, start + i)
                return i + 1, out_BS.at[:, i].set(token_B), cache, logits_B1V[:, -1], finished_B

            out_BS = jnp.zeros((B, self.max_len), jnp.int32)
            i, out_BS, _, logits_BV, finished_B = jax.lax.while_loop(
                more, body, (jnp.int32(0), out_BS, cache, logits_BV, finished_B)
            )
            # the loop ran out of positions (not of rows): the last token needs no run
            last = ~finished_B.all()
            token_B, finished_B = choose(logits_BV, i, finished_B | ~last)
            out_BS = out_BS.at[:, i].set(token_B)
            return out_BS, i + last, finished_B


def choose_token(
    logits_BV: jax.Array, temperature: jax.Array, top_k: jax.Array, key: jax.Array
) -> jax.Array:
    """The next token [B]: the argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the ``top_k`` largest logits (all when 0; ties
    with the k-th largest are kept)."""
    V = logits_BV.shape[-1]
    greedy_B = jnp.argmax(logits_BV, axis=-1)
    kth_B1 = jnp.sort(logits_BV, axis=-1)[:, V - jnp.clip(top_k, 1, V)][:, None]
    kept_BV = jnp.where((top_k > 0) & (logits_BV < kth_B1), -jnp.inf, logits_BV)
    drawn_B = jax.random.categorical(key, kept_BV / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, drawn_B, greedy_B).astype(jnp.int32)
