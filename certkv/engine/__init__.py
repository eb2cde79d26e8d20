"""The calibration engine: one full prefill per request, every candidate gathered from it."""
