"""One axis vocabulary: the mesh axes are written once, in jaxpar/axes.py, and the package
refers to them through :class:`jaxpar.axes.Axis` — a string literal ``"stage"`` elsewhere
is found by scanning the syntax tree of every module. Likewise the logical axes the engine
reads (``batch``, ``seq``, ``layers``) are written once, in jaxpar/logical.py; the rest of
a model's vocabulary is the model's own, written in its family's files."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.axes import BATCH_AXES, MANUAL_AXES, MESH_AXES, Axis
from jaxpar.logical import BATCH, LAYERS, SEQ
from jaxpar.mesh import MeshConfig, make_mesh

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpar"
NAMES = {axis.value for axis in Axis}
#: calls whose string argument names a config section, not a mesh axis (the ``data`` and
#: ``context`` sections share their names with axes)
SECTION_CALLS = {"section"}
#: a line that uses an axis's word for something else says so with this comment
SPARING_COMMENT = "# not a mesh axis"
#: dicts keyed by layout names: the rules preset ``fsdp`` is named after what it splits
NAMED_LAYOUTS = {"PRESETS"}


def _spared(tree: ast.AST) -> set[int]:
    """ids of the string constants that name a config section or a layout."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) in NAMED_LAYOUTS for t in targets):
                found |= {id(k) for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in SECTION_CALLS:
                found |= {id(a) for a in node.args if isinstance(a, ast.Constant)}
    return found


def axis_literals(
    source: str, names: set[str] = NAMES, sparing: str = SPARING_COMMENT
) -> list[int]:
    """Lines of ``source`` holding a string literal that is one of ``names`` (a mesh
    axis's name), unless the line carries the ``sparing`` comment."""
    tree = ast.parse(source)
    spared = _spared(tree)
    lines = source.splitlines()
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in names
        and id(node) not in spared
        and sparing not in lines[node.lineno - 1]
    ]


def test_no_axis_name_is_written_outside_the_vocabulary():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "axes.py" or path.parent != PACKAGE
        for line in axis_literals(path.read_text())
    ]
    assert not found, f"mesh axis names as string literals (use jaxpar.axes.Axis): {found}"


def test_the_scan_finds_a_literal_and_spares_section_and_layout_names():
    source = (
        'x = mesh.shape["stage"]\n@section("data")\nclass DataConfig: ...\nP(None, "tensor")\n'
        'PRESETS = {"fsdp": {"embed": ("fsdp",)}}\n'
        'meta.get("data")  # not a mesh axis: the loader\'s state\n'
    )
    assert axis_literals(source) == [1, 4, 5]


def test_the_vocabulary_is_the_mesh():
    """The mesh is built with the enum's axes in its order; the groups are axes of it; an
    axis stands wherever JAX takes a name and prints as the plain name."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
    assert mesh.axis_names == MESH_AXES == tuple(Axis)
    assert set(BATCH_AXES) | set(MANUAL_AXES) <= set(MESH_AXES)
    assert P(Axis.DATA, Axis.TENSOR) == P("data", "tensor")
    assert repr(P(Axis.DATA)) == repr(P("data"))
    assert mesh.shape[Axis.FSDP] == mesh.shape["fsdp"] == 2
    assert f"{Axis.CONTEXT}" == "context"
    assert np.prod(list(mesh.shape.values())) == 8


#: the logical axes the engine reads; models (and the Hugging Face key maps beside them)
#: write their own dims' names
ENGINE_NAMES = {BATCH, SEQ, LAYERS}
MODEL_FOLDERS = {"models", "hf"}


def test_the_engine_names_its_logical_axes_in_one_place():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in MODEL_FOLDERS
        and path != PACKAGE / "logical.py"
        for line in axis_literals(path.read_text(), ENGINE_NAMES, "# not a logical axis")
    ]
    assert not found, f"engine logical axes as string literals (use jaxpar.logical): {found}"
