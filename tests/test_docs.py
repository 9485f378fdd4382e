"""The docs say what the code does: no file cites anything outside the repository, the code
layout in docs/architecture.md names every module and only files that exist, and every
flag, benchmark and make target the README and docs/ name exists."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OUTSIDE = re.compile("DESIGN" + r"\.md|\.\./shared/")  # split: this file must not match
# A command line naming a specinfer command, and what follows it.
COMMAND = re.compile(r"(?:specinfer|python -m services)\s+"
                     r"(serve\s+(?:router|speculator|verifier)|up|generate|boost-tune|"
                     r"train-head)\b(.*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _tracked(*under: str) -> list[Path]:
    names = subprocess.run(["git", "ls-files", *under], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def test_no_file_cites_anything_outside_the_repository():
    citing = []
    for path in _tracked():
        if path.stat().st_size > 1_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary
            continue
        citing += [f"{path.relative_to(ROOT)}:{n}" for n, line in
                   enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not citing, citing


def _layout() -> set[str]:
    """The paths docs/architecture.md's code layout names (directories without the slash)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Code layout", 1)[1].split("```", 2)[1]
    named, parents = set(), []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 20:  # blank, or a description's second line
            continue
        name, depth = line.split()[0], indent // 2
        parents = parents[:depth]
        named.add(("".join(parents) + name).rstrip("/"))
        if name.endswith("/"):
            parents.append(name)
    return named


def test_every_file_the_layout_names_exists():
    named = _layout()
    assert {"services/router/scheduler.py", "specinfer/drafting/ssm.py"} <= named
    assert not [p for p in named if not (ROOT / p).exists()]


def test_the_layout_names_every_module():
    named = _layout()
    modules = {str(p.relative_to(ROOT)) for p in _tracked("specinfer", "services")
               if p.suffix == ".py" and "v1" not in p.relative_to(ROOT).parts
               and p.name not in ("__init__.py", "__main__.py")}
    assert modules and not sorted(modules - named)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each specinfer command's parser ("up", "serve router", ...)."""
    from services.cli import build_parser

    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a.choices for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction))

    out = {}
    for name, parser in commands(build_parser()).items():
        if name == "serve":
            out.update({f"serve {role}": p for role, p in commands(parser).items()})
        else:
            out[name] = parser
    return out


def _command_lines(text: str) -> list[str]:
    """Every inline code span and every line of a fenced block (continuations joined,
    comments cut) that may hold a command."""
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        spans += [line.split(" #")[0] for line in block.replace("\\\n", " ").splitlines()]
    return spans


def test_every_flag_the_docs_name_exists():
    parsers = _parsers()
    flags = {name: {s for a in p._actions for s in a.option_strings}
             for name, p in parsers.items()}
    checked, unknown = 0, []
    for doc in DOCS:
        for span in _command_lines(doc.read_text()):
            for m in COMMAND.finditer(span):
                command = " ".join(m.group(1).split())
                for flag in FLAG.findall(m.group(2)):
                    checked += 1
                    if flag not in flags[command]:
                        unknown.append(f"{doc.relative_to(ROOT)}: specinfer {command} {flag}")
    assert checked > 50  # the README's command table alone names more
    assert not unknown, unknown


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "Makefile"], ids=lambda p: p.name)
def test_every_benchmark_and_make_target_named_exists(doc):
    text = doc.read_text()
    scripts = set(re.findall(r"-m bench\.(\w+)", text)) | set(re.findall(r"bench/(\w+)\.py",
                                                                           text))
    assert not [s for s in scripts if not (ROOT / "bench" / f"{s}.py").exists()]
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"`make ([a-z][a-z-]*)", text)) | set(
        re.findall(r"^make ([a-z][a-z-]*)", text, re.M))
    assert not [t for t in targets if not re.search(rf"^{t}:", makefile, re.M)]
