"""The rules tables: logical axis names → mesh axes, as presets (the ``rules`` section) and
the sequence-parallel rule.

Layouts in scaling-book notation (``W[D_fsdp, F_tensor]``: dim D sharded over
mesh axis ``fsdp``, F over ``tensor``), for an MLP weight ``W_in[D, F]`` and
activations ``X[B, T, D]``:

========  =====================================  ================================
preset    parameters                             activations
========  =====================================  ================================
dp        ``W_in[D, F]`` (replicated)            ``X[B_data, T, D]``
fsdp      ``W_in[D_fsdp, F]`` (ZeRO-3)           ``X[B_(data,fsdp), T, D]``
tp        ``W_in[D, F_tensor]``,                 ``X[B_data, T, D]``,
          ``W_out[F_tensor, D]``                 ``H[B_data, T, F_tensor]``
fsdp_tp   ``W_in[D_fsdp, F_tensor]``             ``X[B_(data,fsdp), T, D]``
auto      = fsdp_tp: every axis has a rule, so any mesh degrees work
========  =====================================  ================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from jaxpar.axes import MESH_AXES, Axis
from jaxpar.errors import ConfigError
from jaxpar.logical import ACT_SEQ, BATCH, LAYERS, SEQ, Rules
from jaxpar.schema import section
from jaxpar.tensor_parallel import TensorConfig

# Logical names every preset maps, so any built-in model works under any preset. Stacked
# layers go over 'stage' (a no-op while mesh.stage = 1): pipeline stages are layer ranges;
# the sequence of activations over 'context' (a no-op while mesh.context = 1).
_REPLICATED = {
    SEQ: (Axis.CONTEXT,),
    ACT_SEQ: (Axis.CONTEXT,),
    "experts": (),
    "act_embed": (),
    "kv": (),
    LAYERS: (Axis.STAGE,),
    "classes": (),
    "conv_h": (),
    "conv_w": (),
    "conv_in": (),
    "conv_out": (),
}

PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "dp": {
        **_REPLICATED,
        BATCH: (Axis.DATA,),
        "embed": (),
        "mlp": (),
        "heads": (),
        "kv_heads": (),
        "vocab": (),
    },
    "fsdp": {
        **_REPLICATED,
        BATCH: (Axis.DATA, Axis.FSDP),
        "embed": (Axis.FSDP,),
        "mlp": (),
        "heads": (),
        "kv_heads": (),
        "vocab": (),
    },
    "tp": {
        **_REPLICATED,
        BATCH: (Axis.DATA,),
        "embed": (),
        "mlp": (Axis.TENSOR,),
        "heads": (Axis.TENSOR,),
        "kv_heads": (Axis.TENSOR,),
        "vocab": (Axis.TENSOR,),
    },
    "fsdp_tp": {
        **_REPLICATED,
        BATCH: (Axis.DATA, Axis.FSDP),
        "embed": (Axis.FSDP,),
        "mlp": (Axis.TENSOR,),
        "heads": (Axis.TENSOR,),
        "kv_heads": (Axis.TENSOR,),
        "vocab": (Axis.TENSOR,),
    },
}
PRESETS["auto"] = dict(PRESETS["fsdp_tp"])


def _axes(name: str, value: Any) -> tuple[str, ...]:
    """A rule's mesh axes: ``tensor``, ``data,fsdp`` or ``[data, fsdp]``; None, ``none``,
    ``null`` or empty: not sharded."""
    if value is None:
        return ()
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        return tuple(p for p in parts if p and p.lower() not in ("none", "null"))
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(
        f"rule 'rules.{name}' must be a mesh axis, a list of mesh axes or null, got {value!r}"
    )


def _rule_table(value: Any) -> Any:
    """Overrides given as a mapping (logical name → mesh axes) as sorted pairs."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(name), _axes(name, v)) for name, v in value.items()))
    return value


@section("rules")
class RulesConfig:
    """Logical-axis rules: a named preset plus per-name overrides.

    In YAML and on the command line the overrides are written next to ``preset``, one key
    per logical axis name: ``rules.mlp=tensor``, ``rules.batch=data,fsdp``,
    ``rules.kv=null`` (not sharded).
    """

    preset: str = Field(
        "auto",
        description="the rules table to start from: auto, dp, fsdp, "
        "tp or fsdp_tp (see jaxpar/rules.py)",
    )
    overrides: Annotated[tuple[tuple[str, tuple[str, ...]], ...], BeforeValidator(_rule_table)] = (
        Field(
            (),
            description="rules.<logical axis name>=<mesh axes>: a mesh axis, a list of mesh "
            "axes, or null for not sharded; replaces that name's rule in the preset",
            json_schema_extra={"type": "name → mesh axes"},
        )
    )


def sequence_parallel(rules: Rules) -> dict[str, tuple[str, ...]]:
    """``rules`` with the residual stream's tokens (logical ``act_seq``) split over the
    ``tensor`` axis too: Megatron's sequence parallelism, for any model that names its
    residual stream ``("batch", "act_seq", …)`` (the built-in transformers do)."""
    axes = rules.get(ACT_SEQ, rules.get(SEQ, ()))
    return {**rules, ACT_SEQ: (*axes, Axis.TENSOR) if Axis.TENSOR not in axes else axes}


def resolve_rules(
    cfg: RulesConfig, tensor: TensorConfig | None = None
) -> dict[str, tuple[str, ...]]:
    """The rules table of a preset with the config's overrides applied, and with
    ``tensor.sequence`` the sequence-parallel rule (:func:`sequence_parallel`).

    Raises:
      ConfigError: for an unknown preset or an override naming an unknown mesh axis.
    """
    if cfg.preset not in PRESETS:
        raise ConfigError(
            f"unknown rules.preset '{cfg.preset}'; choose one of {', '.join(sorted(PRESETS))}"
        )
    rules = dict(PRESETS[cfg.preset])
    for name, axes in cfg.overrides:
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(
                    f"rules.{name}={','.join(axes)}: '{axis}' is not a mesh axis; "
                    f"use some of {', '.join(MESH_AXES)} or null"
                )
        rules[name] = tuple(axes)
    return sequence_parallel(rules) if tensor is not None and tensor.sequence else rules
