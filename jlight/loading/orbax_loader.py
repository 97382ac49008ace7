"""Orbax checkpoints of jlight params: written by `jlight convert`, restored into any mesh.

A converted model directory holds:
  config.json             HF-style config (ModelConfig.from_json_file reads it back)
  jlight_checkpoint.json  format version, dtype, quantization and the params "skeleton"
                          (every leaf's shape and dtype, and which nodes are QuantizedWeights)
  params/                 the orbax (tensorstore) checkpoint of the params tree
  tokenizer files         whatever the source model had (tokenizer.json, ...)

Restoring builds an abstract tree (jax.ShapeDtypeStruct with a sharding per leaf) from the
skeleton, so orbax reads each device's slice straight into that device: no full host copy,
no re-quantization, and the same checkpoint serves one device or a tp=8 mesh.
"""
from __future__ import annotations

import json
import os
import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jlight.core import quantization
from jlight.core.config import ModelConfig
from jlight.core.errors import ModelLoadError
from jlight.models import get_model_family
from jlight.sharding import rules

MANIFEST_NAME = "jlight_checkpoint.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1
# Named tuples that may appear in a params tree, by the name the skeleton records.
_NAMED_TUPLES = {cls.__name__: cls for cls in (quantization.QuantizedWeight, quantization.W8A8Weight, quantization.Fp8Weight)}


def is_orbax_model_dir(path: str) -> bool:
    """True when `path` is a directory written by `jlight convert`."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST_NAME))


def params_skeleton(params) -> dict:
    """A JSON-able mirror of the params tree: {"shape", "dtype"} per leaf, named tuples tagged."""
    if isinstance(params, tuple) and hasattr(params, "_fields"):
        node = {"__namedtuple__": type(params).__name__}
        node.update({f: params_skeleton(getattr(params, f)) for f in params._fields})
        return node
    if isinstance(params, dict):
        return {k: params_skeleton(v) for k, v in params.items()}
    return {"shape": list(params.shape), "dtype": jnp.dtype(params.dtype).name}


def save_params(directory: str, params, *, manifest_extra: dict | None = None) -> None:
    """Write `params` as an orbax checkpoint under directory/params plus the manifest.

    The manifest is written last, so a directory without it (a crashed convert) is never
    mistaken for a complete checkpoint.
    """
    # orbax, slow to import, loads only for converted checkpoints.
    import orbax.checkpoint as ocp

    os.makedirs(directory, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(directory, PARAMS_DIR)), params, force=True)
    checkpointer.wait_until_finished()
    manifest = {"format_version": FORMAT_VERSION, "skeleton": params_skeleton(params),
                "files": _file_sizes(os.path.join(directory, PARAMS_DIR)), **(manifest_extra or {})}
    tmp = os.path.join(directory, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(directory, MANIFEST_NAME))


def _file_sizes(params_path: str) -> dict:
    """{path relative to params/: size in bytes} of every file orbax wrote."""
    sizes = {}
    for root, _, names in os.walk(params_path):
        for name in names:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, params_path)] = os.path.getsize(path)
    return sizes


def check_files(directory: str, manifest: dict) -> None:
    """Refuse a checkpoint whose params files are missing or cut short (an interrupted copy), before
    orbax reads it: its failed reads leave threads that print tracebacks when the process exits.
    Checkpoints written before the manifest listed its files are not checked."""
    params_path = os.path.join(directory, PARAMS_DIR)
    for rel, size in manifest.get("files", {}).items():
        path = os.path.join(params_path, rel)
        found = os.path.getsize(path) if os.path.isfile(path) else None
        if found != size:
            what = "is missing" if found is None else f"has {found} bytes, the conversion wrote {size}"
            raise ModelLoadError(f"{directory}: the checkpoint's file {PARAMS_DIR}/{rel} {what}; "
                                 "it is damaged or incomplete, copy it again or run `jlight convert` again")


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path} ({e}); re-run `jlight convert` to rewrite the checkpoint") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(
            f"{path} has checkpoint format {manifest.get('format_version')!r}, this jlight reads format "
            f"{FORMAT_VERSION}; re-run `jlight convert` with this version"
        )
    return manifest


def mesh_shardings(config, skeleton: dict, mesh):
    """NamedShardings on `mesh` for every leaf, from the family's logical axes and the sharding
    rules (jlight/sharding/rules.py). A QuantizedWeight's scales get their own spec there."""
    family = get_model_family(config)
    specs = rules.param_specs(family.param_axes(config), abstract_params(skeleton))
    return rules.named_shardings(mesh, specs)


def abstract_params(node: dict, shardings=None):
    """ShapeDtypeStructs (with their target sharding, when given) in the params tree's structure."""
    if "__namedtuple__" in node:
        cls = _NAMED_TUPLES.get(node["__namedtuple__"])
        if cls is None:
            raise ModelLoadError(f"checkpoint holds an unknown weight type {node['__namedtuple__']!r}; convert it again with this jlight")
        return cls(**{f: abstract_params(node[f], _pick(shardings, f)) for f in cls._fields})
    if "shape" in node and "dtype" in node and not isinstance(node["shape"], dict):
        return jax.ShapeDtypeStruct(tuple(node["shape"]), jnp.dtype(node["dtype"]), sharding=shardings)
    return {k: abstract_params(v, _pick(shardings, k)) for k, v in node.items()}


def _pick(shardings, key):
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return shardings  # one sharding for the whole subtree (or the default device)
    if isinstance(shardings, dict):
        return shardings[key]
    return getattr(shardings, key)


def restore_params(directory: str, shardings=None, *, manifest: dict | None = None):
    """Restore the params tree, each leaf directly into its target sharding.

    `shardings`: None (every leaf on the first local device), one Sharding for all leaves,
    or a tree of Shardings matching the params (see mesh_shardings).
    """
    # orbax, slow to import, loads only for converted checkpoints.
    import orbax.checkpoint as ocp

    manifest = manifest or read_manifest(directory)
    skeleton = manifest["skeleton"]
    if shardings is None:
        shardings = SingleDeviceSharding(jax.local_devices()[0])
    target = abstract_params(skeleton, shardings)
    params_path = os.path.abspath(os.path.join(directory, PARAMS_DIR))
    if not os.path.isdir(params_path):
        raise ModelLoadError(f"{directory} has no {PARAMS_DIR}/ folder; the conversion did not finish, run `jlight convert` again")
    check_files(directory, manifest)
    try:
        with ocp.StandardCheckpointer() as checkpointer:  # closed even on failure (else its threads print at exit)
            return checkpointer.restore(params_path, target)
    except Exception as e:  # orbax/TensorStore errors of many types; reading the user's files is all this does
        root = e
        while root.__cause__ is not None or root.__context__ is not None:  # the innermost error says what is wrong
            root = root.__cause__ or root.__context__
        why = (str(root).strip().splitlines() or [type(root).__name__])[0][:200]
        raise ModelLoadError(f"{directory}: the checkpoint's params could not be read ({why}); "
                             "it is damaged or incomplete, run `jlight convert` again") from e


def load_orbax_model(directory: str, *, mesh=None):
    """(ModelConfig, params) of a converted model directory, restored onto `mesh`'s shardings
    (None: the first local device)."""
    manifest = read_manifest(directory)
    config = ModelConfig.from_json_file(os.path.join(directory, "config.json"))
    shardings = mesh_shardings(config, manifest["skeleton"], mesh) if mesh is not None else None
    return config, restore_params(directory, shardings, manifest=manifest)
