"""`python -m lofast` runs the command-line interface."""

from lofast.cli.main import main

main()
