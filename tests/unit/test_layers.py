"""The llmesh package's layers (docs/architecture.md#layers): imports run one way, down. Every import in
shared/ counts, also one inside a function and an `importlib.import_module("...")` of a literal name."""

import ast
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
LAYERS = ("wire", "policies", "engine", "deploy")
# a layer -> the other llmesh layers it may import
ALLOWED = {"wire": set(), "policies": {"wire"}, "engine": {"wire", "policies"}, "deploy": {"wire"}}


def layer(module: str) -> str | None:
    """`module`'s layer: a name of LAYERS, "service" for the services' packages (llmesh_router...), "llmesh"
    for the package itself, None outside the mesh."""
    parts = module.split(".")
    if parts[0].startswith("llmesh_"):
        return "service"
    if parts[0] != "llmesh":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "llmesh"


def imported(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, module) of each import in `tree`, a module of `package`; `from p import m` counts as `p.m`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def backward(source: str, package: str) -> list[str]:
    """The imports of `source`, a module of `package` (e.g. llmesh.wire), that run back up."""
    own = layer(package)
    wrong = []
    for line, name in imported(ast.parse(source), package):
        target = layer(name)
        if target in (None, own) or name == "llmesh":
            continue
        if target not in ALLOWED[own]:  # "service" and "llmesh" (outside every layer) never are
            wrong.append(f"line {line}: {own} imports {name} ({target})")
    return wrong


def test_no_import_runs_back_up():
    wrong = []
    for path in sorted(SHARED.rglob("*.py")):
        package = ".".join(("llmesh", *path.relative_to(SHARED).parent.parts))
        if path == SHARED / "__init__.py":
            continue
        assert layer(package) in LAYERS, f"{path}: in no layer; move it into one of shared/{{{','.join(LAYERS)}}}"
        wrong += [f"{path.relative_to(SHARED.parent)} {problem}" for problem in backward(path.read_text(), package)]
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)


def test_the_rule_rejects_a_backward_import():
    source = "from llmesh.wire import errors\n\ndef f():\n    from llmesh.deploy.credentials import main\n"
    assert backward(source, "llmesh.wire") == ["line 4: wire imports llmesh.deploy.credentials.main (deploy)"]
    assert backward("import importlib\nimportlib.import_module('llmesh.engine.worker')\n", "llmesh.deploy")
    assert backward("from llmesh_router import service\n", "llmesh.engine")  # no layer imports a service
    assert backward("from ..engine import worker\n", "llmesh.policies")  # relative, resolved
    assert backward("from llmesh import kvclient\n", "llmesh.engine")  # a module outside every layer
    assert not backward("from llmesh.policies import core\nfrom llmesh.wire import bus\n", "llmesh.engine")
    assert not backward("from .metadata import x\nfrom ..worker import y\n", "llmesh.engine.kv_connector")
