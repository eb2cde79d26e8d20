"""What ``certkv gateway`` deploys: the operating point, its contract's endpoints, the monitor and the store.

An operating point names its candidate (``<label>@<memory>``) but not the servers; the endpoint
contract it was certified from does. The gateway reads that contract from the calibration store
beside the point (``certkv certify`` writes ``<store>/operating_point.json``, and the store keeps
the contract it was calibrated for), or from ``--contract``; either way its hash must be the one
the point was certified under, so a gateway never sends requests to servers another contract
names. The store's ``endpoints`` meta also says which servers are ``certkv serve`` upstreams, as
calibration found them, so the gateway sends them the same fields without asking again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from certkv.errors import CertkvError

if TYPE_CHECKING:
    from certkv.contract.schema import Contract
    from certkv.core.operating_point import OperatingPoint
    from certkv.gateway.upstream import Upstream


def point_contract(op_path: Path, op: OperatingPoint, contract_path: Path | None) -> tuple[Contract, dict]:
    """The endpoint contract `op` was certified under and the store's endpoint identities ({} when
    none is known); one line when it cannot be found, is another contract or runs in-process."""
    from certkv.contract.loading import load_contract, parse_contract

    identities: dict = {}
    if contract_path is not None:
        contract = load_contract(contract_path)
    else:
        folder = op_path.resolve().parent
        if not (folder / "records.sqlite").is_file():
            raise CertkvError(f"no calibration store beside {op_path} to read the endpoints from; pass --contract "
                              "CONTRACT (the endpoint contract the point was certified from)")
        from certkv.calibration.store import CalibrationStore

        with CalibrationStore.read(folder) as store:
            meta = store.meta()
        contract = parse_contract(json.loads(meta["contract"]), source=f"{folder}/records.sqlite")
        identities = json.loads(meta.get("endpoints") or "{}")
    if contract.endpoint is None:
        raise CertkvError(f"contract {contract.name} runs its model in-process; deploy its point with certkv serve")
    if op.contract_sha256 is not None and contract.sha256() != op.contract_sha256:
        raise CertkvError(f"contract {contract.name} (sha256 {contract.sha256()[:12]}) is not the one {op_path} was "
                          f"certified under (sha256 {op.contract_sha256[:12]}); pass the contract it was certified from")
    return contract, identities


def check_identities(contract: Contract, identities: dict, deployed: set[str]) -> None:
    """Each server the gateway sends to (the full endpoint and the `deployed` candidates' policies)
    that answers now must be the one calibration measured: its ``/v1/models`` answer (without its
    creation times) equal to the identity the store bound. One line naming the server otherwise; a
    server that does not answer yet is left to the gateway's down handling (it is asked once, not
    retried, so a down candidate does not hold the start up)."""
    from certkv.calibration.endpoints import EndpointExecutor, EndpointOptions, EndpointUnreachable

    full, cands = EndpointExecutor(contract, EndpointOptions(retries=0, timeout=10.0)).endpoints()
    servers = {"full": full, **{policy: e for policy, _, e in cands if policy in deployed}}
    for policy, endpoint in servers.items():
        bound = identities.get(policy)
        if bound is None:
            continue
        try:
            found = endpoint.identity()
        except EndpointUnreachable:  # not answering now: the gateway's own down handling applies
            continue
        if found != bound:
            raise CertkvError(f"endpoint {endpoint.url} ({policy}) is not the server the point was certified against: its "
                              f"/v1/models answer is {json.dumps(found['models'])}, calibration's was "
                              f"{json.dumps(bound['models'])}; deploy the calibrated server or calibrate again")


def upstreams(op: OperatingPoint, contract: Contract, identities: dict, *, timeout: float, candidate_timeout: float,
              retry_after: float) -> tuple[Upstream, dict[str, Upstream]]:
    """The full endpoint and every candidate the point deploys (by base policy), each a
    :class:`~certkv.gateway.upstream.Upstream`; one line when the point deploys a candidate the
    contract does not name."""
    from certkv.calibration.endpoints import EndpointExecutor, serves_certkv
    from certkv.gateway.upstream import Upstream

    def certkv_of(policy: str) -> bool | None:
        identity = identities.get(policy)
        return serves_certkv(identity["models"], identity["name"]) if identity else None

    entries = list(op.strata.entries.values()) if op.strata is not None else [op]
    check_identities(contract, identities, {e.base_policy for e in entries if not e.fallback})
    full_spec, cands = EndpointExecutor(contract).endpoints()
    def bound(policy: str) -> list | None:
        return (identities.get(policy) or {}).get("models")

    full = Upstream(full_spec.url, full_spec.name, full_spec.api_key, timeout=timeout, retry_after=retry_after,
                    certkv=certkv_of("full"), bound_models=bound("full"))
    named = {policy: e for policy, _, e in cands}
    out: dict[str, Upstream] = {}
    for entry in entries:
        if entry.fallback:
            continue
        spec = named.get(entry.base_policy)
        if spec is None:
            raise CertkvError(f"the operating point deploys {entry.base_policy}, which contract {contract.name} does not "
                              f"name (its candidates: {', '.join(named) or 'none'})")
        out[entry.base_policy] = Upstream(spec.url, spec.name, spec.api_key, timeout=candidate_timeout,
                                          retry_after=retry_after, certkv=certkv_of(entry.base_policy),
                                          bound_models=bound(entry.base_policy))
    return full, out
