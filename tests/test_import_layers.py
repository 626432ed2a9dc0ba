"""The package's floors: imports run one way, with no cycle and nothing hidden in a function.

``engine/`` is built in floors (``docs/architecture.md`` opens with the picture). A module
may import its own floor or any floor below, never one above; no two modules import each
other, even through others; and no module imports another of ``engine`` inside a function
(the old way to dodge a cycle). Lazy imports of heavy optional libraries (triton, ray,
xgrammar, ...) are not ``engine`` modules and are not concerned. ``if TYPE_CHECKING:``
imports must point down too, but do not run, so they may close a loop inside one floor.

The graph is read from the source with :mod:`ast` (no module is imported), so this test is
the lint step that fails on a cycle; ``make lint`` runs it beside ruff.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "engine"

# Top to bottom. The first prefix that a module's dotted name starts with gives its floor
# (``engine.api`` matches ``engine.api`` and ``engine.api.engine``, not ``engine.apis``).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("package facade", ("engine",)),  # engine/__init__.py only, see _floor
    ("command line", ("engine.__main__", "engine.cli")),
    ("HTTP front ends", ("engine.http",)),
    ("embedded API", ("engine.api",)),
    ("chat", ("engine.chat",)),
    ("process plumbing", ("engine.process",)),
    ("actors", ("engine.actors",)),
    ("pure policy", ("engine.core",)),
    ("model runner", ("engine.runner",)),
    ("models", ("engine.models",)),
    ("kernels", ("engine.ops", "engine.parallel")),
    ("shared types", ("engine.messages", "engine.params", "engine.config", "engine.multimodal", "engine.pixels",
                      "engine.audio", "engine.image_tiles", "engine.kv_transfer")),
    ("structured outputs", ("engine.structured",)),
    ("base", ("engine.errors", "engine._version")),
)

# The only function-level imports of engine modules: modules that exist to wrap a heavy
# optional library, imported when first needed (with the reason).
LAZY = {
    ("engine.ops", "engine.ops.triton_ops"):
        "triton is heavy and optional, and TRITON_INTERPRET must be set before its kernels "
        "are decorated at import",
    ("engine.models.layers.linear", "engine.ops.triton.quant_matmul"):
        "triton is heavy and optional: QuantLinear imports the Triton matmul only when it "
        "first multiplies by weights kept in GGUF's blocks (the Triton backend's layout)",
}

# A module this much over 600 lines must say in its docstring why it is one room.
MAX_LINES = 650


@dataclasses.dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    in_function: bool
    typing_only: bool


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _floor(module: str) -> int:
    if module == "engine":
        return 0
    for index, (_, prefixes) in enumerate(FLOORS[1:], start=1):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and the picture in "
                         f"docs/architecture.md)")


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The ``engine`` modules an import statement loads (a name imported from a package is
    its submodule when one exists)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if not is_package:
                parts.pop()
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        if name.split(".")[0] != "engine":
            continue
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES:
            found.append(name)
    return found


def _imports() -> list[Import]:
    out = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool, typing_only: bool,
                  module: str = module, is_package: bool = is_package) -> None:
            for child in ast.iter_child_nodes(node):
                typing = typing_only or (
                    isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _resolve(module, is_package, child):
                        if target != module:
                            out.append(Import(module, target, child.lineno, in_function, typing))
                nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, in_function or nested, typing)

        visit(tree, False, False)
    return out


IMPORTS = _imports()


def _cycles(edges: list[Import], modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for edge in edges:
        graph[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            strong(v)
    return found


def test_every_module_is_on_a_floor() -> None:
    for module in MODULES:
        _floor(module)


def test_no_import_cycle() -> None:
    running = [i for i in IMPORTS if not i.typing_only]
    assert _cycles(running, set(MODULES)) == []


def test_no_import_runs_up_a_floor() -> None:
    up = [f"{i.source}:{i.line} imports {i.target} ({FLOORS[_floor(i.source)][0]} -> "
          f"{FLOORS[_floor(i.target)][0]})"
          for i in IMPORTS if _floor(i.target) < _floor(i.source)]
    assert up == []


def test_no_engine_module_is_imported_inside_a_function() -> None:
    hidden = [f"{i.source}:{i.line} imports {i.target}" for i in IMPORTS
              if i.in_function and (i.source, i.target) not in LAZY]
    assert hidden == []


def test_a_module_much_over_600_lines_says_why_it_is_one_room() -> None:
    large = []
    for module, path in MODULES.items():
        text = path.read_text()
        lines = len(text.splitlines())
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and "one room" not in docstring:
            large.append(f"{module}: {lines} lines")
    assert large == []


def test_the_cycle_finder_finds_a_loop_through_three_modules() -> None:
    # The cycle check above must be able to fail.
    loop = [Import("a", "b", 1, False, False), Import("b", "c", 1, False, False),
            Import("c", "a", 1, False, False), Import("c", "d", 1, False, False)]
    assert _cycles(loop, {"a", "b", "c", "d"}) == [["a", "b", "c"]]
    assert _cycles(loop[1:], {"a", "b", "c", "d"}) == []


def _picture_arrows() -> list[tuple[tuple[str, ...], str]]:
    """The arrows of the floor picture that opens docs/architecture.md: each ``A, B --> C,
    D`` line of its first fenced block means some module of A or B imports C, and D."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = doc.split("```", 2)[1]
    arrows = []
    for line in block.splitlines():
        if "-->" not in line:
            continue
        left, right = line.split("-->")
        sources = tuple(s.strip() for s in left.split(None, 1)[1].split(","))
        arrows.extend((sources, target.strip()) for target in right.split(","))
    return arrows


def _package(name: str) -> str:
    return "engine." + name.rstrip("/")


def test_every_arrow_of_the_floor_picture_is_an_import_that_exists() -> None:
    arrows = _picture_arrows()
    assert len(arrows) > 50  # the picture was found and read
    running = {(i.source, i.target) for i in IMPORTS if not i.typing_only}

    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    missing = []
    for sources, target in arrows:
        groups = [_package(s) for s in sources]
        if not any(within(a, g) and within(b, _package(target)) for a, b in running for g in groups):
            missing.append(f"{', '.join(sources)} --> {target}")
    assert missing == []


def test_the_floor_picture_lists_the_floors_in_order() -> None:
    # Each arrow of the picture points down a floor (or stays on one).
    for sources, target in _picture_arrows():
        for source in sources:
            assert _floor(_package(target)) >= _floor(_package(source)), (source, target)



def test_import_engine_stays_light() -> None:
    # engine/__init__.py promises that ``import engine`` (errors, params, messages) does
    # not import torch; a fresh interpreter is the only honest place to check it.
    code = ("import sys, engine, engine.messages; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"import engine pulled in {out}"
