"""The docs stay true to the code: every setting has exactly one row in docs/configuration.md's
settings table with the class's default, no row names a setting that is gone, and every
relative link in README.md, docs/ and bench/README.md reaches its file and heading."""

from __future__ import annotations

import json
import re
from pathlib import Path

from common.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def settings_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in table.splitlines() if line.startswith("| `SPEECH_")]


def documented(default_cell: str, index: int, value: object) -> bool:
    """Whether the table's default cell says `value`, the `index`-th setting of its row (a
    mapping, or a value computed at start such as a consumer name, may be told in words)."""
    written = re.findall(r"`([^`]*)`", default_cell)
    if not written:
        words = default_cell.strip()
        return (words == "unset" and value is None) or (isinstance(value, dict) and bool(value)) \
            or (value == "" and bool(words))
    said = written[min(index, len(written) - 1)]
    if value is None:
        return said == "unset"
    if isinstance(value, bool):
        return said == str(value).lower()
    if isinstance(value, int | float):
        try:
            return float(said) == float(value)
        except ValueError:
            return False
    if isinstance(value, list | dict):
        try:
            return json.loads(said) == value
        except ValueError:
            return isinstance(value, dict)  # a mapping described rather than spelled out
    return said == str(value) or (said == '""' and value == "")


def test_every_setting_has_one_row_with_its_default() -> None:
    defaults = Settings().model_dump(mode="json")
    seen: dict[str, int] = {}
    problems = []
    for cells in settings_rows():
        for index, name in enumerate(re.findall(r"`SPEECH_([A-Z0-9_]+)`", cells[0])):
            field = name.lower()
            if field not in Settings.model_fields:
                problems.append(f"stale row: SPEECH_{name}")
                continue
            seen[field] = seen.get(field, 0) + 1
            if not documented(cells[1], index, defaults[field]):
                problems.append(f"SPEECH_{name}: the table says {cells[1]}, the code "
                                f"{defaults[field]!r}")
    problems += [f"SPEECH_{field.upper()} has {seen.get(field, 0)} rows"
                 for field in Settings.model_fields if seen.get(field, 0) != 1]
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    heading = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.*)$", text, flags=re.M):
        slug = _slug(heading)
        counts[slug] = counts.get(slug, -1) + 1
        found.add(slug if counts[slug] == 0 else f"{slug}-{counts[slug]}")
    return found


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    broken = []
    for page in DOCS:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, mailto:
            path, _, anchor = target.partition("#")
            destination = (page.parent / path) if path else page
            if not destination.exists():
                broken.append(f"{page.relative_to(ROOT)}: no file {target}")
            elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
                broken.append(f"{page.relative_to(ROOT)}: no heading {target}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_gives_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "scripts/serve.sh" in readme and "scripts/test.sh" in readme
