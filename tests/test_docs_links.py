"""Every relative link in README.md and docs/ points at a file or folder of the
repository (web links are not fetched: no network here)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)
