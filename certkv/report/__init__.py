"""Presentation: what a certificate means, in words, on the console, in figures and on one HTML page.

One module per medium, all reading the same sentences from :mod:`certkv.report.text`:
:mod:`~certkv.report.console` (``certkv certify``'s output), :mod:`~certkv.report.tables` (console
tables that never cut a value), :mod:`~certkv.report.figures` (matplotlib, imported lazily),
:mod:`~certkv.report.html` (the self-contained page, from ``templates/report.html.j2``) and
:mod:`~certkv.report.calibration_summary` (``certkv calibrate``'s table).
"""
