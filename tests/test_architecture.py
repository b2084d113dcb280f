"""The package's layout as docs/ARCHITECTURE.md draws it: each top-level folder (or root module) of
moerun may import only the parts listed for it here, so imports flow downward. A new folder, or an
import the picture does not allow (kernels/ reading files, families/ picking a kernel, the core
importing cli/ or benchmarks/), fails here and names the file and the import."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moerun"

# part -> the parts it may import (besides itself); kept in step with docs/ARCHITECTURE.md
ALLOWED = {
    "settings.py": set(),
    "activations.py": set(),
    "quant": set(),
    "text": {"loader"},
    "loader": {"quant", "settings.py"},
    "placement.py": {"loader"},
    "linear.py": {"cpu", "quant"},
    "kernels": {"quant", "activations.py"},
    "cpu": {"quant", "activations.py", "settings.py"},
    "offload": {"loader", "quant"},
    "moe": {
        "kernels",
        "cpu",
        "quant",
        "offload",
        "activations.py",
        "placement.py",
        "linear.py",
        "settings.py",
    },
    "sampling.py": set(),
    "batching.py": {"text", "sampling.py", "decoder"},
    "generate.py": {"batching.py", "decoder"},
    "model.py": {"decoder", "generate.py", "batching.py"},
    "decoder": {
        "moe",
        "offload",
        "cpu",
        "quant",
        "text",
        "activations.py",
        "placement.py",
        "linear.py",
    },  # fmt: skip
    "families": {"decoder", "moe", "activations.py"},
    "perplexity.py": {"decoder"},
    "distributed": {"settings.py", "quant"},
    "checkpoint": {
        "decoder",
        "families",
        "loader",
        "moe",
        "offload",
        "quant",
        "text",
        "distributed",
        "model.py",
    },  # fmt: skip
    "export": {"checkpoint", "decoder", "families", "loader", "quant", "text"},
    "benchmarks": {
        "checkpoint",
        "families",
        "moe",
        "offload",
        "quant",
        "loader",
        "model.py",
        "serve",
        "distributed",
        "text",
    },  # fmt: skip
    "serve": {"batching.py", "decoder", "text"},
    "cli": {
        "moerun",
        "serve",
        "text",
        "benchmarks",
        "checkpoint",
        "export",
        "moe",
        "quant",
        "sampling.py",
        "perplexity.py",
        "settings.py",
    },  # fmt: skip
    "__init__.py": {"checkpoint", "batching.py", "model.py", "moe"},
    "__main__.py": {"cli"},
}
# every part may raise the checkpoint errors of errors.py, which imports nothing
ALLOWED = {part: allowed | {"errors.py"} for part, allowed in ALLOWED.items()} | {"errors.py": set()}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0]


def _target(module: str) -> str | None:
    """The part of moerun a dotted module name lies in (None: not moerun)."""
    parts = module.split(".")
    if parts[0] != "moerun":
        return None
    if len(parts) == 1:
        return "moerun"
    return parts[1] if (PACKAGE / parts[1]).is_dir() else parts[1] + ".py"


def _imports(tree: ast.AST):
    """(line, module) of every absolute import, at any depth, `if TYPE_CHECKING:` blocks included (an
    import for a type annotation is a dependency all the same)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "moerun" and node.level == 0:
            # `from moerun import cpu` imports the part it names
            yield from ((node.lineno, f"moerun.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _edges() -> dict[str, dict[str, str]]:
    """part -> {part it imports: where (the first file:line)}, across the package."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _part(path)
        for line, module in _imports(ast.parse(path.read_text())):
            target = _target(module)
            if target is not None and target != me:
                edges.setdefault(me, {}).setdefault(target, f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def test_every_part_is_in_the_picture():
    parts = {
        p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"
    }
    assert parts <= set(ALLOWED), f"add {sorted(parts - set(ALLOWED))} to docs/ARCHITECTURE.md and ALLOWED"


def test_imports_flow_the_way_the_picture_allows():
    wrong = [
        f"{where} imports moerun.{target} ({me} -> {target})"
        for me, targets in _edges().items()
        for target, where in targets.items()
        if target not in ALLOWED.get(me, set())
    ]
    assert not wrong, "\n".join(wrong)


def test_the_picture_lists_only_imports_that_exist():
    """Every import the table allows is made somewhere: the picture says what the code does."""
    edges = _edges()
    unused = [
        f"{me} -> {target}"
        for me, allowed in ALLOWED.items()
        for target in allowed - {"errors.py"}
        if target not in edges.get(me, {})
    ]
    assert not unused, "allowed but never imported (drop from ALLOWED and the doc): " + ", ".join(unused)


def test_the_picture_has_no_cycle():
    """Imports flow one way: no part reaches itself through the parts it may import."""
    graph = {
        part: {"__init__.py" if t == "moerun" else t for t in allowed} for part, allowed in ALLOWED.items()
    }
    done: set[str] = set()

    def visit(part: str, path: list[str]) -> None:
        assert part not in path, "a cycle: " + " -> ".join([*path[path.index(part) :], part])
        if part not in done:
            for target in graph.get(part, ()):
                visit(target, [*path, part])
            done.add(part)

    for part in graph:
        visit(part, [])


def test_the_check_sees_a_forbidden_import():
    """The checker itself: a kernel module that opened files through the loader is caught."""
    tree = ast.parse("def f():\n    from moerun.loader.gguf_file import GGUFFile\n")
    targets = {_target(module) for _, module in _imports(tree)}
    assert "loader" in targets and "loader" not in ALLOWED["kernels"]
    typed_only = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import moerun.cli\n")
    assert "cli" in {_target(m) for _, m in _imports(typed_only)}  # a type's import counts too
