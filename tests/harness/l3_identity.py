"""L3 prompt-state identities as earlier versions computed them (to test upgrades)."""

from __future__ import annotations

import pytest

from actors.l3 import identity
from actors.l3.identity import (
    _FIELDS,
    StateInputs,
    exact_state_identity,
)

#: What the identity was before the per-slot context and the stream count joined it (v2), for the same inputs.
V2_DOMAIN = b"mesh-actor/l3/exact-state-identity/v2\x00"


V2_FIELDS = tuple(n for n in _FIELDS[StateInputs] if n not in ("n_ctx_seq", "n_stream", "split"))


def v2_identity(inputs: StateInputs, monkeypatch: pytest.MonkeyPatch) -> str:
    """The identity the v2 code gave `inputs` (less its new fields): what entries stored before carry."""
    with monkeypatch.context() as patch:
        patch.setattr(identity, "_DOMAIN", V2_DOMAIN)
        patch.setitem(identity._FIELDS, StateInputs, V2_FIELDS)
        return exact_state_identity(inputs)
