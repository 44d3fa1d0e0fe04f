"""Every relative link in README.md, CHANGELOG.md, docs/ and examples/ points at a file that exists, and every
`#anchor` at a heading (GitHub's slug) or an explicit `<a id=...>` in that file."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/README.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = CODE.sub("", page.read_text())
    found, seen = set(), {}
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return found


def test_slug_matches_github():
    assert slug("BiCC and RCC") == "bicc-and-rcc"
    assert slug("Rewards: `--reward_funcs`") == "rewards---reward_funcs"
    assert slug("`overhead.py`: per-step cost of `GRPOExtTrainer`") == "overheadpy-per-step-cost-of-grpoexttrainer"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading or <a id> '{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)
