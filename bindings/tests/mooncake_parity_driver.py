"""The behaviours Mooncake's own store tests (mooncake-wheel/tests) found different in kvtier's
compatible class (issue 23), as one call sequence whose every result is recorded: run by
mooncake_driver.py on the real class (a real master) and on kvtier's (a ``kvtier-l3`` server),
and compared by test_mooncake_real.py. test_mooncake_parity.py checks the kvtier side against
the answers recorded from Mooncake 0.3.13, so CI keeps them where Mooncake cannot install.

Each entry names the upstream test it comes from.
"""

import time


def _try(f):
    """f()'s result, or the name of the exception it raised."""
    try:
        return repr(f())
    except Exception as e:  # noqa: BLE001
        return type(e).__name__


def config_fields(mod):
    """ReplicateConfig's soft-pin fields (test_soft_pin_ttl_optional_conversion,
    test_replicate_config_creation_and_properties) and SoftPinAction's comparisons."""
    out = {}
    c = mod.ReplicateConfig()
    out["ttl_default"] = repr(c.soft_pin_ttl_ms)
    ttl = {}
    for name, v in [("1000", 1000), ("None", None), ("-1", -1), ("2**64", 1 << 64), ("2**64-1", (1 << 64) - 1),
                    ("1.5", 1.5), ("True", True), ("'5'", "5")]:
        c = mod.ReplicateConfig()
        c.soft_pin_ttl_ms = 7
        r = _try(lambda: setattr(c, "soft_pin_ttl_ms", v))
        ttl[name] = [r if r != "None" else "ok", repr(c.soft_pin_ttl_ms)]
    out["ttl_set"] = ttl
    S = mod.SoftPinAction
    act = {}
    for name, v in [("ENABLE", S.ENABLE), ("1", 1), ("None", None), ("True", True), ("'ENABLE'", "ENABLE")]:
        c = mod.ReplicateConfig()
        r = _try(lambda: setattr(c, "soft_pin_action", v))
        act[name] = [r if r != "None" else "ok", c.soft_pin_action.name]
    out["action_set"] = act
    out["action_default"] = mod.ReplicateConfig().soft_pin_action.name
    out["enum"] = [S.ENABLE == S.ENABLE, S.ENABLE == 1, S.ENABLE != 1, int(S.ENABLE), hash(S.DISABLE),
                   S(1).name, S.ENABLE.value, sorted(S.__members__)]
    out["enum_as_dict_key"] = {S.ENABLE: "x"}.get(mod.SoftPinAction.ENABLE)
    return out


def soft_pin_puts(s, mod):
    """test_soft_pin_config_forwarding: a TTL is accepted with ENABLE only (-600 else)."""
    S, out = mod.SoftPinAction, {}

    def cfg(action=None, ttl=None):
        c = mod.ReplicateConfig()
        if action is not None:
            c.soft_pin_action = action
        c.soft_pin_ttl_ms = ttl
        return c

    key = "par-soft-pin"
    out["put_enable_ttl"] = s.put(key, b"soft-pin", cfg(S.ENABLE, 1000))
    out["upsert_preserve_ttl"] = s.upsert(key, b"soft-pin", cfg(None, 1000))
    out["upsert_disable_ttl"] = s.upsert(key, b"soft-pin", cfg(S.DISABLE, 1000))
    out["upsert_plain"] = s.upsert(key, b"soft-pin")
    out["upsert_disable"] = s.upsert(key, b"soft-pin", cfg(S.DISABLE))
    out["put_preserve_ttl_new_key"] = s.put("par-soft-pin-2", b"x", cfg(None, 5))
    out["batch_put_disable_ttl"] = s.put_batch(["par-soft-pin-3"], [b"x"], cfg(S.DISABLE, 5))
    out["exists_after_refused"] = [s.is_exist("par-soft-pin-2"), s.is_exist("par-soft-pin-3")]
    s.remove(key, True)
    return out


def hostname(new_store, master):
    """test_basic_get_hostname: "localhost" gets a port of 12300 ..= 14300."""
    s = new_store()
    rc = s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master)
    host, _, port = s.get_hostname().rpartition(":")
    out = [rc, host, port.isdigit() and 12300 <= int(port) <= 14300]
    s.close()
    return out


def tear_down(new_store, master):
    """test_client_tear_down: close() takes the client's objects; a new setup works."""
    s, out = new_store(), {}
    setup = lambda: s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master)  # noqa: E731
    out["setup"] = setup()
    out["put"] = s.put("par-teardown", b"Hello, World!")
    out["put_batch"] = s.put_batch(["par-teardown-b1", "par-teardown-b2"], [b"1", b"2"])
    out["close"] = s.close()
    out["setup_again"] = setup()
    out["get_after"] = s.get("par-teardown").decode()
    out["exist_after"] = s.batch_is_exist(["par-teardown-b1", "par-teardown-b2"])
    out["put_again"] = s.put("par-teardown", b"Hello, World!")
    out["get_again"] = s.get("par-teardown").decode()
    s.remove("par-teardown", True)
    s.close()
    return out


def replicated_close(new_store, master, mod):
    """test_replication_failure_tolerance: an object put with replica_num=2 while another
    client is mounted outlives the putting client's close (its other replica); one put plainly
    does not (test_client_tear_down)."""
    a, b, out = new_store(), new_store(), {}
    setup = lambda s, port: s.setup(f"localhost:{port}", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",  # noqa: E731
                                    master)
    out["setup"] = [setup(a, 12350), setup(b, 12351)]
    c = mod.ReplicateConfig()
    c.replica_num = 2
    out["put_replicated"] = a.put("par-rep", b"replicated", c)
    out["close"] = a.close()
    out["get_from_other"] = b.get("par-rep").decode()
    out["setup_again"] = setup(a, 12350)
    out["get_after_reinit"] = a.get("par-rep").decode()
    a.remove_all(True)
    a.close()
    b.close()
    return out


def replica_clear(new_store, master, lease_ms):
    """test_batch_replica_clear.py: a named segment (the client's own, another) after the
    lease expired."""
    s, out = new_store(), {}
    s.setup("localhost:12345", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master)
    keys = ["par-clear-self", "par-clear-other", "par-clear-plain"]
    out["puts"] = [s.put(k, b"segment name test data") for k in keys]
    time.sleep(lease_ms / 1000 + 0.5)
    out["hostname"] = s.get_hostname()
    out["clear_self"] = s.batch_replica_clear([keys[0]], segment_name=s.get_hostname())
    out["clear_other_segment"] = s.batch_replica_clear([keys[1]], segment_name="nonexistent_host:99999")
    out["clear_plain"] = s.batch_replica_clear([keys[2]])
    out["exist_after"] = s.batch_is_exist(keys)
    out["get_self_after"] = s.get(keys[0]).decode()
    s.remove_all(True)
    s.close()
    return out


def replicated_clear(new_store, master, mod, lease_ms):
    """test_clear_specific_segment_replica: with two clients mounted, an object put with
    replica_num=2 has a replica in each one's segment; clearing the putting client's segment
    (after the lease) leaves the other replica, from which the object still reads."""
    a, b, out = new_store(), new_store(), {}
    setup = lambda s, port: s.setup(f"localhost:{port}", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",  # noqa: E731
                                    master)
    out["setup"] = [setup(a, 12360), setup(b, 12361)]
    c = mod.ReplicateConfig()
    c.replica_num = 2
    out["put"] = a.put("par-rclear", b"two replicas", c)
    time.sleep(lease_ms / 1000 + 0.5)
    out["clear_own"] = a.batch_replica_clear(["par-rclear"], segment_name=a.get_hostname())
    out["get_from_other"] = b.get("par-rclear").decode()
    out["replicas_left"] = len(a.get_replica_desc("par-rclear"))
    out["clear_own_again"] = a.batch_replica_clear(["par-rclear"], segment_name=a.get_hostname())
    a.remove_all(True)
    a.close()
    b.close()
    return out


def _section(f, *args):
    """f(*args), or the exception's type and text (one section failing leaves the others)."""
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def parity_behaviours(new_store, master, mod, lease_ms):
    """Everything above on clients of `master` (no other client mounted, so placement is
    the client's own segment, as in Mooncake's tests); `new_store()` makes an unset client,
    `mod` is the class's module, `lease_ms` the master's lease TTL."""
    s = new_store()
    out = {"setup": s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master)}
    out["config_fields"] = _section(config_fields, mod)
    out["soft_pin_puts"] = _section(soft_pin_puts, s, mod)
    s.close()
    out["hostname"] = _section(hostname, new_store, master)
    out["tear_down"] = _section(tear_down, new_store, master)
    out["replicated_close"] = _section(replicated_close, new_store, master, mod)
    out["replica_clear"] = _section(replica_clear, new_store, master, lease_ms)
    out["replicated_clear"] = _section(replicated_clear, new_store, master, mod, lease_ms)
    return out
