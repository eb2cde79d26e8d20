"""The `certkv` command line.

Each command lives in its own module under `certkv.cli` and is registered here. Command
modules import torch/transformers/kvpress only inside the command body, so `certkv certify`
and `certkv --help` stay torch-free. User errors (:class:`certkv.errors.CertkvError`, pydantic
validation errors) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

import typer

from certkv.cli import accuracy as _accuracy
from certkv.cli import calibrate as _calibrate
from certkv.cli import certify as _certify
from certkv.cli import demo as _demo
from certkv.cli import export as _export
from certkv.cli import generate as _generate
from certkv.cli import report as _report
from certkv.cli import validate as _validate

app = typer.Typer(
    name="certkv",
    help="Certified KV-cache eviction: calibrate, certify and deploy eviction policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("demo")(_demo.demo)
app.command("generate")(_generate.generate)
app.command("accuracy")(_accuracy.accuracy)
app.command("calibrate")(_calibrate.calibrate)
app.command("certify")(_certify.certify)
app.command("validate")(_validate.validate)
app.command("report")(_report.report)
app.command("export")(_export.export)


def main() -> None:
    """Entry point that turns user errors into one line and exit code 2."""
    from certkv.errors import CertkvError

    import sqlite3

    try:
        code = app(standalone_mode=False)  # click returns a ctx.exit() code instead of raising it
    except CertkvError as exc:
        print(f"certkv: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code)
    except PermissionError as exc:
        print(f"certkv: error: permission denied: {exc.filename or exc}; choose a writable path", file=sys.stderr)
        raise SystemExit(2)
    except sqlite3.OperationalError as exc:
        print(f"certkv: error: calibration store: {exc} (is another certkv process using this store?)", file=sys.stderr)
        raise SystemExit(2)
    except KeyboardInterrupt:
        print("certkv: interrupted; everything stored so far is kept (rerun to resume)", file=sys.stderr)
        raise SystemExit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            raise SystemExit(2)
        if isinstance(exc, click.exceptions.Abort):
            print("certkv: aborted", file=sys.stderr)
            raise SystemExit(130)
        raise
    if isinstance(code, int) and code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
