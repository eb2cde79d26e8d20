"""Model plumbing: loading causal LMs, their layers, greedy generation and attention switching.

Also the window queries and window attention that the gate and the probabilistic press read
inside the single prefill. Nothing here patches transformers at import time.
"""
