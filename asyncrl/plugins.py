"""Plug-ins by name, shared by every registry (environments, rewards, gateway parsers).

A registry has built-in names, entry points of installed packages in its own group, and accepts import
paths `package.module:Attr`. These helpers resolve all three the same way, with errors in the user's
terms, so that each registry is a table and a sentence.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any


def registered_names(builtin: dict[str, str], group: str, kind: str, error: type[LookupError]) -> dict[str, str]:
    """`builtin` plus the entry points of `group`; a name registered twice raises `error` naming both."""
    names = dict(builtin)
    for point in entry_points(group=group):
        if point.name in names and names[point.name] != point.value:
            raise error(
                f"{kind} name {point.name!r} is registered twice: {names[point.name]} and {point.value} "
                f"(entry point of {_dist_name(point)}); rename one, or use an import path in the config"
            )
        names[point.name] = point.value
    return names


def import_target(ref: str, path: str, kind: str, error: type[LookupError]) -> Any:
    """The callable at `path` ('package.module:Attr.attr'); `ref` is what the user wrote, for messages."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as failure:
        raise error(f"{kind} {ref!r}: cannot import module {module_name!r} ({failure})") from failure
    target: Any = module
    for part in attribute.split("."):
        if not part or not hasattr(target, part):
            raise error(f"{kind} {ref!r}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise error(f"{kind} {ref!r}: {path} is not a class or factory")
    return target


def _dist_name(point: Any) -> str:
    dist = getattr(point, "dist", None)
    return getattr(dist, "name", None) or "an installed package"
