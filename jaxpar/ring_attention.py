"""Ring attention (``context.attention=ring``, :mod:`jaxpar.context`): key/value blocks
travel round the devices of the context axes with ``ppermute``; each block's partial
result is merged by its log-sum-exp; a block wholly in a query's future is skipped; a
query row with no visible key in a block contributes nothing. The backward pass (a
``custom_vjp``) sends the blocks round again, their dK and dV travelling with them, instead
of keeping every block's probabilities: memory O(local block). And the mask every strategy
builds from positions (:func:`visible`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def visible(
    pos_q: jax.Array,
    pos_k: jax.Array,
    causal: bool,
    window: int = 0,
    seg_q: jax.Array | None = None,
    seg_k: jax.Array | None = None,
) -> jax.Array:
    """[1, 1, Tq, Tk] True where a query may see a key (within ``window`` positions back
    when it is > 0); [B, 1, Tq, Tk] with segment ids [B, T] (and only within a segment:
    within one, the positions' differences are the documents' own)."""
    if not causal:
        seen = jnp.ones((1, 1, pos_q.shape[0], pos_k.shape[0]), bool)
    else:
        back = pos_q[:, None] - pos_k[None, :]
        seen = back >= 0
        if window:
            seen = seen & (back < window)
        seen = seen[None, None]
    if seg_q is None:
        return seen
    return seen & (seg_q[:, None, :, None] == seg_k[:, None, None, :])


def _shift(tree, axes, ways):
    """Each device's blocks to the next device of the ring."""
    perm = [(j, (j + 1) % ways) for j in range(ways)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axes, perm), tree)


def _block(q, k, v, pos_q, pos_k, causal, implementation, seg_q=None, seg_k=None):
    """One key/value block (``causal`` is the pair ``(causal, window)``): output and
    log-sum-exp [B, T, N], both float32 (the kernel
    returns the log-sum-exp in its inputs' dtype, and the merge weights are its
    exponentials: so the block runs on float32 inputs, through XLA's attention); rows that
    see no key of the block give 0 and −inf."""
    del implementation  # cuDNN's kernel takes no float32 inputs
    mask = visible(pos_q, pos_k, *causal, seg_q, seg_k)
    rows = jnp.any(mask, axis=-1)[:, 0]  # [1 or B, T]
    f32 = jnp.float32
    out, lse = jax.nn.dot_product_attention(
        q.astype(f32),
        k.astype(f32),
        v.astype(f32),
        mask=mask,
        return_residual=True,
        implementation="xla",
    )
    out = jnp.where(rows[:, :, None, None], out.astype(jnp.float32), 0.0)
    lse = jnp.where(rows[:, :, None], lse.astype(jnp.float32), -jnp.inf)
    return out, lse


def _merge(out, lse, out_b, lse_b):
    """Two partial attention results merged by their log-sum-exps."""
    top = jnp.maximum(lse, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    a, b = jnp.exp(lse - top), jnp.exp(lse_b - top)
    total = a + b
    safe = jnp.where(total > 0, total, 1.0)
    out = (out * a[..., None] + out_b * b[..., None]) / safe[..., None]
    return out, jnp.where(total > 0, top + jnp.log(safe), -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def ring_attention(q, k, v, pos, seg, axes, ways, causal, implementation):
    # causal: the pair (causal, window) that _visible takes (hashable: a nondiff argument);
    # seg: the queries' segment ids [B, T], or None
    return _ring_forward(q, k, v, pos, seg, axes, ways, causal, implementation)[0]


def _ring_forward(q, k, v, pos, seg, axes, ways, causal, implementation):
    B, T, N, _ = q.shape
    out = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
    block = (k, v, pos, seg)  # a block's segment ids travel with its keys
    for step in range(ways):
        kb, vb, pb, sb = block
        seen = visible(pos, pb, *causal).any() if causal[0] else True
        out_b, lse_b = jax.lax.cond(
            seen,
            lambda q, kb, vb, pb, sb: _block(q, kb, vb, pos, pb, causal, implementation, seg, sb),
            lambda q, kb, vb, pb, sb: (
                jnp.zeros(q.shape, jnp.float32),
                jnp.full((B, T, N), -jnp.inf, jnp.float32),
            ),
            q,
            kb,
            vb,
            pb,
            sb,
        )
        out, lse = _merge(out, lse, out_b, lse_b)
        if step < ways - 1:
            block = _shift(block, axes, ways)
    return out.astype(q.dtype), lse


def _ring_fwd(q, k, v, pos, seg, axes, ways, causal, implementation):
    out, lse = _ring_forward(q, k, v, pos, seg, axes, ways, causal, implementation)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_bwd(axes, ways, causal, implementation, residuals, d_out):
    """Flash attention's backward, block by block round the ring: each block's dK and dV
    travel with it and arrive home after the last step."""
    q, k, v, pos, seg, out, lse = residuals
    scale = 1.0 / math.sqrt(q.shape[-1])
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    qf, do = f32(q), f32(d_out)
    delta = jnp.einsum("btnh,btnh->bnt", do, f32(out))[..., None]  # [B, N, T, 1]
    lse_n = jnp.where(jnp.isfinite(lse), lse, jnp.inf).transpose(0, 2, 1)[..., None]

    def grads(kb, vb, pb, sb):
        mask = visible(pos, pb, *causal, seg, sb)
        s = jnp.einsum("btnh,bsnh->bnts", qf, f32(kb)) * scale
        p = jnp.where(mask, jnp.exp(s - lse_n), 0.0)
        dv = jnp.einsum("bnts,btnh->bsnh", p, do)
        ds = p * (jnp.einsum("btnh,bsnh->bnts", do, f32(vb)) - delta)
        return (
            jnp.einsum("bnts,bsnh->btnh", ds, f32(kb)) * scale,
            jnp.einsum("bnts,btnh->bsnh", ds, qf) * scale,
            dv,
        )

    def nothing(kb, vb, pb, sb):
        return (
            jnp.zeros(q.shape, jnp.float32),
            jnp.zeros(kb.shape, jnp.float32),
            jnp.zeros(vb.shape, jnp.float32),
        )

    dq = jnp.zeros(q.shape, jnp.float32)
    block = (k, v, pos, seg)
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(ways):
        kb, vb, pb, sb = block
        seen = visible(pos, pb, *causal).any() if causal[0] else True
        dq_b, dk_b, dv_b = jax.lax.cond(seen, grads, nothing, kb, vb, pb, sb)
        dq = dq + dq_b
        dkv = (dkv[0] + dk_b, dkv[1] + dv_b)
        dkv = _shift(dkv, axes, ways)  # a block's gradients travel with it, and home last
        if step < ways - 1:
            block = _shift(block, axes, ways)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
