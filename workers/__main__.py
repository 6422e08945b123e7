"""`python -m workers`: the worker entry used by `tokengate serve` for its children."""

from __future__ import annotations

import argparse
import logging
import sys

from common.settings import HelpFormatter, add_redis_url, env_default
from workers import cli


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR")
    add_redis_url(parser)
    cli.add_model_args(parser)
    cli.add_worker_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cli.run(cli.settings_from_args(args))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
