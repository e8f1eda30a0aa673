"""``python -m cardcage``: the same as the ``cardcage`` command."""

from cardcage.cli import main

raise SystemExit(main())
