"""mkdocs hooks. The site's home page is the README (one text, never two copies), its links
into ``docs/`` made relative to the site. And the API reference finds the package: the
repository root is the package ``autopar`` under another folder name, which an editable
install maps by an import hook that static analysis (griffe) cannot follow, so the build
makes ``build/docs-src/autopar`` of links to it, griffe's search path (``mkdocs.yml``)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def on_startup(command, dirty) -> None:
    """``build/docs-src/autopar``: links to the package's modules and subpackages only (a
    link to the whole checkout would have griffe read its virtual environment too)."""
    package = ROOT / "build" / "docs-src" / "autopar"
    package.mkdir(parents=True, exist_ok=True)
    for old in package.iterdir():
        old.unlink()
    for child in ROOT.iterdir():
        if child.suffix == ".py" or ((child / "__init__.py").is_file()
                                     and child.name not in ("tests", "bench")):
            (package / child.name).symlink_to(child, target_is_directory=child.is_dir())


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return README.read_text().replace("](docs/", "](")
