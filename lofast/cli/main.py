"""The `lofast` command: a thin click group over the library. torch is imported inside commands
so that `lofast --help` stays fast."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

import click
from rich.markup import escape

from lofast import __version__
from lofast.cli.console import stderr
from lofast.errors import LofastError


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch scheduler's stop, `timeout`, `kill`), raised where the program is, so
    that it unwinds like Ctrl-C: finished work stays saved."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


# An error line longer than this (a message that quotes a hostile value: a model option or a
# path of 200,000 characters) keeps its start and end, and says how much it left out.
ERROR_CHARS = 600
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _error_line(message: str) -> str:
    """The message as printed after "error:": one line of at most about ERROR_CHARS
    characters, control characters (a newline or a terminal escape in a file or folder name)
    written as escapes."""
    message = _CONTROL.sub(lambda match: ascii(match.group())[1:-1], message)
    if len(message) <= ERROR_CHARS:
        return message
    head, tail = ERROR_CHARS * 2 // 3, ERROR_CHARS // 6
    return (f"{message[:head]} ... ({len(message) - head - tail:,} characters left out) ... "
            f"{message[-tail:]}")


class LofastGroup(click.Group):
    """Maps every user-caused error, and running out of memory, to one line on stderr and exit
    code 1 (click's own option errors keep their usage line and exit code 2, their message cut
    as ours are), and an interrupt to one line and exit code 130 (Ctrl-C) or 143 (SIGTERM),
    instead of a traceback."""

    def invoke(self, ctx: click.Context):
        on_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if on_main_thread else None
        try:
            return super().invoke(ctx)
        except click.ClickException as e:  # click's own checks of options and arguments
            message = e.format_message()
            if _error_line(message) != message:  # a hostile value quoted whole: cut it (click
                # prints what format_message gives, after its usage line)
                e.format_message = lambda: _error_line(message)
            raise
        except LofastError as e:
            stderr.print(f"[bold red]error:[/] {escape(_error_line(str(e)))}", soft_wrap=True)
            sys.exit(1)
        except OSError as e:  # the machine's refusal (full disk, permissions), not a bug of ours
            where = f"{e.filename}: " if e.filename else ""
            stderr.print(f"[bold red]error:[/] {escape(_error_line(where + str(e.strerror or e)))}",
                         soft_wrap=True)
            sys.exit(1)
        except Exception as e:  # torch.OutOfMemoryError is a RuntimeError; any other: a bug
            from lofast.runtime import is_out_of_memory

            if not is_out_of_memory(e):
                raise
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            stderr.print(f"[bold red]error:[/] out of memory ({escape(reason)}); a smaller "
                         "--batch-size needs less, and --resume goes on from the saved work",
                         soft_wrap=True)
            sys.exit(1)
        except KeyboardInterrupt as e:
            resumable = ctx.invoked_subcommand in ("certify", "train")
            stderr.print("[yellow]interrupted[/]" + (": finished work is saved; rerun with "
                                                     "--resume" if resumable else ""))
            sys.exit(128 + signal.SIGTERM if isinstance(e, Terminated) else 130)
        finally:
            if on_main_thread:
                signal.signal(signal.SIGTERM, previous)


@click.group(cls=LofastGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lofast")
def cli() -> None:
    """Train Lipschitz vision transformers and certify their l2 robustness with LoFAST."""


def _register() -> None:
    from lofast.cli import certify_cmd, info_cmd, report_cmd, train_cmd

    cli.add_command(train_cmd.train)
    cli.add_command(certify_cmd.certify)
    cli.add_command(info_cmd.info)
    cli.add_command(report_cmd.report)


_register()


def main() -> None:
    """Run the command. A process of a torchrun job with several processes (WORLD_SIZE > 1)
    then ends at once with the command's exit code, its output flushed, skipping Python's
    finalization: after DistributedDataParallel on gloo, finalization can destroy a C++ thread
    that is still joinable and abort the process ("terminate called without an active
    exception"; torch 2.13, even after destroy_process_group: 1 in 20 to 36 two-process runs
    of a tiny certified training on a loaded 2-core machine), which turned finished, saved
    runs into failed jobs. Every file
    lofast writes is closed (and renamed into place) before the command returns."""
    if os.environ.get("WORLD_SIZE", "1").strip() in ("", "1"):
        cli(prog_name="lofast")
        return
    try:
        cli(prog_name="lofast")
        code = 0
    except SystemExit as e:
        code = e.code
    if not isinstance(code, int):  # sys.exit(None) or sys.exit(message)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
