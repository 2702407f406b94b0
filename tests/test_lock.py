"""pyproject.toml, poetry.lock, constraints.txt and the installed environment agree (DESIGN.md section 25).

`make install` installs the lock's versions through constraints.txt (lock_constraints.py writes it
from the lock). These tests fail when the lock no longer answers pyproject.toml, when constraints.txt
is not the lock's, when the environment running them holds a version the lock does not list, and when
the lock would plan two versions of one package on a machine poetry installs on: poetry's record of
nvidia-cublas 13.1.1.3 and 13.10.0.20 on Linux x86_64 (nvidia-cuda-nvrtc likewise) would install
both over the same files. Each check has a twin that gives it a tampered input and sees it fail.
Standard library and packaging only, no network, no poetry: a second or two.
"""

import collections
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, the same parser (pytest needs it there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LOCK, PYPROJECT, CONSTRAINTS = ROOT / "poetry.lock", ROOT / "pyproject.toml", ROOT / "constraints.txt"
_spec = importlib.util.spec_from_file_location("lock_constraints", ROOT / "lock_constraints.py")
lock_constraints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock_constraints)

ENVIRONMENTS = [
    *(dict(sys_platform="linux", platform_system="Linux", platform_machine="x86_64", python_version=v)
      for v in ("3.10", "3.11", "3.12", "3.13")),
    dict(sys_platform="linux", platform_system="Linux", platform_machine="aarch64", python_version="3.11"),
    dict(sys_platform="darwin", platform_system="Darwin", platform_machine="arm64", python_version="3.11"),
    dict(sys_platform="win32", platform_system="Windows", platform_machine="AMD64", python_version="3.11"),
]


def full(environment: dict) -> dict:
    """A marker environment from the few keys that ENVIRONMENTS spell out."""
    return dict(environment, python_full_version=environment["python_version"] + ".0", implementation_name="cpython",
                platform_python_implementation="CPython", os_name="nt" if environment["sys_platform"] == "win32"
                else "posix", extra="")


def planned(packages: list, environment: dict) -> dict:
    """package name -> the locked versions whose markers match `environment`, every group installed."""
    versions = {}
    for package in packages:
        where = lock_constraints.marker(package)
        if not where or Marker(where).evaluate(full(environment)):
            versions.setdefault(package["name"], []).append(package["version"])
    return versions


def content_hash(pyproject: dict) -> str:
    """poetry's content-hash of a pyproject.toml with a [project] table (poetry 2.5's
    Locker._get_content_hash): the sha256 of sorted JSON holding [project]'s requires-python,
    dependencies and optional-dependencies, [dependency-groups] where there are any, and those of
    [tool.poetry]'s dependencies, source, extras, dev-dependencies and group that are set."""
    project = {key: pyproject["project"][key] for key in ("requires-python", "dependencies", "optional-dependencies")
               if key in pyproject["project"]}
    poetry = {key: value for key, value in pyproject.get("tool", {}).get("poetry", {}).items()
              if key in ("dependencies", "source", "extras", "dev-dependencies", "group")}
    content = {"project": project, "tool": {"poetry": poetry}}
    if pyproject.get("dependency-groups"):
        content["dependency-groups"] = pyproject["dependency-groups"]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def unmet(pyproject: dict, packages: list) -> list:
    """pyproject.toml's requirements ([project] dependencies and every dependency group) that the lock
    misses, or holds at a version the requirement's range excludes (any locked version, as none of
    these requirements carries a marker; one with a marker needs one admitted version)."""
    locked = collections.defaultdict(list)
    for package in packages:
        locked[canonicalize_name(package["name"])].append(package["version"])
    groups = pyproject.get("dependency-groups", {}).values()
    requirements = [*pyproject["project"]["dependencies"], *(r for g in groups for r in g if isinstance(r, str))]
    problems = []
    for requirement in map(Requirement, requirements):
        versions = locked.get(canonicalize_name(requirement.name), [])
        admitted = [v for v in versions if requirement.specifier.contains(v, prereleases=True)]
        if not admitted or (requirement.marker is None and admitted != versions):
            problems.append(f"{requirement}: the lock holds {versions or 'no version'}")
    return problems


def drift(constraints_text: str, installed: list, environment: dict = None) -> list:
    """Installed (name, version) pairs that the constraints name but not at that version for this
    environment (packaging's own when None): a version the lock lists for another Python only counts
    as drift too. A local build of a locked version passes (torch 2.13.0+cpu for 2.13.0), as pip's
    `==` constraint admits it; a package the lock does not name is none of its business."""
    allowed = {}  # name -> the specifiers for this environment ([] where the lock names it for others only)
    for line in constraints_text.splitlines():
        if line.strip() and not line.startswith("#"):
            constraint = Requirement(line)
            specifiers = allowed.setdefault(canonicalize_name(constraint.name), [])
            if constraint.marker is None or constraint.marker.evaluate(environment):
                specifiers.append(constraint.specifier)
    problems = []
    for name, version in installed:
        specifiers = allowed.get(canonicalize_name(name))
        if specifiers is not None and not any(s.contains(version, prereleases=True) for s in specifiers):
            problems.append(f"{name} {version} (the lock: {', '.join(map(str, specifiers)) or 'none here'})")
    return problems


@pytest.fixture(scope="module")
def lock() -> dict:
    return tomllib.loads(LOCK.read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


@pytest.mark.parametrize("environment", ENVIRONMENTS, ids=lambda e: f"{e['platform_machine']}-{e['python_version']}")
def test_one_version_of_each_package(lock, environment):
    duplicated = {name: v for name, v in planned(lock["package"], environment).items() if len(v) > 1}
    assert not duplicated, duplicated


def test_the_check_sees_two_matching_versions():
    packages = [dict(name="nvidia-cublas", version="13.1.1.3", markers='sys_platform == "linux"', groups=["main"]),
                dict(name="nvidia-cublas", version="13.10.0.20", markers='platform_system == "Linux"', groups=["main"])]
    assert planned(packages, ENVIRONMENTS[1])["nvidia-cublas"] == ["13.1.1.3", "13.10.0.20"]


def test_no_registry_in_the_lock(lock, pyproject):
    """The lock may be made against a temporary source (docs/development.md); none of it is committed."""
    assert not [p["name"] for p in lock["package"] if "source" in p]
    assert "source" not in pyproject.get("tool", {}).get("poetry", {})


def test_constraints_txt_is_the_lock_exported():
    assert CONSTRAINTS.read_text() == lock_constraints.constraints(LOCK.read_text()), \
        "constraints.txt is not poetry.lock's: `make constraints` writes it"


def test_the_constraints_check_sees_a_changed_lock():
    first = tomllib.loads(LOCK.read_text())["package"][0]
    entry = 'name = "{name}"\nversion = "{version}"'.format(**first)
    tampered = LOCK.read_text().replace(entry, entry[:-1] + '.post1"')
    assert tampered != LOCK.read_text() and lock_constraints.constraints(tampered) != CONSTRAINTS.read_text()


def test_per_group_markers_are_exported_for_every_group():
    """A group that a lock entry's marker table leaves out has no marker: six is installed everywhere."""
    group_markers = {"name": "six", "version": "1.17.0", "groups": ["main", "benchmark"],
                     "markers": {"benchmark": 'python_version == "3.10"'}}
    assert lock_constraints.marker(group_markers) == ""
    group_markers["groups"] = ["benchmark", "dev"]
    group_markers["markers"]["dev"] = 'sys_platform == "win32"'
    assert lock_constraints.marker(group_markers) == '(python_version == "3.10") or (sys_platform == "win32")'


def test_the_lock_is_pyproject_toml_s(lock, pyproject):
    """The content-hash poetry would compute (`poetry check --lock` compares the same), then each
    requirement against the locked versions."""
    assert content_hash(pyproject) == lock["metadata"]["content-hash"], "pyproject.toml changed since `poetry lock`"
    assert unmet(pyproject, lock["package"]) == []


def test_the_pyproject_check_sees_a_changed_range(lock, pyproject):
    changed = json.loads(json.dumps(pyproject))
    changed["project"]["dependencies"] = [("accelerate>=99" if Requirement(d).name == "accelerate" else d)
                                          for d in pyproject["project"]["dependencies"]]
    changed["dependency-groups"]["dev"].append("not-in-the-lock")
    assert content_hash(changed) != content_hash(pyproject)
    assert [p.split(":")[0] for p in unmet(changed, lock["package"])] == ["accelerate>=99", "not-in-the-lock"]
    source = json.loads(json.dumps(pyproject))
    source.setdefault("tool", {}).setdefault("poetry", {})["source"] = [dict(name="mirror", url="file:///simple")]
    assert content_hash(source) != content_hash(pyproject)


def test_installed_versions_are_the_lock_s():
    """Every distribution installed here that the lock names has a version the lock lists for this
    Python and machine. Lock packages that are not installed are fine: those whose markers do not apply
    here (colorama on Windows, tomli and exceptiongroup on 3.10, the other numpy versions, ...) and those
    that only PyPI's CUDA build of torch pulls in, which a CPU wheel does not (nvidia-*, cuda-*,
    triton). `make install` reinstalls after a relock; a package installed by hand shows here."""
    installed = [(d.metadata["Name"], d.version) for d in importlib.metadata.distributions()]
    assert drift(CONSTRAINTS.read_text(), installed) == [], "the environment is not poetry.lock's: `make install`"


def test_the_environment_check_sees_a_drift():
    constraints = """# a lock's constraints
accelerate==1.15.0 ; python_version == "3.10"
accelerate==1.16.0 ; python_version >= "3.11"
exceptiongroup==1.3.2 ; python_version == "3.10"
torch==2.13.0
typing-extensions==4.16.0
"""
    linux_311 = full(ENVIRONMENTS[1])
    installed = [("accelerate", "1.15.0"), ("torch", "2.13.0+cpu"), ("Typing_Extensions", "4.16.0"),
                 ("exceptiongroup", "1.3.2"), ("not-in-the-lock", "0.1")]
    assert drift(constraints, installed, linux_311) == [
        "accelerate 1.15.0 (the lock: ==1.16.0)", "exceptiongroup 1.3.2 (the lock: none here)"]
    linux_310 = dict(linux_311, python_version="3.10", python_full_version="3.10.0")
    assert drift(constraints, installed, linux_310) == []
    assert drift(constraints, [("torch", "2.13.1")], linux_310) == ["torch 2.13.1 (the lock: ==2.13.0)"]
