"""`python -m gradaccum` runs the command-line interface."""

from gradaccum.cli import main

raise SystemExit(main())
