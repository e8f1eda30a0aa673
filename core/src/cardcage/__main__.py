"""``python -m cardcage``: the same as the ``cardcage`` command."""

from cardcage.cli.main import main

raise SystemExit(main())
