"""Command-line flags spelled one way: units in the name, old spellings as hidden aliases.

Every kvroute command names a quantity's unit in its flag (``--lease-ttl-s``,
``--flush-interval-s``, ``--max-body-bytes``) and states its default once, in one form:
``(default: VALUE; env $NAME)``. :func:`add_flag` adds a flag that way; a flag renamed to
gain its unit keeps its old spelling as an alias that parses to the same destination but
stays out of ``--help``, so existing scripts and config files keep working.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

__all__ = ["add_flag", "dest_of", "help_text", "renamed_dests"]


def dest_of(flag: str) -> str:
    """The argparse destination (and config-file key) of a flag: ``--lease-ttl-s`` ->
    ``lease_ttl_s``."""
    return flag.lstrip("-").replace("-", "_")


def help_text(
    meaning: str, default: Any = None, *, default_text: str | None = None, env: str | None = None
) -> str:
    """A flag's help: its meaning, then its default and environment variable, once.

    Args:
        meaning: What the flag sets (no default in it).
        default: The default value, shown as is unless ``default_text`` is given; ``None``
            shows no default.
        default_text: Words for the default when its value says little (``None`` meaning
            "computed", "off", ...).
        env: The environment variable read when the flag is absent.

    Returns:
        The text, with ``%`` escaped for argparse.
    """
    shown = default_text if default_text is not None else default
    parts = [] if shown is None else [f"default: {shown}"]
    if env is not None:
        parts.append(f"env ${env}")
    text = f"{meaning} ({'; '.join(parts)})" if parts else meaning
    return text.replace("%", "%%")


def add_flag(
    parser: argparse._ActionsContainer,
    flag: str,
    *,
    meaning: str,
    aliases: Iterable[str] = (),
    default: Any = None,
    default_text: str | None = None,
    env: str | None = None,
    **kwargs: Any,
) -> argparse.Action:
    """Add ``flag`` to ``parser`` (or an argument group), with hidden ``aliases``.

    Args:
        parser: The parser or argument group.
        flag: The canonical spelling, units included.
        meaning: What the flag sets; :func:`help_text` appends the default once.
        aliases: Older spellings: accepted, parsed into the same destination, not shown.
        default: The parsed default (also the one shown, unless ``default_text``).
        default_text: Words for the default in the help instead of the value.
        env: The environment variable the caller reads as a fallback (shown in the help).
        kwargs: Passed to ``add_argument`` (``type``, ``metavar``, ``choices``, ...).

    Returns:
        The canonical flag's action.
    """
    dest = kwargs.pop("dest", dest_of(flag))
    action: argparse.Action = parser.add_argument(
        flag,
        dest=dest,
        default=default,
        help=help_text(meaning, default, default_text=default_text, env=env),
        **kwargs,
    )
    for alias in aliases:
        # SUPPRESS as the alias's default: the canonical flag's default is the one set.
        parser.add_argument(
            alias, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs
        )
    return action


def renamed_dests(aliases: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Old destination -> new one, for config files written with the old names.

    Args:
        aliases: Canonical flag -> its old spellings, as given to :func:`add_flag`.
    """
    return {dest_of(old): dest_of(new) for new, olds in aliases.items() for old in olds}
