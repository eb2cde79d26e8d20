"""From a contract to the core's :class:`~certkv.core.spec.CertificationSpec`.

The core knows nothing about contracts, so that it can certify any loss table; a contract's
pre-registered choices become a spec in :meth:`certkv.contract.schema.Contract.certification_spec`
(the core's :func:`~certkv.core.certify.certify` calls it on a contract), which this function names
for callers that hold a contract. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from certkv.contract.schema import Contract
    from certkv.core.spec import CertificationSpec


def certification_spec(contract: Contract) -> CertificationSpec:
    """The contract's τ, ε, confidence, procedure and sequences as a CertificationSpec.

    The sequences are the contract's policy entries in the order written, each followed by its
    gated sequences (:meth:`certkv.contract.schema.Contract.sequences`); that order is the
    pre-registration and is never re-derived from data. ``candidate_info`` carries what deploying
    each candidate needs (base policy, press_kwargs, gate settings). A pilot gate (confidence,
    lookahead, learned) carries its quantile and ``pilot_gate``; its threshold is placed on the
    pilot split (``gate.pilot``, drawn by ``requests.seed``) when the records are certified.
    """
    return contract.certification_spec()
