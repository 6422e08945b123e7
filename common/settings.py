"""What every command's settings share: the environment fallback of each flag and the help
that shows each default (the gateway's and the worker's CLIs both read them)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def env_default(name: str, default: Any = None) -> Any:
    """Every flag is also an environment variable: TOKENGATE_<NAME>."""
    return os.environ.get(f"TOKENGATE_{name.upper().replace('-', '_')}", default)


def env_flag(name: str) -> bool:
    """An on/off flag's environment variable: set and not "", "0", "false" or "no" means on."""
    return str(env_default(name, "")).strip().lower() not in ("", "0", "false", "no")


def field_default(settings: type[Any], name: str) -> Any:
    """The default of the settings dataclass's field ``name``: the one place it is written.
    KeyError for a field without a plain default (one made per process, a required one)."""
    for f in dataclasses.fields(settings):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    raise KeyError(f"{settings.__name__}.{name} has no plain default")


#: a command's flag table: (flag, settings field, help[, argparse extras; "scale": the flag's
#: unit over the field's, e.g. 1000 for milliseconds of a field in seconds])
FlagRow = tuple[str, str, str | None] | tuple[str, str, str | None, Mapping[str, Any]]


def add_flags(parser: argparse.ArgumentParser, settings: type[Any], table: Sequence[FlagRow],
              dest: Callable[[str, str], str]) -> None:
    """One flag per row of ``table`` (the gateway's and the worker's alike): its default is the
    settings field's (``field_default``; none for a field made per process), scaled to the
    flag's unit, ``TOKENGATE_<FLAG>`` overrides it, and its type is the default's unless the
    row says otherwise. ``dest(flag, field)`` names the parsed attribute."""
    for row in table:
        flag, name, help = row[0], row[1], row[2]
        kw = dict(row[3]) if len(row) > 3 else {}
        scale = kw.pop("scale", 1.0)
        try:
            default = field_default(settings, name)
        except KeyError:
            default = None
        if default is not None and scale != 1.0:
            default = default * scale
        if "choices" not in kw and "type" not in kw and default is not None and not isinstance(default, str):
            kw["type"] = type(default)
        parser.add_argument(f"--{flag}", dest=dest(flag, name), default=env_default(flag, default), help=help, **kw)


SECRET_FLAGS = frozenset({"admin_token"})  # dests whose value --help never shows (it may come from the environment)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every flag's default (the value ``TOKENGATE_<FLAG>`` sets, where it is
    set), except a secret's, and None's: such a flag's help says what its absence means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.dest in SECRET_FLAGS:
            return action.help
        return super()._get_help_string(action)


SHARED_REDIS = "the shared Redis, e.g. redis://host:6379/0 (required, unless TOKENGATE_REDIS_URL is set)"


def add_redis_url(parser: argparse.ArgumentParser, private: str | None = None) -> None:
    """``--redis-url`` (``TOKENGATE_REDIS_URL``): the shared Redis a gateway or worker needs,
    or, given ``private`` (what happens without one), an optional one (`serve`)."""
    default = env_default("redis_url")
    if private is None:
        parser.add_argument("--redis-url", default=default, required=default is None, help=SHARED_REDIS)
    else:
        parser.add_argument("--redis-url", default=default, help=private)
