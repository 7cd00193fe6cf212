"""The README and docs/: the README stays a first screen whose two commands are the ones CI runs, its fit summary
quotes docs/fit.md (whose tables tests/test_planner.py checks against the planner), and every link between the pages
reaches a file and a heading that exist. Pure text checks: no engine starts."""
import glob
import os
import re

import pytest

from conftest import ROOT

PAGES = sorted([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "workflows", "README.md")]
               + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where links are links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        ids.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
    return ids


def tables(text: str) -> list[dict[str, str]]:
    """Every row of every markdown table in the text, as {column header: cell} plus "": the row's cells."""
    rows, header, lines = [], None, text.splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if not line.startswith("|") or line.startswith("|---"):
            header = header if line.startswith("|---") else None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if i + 1 < len(lines) and lines[i + 1].strip().startswith("|---"):
            header = cells
        elif header:
            rows.append(dict(zip(header, cells)) | {"": cells})
    return rows


def test_the_readme_holds_the_test_command_ci_runs_and_the_demo_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci_command = [line for line in f.read().splitlines() if line.startswith("python ")]
    blocks = re.findall(r"^```bash\n(.*?)^```", read(os.path.join(ROOT, "README.md")), flags=re.S | re.M)
    assert len(ci_command) == 1 and ci_command[0] + "\n" in blocks
    assert "python -m pip install torch==2.13.0 -r requirements.txt && python -m engine demo\n" in blocks


def test_the_readme_stays_a_first_screen_with_the_rest_in_docs():
    readme = read(os.path.join(ROOT, "README.md"))
    assert len(readme.splitlines()) <= 300
    linked = {os.path.normpath(os.path.join(ROOT, t.split("#")[0])) for t in LINK.findall(prose(readme))}
    assert os.path.join(ROOT, "docs", "README.md") in linked


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_every_link_reaches_a_file_and_a_heading_that_exist(page):
    broken = []
    for target in LINK.findall(prose(read(page))):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(path):
            broken.append(target)
        elif anchor and (not path.endswith(".md") or anchor not in anchors(read(path))):
            broken.append(target)
    assert broken == []


def test_every_docs_page_is_in_the_docs_index():
    index = read(os.path.join(ROOT, "docs", "README.md"))
    docs_dir = os.path.join(ROOT, "docs")
    linked = {os.path.normpath(os.path.join(docs_dir, t.split("#")[0])) for t in LINK.findall(prose(index))}
    pages = {p for p in glob.glob(os.path.join(docs_dir, "**", "*.md"), recursive=True) if not p.endswith("README.md")}
    assert sorted(os.path.relpath(p, docs_dir) for p in pages - linked) == []


def test_the_readme_fit_summary_quotes_docs_fit():
    """The README's memory rows are docs/fit.md's rows; each "GPUs: cell" of its summary is the cell docs/fit.md gives
    for those GPUs in a row of the same weights and job."""
    readme = read(os.path.join(ROOT, "README.md"))
    summary = readme.split("\n## GPUs and what fits\n", 1)[1].split("\n## ", 1)[0]
    fit_doc = read(os.path.join(ROOT, "docs", "fit.md"))
    fit_rows = tables(fit_doc)
    memory = [line for line in summary.splitlines() if line.startswith("| ") and line.count("|") == 10]
    quoted, unmatched = 0, []
    for row in tables(summary):
        if "weights" not in row or "job" not in row:
            continue
        for entry in (row["on 24 GB cards"] + "; " + row["on 48 or 80 GB cards"]).split("; "):
            gpus, cell = entry.split(": ", 1)
            quoted += 1
            if not any(f.get(gpus) == cell and row["weights"] in f[""]
                       and any(c.startswith(row["job"]) for c in f[""]) for f in fit_rows):
                unmatched.append(f"{row['model']} {row['weights']} {row['job']}: {entry}")
    print(f"{len(memory)} memory rows, {quoted} quoted cells")
    assert len(memory) >= 5 and [r for r in memory if r not in fit_doc] == []
    assert quoted >= 10 and unmatched == []
