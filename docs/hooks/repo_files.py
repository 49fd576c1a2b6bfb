"""MkDocs hook: the pages link to repository files outside ``docs/`` (benchmark scripts, their JSON and PNGs)
as ``../benchmarks/...``, which works when the Markdown is read in the repository. For the site, each such
file that exists is copied in under ``repo/`` and the link pointed at the copy; a link to a file that does
not exist is left alone, so ``mkdocs build --strict`` fails on it."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

LINK = re.compile(r"(\]\()(\.\./[^)\s#]+)")


def _outside(page_uri: str, target: str, root: Path, docs: Path) -> str | None:
    """The repository path a page's ``../`` link names, if it leaves docs/ and names a file that exists."""
    rel = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target))
    if not rel.startswith("../"):
        return None
    path = (docs / rel).resolve()
    if path.suffix == ".md" or not path.is_file() or root not in path.parents:
        return None
    return path.relative_to(root).as_posix()


def on_files(files, config):
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    wanted = set()
    for f in list(files.documentation_pages()):
        for _, target in LINK.findall(Path(f.abs_src_path).read_text()):
            found = _outside(f.src_uri, target, root, docs)
            if found:
                wanted.add(found)
    for rel in sorted(wanted):
        files.append(File.generated(config, f"repo/{rel}", abs_src_path=str(root / rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent

    def point(m: re.Match) -> str:
        found = _outside(page.file.src_uri, m.group(2), root, docs)
        if not found:
            return m.group(0)
        return m.group(1) + posixpath.relpath(f"repo/{found}", posixpath.dirname(page.file.src_uri) or ".")

    return LINK.sub(point, markdown)
