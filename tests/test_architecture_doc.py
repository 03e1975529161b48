"""docs/ARCHITECTURE.md's layout table is true to the package: every module and sub-package of
each listed folder is named there, and nothing is named that does not exist."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
MAX_LINES = 400


def layout_table() -> dict[str, set[str]]:
    """{package folder: the names its row lists} from the first code block of the layout
    section; a row starts with ``ngdist/...`` and continues on indented lines."""
    text = DOC.read_text()
    section = text[text.index("## Layout and layering"):]
    block = section[section.index("```") + 3:]
    block = block[:block.index("```")]
    rows: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        match = re.match(r"(ngdist/(?:\w+/)?)\s+(.*)", line)
        if match:
            current = match.group(1)
            rows[current] = match.group(2)
        elif current is not None and line.startswith(" "):
            rows[current] += " " + line.strip()
    return {folder: set(re.findall(r"[\w.]+\.py|\w+/", names)) for folder, names in rows.items()}


def package_files() -> list[str]:
    """The package's files: those git tracks in a checkout (a file someone is still writing
    is not the package's yet), else every file on disk."""
    try:
        out = subprocess.run(["git", "ls-files", "ngdist"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
    return out or [str(p.relative_to(ROOT)) for p in (ROOT / "ngdist").rglob("*.py")]


def on_disk(folder: str, own_rows: set[str], files: list[str]) -> set[str]:
    """The modules and sub-packages of ``folder`` (sub-packages with a row of their own left
    out)."""
    names = set()
    for f in files:
        if not f.startswith(folder) or not f.endswith(".py"):
            continue
        rest = f[len(folder):].split("/")
        if len(rest) == 1 and rest[0] != "__init__.py":
            names.add(rest[0])
        elif len(rest) == 2 and rest[1] == "__init__.py" and f"{folder}{rest[0]}/" not in own_rows:
            names.add(rest[0] + "/")
    return names


def test_the_layout_table_names_every_module_and_nothing_else():
    table = layout_table()
    files = package_files()
    assert "ngdist/" in table and "ngdist/runtime/" in table, table.keys()
    for folder, listed in table.items():
        actual = on_disk(folder, set(table), files)
        assert listed == actual, (
            f"{folder}: docs/ARCHITECTURE.md's layout table lists {sorted(listed - actual)} "
            f"that do not exist and leaves out {sorted(actual - listed)}; update its row")
    packages = {f.rsplit("/", 1)[0] + "/" for f in files if f.count("/") == 2
                and f.endswith("/__init__.py")}
    assert packages - set(table) <= {f"ngdist/{n}" for n in table["ngdist/"]}


def test_the_architecture_file_stays_short():
    assert len(DOC.read_text().splitlines()) < MAX_LINES
