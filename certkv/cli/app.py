"""The `certkv` command line.

Each command lives in its own module under `certkv.cli` and is registered here. Command
modules import torch/transformers/kvpress only inside the command body, so `certkv certify`
and `certkv --help` stay torch-free. User errors (:class:`certkv.errors.CertkvError`, pydantic
validation errors) become one line on stderr and exit code 2; click's usage errors (an unknown
command or option, a missing argument, a value of the wrong type) become click's short usage
message and exit code 2, whichever click the running typer uses (see :func:`_click_exceptions`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import typer

from certkv.cli import accuracy as _accuracy
from certkv.cli import calibrate as _calibrate
from certkv.cli import certify as _certify
from certkv.cli import demo as _demo
from certkv.cli import export as _export
from certkv.cli import gateway as _gateway
from certkv.cli import generate as _generate
from certkv.cli import report as _report
from certkv.cli import serve as _serve
from certkv.cli import validate as _validate
from certkv.interrupts import exit_code, interruptible

app = typer.Typer(
    name="certkv",
    help="Certified KV-cache eviction: calibrate, certify and deploy eviction policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _Interrupted(Exception):
    """Ctrl-C or SIGTERM inside a command. typer >= 0.26 turns a KeyboardInterrupt into a silent
    exit code 130 and older typer into an Abort; raised from the command itself, it reaches
    :func:`main` the same way under every typer version, so the "everything stored is kept" line
    is printed and the exit code is the signal's (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _command(name: str, function: Callable[..., Any], *, own_signals: bool = False) -> None:
    """Register `function` as command `name`: SIGINT and SIGTERM stop it between store
    transactions (:func:`certkv.interrupts.interruptible`) and reach :func:`main` as
    :class:`_Interrupted`. `own_signals`: the command handles them itself (the server drains)."""

    @functools.wraps(function)  # typer reads the signature and type hints through __wrapped__
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            if own_signals:
                return function(*args, **kwargs)
            with interruptible():
                return function(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise _Interrupted(exit_code(exc)) from None

    app.command(name)(command)


_command("demo", _demo.demo)
_command("generate", _generate.generate)
_command("accuracy", _accuracy.accuracy)
_command("calibrate", _calibrate.calibrate)
_command("certify", _certify.certify)
_command("validate", _validate.validate)
_command("report", _report.report)
_command("export", _export.export)
_command("serve", _serve.serve, own_signals=True)
_command("gateway", _gateway.gateway, own_signals=True)


def _click_exceptions() -> tuple[tuple[type[Any], ...], tuple[type[Any], ...]]:
    """(usage-error classes, abort classes) of the click that the running typer raises.

    typer >= 0.26 ships its own copy of click as ``typer._click`` and raises that copy's exceptions
    (its Abort is ``typer.exceptions.Abort``); older typer uses the ``click`` package. Every typer
    version re-exports ``typer.BadParameter`` and ``typer.Abort``, so the module that defines
    ``typer.BadParameter`` is the running click's ``exceptions`` module, already imported by typer
    (nothing is imported here); the ``click`` package's classes are added when something loaded it.
    """
    found = [sys.modules.get(typer.BadParameter.__module__), sys.modules.get("click.exceptions")]
    modules = [m for m in found if m is not None]
    usage = tuple(m.ClickException for m in modules if hasattr(m, "ClickException"))
    aborts = tuple({typer.Abort, *(m.Abort for m in modules if hasattr(m, "Abort"))})
    return usage, aborts


def main() -> None:
    """Entry point that turns user errors into one line and exit code 2."""
    import sqlite3

    from certkv.errors import CertkvError

    try:
        code = app(standalone_mode=False)  # click returns a ctx.exit() code instead of raising it
    except CertkvError as exc:
        print(f"certkv: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except PermissionError as exc:
        print(f"certkv: error: permission denied: {exc.filename or exc}; choose a writable path", file=sys.stderr)
        raise SystemExit(2) from None
    except sqlite3.OperationalError as exc:
        print(f"certkv: error: calibration store: {exc} (is another certkv process using this store?)", file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, _Interrupted) as exc:
        print("certkv: interrupted; everything stored so far is kept (rerun to resume)", file=sys.stderr)
        raise SystemExit(exc.code if isinstance(exc, _Interrupted) else exit_code(exc)) from None
    except Exception as exc:
        usage_errors, aborts = _click_exceptions()
        if isinstance(exc, usage_errors):  # click's short usage message: "Usage: …", "Error: …"
            exc.show()
            raise SystemExit(2) from None
        if isinstance(exc, aborts):
            print("certkv: aborted", file=sys.stderr)
            raise SystemExit(130) from None
        raise
    if isinstance(code, int) and code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
