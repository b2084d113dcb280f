"""Figures of the code's shape, for reviews and closing notes: the longest functions, functions with
more than 8 parameters, boolean parameters, import cycles between modules, and the lines of the
files named on the command line.

    python scripts/code_metrics.py [--top 10] [FILE ...]      (from the repository's root)

Triton kernels (functions decorated with triton.jit) are left out of the length and parameter
counts: a kernel's parameters are its launch signature. Imports inside functions and under
TYPE_CHECKING count as edges: a cycle through them is still a cycle a reader has to hold in mind.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path("moerun").resolve()  # the package of the checkout the command runs in


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _parameters(node: ast.FunctionDef) -> list[ast.arg]:
    a = node.args
    named = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
    return named + [p for p in (a.vararg, a.kwarg) if p is not None]


def _is_bool(node: ast.FunctionDef, param: ast.arg) -> bool:
    """Annotated bool (or bool | None), or defaulting to True/False."""
    if param.annotation is not None and ast.unparse(param.annotation) in ("bool", "bool | None"):
        return True
    a = node.args
    positional = a.posonlyargs + a.args
    with_defaults = [p.arg for p in positional][len(positional) - len(a.defaults) :]
    defaults = dict(zip(with_defaults, a.defaults, strict=True))
    defaults |= {p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None}
    default = defaults.get(param.arg)
    return isinstance(default, ast.Constant) and isinstance(default.value, bool)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The moerun modules a file imports: `from a import b` counts a.b where that is a module, else
    a (the parent packages Python runs first are not counted: they would put every file in a cycle
    with the package's __init__)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.append(full if full in modules else node.module)
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("moerun"):
                found.add(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10, help="longest functions to list (default 10)")
    parser.add_argument("files", nargs="*", default=["moerun/decoder/model.py", "moerun/moe/layer.py"])
    args = parser.parse_args()
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(p) for p in paths}
    lengths, many, bools, graph = [], [], 0, {}
    for path in paths:
        tree = ast.parse(path.read_text())
        name = _module(path)
        graph[name] = _imports(tree, modules) - {name}
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_kernel(node):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
            lengths.append((node.end_lineno - node.lineno + 1, where))
            params = _parameters(node)
            bools += sum(_is_bool(node, p) for p in params)
            if len(params) > 8:
                many.append((len(params), where))
    lengths.sort(reverse=True)
    print(f"longest functions (outside Triton kernels), of {len(lengths)}:")
    for n, where in lengths[: args.top]:
        print(f"  {n:4d}  {where}")
    print(f"functions over 80 lines: {sum(1 for n, _ in lengths if n > 80)}")
    print(f"functions with more than 8 parameters: {len(many)}")
    for n, where in sorted(many, reverse=True):
        print(f"  {n:4d}  {where}")
    print(f"boolean parameters: {bools}")
    cycles = _cycles(graph)
    print(f"import cycles between modules: {len(cycles)}")
    for cycle in cycles:
        print("  " + " <-> ".join(cycle))
    for file in args.files:
        path = Path(file)
        lines = len(path.read_text().splitlines()) if path.exists() else "absent"
        print(f"lines in {file}: {lines}")


if __name__ == "__main__":
    main()
