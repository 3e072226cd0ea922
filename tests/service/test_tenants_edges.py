"""The tenants' values at their edges, without a runner (docs/service.md section D): a
tenant's patterns are refused one by one, naming the field, as a tenants file's reader
reports them."""

from __future__ import annotations

import pytest

from trio_supervisor.service.tenants import Tenant, token_hash


@pytest.mark.parametrize(
    ("pattern", "error", "message"),
    [
        ("", ValueError, "Tenant.identities[] must not be empty"),
        (7, TypeError, "Tenant.identities[] must be a str, not int"),
        ("a" * 129, ValueError, "Tenant.identities[] must be at most 128 characters, got 129"),
    ],
)
def test_a_bad_pattern_among_good_ones_is_refused_naming_the_patterns_field(
    pattern: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        Tenant(name="acme", token_sha256=token_hash("t"), identities=("acme", pattern))  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_a_pattern_of_the_longest_identity_is_one_pattern() -> None:
    longest = "a" * 127 + "*"
    tenant = Tenant(name="acme", token_sha256=token_hash("t"), identities=[longest])
    assert tenant.identities == (longest,)
    assert tenant.may_use("a" * 127)
    assert not tenant.may_use("b")
