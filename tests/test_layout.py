"""The package's shape: no import cycles, public API at the top, no machine paths in the repo."""
import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "rllib_exgrpo"


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict:
    """module -> project modules it imports anywhere (top level or inside functions)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        # a package's __init__ is not a real dependency edge for "import pkg.sub"
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def test_no_import_cycle_inside_the_package():
    graph = _imports()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_public_api_at_the_package_top():
    out = subprocess.run(
        [sys.executable, "-c", "from rllib_exgrpo import ExGRPO, ExGRPOConfig, GRPO, GRPOConfig, "
         "ExGRPOTorchLearner, LLMTorchRLModule, LLMEnvRunner; print(ExGRPOConfig().algo_class.__name__)"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "ExGRPO"


def test_no_absolute_machine_paths_in_the_repo():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"(/home/\w|/work/|/Users/\w|/root/)")
    this = Path(__file__).resolve().relative_to(REPO).as_posix()  # holds the patterns
    hits = [f for f in files if f != this and (REPO / f).is_file()
            and pattern.search((REPO / f).read_text(errors="ignore"))]
    assert not hits, f"absolute machine paths in {hits}"
