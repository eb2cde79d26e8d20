"""The ``certkv`` command line: one module per command, registered in :mod:`certkv.cli.app`.

Command modules import torch, transformers and kvpress only inside the command body, so
``certkv certify`` and ``certkv --help`` stay torch-free.
"""
