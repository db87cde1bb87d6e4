"""The layering of tempokern/_ops, read from the source (ast, nothing imported): the two InfoNCE op modules
do not import each other (the entry points that route between them live in routing.py, above both), the
op modules import each other only at the top level, and no module of the package imports a private
(underscore) name from an _ops module other than itself, save loss_args.py (the shared argument checks)."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tempokern"
OPS = PKG / "_ops"
VALIDATION = "tempokern._ops.loss_args"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path):
    """(module imported from, names, top-level?) for every import of the file; relative imports resolved.
    ``from . import x`` yields the submodule tempokern.<...>.x with no names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, (), id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            if node.module is None:
                out += [(f"{mod}.{a.name}", (), id(node) in top) for a in node.names]
            else:
                out.append((mod, tuple(a.name for a in node.names), id(node) in top))
    return out


def test_the_two_loss_modules_do_not_import_each_other():
    pair = {"tempokern._ops.multipos_infonce", "tempokern._ops.matryoshka_infonce"}
    for path in (OPS / "multipos_infonce.py", OPS / "matryoshka_infonce.py"):
        me = module_name(path)
        mods = {m for m, _, _ in imports(path)}
        assert not (mods & (pair - {me})), f"{me} imports {sorted(mods & (pair - {me}))}"
        assert "tempokern._ops.routing" not in mods, f"{me} imports the routing module above it"


def test_routing_imports_both_at_the_top_level():
    got = {m for m, _, top in imports(OPS / "routing.py") if top}
    assert {"tempokern._ops.multipos_infonce", "tempokern._ops.matryoshka_infonce"} <= got


@pytest.mark.parametrize("path", sorted(OPS.glob("*.py")), ids=lambda p: p.name)
def test_ops_modules_import_tempokern_modules_at_the_top_level(path):
    late = [m for m, _, top in imports(path) if not top and m.startswith("tempokern")]
    assert not late, f"{path.name}: function-local imports of {late}"


def test_no_private_names_imported_from_other_ops_modules():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        if me == VALIDATION:
            continue
        for mod, names, _ in imports(path):
            if not mod.startswith("tempokern._ops.") or mod == me:
                continue
            private = [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{me}: from {mod} import {', '.join(private)}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_imports():
    """The parser above finds what it looks for (a check that finds nothing would pass vacuously)."""
    got = imports(OPS / "routing.py")
    assert ("tempokern._ops.loss_args", ("BIAS_NAMES", "check_bias_table_points", "check_groups",
                                         "group_scoped_bounds", "id_spans", "span_bounds", "validate_bias"), True) in got
    assert ("tempokern._ops.dispatch", (), True) in got
    assert any(m == "tempokern._ops.multipos_blocked" and "_acc" not in n
               for m, n, _ in imports(OPS / "matryoshka_blocked.py"))
