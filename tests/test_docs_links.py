"""Every relative link in README.md, docs/ and bench/'s READMEs points at a file or folder
of the repository, and every `#anchor` at a heading of its page (GitHub's slugs). Web links
are not fetched: no network here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
         *sorted((ROOT / "bench" / "results").glob("*/README.md")),
         ROOT / "bench" / "results" / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def test_slugs_follow_github():
    assert slug("torch.compile off by default") == "torchcompile-off-by-default"
    assert slug("Kernels launched early (programmatic dependent launch)") == \
        "kernels-launched-early-programmatic-dependent-launch"
    assert slug("`n` > 1 shares the prompt") == "n--1-shares-the-prompt"


def test_links_resolve():
    broken = []
    for page in PAGES:
        if not page.exists():
            continue
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
