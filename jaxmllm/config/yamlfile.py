"""YAML as configs read it: what PyYAML's safe loader accepts, less what would silently change
a config or hold the process.

- A key given twice in one mapping (a second `data:` section, a pasted `lr:`) is refused
  naming both lines: YAML keeps the last without a word. (Keys a `<<: *base` merge brings in
  may be overridden: that is what a merge is for.)
- A document whose aliases expand past MAX_NODES values is refused before anything walks it:
  aliases share one object, so 600 bytes of nested `*a` lists read in microseconds as a value
  of 10^9 elements, which a check formatting it (`got [...]`) spent half a minute and all
  memory on (a "billion laughs").
- `shown` is a value as an error message quotes it: cut to a line, whatever its size.
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml

from jaxmllm.config.checks import ConfigError

MAX_NODES = 1 << 16  # values a config document may expand to (configs hold a few hundred)
MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            marks: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = marks.setdefault(key, key_node.start_mark)
                except TypeError:  # (an unhashable key: the constructor refuses it below)
                    continue
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"the key {shown(key)} is given twice in one mapping ("
                        f"{_places(first, key_node.start_mark)}): YAML would keep the second "
                        "without a word; merge them into one",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def _places(a, b) -> str:
    """'lines 3 and 17', or 'line 1, columns 2 and 14'."""
    if a.line != b.line:
        return f"lines {a.line + 1} and {b.line + 1}"
    return f"line {a.line + 1}, columns {a.column + 1} and {b.column + 1}"


def read_yaml(text: str, where: str) -> Any:
    """The YAML document `text` (from `where`, for messages) as Python values.

    Raises:
      ConfigError: not valid YAML, a key given twice in a mapping, or more than MAX_NODES
        values once its aliases are expanded.
    """
    try:
        value = yaml.load(text, Loader=_Loader)  # noqa: S506  (_Loader is the safe loader)
        size = expanded_size(value)
    except yaml.YAMLError as e:
        problem = " ".join(str(e).split())
        raise ConfigError(f"{where}: not valid YAML: {problem[:500]}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (lists or mappings in each other)") from None
    if size > MAX_NODES:
        raise ConfigError(
            f"{where}: its aliases (*name) expand to more than {MAX_NODES} values (a config "
            "holds a few hundred): write the values out, or reuse a section with a merge "
            "(<<: *name) instead of nesting aliases"
        )
    return value


def expanded_size(value: Any, most: int = MAX_NODES) -> int:
    """The values `value` holds once every shared (aliased) list or mapping is counted as
    often as it appears; the count stops a little past `most` (each shared object's is
    computed once: time grows with the distinct objects, not the expansion)."""
    sizes: dict[int, int] = {}

    def size(v: Any) -> int:
        if not isinstance(v, list | dict):
            return 1
        known = sizes.get(id(v))
        if known is not None:
            return known
        sizes[id(v)] = most + 1  # (a cycle, if a loader ever made one: over the bound)
        children = v.values() if isinstance(v, dict) else v
        total = 1
        for child in children:
            total += size(child)
            if total > most:
                break
        sizes[id(v)] = total = min(total, most + 1)
        return total

    return size(value)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 6
_REPR.maxlevel = 3


def shown(value: Any) -> str:
    """`value` as an error message quotes it: its repr, cut to about a line (a few items of
    a list or mapping, a few levels, 80 characters of a string)."""
    return _REPR.repr(value)
