#!/usr/bin/env bash
# Builds the documentation site from docs/ and the docstrings (mkdocs-material,
# mkdocstrings and MathJax, the `docs` extra, installed into .venv on first use), and
# serves it at http://127.0.0.1:8000 with live reload. The site loads nothing from
# outside: MathJax is copied into it (docs/hooks.py).
#
#   bash scripts/docs.sh          build into site/ (strict: a warning fails), then serve
#   bash scripts/docs.sh build    build into site/ only
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADACCUM_EXTRAS=tf,experiment,docs source "$root/scripts/setup.sh"
cd "$root"
export NO_MKDOCS_2_WARNING=1
python -m mkdocs build --strict
if [ "${1:-serve}" != "build" ]; then
  python -m mkdocs serve --dev-addr 127.0.0.1:8000
fi
