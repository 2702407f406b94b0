"""poetry.lock plans one version of each package on every machine poetry installs on: two versions
whose markers both match (poetry's record of nvidia-cublas 13.1.1.3 and 13.10.0.20 on Linux x86_64,
nvidia-cuda-nvrtc likewise) would be installed in parallel over the same files."""

import os
import tomllib

import pytest
from packaging.markers import Marker

LOCK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "poetry.lock")
ENVIRONMENTS = [
    *(dict(sys_platform="linux", platform_system="Linux", platform_machine="x86_64", python_version=v)
      for v in ("3.10", "3.11", "3.12", "3.13")),
    dict(sys_platform="linux", platform_system="Linux", platform_machine="aarch64", python_version="3.11"),
    dict(sys_platform="darwin", platform_system="Darwin", platform_machine="arm64", python_version="3.11"),
    dict(sys_platform="win32", platform_system="Windows", platform_machine="AMD64", python_version="3.11"),
]


def planned(packages: list, environment: dict) -> dict:
    """package name -> the versions whose markers match `environment`."""
    full = dict(environment, python_full_version=environment["python_version"] + ".0", implementation_name="cpython",
                platform_python_implementation="CPython", os_name="nt" if environment["sys_platform"] == "win32"
                else "posix", extra="")
    versions = {}
    for package in packages:
        markers = package.get("markers", [])
        markers = list(markers.values()) if isinstance(markers, dict) else [markers] if markers else []  # (per group)
        if not markers or any(Marker(m).evaluate(full) for m in markers):
            versions.setdefault(package["name"], []).append(package["version"])
    return versions


@pytest.mark.parametrize("environment", ENVIRONMENTS, ids=lambda e: f"{e['platform_machine']}-{e['python_version']}")
def test_one_version_of_each_package(environment):
    with open(LOCK, "rb") as f:
        packages = tomllib.load(f)["package"]
    duplicated = {name: v for name, v in planned(packages, environment).items() if len(v) > 1}
    assert not duplicated, duplicated


def test_the_check_sees_two_matching_versions():
    packages = [{"name": "nvidia-cublas", "version": "13.1.1.3", "markers": 'sys_platform == "linux"'},
                {"name": "nvidia-cublas", "version": "13.10.0.20", "markers": 'platform_system == "Linux"'}]
    assert planned(packages, ENVIRONMENTS[1])["nvidia-cublas"] == ["13.1.1.3", "13.10.0.20"]


def test_no_registry_in_the_lock():
    """The lock is made against a temporary source (docs/development.md); none of it is committed."""
    with open(LOCK, "rb") as f:
        packages = tomllib.load(f)["package"]
    assert not [p["name"] for p in packages if "source" in p]
