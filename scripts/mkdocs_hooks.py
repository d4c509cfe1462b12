"""MkDocs hooks (mkdocs.yml): the site holds two pages from outside docs/, the README as its home page and
benchmarks/README.md with its figures, each at the path it has in the repository relative to docs/'s parent; the links
between them and docs/ are rewritten from the repository's layout to the site's, so that `mkdocs build --strict`
checks every one of them."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = [
    "README.md",
    "benchmarks/README.md",
    *(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "results").glob("*.png")),
]
"""Files from outside docs/, by their path in the repository (which is their path in the site)."""


def on_files(files, config):
    for path in OUTSIDE:
        files.append(File(path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A link written for the repository, made one for the site: from the README, `docs/x` is `x`; from a page of
    docs/, `../benchmarks/` is `benchmarks/`; from benchmarks/README.md, `../docs/x` is `../x`."""
    where = page.file.src_uri
    if where == "README.md":
        return re.sub(r"\]\(docs/", "](", markdown)
    if where == "benchmarks/README.md":
        return re.sub(r"\]\(\.\./docs/", "](../", markdown)
    return re.sub(r"\]\(\.\./benchmarks/", "](benchmarks/", markdown)
