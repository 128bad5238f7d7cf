"""SwiGLU MLPs: dense, and a mixture of experts — logical axes only: a float32 router, top-k
gating, a load-balancing auxiliary loss and a router z-loss, **dropless** expert
computation (each device's tokens sorted by expert, one grouped matmul per projection
through ``jax.lax.ragged_dot``), an optional capacity factor, and expert parallelism.

Layout. The layer runs inside ``shard_map`` over the mesh axes that split the batch (the
rules of ``batch``), so sorting and grouping stay on each device's own tokens. The experts'
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
from jax.sharding import PartitionSpec

from jaxpar.logical import active_layout, constrain
from jaxpar.models import alltoall
from jaxpar.models.family import LabLayout, Term

#: How expert parallelism moves tokens to their experts' devices (``model.moe_dispatch``).
Dispatch = Literal["all_gather", "all_to_all"]


def swiglu(h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """``down(silu(gate(h)) · up(h))``: column-parallel in, row-parallel out under TP."""
    gate = jnp.einsum("btd,df->btf", h, p["w_gate"])
    up = jnp.einsum("btd,df->btf", h, p["w_up"])
    u = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    return jnp.einsum("btf,fd->btd", u, p["w_down"])


def in_compute_dtype(p: dict[str, jax.Array], dtype: Any) -> dict[str, jax.Array]:
    """Parameters in the compute dtype, but a router (float32 throughout) and experts
    (``e_*``: cast inside :func:`moe_mlp`'s ``shard_map``, so that their gradients are
    summed over the devices in float32 — and XLA:CPU aborts on bfloat16 ones there)."""
    return {n: a if n == "router" or n.startswith("e_") else a.astype(dtype) for n, a in p.items()}


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
    E, n = router_DE.shape[-1], total(jnp.float32(x_TD.shape[0]))
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
    B, T, D = h_BTD.shape
    E = p["router"].shape[-1]
    w = {n: p[n] for n in ("w_gate", "w_up", "w_down")}
    layout = active_layout()
    mesh, rules = (layout[0], layout[1]) if layout else (None, {})
    batch_axes = tuple(
        a for a in rules.get("batch", ()) if mesh is not None and mesh.shape.get(a, 1) > 1
    )
    ep_axes = tuple(a for a in rules.get("experts", ()) if a in batch_axes)
    # inside a program already manual over batch axes (the spmd pipeline's stages), the
    # statistics are summed over those: the routing sees the whole (micro)batch
    stat_axes = batch_axes or _manual_batch_axes(mesh)

    def local(h, router, w):
        b = h.shape[0]
        experts, weights, stats = route(h.reshape(b * T, D), router, top_k, stat_axes)
        experts, weights = experts.reshape(b, T, top_k), weights.reshape(b, T, top_k)
        stats["dropped"] = jnp.zeros((), jnp.int32)
        if capacity_factor:
            keep = capacity_mask(experts, E, capacity_factor, positions_T)
            weights, dropped = jnp.where(keep, weights, 0.0), jnp.sum(~keep)
            stats["dropped"] = jax.lax.psum(dropped, stat_axes) if stat_axes else dropped
        dtype = h.dtype
        w = {n: a.astype(dtype) for n, a in w.items()}
        if ep_axes and dispatch == "all_to_all":
            run = lambda r, s: swiglu_groups(r.astype(dtype), s, w).astype(r.dtype)  # noqa
            y = alltoall.dispatch(
                h.reshape(-1, D).astype(_wire(dtype)),
                experts.reshape(-1, top_k),
                weights.reshape(-1, top_k),
                run,
                w["w_gate"].shape[0],
                ep_axes,
            )
            return y.astype(dtype).reshape(-1, T, D), stats
        if ep_axes:  # gather the group's tokens: each device runs its experts on them all
            gather = functools.partial(jax.lax.all_gather, axis_name=ep_axes, tiled=True)
            h = gather(h.astype(_wire(dtype))).astype(dtype)
            experts, weights = gather(experts), gather(weights)
        first = jax.lax.axis_index(ep_axes) * w["w_gate"].shape[0] if ep_axes else 0
        n = h.shape[0] * T
        y = grouped_swiglu(
            h.reshape(n, D), experts.reshape(n, top_k), weights.reshape(n, top_k), w, first
        ).reshape(-1, T, D)
        if ep_axes:  # each device's partial sums back to the tokens' devices
            y = jax.lax.psum_scatter(
                y.astype(_wire(dtype)), ep_axes, scatter_dimension=0, tiled=True
            ).astype(dtype)
        return y, stats

    if ep_axes and dispatch == "all_to_all":
        alltoall.refuse_on_cpu()
    if batch_axes:
        bspec = PartitionSpec(batch_axes if len(batch_axes) > 1 else batch_axes[0])
        wspec = PartitionSpec((ep_axes if len(ep_axes) > 1 else ep_axes[0]) if ep_axes else None)
        local = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(bspec, PartitionSpec(), {n: wspec for n in w}),
            out_specs=(bspec, PartitionSpec()),
            axis_names=set(batch_axes),
            check_vma=False,
        )
    y, stats = local(h_BTD, p["router"], w)
    return constrain(y, ("batch", "seq", "act_embed")), stats


def _manual_batch_axes(mesh: Any) -> tuple[str, ...]:
    """The batch axes (``data``, ``fsdp``) the program being traced is manual over."""
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ()
    return tuple(
        a for a in ("data", "fsdp") if a in manual and mesh is not None and mesh.shape.get(a, 1) > 1
    )


def _wire(dtype: Any) -> Any:
    """What the dispatch moves (and sums, gathering's transpose included) a dtype as:
    XLA:CPU aborts on bfloat16 reductions there ("Invalid binary instruction opcode copy"),
    so on the CPU bfloat16 travels as float32 (as the lab counts it); elsewhere as it is."""
    return jnp.float32 if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else dtype


def dispatch_terms(cfg: Any, layout: LabLayout) -> list[Term]:
    """The layout lab's expert-parallel dispatch per MoE layer (every ``cfg.moe_every``-th), for
    experts split over ``e`` devices: forward, the tokens [b·e, T, D] and their routing
    [b·e, T, k] (experts int32, weights float32) all-gathered, the outputs reduce-scattered;
    backward, their transposes — the output gradients all-gathered, the input and weight
    gradients reduce-scattered."""
    layers = cfg.n_layers // cfg.moe_every if cfg.n_experts else 0
    e = expert_degree(layout)
    if e == 1 or not layers or layout.stages is not None:  # pipelines: jaxpar/lab/staged.py
        return []
    k, seq = (
        layout.grad_accum,
        layout.seq_len // math.prod(layout.sizes[a] for a in layout.rules.get("seq", ())),
    )
    itemsize = 4 if layout.cpu else jnp.dtype(cfg.dtype).itemsize
    tokens = layout.rows * e * seq / k  # a group's tokens, per microbatch
    times = k * layers
    # a rematerialized forward gathers again; its reduce-scatter feeds nothing the backward
    # reads (the next group's input is kept): dead code
    again = times * (2 if cfg.remat != "none" else 1)
    if getattr(cfg, "moe_dispatch", "all_gather") == "all_to_all":
        # balanced routing: a device's n·k routed rows there and back, and their gradients
        # (not measured: XLA:CPU does not compile ragged_all_to_all; the count exchanges'
        # e·E/e integers left out)
        rows = tokens / e * cfg.top_k * cfg.d_model * itemsize
        return [
            Term("all-to-all", "experts: routed rows there and back", rows, e, 2 * again),
            Term("all-to-all", "experts: their gradients back and there", rows, e, 2 * times),
        ]
    return [
        Term(
            "all-gather",
            "experts: tokens and routing gathered",
            tokens * (cfg.d_model * itemsize + 8 * cfg.top_k),
            e,
            again,
        ),
        Term(
            "reduce-scatter",
            "experts: outputs reduce-scattered",
            tokens * cfg.d_model * itemsize,
            e,
            times,
        ),
        Term(
            "all-gather",
            "experts: output gradients gathered",
            tokens * cfg.d_model * itemsize,
            e,
            times,
        ),
        Term(
            "reduce-scatter",
            "experts: input and weight gradients reduce-scattered",
            tokens * (cfg.d_model * itemsize + 4 * cfg.top_k),
            e,
            times,
        ),
    ]


def expert_degree(layout: LabLayout) -> int:
    """The devices a group's experts are split over (``e``): those of the batch axes that
    ``rules.experts`` names — none inside the spmd pipeline's stages, which are manual over
    the batch axes and take the experts in gathered (as FSDP's weights)."""
    if layout.stages is not None and not layout.sub_mesh:
        return 1
    batch = [a for a in layout.rules.get("batch", ()) if layout.sizes.get(a, 1) > 1]
    return math.prod(layout.sizes[a] for a in layout.rules.get("experts", ()) if a in batch)


#: The dense transformer's activation all-reduces (``jaxpar/models/transformer.py``).
MEGATRON = "Megatron activation all-reduces"


def tensor_terms(cfg: Any, layout: LabLayout, dense: list[Term]) -> list[Term]:
    """A dense transformer's activation all-reduces under ``tensor`` (``dense``: Megatron's
    count, a SwiGLU MLP in every layer) with the MoE layers' own (measured, XLA:CPU).

    The experts' F dim is split over ``tensor`` inside :func:`moe_mlp`'s ``shard_map``
    (manual over the batch axes only), so a grouped matmul's output rows, ``[b·e·T·k, D]``
    (the group's assignments: every token ``top_k`` times, ``e`` devices' tokens under
    expert parallelism), are partial sums: XLA all-reduces the down projection's once a
    forward — again in a recomputed one, ``save_dots`` included (the routing weights'
    gradient reads them) — and the gate and up projections' input gradients once each a
    backward. Shared experts are one dense SwiGLU, which Megatron's count covers; without
    them an MoE layer has no dense MLP, whose all-reduces come off the count. A fully
    rematerialized group also recomputes its first ``moe_every − 1`` MLPs' outputs (the next
    layer reads them). Pipelines as Megatron's count: every tick as its costliest branch
    (spmd), a device of the first stage (mpmd: its forward and its backward's recompute)."""
    megatron = next((t for t in dense if t.what == MEGATRON), None)
    if not cfg.n_experts or megatron is None:
        return dense
    layers, passes = cfg.n_layers // cfg.moe_every, layout.grad_accum  # microbatches
    forward = counted = 1  # a pass's forwards that all-reduce the rows; that count a dense MLP
    again = cfg.remat != "none" and not layout.sub_mesh
    if layout.stages is not None:
        ticks, p, v, m = layout.stages
        layers //= p * v
        passes *= m if layout.sub_mesh else ticks
        if layout.sub_mesh:
            counted, forward = 2, 1 if layout.residuals else 2
    n = passes * layers
    mlps = (cfg.moe_every - 1) * (again and cfg.remat == "full") - (
        0 if cfg.n_shared_experts else counted + 2
    )
    rows = megatron.payload_bytes * cfg.top_k * expert_degree(layout)
    return [
        dataclasses.replace(x, times=x.times + n * mlps) if x is megatron else x for x in dense
    ] + [
        Term(
            "all-reduce",
            "experts: routed outputs all-reduced over tensor",
            rows,
            megatron.group,
            n * (forward + again),
        ),
        Term(
            "all-reduce",
            "experts: routed input gradients all-reduced over tensor",
            rows,
            megatron.group,
            n * 2,
        ),
    ]
