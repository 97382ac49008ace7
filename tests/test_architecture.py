"""The installed package holds to the rooms table in docs/ARCHITECTURE.md.

The table is read from the document, so the document and this test cannot drift apart. Every module
of every room is imported; the import graph is built from the source (ast): module-level imports,
function-level imports (each of which must be listed below with its reason) and the modules that
`importlib.import_module` loads by name. The test fails on an edge the table does not allow, on a
cycle between rooms, on a cycle between modules at module level, and on a library a room may not use.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
import pkgutil
import re
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURE_MD = os.path.join(REPO_ROOT, "docs", "ARCHITECTURE.md")
ROOMS_HEADING = "## Rooms and the imports they may make"

# Function-level imports of jlight modules: (importing module, imported module) -> why it is not at the top.
FUNCTION_LEVEL_IMPORTS = {
    ("jlight", "jlight.api"): "`import jlight` stays cheap: jlight.LLM and jlight.generate load the engine on first use",
    ("jlight.pallas_kernels.dispatch", "jlight.pallas_kernels.paged_attention_pallas"): "GPU kernel, loaded when chosen",
    ("jlight.pallas_kernels.dispatch", "jlight.pallas_kernels.paged_attention_mosaic"): "GPU kernel, loaded when chosen",
    ("jlight.pallas_kernels.dispatch", "jlight.pallas_kernels.paged_prefill_mosaic"): "GPU kernel, loaded when chosen",
    ("jlight.pallas_kernels.dispatch", "jlight.pallas_kernels.paged_decode_mosaic"): "GPU kernel, loaded when chosen",
    ("jlight.pallas_kernels.dispatch", "jlight.pallas_kernels.matmul_pallas"): "GPU kernel, loaded when chosen",
    ("jlight.pallas_kernels.dispatch", "jlight.pallas_kernels.grouped_matmul_pallas"): "GPU kernel, loaded when chosen",
    ("jlight.serve.cli", "jlight.serve.app"): "the web stack (fastapi) loads only when the server runs",
    ("jlight.serve.cli", "jlight.serve.drain"): "the web stack (uvicorn) loads only when the server runs",
    ("jlight.serve.cli", "jlight.serve.host_work"): "the web stack (fastapi) loads only when the server runs",
    ("jlight.serve.cli", "jlight.serve.router"): "the web stack (fastapi, httpx) loads only when the router runs",
}

# Libraries a module may import inside a function, and why they load only when used. The standard
# library is not listed: importing it inside a function costs nothing and makes no cycle.
LAZY_LIBRARIES = {
    "llguidance": "structured outputs only (grammar compilation, token masks)",
    "gguf": "GGUF checkpoints only",
    "huggingface_hub": "hub downloads only",
    "orbax": "converted checkpoints only",
    "safetensors": "HF safetensors checkpoints only",
    "ml_dtypes": "safetensors dtypes numpy lacks, when such a checkpoint loads",
    "tokenizers": "a tokenizer is built only when a model loads",
    "jinja2": "chat templates only",
    "tqdm": "progress bars only",
    "uvicorn": "the web server only",
    "matplotlib": "benchmark plots only (`jlight bench serve --plot`)",
    "jax": "private Mosaic GPU interpreter parameters (jax._src), for interpret mode only",
}


def parse_rooms(text: str) -> dict:
    """The rooms table under ROOMS_HEADING: room -> (may import: tuple of rooms or modules, libraries:
    tuple, or None for any)."""
    assert ROOMS_HEADING in text, f"docs/ARCHITECTURE.md has no section {ROOMS_HEADING!r}"
    lines = text.split(ROOMS_HEADING, 1)[1].splitlines()
    table = []
    for line in lines:
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    header = [cell.lower() for cell in table[0]]
    room_col, may_col, lib_col = header.index("room"), header.index("may import"), header.index("libraries")
    rooms = {}
    for row in table[2:]:  # after the header and its |---| line
        (room,) = re.findall(r"`([^`]+)`", row[room_col])
        libraries = None if row[lib_col] == "any" else tuple(re.findall(r"`([^`]+)`", row[lib_col]))
        rooms[room] = (tuple(re.findall(r"`([^`]+)`", row[may_col])), libraries)
    return rooms


@functools.cache
def rooms() -> dict:
    with open(ARCHITECTURE_MD, encoding="utf-8") as f:
        return parse_rooms(f.read())


def room_of(module: str, names=None) -> str | None:
    """The room whose name is the longest prefix of `module` (None: not in any room)."""
    names = rooms() if names is None else names
    matches = [r for r in names if module == r or module.startswith(r + ".")]
    return max(matches, key=len) if matches else None


@functools.cache
def package_modules() -> dict:
    """Every module of every room: name -> (source path, is a package)."""
    found = {}
    for room in rooms():
        spec = importlib.util.find_spec(room)
        assert spec is not None and spec.origin, f"room {room} is not an installed module"
        found[room] = (spec.origin, spec.submodule_search_locations is not None)
        if spec.submodule_search_locations:
            for info in pkgutil.walk_packages(spec.submodule_search_locations, room + "."):
                sub = importlib.util.find_spec(info.name)
                found[info.name] = (sub.origin, info.ispkg)
    return found


def _target(base: str, name: str, modules) -> str:
    """`from base import name`: the module `base.name` if it is one, else `base`."""
    return f"{base}.{name}" if f"{base}.{name}" in modules else base


def imports_of(module: str) -> dict:
    """{"module": [(target, line)], "function": [(target, line)], "dynamic": [(target, line)]} for one
    module's source. Targets are full module names (jlight's) or any other module's dotted name."""
    path, is_pkg = package_modules()[module]
    modules = package_modules()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = {"module": [], "function": [], "dynamic": []}
    package = module.split(".") if is_pkg else module.split(".")[:-1]

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            kind = "function" if in_function else "module"
            if isinstance(child, ast.Import):
                found[kind] += [(alias.name, child.lineno) for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package[:len(package) - (child.level - 1)]
                    base = ".".join(parts + ([child.module] if child.module else []))
                else:
                    base = child.module
                found[kind] += [(_target(base, alias.name, modules), child.lineno) for alias in child.names]
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    # A module that imports by name (importlib.import_module) may load any module its strings name.
    calls_import_module = any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree))
    if calls_import_module:
        found["dynamic"] = [(n.value, n.lineno) for n in ast.walk(tree)
                            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in modules]
    return found


def all_edges():
    """(importer, target, line, kind) for every import of a jlight module."""
    for module in sorted(package_modules()):
        for kind, targets in imports_of(module).items():
            for target, line in targets:
                if target == "jlight" or target.startswith("jlight."):
                    yield module, target, line, kind


def allowed(importer: str, target: str) -> bool:
    source_room, target_room = room_of(importer), room_of(target)
    if source_room == target_room:
        return True
    # An entry that is a room allows that room; one that is a module allows that module (and its submodules).
    entries = rooms()[source_room][0]
    return any(target_room == e or (e not in rooms() and (target == e or target.startswith(e + "."))) for e in entries)


def find_cycle(graph: dict) -> list | None:
    """A cycle in a directed graph {node: set of nodes}, as a list of nodes, or None."""
    state, stack = {}, []

    def dfs(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def test_rooms_table():
    table = rooms()
    assert {"jlight", "jlight.core", "jlight.models", "jlight.sharding", "jlight.pallas_kernels", "jlight.serve",
            "jlight.cli"} <= set(table)
    assert table["jlight.core"][0] == (), "jlight.core is a leaf: it may import no other room"
    for room, (entries, _) in table.items():
        for entry in entries:
            assert entry in table or entry in package_modules(), f"{room} may import {entry}: no such room or module"
    graph = {room: {room_of(e) for e in entries} - {room} for room, (entries, _) in table.items()}
    assert find_cycle(graph) is None, f"the rooms table allows a cycle: {find_cycle(graph)}"


def test_parse_rooms_reads_a_table():
    text = f"""{ROOMS_HEADING}

| room | folder | may import | libraries |
|---|---|---|---|
| `a` | a/ | | `jax` |
| `a.b` | b/ | `a`, `a.c.d` | any |

after the table
"""
    assert parse_rooms(text) == {"a": ((), ("jax",)), "a.b": (("a", "a.c.d"), None)}
    assert room_of("a.b.x", {"a": 0, "a.b": 0}) == "a.b" and room_of("a.bc", {"a": 0, "a.b": 0}) == "a"


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("module", sorted(package_modules()) if os.path.exists(ARCHITECTURE_MD) else [])
def test_module_imports(module):
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and not (e.name == "jlight" or e.name.startswith("jlight.")):
            pytest.skip(f"{module} needs {e.name}, which is not installed")
        raise


def test_every_module_is_in_a_room():
    assert [m for m in package_modules() if room_of(m) is None] == []
    # The rooms cover the package: every jlight module an import names was found by the walk.
    unknown = sorted({t for _, t, _, _ in all_edges() if t not in package_modules()})
    assert unknown == [], f"imports of modules outside the walked rooms: {unknown}"


def test_room_edges_are_allowed():
    bad = [f"{m}:{line} imports {t} ({kind} level): {room_of(m)} may not import {room_of(t)}"
           for m, t, line, kind in all_edges() if not allowed(m, t)]
    assert bad == [], "\n".join(bad)


def test_no_cycle_between_rooms():
    graph = {}
    for m, t, _, _ in all_edges():
        if room_of(m) != room_of(t):
            graph.setdefault(room_of(m), set()).add(room_of(t))
    assert find_cycle(graph) is None, f"rooms import each other: {' -> '.join(find_cycle(graph))}"


def test_no_cycle_between_modules_at_module_level():
    graph = {}
    for m, t, _, kind in all_edges():
        if kind == "module" and t != m:
            graph.setdefault(m, set()).add(t)
    assert find_cycle(graph) is None, f"modules import each other: {' -> '.join(find_cycle(graph))}"


def test_function_level_imports_are_listed():
    seen, bad = set(), []
    for module in sorted(package_modules()):
        for target, line in imports_of(module)["function"]:
            top = target.split(".")[0]
            if top == "jlight":
                key = (module, target)
                seen.add(key)
                if key not in FUNCTION_LEVEL_IMPORTS:
                    bad.append(f"{module}:{line} imports {target} inside a function; import it at the top "
                               "(or list it in FUNCTION_LEVEL_IMPORTS with its reason)")
            elif top not in sys.stdlib_module_names and top not in LAZY_LIBRARIES:
                bad.append(f"{module}:{line} imports {target} inside a function; import it at the top "
                           "(or list the library in LAZY_LIBRARIES with its reason)")
    assert bad == [], "\n".join(bad)
    assert set(FUNCTION_LEVEL_IMPORTS) - seen == set(), "FUNCTION_LEVEL_IMPORTS lists imports that are gone"


def test_rooms_use_only_their_libraries():
    bad = []
    for module in sorted(package_modules()):
        libraries = rooms()[room_of(module)][1]
        if libraries is None:
            continue
        for kind, targets in imports_of(module).items():
            for target, line in targets:
                top = target.split(".")[0]
                if top not in ("jlight", "__future__") and top not in sys.stdlib_module_names and top not in libraries:
                    bad.append(f"{module}:{line} imports {target}; {room_of(module)} may use {', '.join(libraries)}")
    assert bad == [], "\n".join(bad)


def test_allowed_reads_rooms_and_modules():
    assert allowed("jlight.models.llama", "jlight.core.config")
    assert not allowed("jlight.models.moe", "jlight.pallas_kernels.grouped_matmul_pallas")  # it arrives in Kernels
    assert not allowed("jlight.models.llama", "jlight.pallas_kernels.dispatch")
    assert not allowed("jlight.models.llama", "jlight.sharding.plan")
    assert not allowed("jlight.sharding.plan", "jlight.models.moe")
    assert not allowed("jlight.serve.cli", "jlight.cli")  # the room `jlight` does not allow its sub-room jlight.cli
    assert not allowed("jlight.core.config", "jlight.errors")
