"""mkdocs hook: the site's home page is the README (one text, never two copies), its links
into ``docs/`` made relative to the site."""
from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return README.read_text().replace("](docs/", "](")
