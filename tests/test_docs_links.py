"""Every relative link in README.md and docs/ resolves: the file exists and, for `#anchor`, one of its
headings has that GitHub anchor."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _anchors(path):
    """GitHub's heading anchors: lower case, punctuation dropped except '-' and '_', spaces to '-'."""
    heads = (m.group(1) for m in re.finditer(r"^#+\s+(.*?)\s*$", _text(path), re.M))
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_docs_folder_exists():
    assert len(DOCS) > 1


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    bad = []
    for target in LINK.findall(_text(doc)):
        if re.match(r"[a-z]+:", target):   # http:, https:, mailto: are not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.isfile(os.path.join(ROOT, dest)):
            bad.append(f"{target}: no file {dest}")
        elif anchor and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest}")
    assert not bad, f"{doc}: " + "; ".join(bad)
