"""poetry.lock as a pip constraints file: one `name==version ; marker` line per locked package.

`make install` passes constraints.txt to every pip call with `-c`, so pip installs the lock's versions
and no other, each Python its own where the lock holds several (numpy 2.2.6 on 3.10, 2.4.6 on 3.11,
2.5.5 from 3.12). A constraint only limits versions: it installs nothing the project does not ask for.

    python3 lock_constraints.py    (what `make constraints` runs; writes constraints.txt)

Only the standard library, as it runs before anything is installed. tests/test_lock.py checks that
constraints.txt is what this script writes for the committed lock.
"""

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, the same parser (pytest needs it there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
HEADER = "# Written from poetry.lock by lock_constraints.py (`make constraints`); do not edit.\n"


def marker(package: dict) -> str:
    """Where this version applies when every group is installed ("" for everywhere). A lock entry's
    markers are one string, or a table of one per group, where a group left out has none."""
    markers = package.get("markers", "")
    if isinstance(markers, str):
        return markers
    per_group = [markers.get(group) for group in package["groups"]]
    if None in per_group:
        return ""
    return " or ".join(f"({m})" for m in dict.fromkeys(per_group))


def constraints(lock_text: str) -> str:
    """The constraints file for a lock, in the lock's order (by name, then version)."""
    lines = [HEADER]
    for package in tomllib.loads(lock_text)["package"]:
        where = marker(package)
        lines.append(f"{package['name']}=={package['version']}{f' ; {where}' if where else ''}\n")
    return "".join(lines)


if __name__ == "__main__":
    (ROOT / "constraints.txt").write_text(constraints((ROOT / "poetry.lock").read_text()))
