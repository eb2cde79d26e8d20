"""Calibration: run every request under the full cache and every candidate, keep the evidence.

:mod:`~certkv.calibration.run` drives the engine over a contract's requests and writes
:mod:`~certkv.calibration.store` (crash-safe SQLite); :mod:`~certkv.calibration.utility` scores an
answer; :mod:`~certkv.calibration.certification` loads a contract's evidence back for certification.
Importing this package imports no torch, nor does the certify path (certification, validation_file,
store); the modules of a calibrate run (run, ray_executor, accuracy) import the model stack at their top.
"""
