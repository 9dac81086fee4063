"""The layers of imports that docs/architecture.md states: which part of src/myvllm/ may import
which (ALLOWED below). The model's stack points down, never up:

    models/  ->  layers/  ->  kernels/      (layers/ uses only utils/context.py and
                                             utils/distributed.py of utils/)

and above it the engine: engine/ (the core) makes the features' objects (worker/, sample/,
spec_decode/, structured_output/, executor/), which read the core's requests and batches;
serving/ and entrypoints/ sit on top. The settings (config.py, sampling_parameters.py,
value_checks.py) import nothing of the package.

Every import of a myvllm module is read with ast, at module level and inside functions (a late
import is still an import). One under ``if TYPE_CHECKING:`` never runs (a type hint only) and
is spared by the layering check, but not by the circle check: no module may reach itself
through imports of any kind (test_no_import_circles).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "myvllm"
SETTINGS = ("config", "sampling_parameters", "value_checks")  # top-level modules
FACE = ("__init__", "demo")  # the package's public face: it may import anything

# part -> the parts (or single modules, "utils.context") it may import besides itself
ALLOWED: dict[str, tuple[str, ...]] = {
    "settings": (),
    "kernels": (),
    "utils": ("kernels", "settings"),
    "layers": ("kernels", "utils.context", "utils.distributed"),
    "models": ("layers",),
    # The core: it makes the features' objects and hands them to its parts.
    "engine": ("worker", "sample", "spec_decode", "structured_output", "executor", "models",
               "layers", "kernels", "utils", "settings"),
    # The runner's machinery and the features: they read the core's requests and batches.
    "worker": ("engine", "sample", "spec_decode", "models", "layers", "kernels", "utils",
               "settings"),
    "sample": ("engine", "structured_output", "layers", "kernels", "utils", "settings"),
    "spec_decode": ("engine", "worker", "sample", "models", "layers", "kernels", "utils",
                    "settings"),
    "structured_output": ("engine", "layers", "utils", "settings"),
    "executor": ("engine", "worker", "sample", "utils", "settings"),
    # Above the core: its process, its clients, the HTTP server and the CLI.
    "serving": ("engine", "executor", "sample", "utils", "settings"),
    "entrypoints": ("engine", "serving", "executor", "sample", "structured_output", "utils",
                    "settings"),
}


def part_of(module: str) -> str:
    """myvllm.layers.linear -> "layers"; myvllm.config -> "settings"; myvllm -> "face"."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in FACE:
        return "face"
    if parts[0] in SETTINGS:
        return "settings"
    return parts[0]


def may_import(importer: str, target: str) -> bool:
    part, target_part = part_of(importer), part_of(target)
    if part == "face" or part == target_part:
        return True
    name = target.removeprefix("myvllm.")
    return any(target_part == allowed or name == allowed or name.startswith(allowed + ".")
               for allowed in ALLOWED[part])  # fmt: skip


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_imports(tree: ast.AST, type_checking: bool = False
                      ) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, anywhere, except those inside `if TYPE_CHECKING:` (those too
    with type_checking=True)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imported_modules(path: Path, root: Path, type_checking: bool = False
                     ) -> list[tuple[int, str]]:
    """(line, module) for each myvllm module that the file imports at run time (and under
    `if TYPE_CHECKING:` too, with type_checking=True)."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in _run_time_imports(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:  # from .x import y: relative to this file's package
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        for alias in node.names:  # `from myvllm.utils import context` imports a module too
            sub = root.parent.joinpath(*f"{base}.{alias.name}".split("."))
            is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
            out.append((node.lineno, f"{base}.{alias.name}" if is_module else base))
    return [(line, name) for line, name in out if name.split(".")[0] == root.name]


def back_arrows(root: Path = PACKAGE) -> list[str]:
    """Each import that points up (or sideways into a part it may not use), as file:line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = _module_name(path, root)
        for line, target in imported_modules(path, root):
            if not may_import(importer, target):
                allowed = ", ".join(ALLOWED[part_of(importer)]) or "nothing else of myvllm"
                found.append(f"{path.relative_to(root)}:{line} imports {target} "
                             f"({part_of(importer)} may import: {allowed})")  # fmt: skip
    return found


def test_every_part_of_the_package_has_a_place() -> None:
    parts = {part_of(_module_name(p, PACKAGE)) for p in PACKAGE.rglob("*.py")}
    unknown = parts - set(ALLOWED) - {"face"}
    assert not unknown, (f"{sorted(unknown)}: give each a place in docs/architecture.md, "
                         "\"Layers of imports\", and in ALLOWED here")  # fmt: skip


def test_imports_point_down() -> None:
    arrows = back_arrows()
    assert not arrows, ("imports that point up (docs/architecture.md, \"Layers of imports\"):"
                        + "".join(f"\n  {arrow}" for arrow in arrows))


def test_a_planted_back_arrow_is_found(tmp_path: Path) -> None:
    """The check sees module-level, function-level and relative imports, and spares
    TYPE_CHECKING ones."""
    root = tmp_path / "myvllm"
    for folder in ("kernels", "layers", "utils"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "layers" / "linear.py").write_text("import torch\n")
    (root / "utils" / "context.py").write_text("")
    (root / "kernels" / "ok.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from myvllm.layers.linear import linear\n")  # fmt: skip
    (root / "kernels" / "late.py").write_text("def f():\n    from ..layers import linear\n")
    (root / "utils" / "top.py").write_text("import myvllm.layers.linear\n")
    (root / "layers" / "fine.py").write_text("from myvllm.utils import context\n")
    assert back_arrows(root) == [
        "kernels/late.py:2 imports myvllm.layers.linear (kernels may import: nothing else of "
        "myvllm)",
        "utils/top.py:1 imports myvllm.layers.linear (utils may import: kernels, settings)",
    ]


def import_circles(root: Path = PACKAGE) -> list[list[str]]:
    """The circles of the module graph: each group of modules that reach one another through
    imports, every import counted (module level, in functions, under TYPE_CHECKING). A
    package's __init__ counts as the module it is; importing a submodule is not counted as
    importing its package."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        graph[module] = {target for _, target in imported_modules(path, root, True)
                         if target != module}
    # Tarjan's strongly connected components, iteratively (no recursion limit to mind).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        circles.append(sorted(group))
    return circles


def test_no_import_circles() -> None:
    circles = import_circles()
    assert not circles, "modules that import one another, directly or around a circle:" + "".join(
        f"\n  {', '.join(group)}" for group in circles)


def test_a_planted_circle_is_found(tmp_path: Path) -> None:
    """A circle closed only under TYPE_CHECKING, or by an import inside a function, is one."""
    root = tmp_path / "myvllm"
    (root / "engine").mkdir(parents=True)
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "a.py").write_text("from myvllm.engine.b import f\n")
    (root / "engine" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from myvllm.engine import a\n")
    (root / "engine" / "c.py").write_text("import myvllm.engine.d\n")
    (root / "engine" / "d.py").write_text("def g():\n    from . import c\n")
    (root / "engine" / "e.py").write_text("from myvllm.engine import a\n")
    assert import_circles(root) == [["myvllm.engine.a", "myvllm.engine.b"],
                                    ["myvllm.engine.c", "myvllm.engine.d"]]


MAX_MODULES_A_FOLDER = 20
# The classes a learner reads first: each derives from no class of the project (a feature
# reaches them as an object they are handed, never as a base class).
CORE_CLASSES = {"engine/sequence.py": "Sequence", "engine/block_manager.py": "BlockManager",
                "engine/scheduler.py": "Scheduler", "engine/model_runner.py": "ModelRunner",
                "engine/core.py": "EngineCore", "engine/llm_engine.py": "LLMEngine"}


def test_no_folder_holds_more_than_20_modules() -> None:
    """Each folder of src/myvllm a short list a reader can take in (its __init__.py counted)."""
    crowded = {str(folder.relative_to(PACKAGE)): n for folder in [PACKAGE, *PACKAGE.rglob("*")]
               if folder.is_dir() and (n := len(list(folder.glob("*.py")))) > MAX_MODULES_A_FOLDER}
    assert not crowded, f"folders over {MAX_MODULES_A_FOLDER} modules: {crowded}"


def test_the_core_classes_derive_from_no_class() -> None:
    for path, name in CORE_CLASSES.items():
        tree = ast.parse((PACKAGE / path).read_text())
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
        assert not node.bases, f"{path}: class {name} derives from {ast.unparse(node.bases[0])}"
