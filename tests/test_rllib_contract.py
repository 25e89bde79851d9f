"""The package's contract with RLlib: the private names it uses (``rllib/rllib_contract.py``)
still exist in the installed Ray as listed, they are used nowhere else, and every method
that overrides an RLlib method says so with ``@override``."""

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import rllib_exgrpo
from rllib_exgrpo.rllib.rllib_contract import PRIVATE_NAMES

ROOT = Path(rllib_exgrpo.__file__).parent
CONTRACT = ROOT / "rllib" / "rllib_contract.py"


def _package_modules():
    return [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(rllib_exgrpo.__path__, "rllib_exgrpo.")
        if not m.name.endswith("__main__")
    ]


def _assigned_in_source(owner: type, name: str) -> bool:
    """``self.<name> = ...`` somewhere in the owner's classes (instance attributes)."""
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=")
    for cls in owner.__mro__:
        if cls.__module__.startswith("ray.") and pattern.search(inspect.getsource(cls)):
            return True
    return False


def _without_tracing(sig: inspect.Signature) -> inspect.Signature:
    """The signature without ``_ray_trace_ctx``: Ray's tracing hook adds that keyword to the
    methods of a class once an actor of it was created in this process (a test before this
    one may have), so it is not part of the method's contract."""
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "_ray_trace_ctx"])


@pytest.mark.parametrize("entry", PRIVATE_NAMES, ids=lambda p: f"{p.owner.split(':')[-1]}.{p.name}")
def test_each_private_name_still_exists_as_listed(entry):
    where = f"{entry.owner}.{entry.name}"
    try:
        owner = entry.resolve_owner()
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{entry.owner} (owner of {entry.name}) is gone from the installed Ray: {e}")
    if entry.kind in ("method", "override"):
        member = inspect.getattr_static(owner, entry.name, None)
        assert callable(member), f"{where} is no longer a method of {owner.__name__} (used for: {entry.used_for})"
        if entry.signature is not None:
            got = str(_without_tracing(inspect.signature(getattr(owner, entry.name))))
            assert got == entry.signature, f"{where} changed its signature: {entry.signature} -> {got}"
    elif entry.kind == "attribute":
        assert _assigned_in_source(owner, entry.name), (
            f"{where}: {owner.__name__} no longer assigns self.{entry.name} (used for: {entry.used_for})"
        )
    else:
        assert entry.kind == "module_attribute", entry.kind
        assert hasattr(owner, entry.name), f"{where} is gone (used for: {entry.used_for})"


def _private_uses(tree: ast.AST, names: set):
    """(line, what) of each place a private RLlib / Ray name is touched: ``x.<name>``, a
    ``"<name>"`` string, an import of it, or an import from a private Ray module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            yield node.lineno, f".{node.attr}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            yield node.lineno, repr(node.value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for module in modules:
                if module.startswith("ray.") and any(part.startswith("_") for part in module.split(".")):
                    yield node.lineno, f"import from {module}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        yield node.lineno, f"import {alias.name}"


def _override_defs(tree: ast.AST):
    """(class name, method name, base name) of each ``@override(Base)`` method."""
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for d in node.decorator_list:
                        if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "override":
                            yield cls.name, node.name, ast.unparse(d.args[0])


def test_no_module_outside_the_contract_touches_a_private_rllib_name():
    names = {p.name for p in PRIVATE_NAMES if p.kind != "override"}
    overridden = {p.name for p in PRIVATE_NAMES if p.kind == "override"}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == CONTRACT:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, what in _private_uses(tree, names):
            found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
        for node in ast.walk(tree):  # super()._x(...) of an overridden private method
            if (
                isinstance(node, ast.Attribute)
                and node.attr in overridden
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "super"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: super().{node.attr}")
    assert not found, (
        "private RLlib / Ray names used outside rllib/rllib_contract.py (add them to "
        "PRIVATE_NAMES and use an accessor there):\n" + "\n".join(found)
    )


def test_every_overridden_private_method_is_declared_in_the_contract():
    declared = {p.name for p in PRIVATE_NAMES if p.kind == "override"}
    for path in sorted(ROOT.rglob("*.py")):
        for cls, method, _ in _override_defs(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                method.startswith("_")
                and not method.startswith("__")
                and method not in ("_forward", "_forward_train", "_get_torch_distribution")
            ):
                assert method in declared, (
                    f"{path.relative_to(ROOT)}: {cls}.{method} overrides a private RLlib method not listed in rllib_contract.PRIVATE_NAMES"
                )


def _rllib_subclasses():
    seen = []
    for module in _package_modules():
        for cls in vars(module).values():
            if (
                inspect.isclass(cls)
                and cls.__module__ == module.__name__
                and cls not in seen
                and any(b.__module__.startswith("ray.") for b in cls.__mro__[1:])
            ):
                seen.append(cls)
    return seen


def _shadowing_methods(cls):
    """(name, RLlib base defining it) of each method ``cls`` defines over an RLlib one."""
    for name, value in vars(cls).items():
        if name == "__init__":
            continue
        fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        fn = fn.fget if isinstance(fn, property) else fn
        if not inspect.isfunction(fn):
            continue
        for base in cls.__mro__[1:]:
            if name in vars(base):
                if base.__module__.startswith("ray."):
                    yield name, base
                break


def test_every_method_over_an_rllib_method_carries_override():
    missing, count = [], 0
    for cls in _rllib_subclasses():
        tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text(encoding="utf-8"))
        declared = {(c, m) for c, m, _ in _override_defs(tree)}
        for name, base in _shadowing_methods(cls):
            count += 1
            if (cls.__name__, name) not in declared:
                missing.append(f"{cls.__module__}.{cls.__name__}.{name} (overrides {base.__name__}.{name})")
    assert not missing, "methods overriding RLlib without @override:\n" + "\n".join(missing)
    assert count >= 50  # the package's RLlib subclasses were found


def test_every_override_names_a_base_class_that_has_the_method():
    checked = 0
    for cls in _rllib_subclasses():
        module = importlib.import_module(cls.__module__)
        tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text(encoding="utf-8"))
        for cls_name, method, base_expr in _override_defs(tree):
            if cls_name != cls.__name__:
                continue
            # The class's own bases by name first (a class defined inside a function imports
            # its base there), else a name imported in the module.
            base = next((b for b in cls.__mro__ if b.__name__ == base_expr), None) or eval(base_expr, vars(module))
            assert issubclass(cls, base), f"{cls.__name__}.{method}: @override({base_expr}) is not a base class"
            assert hasattr(base, method), f"{cls.__name__}.{method}: {base_expr} has no {method} to override"
            checked += 1
    assert checked >= 50
