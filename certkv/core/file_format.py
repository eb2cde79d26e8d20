"""The format version of the files certkv writes, and the one check every reader makes of it.

Every file certkv writes for a later command to read (``operating_point.json``, ``validation.json``,
a store's ``records.sqlite`` meta table) carries a ``format_version``: an integer, raised whenever
what a reader expects of the file changes. A reader accepts exactly its own version. A file of
another version (or of a build from before versions were written: none) is refused with one line
that names the file, both versions and the command that writes the file again, instead of being
read through compatibility defaults that could silently change what it means.
Torch-free.
"""

from __future__ import annotations

import os

from certkv.errors import CertkvError


def check_format_version(found: object, expected: int, file: str | os.PathLike[str], rewrite: str) -> None:
    """Raise unless `found` (the version a file carries; None when it has none) is `expected`.

    Parameters
    ----------
    found : object
        The file's ``format_version`` as read (an int, or its text in a SQLite meta table), or None.
    expected : int
        The version this certkv writes and reads.
    file : path-like
        The file, named in the error.
    rewrite : str
        The command that writes the file again, named in the error.

    Raises
    ------
    CertkvError
        One line: ``<file>: format_version <found>, this certkv reads <expected>; re-run <rewrite>``.

    Examples
    --------
    >>> check_format_version(1, 1, "operating_point.json", "certkv certify CONTRACT")
    >>> check_format_version("1", 1, "records.sqlite", "certkv calibrate CONTRACT --new-store")
    >>> try:  # doctest: +NORMALIZE_WHITESPACE
    ...     check_format_version(None, 1, "operating_point.json", "certkv certify CONTRACT")
    ... except CertkvError as exc:
    ...     print(exc)
    operating_point.json: format_version none (written by an earlier certkv build), this certkv reads 1;
    re-run `certkv certify CONTRACT` to write it again
    """
    if found is not None and str(found) == str(expected):
        return
    shown = "none (written by an earlier certkv build)" if found is None else str(found)
    raise FormatVersionError(
        f"{os.fspath(file)}: format_version {shown}, this certkv reads {expected}; re-run `{rewrite}` to write it again"
    )


class FormatVersionError(CertkvError):
    """A file of another ``format_version`` than this certkv writes (the message says which and
    what re-writes it). A :class:`CertkvError`: callers that only report it need nothing more;
    one that can recompute the file (``certkv report``'s validation) catches this type.

    Examples
    --------
    >>> try:
    ...     check_format_version(2, 1, "validation.json", "certkv validate CONTRACT")
    ... except FormatVersionError as exc:
    ...     print(isinstance(exc, CertkvError), str(exc).split(";")[0])
    True validation.json: format_version 2, this certkv reads 1
    """


__all__ = ["FormatVersionError", "check_format_version"]
