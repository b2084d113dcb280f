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
    "moe": {"kernels", "cpu", "quant", "activations.py", "placement.py", "linear.py", "settings.py"},
    "sampling.py": set(),
    "batching.py": {"text", "sampling.py"},
    "generate.py": {"batching.py"},
    "decoder": {
        "moe",
        "offload",
        "cpu",
        "quant",
        "text",
        "activations.py",
        "placement.py",
        "linear.py",
        "generate.py",
        "batching.py",
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
        "settings.py",
        "distributed",
    },  # fmt: skip
    "export": {"checkpoint", "decoder", "families", "loader", "quant", "text"},
    "benchmarks": {
        "checkpoint",
        "decoder",
        "families",
        "moe",
        "offload",
        "quant",
        "loader",
        "kernels",
        "cpu",
        "export",
        "text",
        "generate.py",
        "batching.py",
        "serve",
        "distributed",
        "activations.py",
        "settings.py",
    },  # fmt: skip
    "serve": {"batching.py"},
    "cli": {
        "moerun",
        "serve",
        "benchmarks",
        "checkpoint",
        "export",
        "decoder",
        "moe",
        "quant",
        "text",
        "sampling.py",
        "batching.py",
        "perplexity.py",
        "settings.py",
    },  # fmt: skip
    "__init__.py": {"checkpoint", "decoder", "moe", "generate.py"},
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
    """(line, module) of every absolute import, at any depth, outside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "moerun" and node.level == 0:
            # `from moerun import cli` imports the part it names
            yield from ((node.lineno, f"moerun.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_every_part_is_in_the_picture():
    parts = {
        p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"
    }
    assert parts <= set(ALLOWED), f"add {sorted(parts - set(ALLOWED))} to docs/ARCHITECTURE.md and ALLOWED"


def test_imports_flow_the_way_the_picture_allows():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _part(path)
        for line, module in _imports(ast.parse(path.read_text())):
            target = _target(module)
            if target is None or target == me:
                continue
            if target not in ALLOWED.get(me, set()):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} ({me} -> {target})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_forbidden_import():
    """The checker itself: a kernel module that opened files through the loader is caught."""
    tree = ast.parse("def f():\n    from moerun.loader.gguf_file import GGUFFile\n")
    targets = {_target(module) for _, module in _imports(tree)}
    assert "loader" in targets and "loader" not in ALLOWED["kernels"]
    typed_only = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import moerun.cli\n")
    assert {_target(m) for _, m in _imports(typed_only)} == {None}
