"""The package's contract with DeepSpeed, vLLM and transformers (``dependency_contract.py``):
every listed call still exists in the installed versions with the keywords the package
passes and the preconditions the package's code is built on, and no private name of
theirs is used that the contract does not list."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

import rllib_exgrpo
from rllib_exgrpo.dependency_contract import CALLS, calls_of, private_names, problems

ROOT = Path(rllib_exgrpo.__file__).parent
DEPENDENCIES = ("deepspeed", "vllm", "transformers")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _params(package: str, marks=()):
    return [pytest.param(c, id=f"{c.package}:{c.target.partition(':')[2]}", marks=marks) for c in calls_of(package)]


@pytest.mark.parametrize("call", _params("deepspeed") + _params("transformers") + _params("torch") + _params("llvmlite"))
def test_deepspeed_transformers_and_other_calls_hold(call):
    if not _installed(call.package):
        pytest.skip(f"{call.package} is not installed here")
    if not call.present():
        pytest.skip(f"{call.target}: not in this build ({call.present_if} is False); checked where it is")
    assert problems(call) == []


@pytest.mark.vllm
@pytest.mark.parametrize("call", _params("vllm"))
def test_vllm_calls_hold(call):
    assert problems(call) == []


def test_every_entry_says_where_it_is_used_and_names_a_dependency():
    assert CALLS
    for call in CALLS:
        assert call.package in DEPENDENCIES + ("torch", "llvmlite"), call
        assert call.target.startswith(call.package) and call.used_in, call
        assert call.kind in ("callable", "attribute", "value"), call


def _references(tree: ast.AST):
    """``(package, dotted name)`` of every ``from <dep>... import x`` and ``<dep>.a.b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in DEPENDENCIES:
            for alias in node.names:
                yield node.module.split(".")[0], f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Attribute):
            parts = []
            cur = node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in DEPENDENCIES:
                yield cur.id, ".".join([cur.id] + parts[::-1])


def _listed(reference: str) -> bool:
    """Whether a reference is (a prefix of) a listed target, or the module-level name
    of one (``deepspeed.zero.GatheredParameters`` is ``deepspeed:zero.GatheredParameters``)."""
    flat = reference.replace(":", ".")
    return any(c.target.replace(":", ".") == flat or c.target.replace(":", ".").startswith(flat + ".") for c in CALLS)


#: References that are modules or version strings, not calls (importing is not a call).
NOT_CALLS = {"deepspeed.ops", "transformers.__version__", "vllm.__version__", "vllm.envs"}


def test_every_module_level_reference_into_a_dependency_is_listed():
    unlisted = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "dependency_contract.py":
            continue
        for package, ref in _references(ast.parse(path.read_text())):
            if package == "vllm" or ref in NOT_CALLS:
                continue  # vLLM's calls are checked in the vLLM venv (test below)
            if not _listed(ref):
                unlisted.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not unlisted, "not in dependency_contract.py:\n" + "\n".join(unlisted)


#: Further third-party packages whose private names the scan looks for (their calls are
#: listed in rllib/rllib_contract.py for Ray, here for the rest).
PRIVATE_SCAN_ALSO = ("torch", "ray", "llvmlite", "mlflow", "peft", "math_verify")

#: ``self._name = ...`` or ``self._name: T = ...`` (not ``==``, not ``if x in self._name:``).
ASSIGNED = r"self\.(_[a-z][a-z0-9_]*)\s*(?::[^=\n]*)?=(?!=)"

#: Standard-library receivers of private names (``os._exit``): not a dependency's.
STDLIB_RECEIVERS = {"os", "sys"}


def test_private_dependency_names_are_used_only_where_the_contract_lists_them():
    """A private attribute of a third-party object (``opt._get_norm_groups``, Ray's
    ``mlflow_util._get_client``) can only be told apart from the package's own by name: every
    ``._name`` the package uses, does not define itself, and an installed dependency defines
    must be listed here or in rllib/rllib_contract.py."""
    from rllib_exgrpo.rllib.rllib_contract import PRIVATE_NAMES

    listed = set(private_names()) | {p.name for p in PRIVATE_NAMES}
    unlisted = set()
    sources = {}
    for package in DEPENDENCIES + PRIVATE_SCAN_ALSO:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        sources[package] = Path(list(spec.submodule_search_locations)[0])
    defined = set()
    for folder in sources.values():
        for path in folder.rglob("*.py"):
            text = path.read_text(errors="ignore")
            defined.update(re.findall(r"def (_[a-z][a-z0-9_]*)\(", text))
            defined.update(re.findall(ASSIGNED, text))
    own = set()
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        own.update(re.findall(r"def (_[a-z][a-z0-9_]*)\(", text))
        own.update(re.findall(ASSIGNED, text))
        own.update(re.findall(r"^\s*(_[a-z][a-z0-9_]*)\s*(?::[^=\n]*)?=(?!=)", text, re.M))
    for path in ROOT.rglob("*.py"):
        if path.name in ("dependency_contract.py", "rllib_contract.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and re.fullmatch(r"_[a-z][a-z0-9_]*", node.attr)):
                continue
            receiver, name = getattr(node.value, "id", ""), node.attr
            if receiver in STDLIB_RECEIVERS:
                continue
            if name in defined and name not in own and name not in listed:
                unlisted.add(f"{path.relative_to(ROOT)}: .{name}")
    assert not unlisted, "private dependency names not in dependency_contract.py:\n" + "\n".join(sorted(unlisted))
