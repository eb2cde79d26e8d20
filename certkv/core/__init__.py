"""The torch-free core: exact binomial statistics, family-wise procedures and certification.

Everything a certificate rests on lives here and imports numpy, scipy, pydantic and, lazily,
statsmodels (validation) and scikit-learn (the pilot's learned gate), nothing else: no torch,
transformers or kvpress, and nothing from the rest of certkv but :mod:`certkv.errors`,
:mod:`certkv.atomic_io` and the version. So a certificate can be computed and checked on a
machine without the model stack (``certkv certify``).

Modules, in the order they build on each other:

* :mod:`~certkv.core.binomial` — violation counts and exact binomial p-values / bounds;
* :mod:`~certkv.core.procedures` — the family-wise procedures (fixed sequence, pilot-ordered,
  Bonferroni, Holm), one class each;
* :mod:`~certkv.core.policy_names` — the one naming rule for candidates;
* :mod:`~certkv.core.signals` — the gate signals, one declaration each;
* :mod:`~certkv.core.spec` — what the certifier needs (τ, ε, 1 − δ, sequences, gate settings);
* :mod:`~certkv.core.loss_table` — one loss per (request, policy), read from any source;
* :mod:`~certkv.core.gate_features` — the learned gate's features and score;
* :mod:`~certkv.core.gated` — gated candidates derived from their base's records;
* :mod:`~certkv.core.grouped` — the certificate over context groups (Hoeffding–Bentkus, binomial
  over contexts) when requests share a context;
* :mod:`~certkv.core.pilot` — the pilot split: thresholds and learned gates placed on it;
* :mod:`~certkv.core.coverage` — the coverage envelope of a certificate (strata, context lengths);
* :mod:`~certkv.core.file_format` — the ``format_version`` every file certkv writes, checked on load;
* :mod:`~certkv.core.operating_point` — the result, as written to ``operating_point.json``;
* :mod:`~certkv.core.certify` — the decision: counts, p-values, the family-wise choice;
* :mod:`~certkv.core.strata` — certificates per stratum, separately or simultaneously;
* :mod:`~certkv.core.validation` — repeated-split validation;
* :mod:`~certkv.core.monitor` — the live risk monitor's anytime-valid test and bound.
"""
