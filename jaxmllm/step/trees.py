"""Nested dicts of parameters (pure dicts keyed like the model): split by path, joined
back, overlaid; what the step, its objectives and the checkpoint readers share."""

from __future__ import annotations

from collections.abc import Callable


def split_tree(tree: dict, keep: Callable[[tuple[str, ...]], bool], path=()) -> tuple[dict, dict]:
    """(the leaves of a nested dict whose path `keep` takes, the others), nested alike; a
    branch left without leaves is left out (orbax refuses empty subtrees)."""
    kept, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            a, b = split_tree(value, keep, (*path, key))
            kept.update({key: a} if a else {})
            rest.update({key: b} if b else {})
        elif keep((*path, key)):
            kept[key] = value
        else:
            rest[key] = value
    return kept, rest


def join(*trees: dict) -> dict:
    """Nested dicts with disjoint leaves merged into one (what `split_tree` split)."""
    out: dict = {}
    for tree in trees:
        for key, value in tree.items():
            mine = out.get(key)
            out[key] = join(mine, value) if isinstance(mine, dict) else value
    return out


def overlay(tree: dict, given: dict) -> dict:
    """`tree` with the leaves `given` has (same nesting) replaced by them."""
    out = dict(tree)
    for key, value in given.items():
        if key in out:
            out[key] = overlay(out[key], value) if isinstance(value, dict) else value
    return out
