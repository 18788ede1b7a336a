"""The two consoles every command writes to: results on stdout, progress and errors on stderr.

rich resolves sys.stdout / sys.stderr when it prints, so these module-level consoles follow
any redirection (a test runner's capture, a log file)."""

from rich.console import Console

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)
