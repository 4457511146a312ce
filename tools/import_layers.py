#!/usr/bin/env python3
"""The package's own import graph, from the AST alone (nothing is imported), checked against its layers.

    python tools/import_layers.py [ROOT]                    # report (ROOT: the repository, default cwd)
    python tools/import_layers.py [ROOT] --layers --check   # exit 1 on any import of the package inside a
                                                            # function, any circle, or any edge against LAYERS
    python tools/import_layers.py [ROOT] --edges            # also list every import inside a function
    python tools/import_layers.py [ROOT] --json FILE        # write the graph as JSON

Each folder of `marlhf_edu/` is a layer (LAYERS; a lower number is a lower layer). An import may point to a lower
layer or stay inside its own folder (no circle: checked by the strongly-connected-components test); no module of
`stages/` imports another (each is one command), and no module imports a package facade (a package's
`__init__`) other than the root package's. `tests/test_repo.py` runs the check.

Edges: every `import marlhf_edu.x`, `from marlhf_edu.x import y`, `from marlhf_edu import x` (x a submodule ->
marlhf_edu.x; x a name -> the package __init__), relative imports resolved. Implicit parent-package imports
(importing a.b.c runs a/__init__ and a/b/__init__) are not edges. `if TYPE_CHECKING:` imports are reported
apart and not counted as runtime edges. Scope of an import: "top" (module body, incl. if/try at module level),
"class" (class body), "func" (inside any def/lambda, however deep).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections import defaultdict

PKG = "marlhf_edu"
HEAVY = ("transformers", "peft", "trl", "accelerate", "matplotlib", "bitsandbytes", "datasets")

# --layers: the layer of each top-level folder (or root module); lower number = lower layer.
# An edge may point to a lower layer, or stay inside its own folder (acyclic: checked by the SCC test); the
# root entry points (`marlhf_edu/__init__.py`, `cli.py`) sit on top. Inside `stages/` every module is a command:
# no edge between two of them. No module imports a package facade (a package's __init__) of the package.
LAYERS = {"errors": 0, "math": 1, "loading": 2, "data": 3, "records": 3, "ppo": 4, "memory": 5, "training": 6,
          "stages": 7, "teaching": 7, "cli": 8, "": 8}


def module_name(root, path):
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def collect(root):
    files = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PKG)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                p = os.path.join(dirpath, f)
                files[module_name(root, p)] = p
    return files


def is_type_checking(test):
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(mod, path, modules):
    """Yield (target_module, names, lineno, scope, enclosing_function, type_checking, third_party_root)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    out = []

    def resolve_from(node):
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            return ".".join(base + ([node.module] if node.module else []))
        return node.module or ""

    def visit(node, scope, func, tc):
        for child in ast.iter_child_nodes(node):
            s, f, t = scope, func, tc
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                s = "func"
                f = (func + "." if func else "") + getattr(child, "name", "<lambda>")
            elif isinstance(child, ast.ClassDef):
                s = "class" if scope == "top" else scope
                f = (func + "." if func else "") + child.name
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for b in child.body:
                    visit_stmt(b, scope, func, True)
                for b in child.orelse:
                    visit_stmt(b, scope, func, tc)
                continue
            visit_stmt(child, s, f, t, descend=True)

    def visit_stmt(child, s, f, t, descend=True):
        if isinstance(child, ast.Import):
            for a in child.names:
                if a.name == PKG or a.name.startswith(PKG + "."):
                    tgt = a.name
                    while tgt not in modules and "." in tgt:
                        tgt = tgt.rsplit(".", 1)[0]
                    out.append((tgt, [a.name], child.lineno, s, f, t, None))
                else:
                    out.append((None, [a.name], child.lineno, s, f, t, a.name.split(".")[0]))
        elif isinstance(child, ast.ImportFrom):
            base = resolve_from(child)
            if base == PKG or base.startswith(PKG + "."):
                # `from pkg import sub` -> edge to pkg.sub; a name -> edge to pkg (its __init__)
                subs = [a.name for a in child.names if f"{base}.{a.name}" in modules]
                names = [a.name for a in child.names if f"{base}.{a.name}" not in modules]
                for sname in subs:
                    out.append((f"{base}.{sname}", [sname], child.lineno, s, f, t, None))
                if names:
                    tgt = base
                    while tgt not in modules and "." in tgt:
                        tgt = tgt.rsplit(".", 1)[0]
                    out.append((tgt, names, child.lineno, s, f, t, None))
            else:
                out.append((None, [a.name for a in child.names], child.lineno, s, f, t, base.split(".")[0]))
        if descend:
            visit(child, s, f, t)

    visit(tree, "top", "", False)
    return out


def tarjan(nodes, edges):
    index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
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
            sccs.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return [c for c in sccs if len(c) > 1 or c[0] in edges.get(c[0], ())]


def folder_of(mod):
    """'math' for marlhf_edu.math.gae, 'errors' for marlhf_edu.errors, '' for the package itself."""
    return mod[len(PKG) + 1:].split(".")[0] if mod != PKG else ""


def layer_of(mod):
    return LAYERS.get(folder_of(mod))


def edge_problem(src, dst, facades):
    fs, fd = folder_of(src), folder_of(dst)
    ls, ld = layer_of(src), layer_of(dst)
    if ls is None or ld is None:
        return "outside the layout"
    if dst in facades and src != PKG and not src.startswith(dst + ".") and dst != PKG:
        return "imports a package facade"
    if fs == fd == "stages":
        return "one command imports another"
    if fs == fd or {fs, fd} <= {"", "cli"}:
        return None
    return None if ld < ls else "points up or sideways"


def short(m):
    return m[len(PKG) + 1:] if m.startswith(PKG + ".") else ("(pkg)" if m == PKG else m)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", nargs="?", default=".")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--layers", action="store_true", help="also check that every edge points down (LAYERS)")
    ap.add_argument("--edges", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    files = collect(root)
    modules = set(files)

    imps = {m: imports_of(m, p, modules) for m, p in files.items()}
    own = {m: [i for i in v if i[0] and not i[5]] for m, v in imps.items()}
    tc_only = sum(1 for v in imps.values() for i in v if i[0] and i[5])
    edges_all, edges_top = defaultdict(set), defaultdict(set)
    for m, v in own.items():
        for tgt, names, line, scope, func, tc, _ in v:
            if tgt == m:
                continue
            edges_all[m].add(tgt)
            if scope != "func":
                edges_top[m].add(tgt)
    # heavy third-party libraries each module loads at import time, directly or through top-level own imports
    heavy_direct = {m: sorted({i[6] for i in v if i[6] in HEAVY and i[3] != "func" and not i[5]}) for m, v in imps.items()}

    def heavy_closure(m, seen=None):
        seen = seen if seen is not None else set()
        if m in seen:
            return set()
        seen.add(m)
        out = set(heavy_direct[m])
        # a submodule import also runs its parent packages' __init__
        parts = m.split(".")
        for k in range(1, len(parts)):
            parent = ".".join(parts[:k])
            if parent in modules:
                out |= heavy_closure(parent, seen)
        for t in edges_top.get(m, ()):
            out |= heavy_closure(t, seen)
        return out

    heavy = {m: sorted(heavy_closure(m)) for m in modules}

    sccs_all = tarjan(modules, edges_all)
    sccs_top = tarjan(modules, edges_top)
    comp_of = {m: i for i, c in enumerate(sccs_all) for m in c}

    def reaches(a, b, edges):
        seen, todo = {a}, [a]
        while todo:
            x = todo.pop()
            if x == b:
                return True
            for y in edges.get(x, ()):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return False

    # classify in-function own imports
    rows = []
    for m in sorted(own):
        top_targets = {t for (t, _, _, s, _, _, _) in own[m] if s != "func"}
        for tgt, names, line, scope, func, tc, _ in own[m]:
            if scope != "func":
                continue
            if tgt == m:
                kind = "self"
            elif m in comp_of and comp_of.get(tgt) == comp_of[m]:
                kind = "cycle-hard" if reaches(tgt, m, edges_top) else "cycle-soft"
            elif tgt in top_targets:
                kind = "redundant"
            elif heavy[tgt] and not heavy[m]:
                kind = "keeps-heavy-lazy"
            else:
                kind = "free"
            rows.append(dict(module=m, line=line, func=func, target=tgt, names=names, kind=kind,
                             target_heavy=heavy[tgt]))

    lines_total = sum(sum(1 for _ in open(p, encoding="utf-8")) for p in files.values())
    n_stmt = len({(r["module"], r["line"]) for r in rows})
    print(f"modules: {len(modules)}   lines: {lines_total}")
    print(f"own-package imports inside functions: {n_stmt} statements ({len(rows)} module edges)"
          f"   TYPE_CHECKING-only: {tc_only}")
    by_kind = defaultdict(int)
    for r in rows:
        by_kind[r["kind"]] += 1
    print("  by kind (edges): " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())))
    print("    cycle-hard: the target already reaches the importer through top-level imports (moving this import to")
    print("      the top today fails); cycle-soft: same SCC, but only through other in-function imports;")
    print("    redundant: target also imported at top of the module;")
    print("    keeps-heavy-lazy: target loads a heavy library at import, the importer does not; free: none of these")
    print()
    print("per module (statements inside functions / of which in a cycle):")
    per = defaultdict(lambda: [set(), set()])
    for r in rows:
        per[r["module"]][0].add(r["line"])
        if r["kind"].startswith("cycle"):
            per[r["module"]][1].add(r["line"])
    for m in sorted(per, key=lambda k: (-len(per[k][0]), k)):
        print(f"  {len(per[m][0]):4d} {len(per[m][1]):4d}  {short(m)}")
    print()
    print(f"strongly connected components, all imports: {len(sccs_all)}")
    for c in sccs_all:
        print(f"  [{len(c)}] " + ", ".join(short(x) for x in c))
    print(f"strongly connected components, top-level imports only: {len(sccs_top)}")
    for c in sccs_top:
        print(f"  [{len(c)}] " + ", ".join(short(x) for x in c))
    print()
    print("heavy libraries loaded at import time (directly or through top-level own imports; parents' __init__ incl.):")
    for m in sorted(modules):
        if heavy[m]:
            print(f"  {short(m)}: {', '.join(heavy[m])}")
    bad_layers = []
    if args.layers:
        facades = {m for m, p in files.items() if p.endswith("__init__.py")}
        for m in sorted(edges_all):
            for t in sorted(edges_all[m]):
                why = edge_problem(m, t, facades)
                if why:
                    bad_layers.append((m, t, why))
        print()
        print(f"edges against the layering: {len(bad_layers)}")
        for m, t, why in bad_layers:
            print(f"  {short(m)} -> {short(t)}: {why}")
    if args.edges:
        print()
        print("in-function own imports:")
        for r in rows:
            print(f"  {r['kind']:16s} {short(r['module'])}:{r['line']} in {r['func']}() -> {short(r['target'])}"
                  f" {','.join(r['names'])}" + (f"  [target loads {','.join(r['target_heavy'])}]" if r['target_heavy'] else ""))
    if args.json:
        json.dump(dict(edges_all={k: sorted(v) for k, v in edges_all.items()},
                       edges_top={k: sorted(v) for k, v in edges_top.items()},
                       sccs_all=sccs_all, sccs_top=sccs_top, in_function=rows, heavy=heavy),
                  open(args.json, "w"), indent=1)
    if args.check:
        ok = not rows and not sccs_all and not bad_layers
        print()
        print("CHECK", "PASSED" if ok else f"FAILED: {len(rows)} in-function own imports, {len(sccs_all)} cycles, "
              f"{len(bad_layers)} upward edges")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
