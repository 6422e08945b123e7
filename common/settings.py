"""What every command's settings share: the environment fallback of each flag and the help
that shows each default (the gateway's and the worker's CLIs both read them)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_default(name: str, default: Any = None) -> Any:
    """Every flag is also an environment variable: TOKENGATE_<NAME>."""
    return os.environ.get(f"TOKENGATE_{name.upper().replace('-', '_')}", default)


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
