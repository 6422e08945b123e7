from starlette.datastructures import Headers

from gateway.tenancy.auth import admin_error, bearer

TOKEN = "a-long-admin-token-0123"


def test_bearer_reads_the_authorization_header() -> None:
    assert bearer(Headers({"authorization": "Bearer abc"})) == "abc"
    assert bearer(Headers({"authorization": "bearer  abc "})) == "abc"
    assert bearer(Headers({"authorization": "Basic abc"})) is None
    assert bearer(Headers({"authorization": "Bearer "})) is None
    assert bearer(Headers({})) is None


def test_the_admin_token_must_match_exactly() -> None:
    assert admin_error(Headers({"authorization": f"Bearer {TOKEN}"}), TOKEN) is None
    for given in ("", "Bearer x", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", TOKEN):
        err = admin_error(Headers({"authorization": given}), TOKEN)
        assert err is not None and err.status == 401 and TOKEN not in err.message


def test_without_a_configured_token_the_admin_api_is_closed() -> None:
    err = admin_error(Headers({"authorization": f"Bearer {TOKEN}"}), None)
    assert err is not None and err.code == "admin_disabled"


def test_the_key_cache_needs_the_same_digest_and_forgets() -> None:
    from gateway.tenancy.auth import KeyCache
    from gateway.tenancy.keys import KeyRef
    from gateway.tenancy.tenants import Tenant

    t = Tenant("tn_0000000000000001", "a", 1.0, 1)
    cache = KeyCache(ttl_s=1.0, max_entries=2)
    ref = KeyRef("0123abcd", "d" * 64)
    cache.put(ref, t, now=10.0)
    assert cache.get(ref, now=10.5) == t
    assert cache.get(KeyRef("0123abcd", "e" * 64), now=10.5) is None  # a forged secret
    assert cache.get(ref, now=11.0) is None  # expired
    cache.forget(tenant_id=t.id)
    assert cache.get(ref, now=10.5) is None
    for i in range(5):
        cache.put(KeyRef(f"0000000{i}", "d" * 64), t, now=20.0)
    assert len(cache.entries) <= 2
    assert not KeyCache(ttl_s=0.0).entries and KeyCache(ttl_s=0.0).get(ref, 0.0) is None
