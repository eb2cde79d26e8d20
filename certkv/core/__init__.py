"""The torch-free core: exact binomial statistics, family-wise procedures and certification.

Everything a certificate rests on lives here and imports numpy, scipy, pydantic and (for
validation only, lazily) statsmodels, nothing else: no torch, transformers or kvpress, and nothing
from the rest of certkv but :mod:`certkv.errors`, :mod:`certkv.atomic_io` and the version. So a
certificate can be computed and checked on a machine without the model stack (``certkv certify``).

Modules, in the order they build on each other:

* :mod:`~certkv.core.binomial` — violation counts and exact binomial p-values / bounds;
* :mod:`~certkv.core.procedures` — fixed-sequence, Bonferroni and Holm family-wise control;
* :mod:`~certkv.core.policy_names` — the one naming rule for candidates;
* :mod:`~certkv.core.loss_table` — one loss per (request, policy), read from any source;
* :mod:`~certkv.core.gated` — gated candidates derived from their base's records;
* :mod:`~certkv.core.spec` — what the certifier needs (τ, ε, 1 − δ, sequences);
* :mod:`~certkv.core.certify` — the decision: counts, p-values, the family-wise choice;
* :mod:`~certkv.core.operating_point` — the result, as written to ``operating_point.json``;
* :mod:`~certkv.core.validation` — repeated-split validation;
* :mod:`~certkv.core.conformal` — scale factors for the probabilistic press's certificate.
"""
