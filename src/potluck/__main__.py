"""``python -m potluck`` runs the CLI."""

from potluck.cli import main

main()
