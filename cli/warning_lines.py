"""The package's warnings as one `warning: <message>` line on stderr, as its
errors are one `error:` line: its `DFlashWarning`s and the records of its
`dflash_mlx` logger. Other warnings keep Python's format."""

import logging
import warnings

from rich.console import Console
from rich.markup import escape

from dflash_mlx.errors import DFlashWarning, printable

LOGGER = "dflash_mlx"


def print_warning(console: Console, message: str) -> None:
    console.print(f"[bold red]warning:[/] {escape(printable(message))}", soft_wrap=True)


class _WarningLines(logging.Handler):
    def __init__(self, console: Console):
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print_warning(self.console, record.getMessage())
        except Exception:
            self.handleError(record)


def show_warnings(console: Console) -> None:
    """Print the package's warnings on `console`, each as one line. Calling it
    again changes nothing."""
    shown = warnings.showwarning
    if not getattr(shown, "dflash_mlx", False):

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, DFlashWarning) and file is None:
                print_warning(console, str(message))
            else:
                shown(message, category, filename, lineno, file, line)

        show.dflash_mlx = True
        warnings.showwarning = show
    log = logging.getLogger(LOGGER)
    if not any(isinstance(h, _WarningLines) for h in log.handlers):
        log.addHandler(_WarningLines(console))
