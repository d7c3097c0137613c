"""``python -m ddtree.service``: the same as the ``ddtree`` command."""

from ddtree.service.cli import main

raise SystemExit(main())
