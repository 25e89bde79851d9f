"""The package's shape: no import cycles, public API at the top, no machine paths in the repo."""

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "rllib_exgrpo"


#: The sub-packages from the lowest layer up (docs/ARCHITECTURE.md). A module imports only
#: from its own package and from packages of lower layers; packages that share a layer do
#: not import each other. The top-level ``rllib_exgrpo/__init__.py`` is outside the layers:
#: it imports nothing of the project when it runs (the public API resolves lazily from
#: ``rllib``), so any module may import it.
LAYERS = (
    ("core", "dependency_contract"),  # dependency_contract: data about DeepSpeed, vLLM, transformers
    ("envs",),
    ("models",),
    ("generation",),
    ("exgrpo", "xrpo"),
    ("warm_start",),
    ("planning",),
    ("rllib",),
    ("evaluation",),
    ("cli",),
)
RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_only(tree: ast.AST) -> set:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imports for type checkers only)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            getattr(node.test, "id", None) == "TYPE_CHECKING" or getattr(node.test, "attr", None) == "TYPE_CHECKING"
        ):
            skip.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skip


def _imports() -> dict:
    """module -> {project module it imports: line}, for every ``import`` / ``from ... import``
    anywhere in it (top level or inside functions; not under ``if TYPE_CHECKING:``).

    ``from X import a`` depends on ``X.a`` when that is a module, else on ``X`` (whose
    ``__init__`` defines ``a``); it counts as a dependency on ``X`` even when ``X`` is the
    importer's own package, since it reads ``X``'s namespace.
    """
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        deps: dict = {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    deps.setdefault(target, node.lineno)
        graph[name] = deps
    return graph


def _package(module: str) -> str:
    """``rllib_exgrpo.<package>.…`` -> ``<package>``; the top-level package -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_inside_the_package():
    """No cycle among the package's modules, counting imports inside functions too."""
    graph = _imports()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_package_imports_only_from_lower_layers():
    graph = _imports()
    packages = {_package(m) for m in graph} - {""}
    assert packages == set(RANK), f"packages not placed in LAYERS: {sorted(packages ^ set(RANK))}"
    assert not graph["rllib_exgrpo"], "the top-level __init__ must import nothing of the project when it runs"
    wrong = []
    for module, deps in sorted(graph.items()):
        mine = _package(module)
        for dep, line in sorted(deps.items()):
            theirs = _package(dep)
            if mine and theirs and theirs != mine and RANK[theirs] >= RANK[mine]:
                path = (PKG.parent / module.replace(".", "/")).with_suffix(".py")
                if not path.is_file():
                    path = PKG.parent / module.replace(".", "/") / "__init__.py"
                wrong.append(f"{path.relative_to(REPO)}:{line}: imports {dep} ({mine} -> {theirs})")
    assert not wrong, "imports against the layering (" + " < ".join("/".join(layer) for layer in LAYERS) + "):\n" + "\n".join(wrong)


def test_public_api_at_the_package_top():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rllib_exgrpo import ExGRPO, ExGRPOConfig, GRPO, GRPOConfig, "
            "ExGRPOTorchLearner, LLMTorchRLModule, LLMEnvRunner; print(ExGRPOConfig().algo_class.__name__)",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "ExGRPO"


def test_no_absolute_machine_paths_in_the_repo():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"(/home/\w|/work/|/Users/\w|/root/)")
    this = Path(__file__).resolve().relative_to(REPO).as_posix()  # holds the patterns
    hits = [f for f in files if f != this and (REPO / f).is_file() and pattern.search((REPO / f).read_text(errors="ignore"))]
    assert not hits, f"absolute machine paths in {hits}"


#: Functions may exceed this many lines (``def`` to last line, docstring included) only
#: rarely: a long function is usually several jobs, each wanting a name.
LONG_FUNCTION_LINES = 60
#: How many functions of the package may exceed it, and of the whole repository (tests,
#: benchmarks and experiments included).
LONG_FUNCTIONS_ALLOWED = 5
LONG_FUNCTIONS_ALLOWED_IN_REPO = 8


def _long_functions(root: Path, files) -> List[str]:
    long = []
    for path in sorted(files):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONG_FUNCTION_LINES:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_few_long_functions():
    long = _long_functions(PKG, PKG.rglob("*.py"))
    assert len(long) <= LONG_FUNCTIONS_ALLOWED, "functions over 60 lines:\n" + "\n".join(long)
    files = [
        p
        for p in REPO.rglob("*.py")
        if not any(part.startswith(".") or part.endswith(".egg-info") or part in ("build", "dist") for part in p.relative_to(REPO).parts)
    ]
    long = _long_functions(REPO, files)
    assert len(long) <= LONG_FUNCTIONS_ALLOWED_IN_REPO, "functions over 60 lines in the repository:\n" + "\n".join(long)


def _in_function_package_imports():
    """(path, line) of every import of the package's own modules inside a function."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                own = (
                    isinstance(node, ast.ImportFrom)
                    and (node.level or (node.module or "").startswith("rllib_exgrpo"))
                    or isinstance(node, ast.Import)
                    and any(a.name.startswith("rllib_exgrpo") for a in node.names)
                )
                if own:
                    found.append((path, node.lineno))
    return sorted(set(found))


def test_imports_inside_functions_are_counted_and_each_says_why():
    """Imports sit at the top; docs/ARCHITECTURE.md states how many of the package's own sit
    inside functions, and each of those is under a comment (``# lazy: ...`` or ``# looked up
    when called: ...``) in its import block."""
    found = _in_function_package_imports()
    stated = re.search(
        r"\*\*(\d+) imports of the package's own modules sit inside\s+functions\*\*", (REPO / "docs" / "ARCHITECTURE.md").read_text()
    )
    assert stated, "docs/ARCHITECTURE.md states the count of in-function imports"
    assert len(found) == int(stated.group(1)), f"{len(found)} in-function imports, the doc says {stated.group(1)}"
    unexplained = []
    for path, line in found:
        lines = path.read_text(encoding="utf-8").splitlines()
        above = line - 2
        while (
            above >= 0
            and lines[above].strip().startswith(("from ", "import ", ")"))
            or (
                above >= 0
                and lines[above].startswith(" " * 8)
                and not lines[above].strip().startswith("#")
                and lines[above].rstrip().endswith(",")
            )
        ):
            above -= 1
        if not (above >= 0 and lines[above].strip().startswith(("# lazy:", "# looked up when called"))):
            unexplained.append(f"{path.relative_to(PKG)}:{line}")
    assert not unexplained, "in-function imports without a reason above them:\n" + "\n".join(unexplained)
