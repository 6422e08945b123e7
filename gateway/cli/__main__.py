"""`python -m gateway.cli`: the `tokengate` command."""

from gateway.cli.main import main

raise SystemExit(main())
