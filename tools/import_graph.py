#!/usr/bin/env python3
"""The Python client's import graph, checked (issue 31).

    python3 tools/import_graph.py [PACKAGE_DIR]     (default client/python/weightsync)

Walks every module of the package with `ast` (nothing is imported or run)
and fails (exit 1, each finding on a line with file:line) on

* an import cycle: modules that reach one another through imports,
  wherever the import statement sits (at the top or inside a function: a
  deferred import is still an arrow between the two modules);
* a private name of another module: `from weightsync.m import _name`, or
  `m._name` where m is a module of the package bound by an import.
  Private modules themselves (weightsync._gpu) may be imported; their
  public names are the package's internal interface. Dunder names are not
  private.

Arrows are drawn to the module named: `from weightsync import planner`
is an arrow to weightsync.planner, `from weightsync import Trainer` one to
the package's __init__; a submodule's import of its parent package (which
Python runs first) is not counted. --graph prints the arrows.
"""

import argparse
import ast
import os
import sys


def modules_of(root):
    """{dotted name: path} of every .py file under the package dir `root`."""
    base = os.path.basename(os.path.normpath(root))
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join([base] + rel)] = os.path.join(d, f)
    return out


def _resolve(name, mods):
    """The longest prefix of dotted `name` that is a module of the package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def _absolute(node, me, is_pkg):
    """The module an ImportFrom names, made absolute for relative imports."""
    if not node.level:
        return node.module or ""
    base = me.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(me, path, mods):
    """([(target module, line)], [(line, message)]) of module `me`."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    arrows, bad, bound = [], [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _resolve(a.name, mods)
                if target is None:
                    continue
                arrows.append((target, node.lineno))
                if a.asname:
                    bound[a.asname] = target
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, me, is_pkg)
            if _resolve(source, mods) is None:
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in mods:   # a module: the arrow goes to it
                    arrows.append((sub, node.lineno))
                    bound[a.asname or a.name] = sub
                    continue
                target = _resolve(source, mods)
                arrows.append((target, node.lineno))
                if _private(a.name) and target != me:
                    bad.append((node.lineno, f"imports private name {a.name} of {target}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _private(node.attr)
                and bound[node.value.id] != me
                and f"{bound[node.value.id]}.{node.attr}" not in mods):
            bad.append((node.lineno, f"uses private name {node.attr} of "
                                     f"{bound[node.value.id]}"))
    parents = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 1)}
    arrows = [(t, line) for t, line in arrows if t != me and t not in parents]
    return arrows, bad


CLASS_LINES, FUNCTION_LINES = 400, 80


def budgets(path):
    """[(line, message)] of the classes and functions of `path` over budget."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        limit = (CLASS_LINES if isinstance(node, ast.ClassDef) else
                 FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 else None)
        if limit is not None:
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                kind = "class" if limit == CLASS_LINES else "function"
                out.append((node.lineno, f"{kind} {node.name} is {n} lines (budget {limit})"))
    return out


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(root, show=False):
    """Findings (strings) for the package at `root`; prints the graph if
    `show`."""
    mods = modules_of(root)
    graph, where, findings = {}, {}, []
    for me, path in sorted(mods.items()):
        arrows, bad = scan(me, path, mods)
        graph[me] = {t for t, _ in arrows}
        for t, line in arrows:
            where.setdefault((me, t), f"{path}:{line}")
        findings += [f"{path}:{line}: {msg}" for line, msg in sorted(bad + budgets(path))]
        if show:
            print(f"{me} -> {', '.join(sorted(graph[me])) or '-'}")
    for comp in cycles(graph):
        inside = set(comp)
        edges = [f"{a} -> {b} ({where[(a, b)]})" for a in comp
                 for b in sorted(graph[a] & inside)]
        findings.append(f"import cycle among {', '.join(comp)}:\n    " + "\n    ".join(edges))
    return findings


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package", nargs="?", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "client", "python", "weightsync"))
    ap.add_argument("--graph", action="store_true", help="print every module's arrows")
    args = ap.parse_args()
    findings = check(args.package, args.graph)
    for f in findings:
        print(f)
    if findings:
        print(f"import_graph: {len(findings)} finding(s) in {args.package}", file=sys.stderr)
        return 1
    print(f"import_graph: {len(modules_of(args.package))} modules, no cycle, "
          "no private name imported, every class and function within budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
