"""`python -m gradaccum` runs the command-line interface."""

from gradaccum.cli import main

if __name__ == "__main__":  # (not in a process the sweep spawns: it imports this module)
    raise SystemExit(main())
