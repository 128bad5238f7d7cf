"""SwiGLU MLPs: dense, and a mixture of experts — logical axes only: a float32 router, top-k
gating, a load-balancing auxiliary loss and a router z-loss, **dropless** expert
computation (each device's tokens sorted by expert, one grouped matmul per projection
through ``jax.lax.ragged_dot``), an optional capacity factor, and expert parallelism.

Layout. The layer runs inside ``shard_map`` over the mesh axes that split the batch and the
sequence (the rules of ``batch`` and ``seq``: context parallelism), so sorting and grouping
stay on each device's own tokens. The experts'
weights carry the logical axis ``experts``; where its rule names batch axes (``rules.
experts=data``, say), each device of those axes holds ``n_experts / degree`` experts
(expert parallelism) and tokens reach them by **all-gather + reduce-scatter**: every device
gathers the tokens (and their routing) of its group, runs its own experts on the ones
routed to them, and the partial outputs are reduce-scattered back to the tokens' devices —
static shapes, on every backend. ``dispatch="all_to_all"`` moves only the routed tokens
instead (``jax.lax.ragged_all_to_all``: GPUs and TPUs; :mod:`jaxpar.models.alltoall`).

Costs. ``ragged_dot`` on the CPU expands to a dense product over every group (about
``n_experts`` × the FLOPs and memory of the routed tokens' matmul); on GPUs and TPUs it is a
grouped matmul. With a capacity factor, the assignments beyond an expert's capacity are
dropped (their weight zeroed; the token keeps its residual and other experts), counted in
the ``moe_dropped`` metric.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxpar.axes import BATCH_AXES
from jaxpar.logical import active_layout, constrain, split_over
from jaxpar.models import alltoall
from jaxpar.models.fp8 import PREFIX, history
from jaxpar.models.transformer import MLP_DOWN, MLP_IN, MLP_OUT, MLP_UP, project

#: How expert parallelism moves tokens to their experts' devices (``model.moe_dispatch``).
Dispatch = Literal["all_gather", "all_to_all"]


def swiglu(h: jax.Array, p: dict[str, jax.Array], precision: str = "default") -> jax.Array:
    """``down(silu(gate(h)) · up(h))``: column-parallel in, row-parallel out under TP; the
    projections in ``precision`` (``model.precision``)."""
    gate, up = (
        checkpoint_name(project("btd,df->btf", h, p[n], MLP_UP, precision, history(p, n)), MLP_IN)
        for n in ("w_gate", "w_up")
    )
    u = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    down = project("btf,fd->btd", u, p["w_down"], MLP_DOWN, precision, history(p, "w_down"))
    return checkpoint_name(down, MLP_OUT)


def in_compute_dtype(p: dict[str, jax.Array], dtype: Any) -> dict[str, jax.Array]:
    """Parameters in the compute dtype, but a router (float32 throughout) and experts
    (``e_*``: cast inside :func:`moe_mlp`'s ``shard_map``, so that their gradients are
    summed over the devices in float32 — and XLA:CPU aborts on bfloat16 ones there) and FP8
    histories (float32)."""
    kept = ("e_", PREFIX)
    return {n: a if n == "router" or n.startswith(kept) else a.astype(dtype) for n, a in p.items()}


def over_layers(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The routers' statistics stacked over the MoE layers as one: the losses and each
    expert's load averaged, the dropped assignments summed (empty for a dense model)."""
    if not stats:
        return {}
    return {
        "balance": stats["balance"].mean(),
        "z": stats["z"].mean(),
        "dropped": stats["dropped"].sum(),
        "load": stats["load"].mean(0),
    }


def loss_terms(
    stats: dict[str, jax.Array], share: float, balance_coef: float, z_coef: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The routers' weighted losses and their metrics (``moe_balance``, ``moe_z``,
    ``moe_dropped``, ``moe_load_<e>``) for ``share`` of the MoE layers, whose statistics
    ``stats`` averages (:func:`over_layers`): what a pipeline stage holding them adds."""
    loss = share * (balance_coef * stats["balance"] + z_coef * stats["z"])
    return loss, {
        "moe_balance": share * stats["balance"],
        "moe_z": share * stats["z"],
        "moe_dropped": stats["dropped"].astype(jnp.float32),
        **{f"moe_load_{e}": share * v for e, v in enumerate(stats["load"])},
    }


def mlp_counts(L: int, D: int, F: int, G: int, E: int, top_k: int, S: int) -> tuple[int, int]:
    """Parameters and multiply-adds per token of L SwiGLU MLPs of width F, G of them a
    mixture of E experts (each token through ``top_k`` of them and S shared ones) with a
    router: (every parameter, what a token runs)."""
    return (
        3 * D * F * (L - G + G * (E + S)) + G * D * E,
        3 * D * F * (L - G + G * (top_k + S)) + G * D * E,
    )


def route(
    x_TD: jax.Array, router_DE: jax.Array, top_k: int, axes: tuple[str, ...] = ()
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Top-k routing in float32: the experts [T, k] of each token, their renormalized
    weights [T, k], and the router's statistics over the tokens of every device of mesh
    ``axes`` (summed there): ``balance`` (Switch/Mixtral's load-balancing loss,
    E · Σ_e f_e · P_e with f_e the share of assignments to expert e and P_e its mean
    probability), ``z`` (the router z-loss, mean logsumexp²) and ``load`` [E] (f_e)."""
    total = (lambda v: jax.lax.psum(v, axes)) if axes else (lambda v: v)
    logits = x_TD.astype(jnp.float32) @ router_DE.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    E = router_DE.shape[-1]
    n = total(jnp.float32(x_TD.shape[0]))
    load = total(jnp.zeros(E, jnp.float32).at[experts.reshape(-1)].add(1.0)) / (n * top_k)
    stats = {
        "balance": E * jnp.sum(load * total(probs.sum(0)) / n),
        "z": total(jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))) / n,
        "load": load,
    }
    return experts, weights, stats


def grouped_swiglu(
    x_TD: jax.Array,
    experts_Tk: jax.Array,
    weights_Tk: jax.Array,
    w: dict[str, jax.Array],
    first: Any,
) -> jax.Array:
    """The weighted sum over each token's experts among ``w``'s (experts ``first`` …
    ``first + E_local - 1``) of SwiGLU(x) [T, D], dropless: the assignments sorted by
    expert, one ``ragged_dot`` per projection (the others' assignments sort last, into no
    group, and give 0)."""
    T, k = experts_Tk.shape
    n_local = w["w_gate"].shape[0]
    local = experts_Tk.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < n_local), local, n_local)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(n_local + 1, jnp.int32).at[key].add(1)[:n_local]
    rows = swiglu_groups(x_TD[order // k], sizes, w)
    out = jnp.zeros((T * k, x_TD.shape[-1]), x_TD.dtype).at[order].set(rows)
    return (out * weights_Tk.reshape(-1, 1).astype(out.dtype)).reshape(T, k, -1).sum(1)


def swiglu_groups(xs: jax.Array, sizes: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """SwiGLU of rows ``xs`` [R, D] sorted by expert, ``sizes[j]`` of them for expert ``j``
    of ``w``'s: one ``ragged_dot`` per projection; the rows past every group give 0."""
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w["w_gate"], sizes)) * jax.lax.ragged_dot(
        xs, w["w_up"], sizes
    )
    rows = jax.lax.ragged_dot(h, w["w_down"], sizes)
    return jnp.where((jnp.arange(xs.shape[0]) < sizes.sum())[:, None], rows, 0)


def capacity_mask(
    experts_BTk: jax.Array, n_experts: int, factor: float, positions_T: Any = None
) -> jax.Array:
    """True for each assignment within its expert's capacity in its sequence,
    ``ceil(factor · T · k / n_experts)``, earliest positions first (per sequence and by
    position — ``positions_T``, when a context-parallel layout runs the tokens in another
    order — so every layout drops the same assignments)."""
    B, T, k = experts_BTk.shape
    capacity = math.ceil(factor * T * k / n_experts)
    by_position = np.argsort(positions_T) if positions_T is not None else np.arange(T)
    in_order = experts_BTk[:, by_position].reshape(B, T * k)
    onehot = jax.nn.one_hot(in_order, n_experts, dtype=jnp.int32)
    rank = ((jnp.cumsum(onehot, axis=1) - onehot) * onehot).sum(-1)
    keep = (rank < capacity).reshape(B, T, k)
    return keep[:, np.argsort(by_position)]


def moe_mlp(
    h_BTD: jax.Array,
    p: dict[str, jax.Array],
    top_k: int,
    capacity_factor: float = 0.0,
    positions_T: Any = None,
    dispatch: str = "all_gather",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE SwiGLU of ``h`` [B, T, D] with router ``p['router']`` [D, E] and experts
    ``p['w_gate']``, ``p['w_up']`` [E, D, F], ``p['w_down']`` [E, F, D]; returns the
    output [B, T, D] and the router statistics (:func:`route`) with ``dropped`` (the
    assignments a capacity factor dropped, counted by the tokens' ``positions_T``).
    Routing, like the experts, runs on each device's own tokens; the statistics are summed
    over the devices. Under expert parallelism ``dispatch`` moves the tokens to their
    experts' devices: ``all_gather`` (every backend) or ``all_to_all``
    (:mod:`jaxpar.models.alltoall`)."""
    w = {n: p[n] for n in ("w_gate", "w_up", "w_down")}
    at = _placement()

    def local(h, router, w):
        experts, weights, stats = _routed(
            h, router, top_k, capacity_factor, positions_T, at.stat_axes, at.seq_axes
        )
        return _experts_output(h, experts, weights, w, at.ep_axes, dispatch), stats

    if at.ep_axes and dispatch == "all_to_all":
        alltoall.refuse_on_cpu()
    if at.batch_axes or at.seq_axes:
        local = _per_batch_shard(local, at, tuple(w))
    y, stats = local(h_BTD, p["router"], w)
    return constrain(y, ("batch", "seq", "act_embed")), stats


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where an MoE layer runs: the mesh, the batch axes and the sequence axes that split
    its tokens (it runs manual over both), those of the batch axes that split its experts,
    and the axes its router statistics are summed over."""

    mesh: Any
    batch_axes: tuple[str, ...]
    ep_axes: tuple[str, ...]
    stat_axes: tuple[str, ...]
    seq_axes: tuple[str, ...] = ()


def _placement() -> _Placement:
    """The MoE layer's placement under the layout being traced (none outside one)."""
    layout = active_layout()
    mesh = layout[0] if layout else None
    rules = layout[1] if layout else {}
    sizes = dict(mesh.shape) if mesh is not None else {}
    batch_axes = split_over(rules, sizes, "batch")
    # the sequence's axes (context parallelism): each device routes its own part of the
    # sequences (where the layer ran manual over the batch only, every device of a context
    # group computed the experts of the group's whole sequences, c times its share)
    seq_axes = tuple(a for a in split_over(rules, sizes, "seq") if a not in batch_axes)
    ep_axes = tuple(a for a in rules.get("experts", ()) if a in batch_axes)
    # inside a program already manual over batch axes (the spmd pipeline's stages; data
    # under accumulation per data shard, whose rules then name fsdp alone), the statistics
    # are summed over those too: the routing sees the whole (micro)batch
    manual = tuple(a for a in _manual_batch_axes(mesh) if a not in batch_axes)
    stat_axes = batch_axes + manual + seq_axes
    return _Placement(mesh, batch_axes, ep_axes, stat_axes, seq_axes)


def _routed(
    h_bTD: jax.Array,
    router_DE: jax.Array,
    top_k: int,
    capacity_factor: float,
    positions_T: Any,
    stat_axes: tuple[str, ...],
    seq_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Each of a device's tokens' experts and weights [b, T, k] and the router statistics
    (:func:`route`) with ``dropped``: a capacity factor zeroes the weights of the
    assignments beyond an expert's capacity, and counts them — over whole sequences where
    ``seq_axes`` split them (the experts of the sequence's other parts gathered)."""
    b, T, D = h_bTD.shape
    experts, weights, stats = route(h_bTD.reshape(b * T, D), router_DE, top_k, stat_axes)
    experts = experts.reshape(b, T, top_k)
    weights = weights.reshape(b, T, top_k)
    stats["dropped"] = jnp.zeros((), jnp.int32)
    if capacity_factor:
        keep = _sequence_capacity(
            experts, router_DE.shape[-1], capacity_factor, positions_T, seq_axes
        )
        weights = jnp.where(keep, weights, 0.0)
        dropped = jnp.sum(~keep)
        stats["dropped"] = jax.lax.psum(dropped, stat_axes) if stat_axes else dropped
    return experts, weights, stats


def _sequence_capacity(
    experts_bTk: jax.Array, n_experts: int, factor: float, positions_T: Any, seq_axes: tuple
) -> jax.Array:
    """:func:`capacity_mask` of a device's part ``[b, T/c, k]`` of its sequences, the parts of
    the ``c`` devices of ``seq_axes`` gathered in order (the whole sequences' ranks decide)."""
    if not seq_axes:
        return capacity_mask(experts_bTk, n_experts, factor, positions_T)
    whole = jax.lax.all_gather(experts_bTk, seq_axes, axis=1, tiled=True)
    keep = capacity_mask(whole, n_experts, factor, positions_T)
    part = experts_bTk.shape[1]
    start = jax.lax.axis_index(seq_axes) * part
    return jax.lax.dynamic_slice_in_dim(keep, start, part, axis=1)


def _experts_output(
    h_bTD: jax.Array,
    experts_bTk: jax.Array,
    weights_bTk: jax.Array,
    w: dict[str, jax.Array],
    ep_axes: tuple[str, ...],
    dispatch: str,
) -> jax.Array:
    """The weighted sum of each of a device's tokens' experts [b, T, D]: its own experts'
    share of it without expert parallelism; under it, its tokens moved to their experts'
    devices and back (``dispatch``)."""
    _, T, D = h_bTD.shape
    top_k = experts_bTk.shape[-1]
    dtype = h_bTD.dtype
    w = {n: a.astype(dtype) for n, a in w.items()}
    if ep_axes and dispatch == "all_to_all":
        return _all_to_all_output(h_bTD, experts_bTk, weights_bTk, w, ep_axes)
    h, experts, weights = h_bTD, experts_bTk, weights_bTk
    if ep_axes:  # gather the group's tokens: each device runs its experts on them all
        gather = functools.partial(jax.lax.all_gather, axis_name=ep_axes, tiled=True)
        h = gather(h.astype(_wire(dtype))).astype(dtype)
        experts = gather(experts)
        weights = gather(weights)
    first = jax.lax.axis_index(ep_axes) * w["w_gate"].shape[0] if ep_axes else 0
    n = h.shape[0] * T
    y = grouped_swiglu(
        h.reshape(n, D), experts.reshape(n, top_k), weights.reshape(n, top_k), w, first
    ).reshape(-1, T, D)
    if ep_axes:  # each device's partial sums back to the tokens' devices
        y = jax.lax.psum_scatter(
            y.astype(_wire(dtype)), ep_axes, scatter_dimension=0, tiled=True
        ).astype(dtype)
    return y


def _all_to_all_output(
    h_bTD: jax.Array,
    experts_bTk: jax.Array,
    weights_bTk: jax.Array,
    w: dict[str, jax.Array],
    ep_axes: tuple[str, ...],
) -> jax.Array:
    """:func:`_experts_output` with only the routed tokens moved, there and back
    (:func:`jaxpar.models.alltoall.dispatch`)."""
    _, T, D = h_bTD.shape
    top_k = experts_bTk.shape[-1]
    dtype = h_bTD.dtype

    def run(rows: jax.Array, sizes: jax.Array) -> jax.Array:
        return swiglu_groups(rows.astype(dtype), sizes, w).astype(rows.dtype)

    y = alltoall.dispatch(
        h_bTD.reshape(-1, D).astype(_wire(dtype)),
        experts_bTk.reshape(-1, top_k),
        weights_bTk.reshape(-1, top_k),
        run,
        w["w_gate"].shape[0],
        ep_axes,
    )
    return y.astype(dtype).reshape(-1, T, D)


def _per_batch_shard(local: Any, at: _Placement, weights: tuple[str, ...]) -> Any:
    """``local(h, router, w)`` run on each device's own tokens (``shard_map`` manual over
    the batch and sequence axes), the experts ``weights`` split over the expert axes."""
    bspec = PartitionSpec(_entry(at.batch_axes), _entry(at.seq_axes))
    wspec = PartitionSpec(_entry(at.ep_axes))
    return jax.shard_map(
        local,
        mesh=at.mesh,
        in_specs=(bspec, PartitionSpec(), {n: wspec for n in weights}),
        out_specs=(bspec, PartitionSpec()),
        axis_names={*at.batch_axes, *at.seq_axes},
        check_vma=False,
    )


def _entry(axes: tuple[str, ...]) -> Any:
    """A spec entry splitting a dim over ``axes`` (none, one, or several)."""
    return (axes if len(axes) > 1 else axes[0]) if axes else None


def _manual_batch_axes(mesh: Any) -> tuple[str, ...]:
    """The batch axes (``data``, ``fsdp``) the program being traced is manual over."""
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ()
    return tuple(
        a for a in BATCH_AXES if a in manual and mesh is not None and mesh.shape.get(a, 1) > 1
    )


def _wire(dtype: Any) -> Any:
    """What the dispatch moves (and sums, gathering's transpose included) a dtype as:
    XLA:CPU aborts on bfloat16 reductions there ("Invalid binary instruction opcode copy"),
    so on the CPU bfloat16 travels as float32 (as the lab counts it); elsewhere as it is."""
    return jnp.float32 if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else dtype
