"""Progress of long runs where rich draws no bar: log files, CI, nohup, remote jobs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console

# Seconds between two plain progress lines; a module constant so that tests can set it to 0.
PLAIN_PROGRESS_SECONDS = 60.0


class PlainProgress:
    """Prints a progress line at most every PLAIN_PROGRESS_SECONDS when the console is not a
    terminal (rich's live bar prints nothing there, so a 10-minute epoch would be silent);
    on a terminal it does nothing and the bar shows progress."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.enabled = not console.is_terminal
        self.last = time.monotonic()

    def __call__(self, text: str) -> None:
        """Print text if the interval has passed since the last line (or the start)."""
        now = time.monotonic()
        if self.enabled and now - self.last >= PLAIN_PROGRESS_SECONDS:
            self.last = now
            self.console.print(text, soft_wrap=True, markup=False)


@contextlib.contextmanager
def phase_progress(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """A callback progress(phase, done, total) for library passes over a data set: a bar per
    phase on a terminal, plain lines (as PlainProgress) elsewhere."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plain = PlainProgress(console)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)
            plain(f"{phase}: {done}/{total} samples")

        yield update
