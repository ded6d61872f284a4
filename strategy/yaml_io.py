"""YAML reading and writing for strategies.

Kept apart from the models so that the schema reads without YAML details. The loader is
stricter than ``yaml.safe_load`` on one point: a key written twice in the same mapping is an
error, because PyYAML would otherwise keep the last value and silently drop the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys within one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(stream: str | IO[str]) -> Any:
    """Parse one YAML document with the duplicate-key check.

    Parse errors become ValueError so that every bad strategy fails with one exception type;
    the message keeps PyYAML's line and column (and the file name when reading a file).
    """
    try:
        return yaml.load(stream, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ValueError(f"strategy YAML does not parse:\n{err}") from err


def dump_yaml(data: Mapping[str, Any]) -> str:
    """Block-style YAML in the given key order; leaf lists and maps stay on one line.

    Non-ASCII text is written escaped: with raw unicode PyYAML emits characters such as
    U+0085 that its own reader takes for line breaks, and the round trip would change them.
    """
    return yaml.safe_dump(plain(data), sort_keys=False, default_flow_style=None,
                          allow_unicode=False)


def dump_flow(data: Any) -> str:
    """One-line YAML (flow style), used to quote a section's values in error messages."""
    text = yaml.safe_dump(plain(data), default_flow_style=True, sort_keys=False,
                          width=float("inf"), allow_unicode=False)
    return text.strip().removesuffix("...").strip()


def plain(value: Any) -> Any:
    """Tuples to lists, recursively, since safe_dump only represents plain containers."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value
