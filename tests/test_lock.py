"""constraints.txt, the pinned stack: it pins every dependency pyproject.toml names (the test extra's too) at
a version pyproject.toml admits, and the environment the tests run in was installed under it."""

import tomllib
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import REPO


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, line in enumerate((REPO / "constraints.txt").read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", (
            f"constraints.txt:{number}: expected name==version, got {line!r}"
        )
        name = canonicalize_name(req.name)
        assert name not in pins, f"constraints.txt:{number}: {req.name} pinned twice"
        pins[name] = Version(spec[0].version)
    return pins


def _requirements() -> list[Requirement]:
    """pyproject.toml's dependencies and its test extra's, the extras it names expanded (not vllm's)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras, todo, out = project["optional-dependencies"], ["test"], list(map(Requirement, project["dependencies"]))
    while todo:
        for line in extras[todo.pop()]:
            req = Requirement(line)
            if canonicalize_name(req.name) == "qevolve":
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def test_the_lock_pins_every_dependency_at_a_version_pyproject_admits():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt: no pin for {req} (pyproject.toml); run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt: {req.name}=={pins[name]}, but pyproject.toml asks {req}; run `make lock`"
        )


def test_the_environment_was_installed_under_the_lock():
    mismatched = []
    for name, pinned in _pins().items():
        try:
            installed = Version(version(name))
        except PackageNotFoundError:
            mismatched.append(f"{name} not installed (lock: {pinned})")
            continue
        if installed.public != pinned.public:
            mismatched.append(f"{name} {installed} (lock: {pinned})")
    assert not mismatched, "installed versions differ from constraints.txt (run `make setup`): " + ", ".join(mismatched)
