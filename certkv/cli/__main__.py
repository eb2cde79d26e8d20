"""``python -m certkv.cli``: the same entry point as the ``certkv`` command."""

from certkv.cli.app import main

main()
