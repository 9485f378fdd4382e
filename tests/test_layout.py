"""The layers point down: the core package imports no service, no two modules import each
other, serving never reaches training code, and the speculation modes load without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specinfer", "services")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts:
                continue  # generated stubs
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules ``path`` imports, at the top or inside functions."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] in PACKAGES and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_the_core_imports_no_service():
    graph = _graph()
    upward = {m: sorted(i for i in deps if i.startswith("services"))
              for m, deps in graph.items() if m.startswith("specinfer")}
    assert not any(upward.values()), upward


def test_no_two_modules_import_each_other():
    graph = _graph()
    pairs = {tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
             if a in graph.get(b, set())}
    assert not pairs, pairs


def test_serving_never_reaches_training_code():
    """Every module a service's composition root can import, directly or lazily."""
    graph = _graph()
    for root in ("services.verifier.main", "services.speculator.main", "services.router.main",
                 "services.cli"):
        seen, todo = set(), [root]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        assert not any(m.startswith("specinfer.training") for m in seen), (root, sorted(seen))
    # The command dispatches by name: running a service loads no training module.
    code = ("import sys; from services.cli import build_parser, _command; "
            "argv = ['serve', 'verifier', '--head-nodes', '4']; "
            "build_parser(_command(argv)).parse_args(argv); "
            "import services.verifier.engine, services.verifier.parallel, "
            "services.verifier.server, services.speculator.engine, services.speculator.server, "
            "services.router.scheduler, services.router.server, specinfer.drafting.head; "
            "print(sorted(m for m in sys.modules if m.startswith('specinfer.training')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_speculation_modes_load_without_torch():
    code = ("import sys; from services.router.policy import SPECULATION_CHOICES; "
            "assert 'torch' not in sys.modules, 'torch'; print(sorted(SPECULATION_CHOICES))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['adaptive',", "'always',", "'head',", "'lookup',",
                                  "'merged',", "'overlap']"]


def test_tests_start_services_only_through_servers():
    """One way to start a service in the tests (tests/servers.py: ``start``, ``service``,
    ``cli``, ``Stack``): no other test file calls Popen or spells ``python -m services``."""
    command = ["-m", "services"]
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name in ("servers.py", "test_layout.py"):  # the helper; this check
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            popen = isinstance(node, ast.Call) and "Popen" in (
                getattr(node.func, "attr", None), getattr(node.func, "id", None))
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)] \
                if isinstance(node, ast.List | ast.Tuple) else []
            if popen or any(words[i:i + 2] == command for i in range(len(words))):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
