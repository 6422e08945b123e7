from gateway.tenancy import keys


def test_a_new_key_has_the_documented_format_and_only_its_digest_is_kept() -> None:
    new = keys.new_key()
    assert new.key.startswith(f"tg-{new.prefix}-") and len(new.key) == 3 + 8 + 1 + 43
    assert keys.prefix_of(new.key) == new.prefix and keys.is_prefix(new.prefix)
    assert new.key not in new.digest and len(new.digest) == 64
    assert keys.matches(new.key, new.digest)


def test_keys_are_unique_and_a_near_miss_does_not_match() -> None:
    a, b = keys.new_key(), keys.new_key()
    assert a.key != b.key
    assert not keys.matches(b.key, a.digest)
    assert not keys.matches(a.key[:-1] + ("A" if a.key[-1] != "A" else "B"), a.digest)


def test_malformed_keys_have_no_prefix() -> None:
    good = keys.new_key().key
    for bad in ("", "sk-123", good[:-1], good + "x", good.replace("tg-", "tx-"), good.upper()):
        assert keys.prefix_of(bad) is None
