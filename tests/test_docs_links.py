"""README.md and docs/*.md: every relative link and image resolves, every #anchor names a heading.

No network: http(s), mailto and other URLs with a scheme are skipped, and so are links inside
fenced code blocks and inline code. Anchors follow GitHub's heading slugs: the heading's text,
lowercased, without punctuation other than hyphens, spaces and underscores, spaces turned into
hyphens; a repeated slug gets -1, -2, ... in order.
"""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 300


def doc_pages():
    return [README, *sorted(DOCS.glob("*.md"))]


# ---------------------------------------------------------------- parsing

FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


def blank_fenced_code(text):
    """The text with every line of a fenced code block (fences included) blanked; line count kept.
    Fences may be indented (code blocks inside list items)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line.strip())
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            fence = None
        elif fence is None:
            out.append(line)
            continue
        out.append("")
    return "\n".join(out)


# A code span: a run of N backticks, then anything up to the next run of exactly N backticks,
# within one paragraph (a code span may wrap onto the next line, not across a blank line).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)


def blank_inline_code(text):
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def prose(text):
    """The page without fenced code blocks and inline code (line numbers kept)."""
    return blank_inline_code(blank_fenced_code(text))


# `](target)` covers links and images, including an image inside a link: [![alt](img)](link).
INLINE_TARGET = re.compile(r"\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[(?!\^)[^\]\n]+\]:\s*(<[^>\n]*>|\S+)", re.M)
HTML_TARGET = re.compile(r"<(?:img|a|source)\b[^>]*?\s(?:src|href|srcset)\s*=\s*([\"'])(.*?)\1", re.I | re.S)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(text):
    """(line number, target) of every link, image and HTML src/href outside code."""
    body = prose(text)
    found = []
    for pattern, group in ((INLINE_TARGET, 1), (REFERENCE_DEF, 1), (HTML_TARGET, 2)):
        for m in pattern.finditer(body):
            target = m.group(group).strip()
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((body.count("\n", 0, m.start()) + 1, target))
    return sorted(found)


HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")


def github_slug(heading):
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: letters, digits and underscores
    return text.replace(" ", "-")


def anchors(text):
    """The anchors GitHub gives the page's headings, in order (github-slugger's duplicates rule)."""
    occurrences, result = {}, []
    for line in blank_fenced_code(text).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        slug = base = github_slug(m.group(2))
        while slug in occurrences:
            occurrences[base] += 1
            slug = f"{base}-{occurrences[base]}"
        occurrences[slug] = 0
        result.append(slug)
    return result


def check_page(page, root):
    """Problems (strings) with the relative links of one page; root bounds where targets may point."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for line, target in links(text):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto, ...: not checked (no network)
        path_part, _, anchor = target.partition("#")
        path_part, anchor = unquote(path_part), unquote(anchor)
        where = f"{page.relative_to(root)}:{line}: ({target})"
        if path_part:
            base = root if path_part.startswith("/") else page.parent
            resolved = (base / path_part.lstrip("/")).resolve()
            if not resolved.is_relative_to(root.resolve()):
                problems.append(f"{where} points outside the repository")
                continue
            if not resolved.exists():
                problems.append(f"{where} {resolved.relative_to(root.resolve())} does not exist")
                continue
        else:
            resolved = page.resolve()
        if anchor and resolved.suffix == ".md" and resolved.is_file():
            if anchor not in anchors(resolved.read_text(encoding="utf-8")):
                problems.append(f"{where} no heading of {resolved.name} has the anchor #{anchor}")
    return problems


def linked_files(page, root):
    """The files a page links to, resolved."""
    out = set()
    for _, target in links(page.read_text(encoding="utf-8")):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        path_part = unquote(target.partition("#")[0])
        if path_part:
            base = root if path_part.startswith("/") else page.parent
            out.add((base / path_part.lstrip("/")).resolve())
    return out


# ---------------------------------------------------------------- the repository's pages


def test_docs_folder_has_pages():
    assert DOCS.is_dir() and list(DOCS.glob("*.md")), "docs/ holds the pages README.md links to"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    problems = check_page(page, REPO)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_a_front_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move sections to docs/ (at most {README_MAX_LINES})"


def test_every_docs_page_is_linked_from_readme():
    linked = linked_files(README, REPO)
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


# ---------------------------------------------------------------- the checker itself


def test_github_slugs():
    assert github_slug("What `./hello_world.sh` does and prints") == "what-hello_worldsh-does-and-prints"
    assert github_slug("Datasets: tldr_dataset.py") == "datasets-tldr_datasetpy"
    assert github_slug("Where we deliberately differ from the paper's scripts") == (
        "where-we-deliberately-differ-from-the-papers-scripts"
    )
    assert github_slug("A Slurm cluster: `sbatches/`") == "a-slurm-cluster-sbatches"
    assert github_slug("Speed: benchmarks/") == "speed-benchmarks"
    assert github_slug("The [link](x.md) and 4-bit") == "the-link-and-4-bit"
    text = "# A\n\n## Results\n\n```\n# Results\n```\n\n## Results\n\n### Results\n\n## Results-1\n"
    assert anchors(text) == ["a", "results", "results-1", "results-2", "results-1-1"]


def test_checker_catches_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "img.png").write_bytes(b"")
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Some section\n\n## Some section\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "Good: [other](other.md), [section](other.md#some-section), [again](other.md#some-section-1),\n"
        "[here](#page), ![img](../img.png), [folder](../docs/), [web](https://example.com/missing),\n"
        '<img src="../img.png">, [mail](mailto:a@b.c), `[in code](missing.md)`, [titled](other.md "t").\n\n'
        "```markdown\n[in a fence](missing.md)\n```\n\n"
        "Bad: [file](missing.md), [anchor](other.md#no-such-section), [self](#nowhere),\n"
        '![image](img.png), <a href="gone.md">a</a>, [out](../../outside.md), [dup](other.md#some-section-2).\n'
    )
    problems = check_page(page, tmp_path)
    bad = ["(missing.md)", "(other.md#no-such-section)", "(#nowhere)", "(img.png)", "(gone.md)",
           "(../../outside.md)", "(other.md#some-section-2)"]
    assert len(problems) == len(bad), problems
    for target in bad:
        assert any(target in p for p in problems), (target, problems)
    assert all(p.startswith("docs/page.md:") for p in problems)
