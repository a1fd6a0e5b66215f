"""YAML read strictly: a key given twice in one mapping, and the plain scalars that YAML 1.1 (PyYAML) reads
otherwise than a reader of the file expects, are refused in one sentence naming the key, the file and the line.

PyYAML keeps the last of two equal keys (a second ``model:`` section silently replaces the first) and resolves
``010`` as the octal 8, ``1:30`` as the base-60 number 90 and ``yes``/``no``/``on``/``off`` as booleans, ``1_000`` as 1000; YAML 1.2
reads none of these so. Quoted scalars are text and pass (``'010'``, ``"on"``), as ``yaml.safe_dump`` writes them.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"
_OCTAL = re.compile(r"[-+]?0[0-7_]+")  # YAML 1.1's octal: a leading zero (YAML 1.2 writes 0o10)


class StrictYAMLError(yaml.YAMLError):
    """A duplicate key or an ambiguous scalar: its message is the whole sentence."""


def _ambiguity(node: yaml.ScalarNode) -> str | None:
    """How YAML 1.1 reads a plain scalar that a reader would take otherwise, and the fix; None when clear."""
    if node.style is not None:  # quoted or block text: a string as written
        return None
    text = node.value
    if node.tag == _BOOL and text.lower() not in ("true", "false"):
        value = "true" if text.lower() in ("yes", "on") else "false"
        return f"reads as {value}; write {value} for a switch, or quote it ('{text}') for text"
    if node.tag == _INT and _OCTAL.fullmatch(text):
        value = int(text.replace("_", ""), 8)
        decimal = int(text.replace("_", ""), 10)
        return f"reads as the octal number {value}; write {decimal} without the leading zero, or quote it for text"
    if node.tag in (_INT, _FLOAT) and "_" in text and ":" not in text:
        return (
            f"reads as the number {text.replace('_', '')} (YAML 1.2 reads text); write the digits without '_'"
        )
    if node.tag in (_INT, _FLOAT) and ":" in text:
        return "reads as a base-60 number (1:30 is 90); write the number itself, or quote it for text"
    return None


def _where(source: str, node: yaml.Node) -> str:
    return f"{source}, line {node.start_mark.line + 1},"


def _check(node: yaml.Node, source: str, path: str, seen: set[int]) -> None:
    """Refuse duplicate keys and ambiguous plain scalars anywhere under ``node`` (``path``: its dotted key)."""
    if id(node) in seen:  # an alias of a node already checked (anchors may even be recursive)
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        why = _ambiguity(node)
        if why:
            raise StrictYAMLError(f"{path or 'the value'}: {node.value} in {_where(source, node)} {why}.")
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check(item, source, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        keys: dict[tuple[str, Any], yaml.Node] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:  # `<<: *defaults`: the mapping's own keys override the merged ones
                _check(value_node, source, path, seen)
                continue
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            dotted = f"{path}.{name}" if path else str(name)
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.style is None and _ambiguity(key_node):
                    raise StrictYAMLError(
                        f"the key {dotted} in {_where(source, key_node)} {_ambiguity(key_node)}."
                    )
                first = keys.setdefault((key_node.tag, key_node.value), key_node)
                if first is not key_node:
                    raise StrictYAMLError(
                        f"{dotted} is given twice in {source} (lines {first.start_mark.line + 1} and "
                        f"{key_node.start_mark.line + 1}); keep one: the second would silently replace the first."
                    )
            _check(value_node, source, dotted, seen)


def parse_yaml(text: str, source: str) -> Any:
    """The YAML document in ``text``, read as :func:`yaml.safe_load` does after the checks above (``source``:
    the file's name as the sentence should give it). A problem raises :class:`yaml.YAMLError`; a duplicate key
    or an ambiguous scalar raises :class:`StrictYAMLError`, whose message is the sentence."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check(node, source, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def syntax_problem(error: yaml.YAMLError, text: str) -> str:
    """What is wrong at the place a YAML parse ``error`` points to, as the end of a sentence naming the file:
    its line, and for a tab among the indentation that YAML indents with spaces."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    what = str(getattr(error, "problem", None) or str(error).splitlines()[0])
    if mark is None:
        return f"is not valid YAML ({what}); fix its syntax"
    line = mark.line + 1
    lines = text.splitlines()
    if "\t" in what or (0 < line <= len(lines) and "\t" in lines[line - 1][: mark.column + 1]):
        return f"has a tab on line {line}; YAML indents with spaces, so replace the tab with spaces"
    return f"is not valid YAML on line {line} ({what}); fix the syntax there"


def scalar_ambiguity(text: str) -> str | None:
    """For one value typed on the command line (``--model.buffer 010``): how YAML 1.1 would misread it and
    the fix, or None when it reads as written (or is no plain scalar)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    return _ambiguity(node) if isinstance(node, yaml.ScalarNode) else None
