"""The documentation stays inside the repository: every relative link and anchor in README.md and docs/*.md
resolves (the file exists, the path does not leave the repository, a #fragment names a heading of the target as
GitHub slugs it), every docs page is reachable from the index, and nothing points at files users do not have
(``../shared``, ``shared/reference``), in the docs or in the recipes' comments. Read from the files only: no
subprocess, no imports of the package."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FORBIDDEN = ("../shared", "shared/reference")

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"""<[a-z]+\b[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})(?:\s+(.*?))?\s*$")
SETEXT_UNDERLINE = re.compile(r"^\s{0,3}(=+|-+)\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
LINE_ANCHOR = re.compile(r"^L\d+(-L\d+)?$")  # GitHub's line anchors in source files


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, without punctuation other than hyphens and
    underscores, spaces turned into hyphens (github-slugger)."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    kept = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: its headings' slugs (repeats numbered -1, -2, ... as GitHub does) and
    explicit HTML ids/names."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    previous = ""
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        text = None
        m = ATX_HEADING.match(line)
        if m:
            text = re.sub(r"\s+#+\s*$", "", m.group(2) or "")
        elif SETEXT_UNDERLINE.match(line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*")):
            text = previous.strip()
        if text is not None:
            base = slug(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(HTML_ANCHOR.findall(line))
        previous = line
    return found


def links(path: Path):
    """(line number, target) of every link in a Markdown file, outside code."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        plain = CODE_SPAN.sub("code", line)
        targets = [m.group(1) for m in INLINE_LINK.finditer(plain)]
        targets += REFERENCE_DEF.findall(plain) + HTML_LINK.findall(plain)
        for target in targets:
            yield number, target.strip("<>")


def check_target(source: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``source``) does not resolve inside the repository, or None when it does."""
    if target.startswith("//") or SCHEME.match(target):
        return None  # another site (papers, package docs): not a file of this repository
    path_part, _, fragment = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    if path_part.startswith("/"):
        return "an absolute path: use one relative to this file"
    resolved = (source.parent / path_part).resolve() if path_part else source
    try:
        resolved.relative_to(ROOT)
    except ValueError:
        return f"{path_part} leaves the repository"
    if not resolved.exists():
        return f"{path_part} does not exist"
    if not fragment:
        return None
    fragment = unquote(fragment)
    if resolved.is_file() and resolved.suffix.lower() in (".md", ".markdown"):
        if fragment not in anchors(resolved):
            return f"#{fragment} names no heading of {resolved.relative_to(ROOT)}"
        return None
    if resolved.is_file() and LINE_ANCHOR.match(fragment):
        return None
    return f"#{fragment}: {resolved.relative_to(ROOT)} has no such anchor"


def test_the_slugs_are_githubs():
    assert slug("Exact loss, epochs and resumption") == "exact-loss-epochs-and-resumption"
    assert slug("`layout: auto`") == "layout-auto"
    assert slug("What CI checks (`tests/test_sft_recipes.py`)") == "what-ci-checks-teststest_sft_recipespy"
    assert slug("1. Engine overhead: `ultrascale_plugins` vs the same layout") == \
        "1-engine-overhead-ultrascale_plugins-vs-the-same-layout"
    assert slug("Why not PyTorch's [`context_parallel`](x.md)") == "why-not-pytorchs-context_parallel"
    assert slug("A — B × C") == "a--b--c"


def test_the_link_reader_skips_code_and_sees_every_kind_of_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n## Title\n[a](x.md) ![b](img.png) `[not](code.md)`\n"
                    "```\n[not](fenced.md)\n```\n[c]: ref.md#part\n<a href=\"h.md\">h</a>\n")
    assert [t for _, t in links(page)] == ["x.md", "img.png", "ref.md#part", "h.md"]
    assert anchors(page) == {"title", "title-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves_inside_the_repository(doc):
    broken = [f"{doc.relative_to(ROOT)}:{number}: ({target}) {why}"
              for number, target in links(doc) if (why := check_target(doc, target))]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_points_at_files_users_do_not_have(doc):
    text = doc.read_text(encoding="utf-8")
    found = [f"{doc.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
             if any(word in line for word in FORBIDDEN)]
    assert not found, "\n".join(found)


def test_recipe_comments_point_at_no_files_users_do_not_have():
    recipes = sorted((ROOT / "recipes").rglob("*.yaml"))
    assert recipes
    found = []
    for path in recipes:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            comment = line[line.index("#"):] if "#" in line else ""
            if any(word in comment for word in FORBIDDEN):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_docs_page_is_in_the_index_and_the_readme_links_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index) if not SCHEME.match(t)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p != index and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link {missing}"
    readme = ROOT / "README.md"
    assert index.resolve() in {(ROOT / t.partition("#")[0]).resolve() for _, t in links(readme)}


def test_what_the_readme_calls_not_available_is_no_field_of_the_package():
    """The README's "Not available here" sentence names no feature the package has a field for (it listed CPU
    offload and the optimizer step inside the backward after both had landed: issue 47)."""
    import re

    from ultrascale_plugins.interface.config import ParallelConfig

    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"Not available here: (.*?)\. ", readme).group(1).lower()
    spelled = {"cpu_offload": "cpu offload", "optimizer_in_backward": "optimizer step inside the backward",
               "activation_offload": "activation", "float8": "float8", "chunked_loss": "chunked"}
    fields = set(ParallelConfig.field_names())
    assert set(spelled) <= fields, set(spelled) - fields  # the spellings follow the fields
    claimed = [field for field, words in spelled.items() if words in said]
    assert not claimed, f"the README calls {claimed} not available: {said!r}"
