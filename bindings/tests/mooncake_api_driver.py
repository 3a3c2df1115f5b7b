"""The calls added to kvtier's Mooncake-compatible class, run on a store; every result is
recorded as JSON so mooncake_driver.py can compare the real class with kvtier's."""

import numpy as np


def tensor_json(t):
    if t is None:
        return None
    import torch

    return [str(t.dtype), list(t.shape), t.reshape(-1).to(torch.float64).tolist()]


def _task_done(s, tid):
    """query_task until the task has run (Mooncake's run on a client; kvtier's already ran):
    (type, status, message, id echoed) or the code."""
    import time

    for _ in range(100):
        r, rc = s.query_task(tid)
        if rc != 0:
            return rc
        if int(r.status) not in (0, 1):  # PENDING, PROCESSING
            break
        time.sleep(0.05)
    return [int(r.type), int(r.status), r.message, tuple(r.id) == tuple(tid)]


def replica_tasks(s, setup_store, master):
    """create_copy_task / create_move_task / query_task between this client's segment and a
    second client's: return codes, the task reports and the replica count after each call."""
    out = {}
    x = setup_store()
    out["task_second_client"] = x.setup(dict(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE",
                                             protocol="tcp", master_server_addr=master,
                                             global_segment_size="64MB", local_buffer_size="1MB"))
    ha, hb = s.get_hostname(), x.get_hostname()
    n = lambda k: len(s.get_replica_desc(k))  # noqa: E731
    s.put("tk-1", b"t" * 3000)

    def copy(k, targets):
        tid, rc = s.create_copy_task(k, targets)
        return [rc, _task_done(s, tid) if rc == 0 else tid, n(k)]

    def move(k, src, dst):
        tid, rc = s.create_move_task(k, src, dst)
        return [rc, _task_done(s, tid) if rc == 0 else tid, n(k)]

    out["copy_missing_key"] = copy("tk-nope", [hb])
    out["copy_missing_key_bad_target"] = copy("tk-nope", ["nope:1"])
    out["copy_unknown_target"] = copy("tk-1", ["nope:1"])
    out["copy_one_unknown_of_two"] = copy("tk-1", [ha, "nope:1"])
    out["copy_no_target"] = copy("tk-1", [])
    out["copy_both"] = copy("tk-1", [ha, hb])
    out["copy_again_holder"] = copy("tk-1", [ha])
    out["move_same_segment"] = move("tk-1", ha, ha)
    out["move_unknown_source"] = move("tk-1", "nope:1", hb)
    out["move_unknown_target"] = move("tk-1", ha, "nope:1")
    out["move_missing_key"] = move("tk-nope", ha, hb)
    out["move_missing_key_bad_segment"] = move("tk-nope", ha, "nope:1")
    out["copy_no_target_missing_key"] = copy("tk-nope", [])
    out["move_onto_holder"] = move("tk-1", ha, hb)
    out["move_back"] = move("tk-1", hb, ha)
    out["move_from_empty"] = move("tk-1", hb, ha)
    out["get_after_moves"] = s.get("tk-1") == b"t" * 3000
    out["query_unknown_task"] = s.query_task((1, 2))
    try:
        s.create_copy_task("tk-1", "notalist")
        out["copy_targets_str"] = "no error"
    except TypeError:
        out["copy_targets_str"] = "TypeError"
    s.remove("tk-1", True)
    x.close()
    return out


def api_behaviours(s, setup_store, master, mod):
    """The same call sequence on `s` (set up on `master`); `setup_store()` makes a fresh
    unset store; `mod` is the module of the class (for ReplicateConfig, SoftPinAction)."""
    import torch

    out = {}
    raw = np.zeros(1 << 16, dtype=np.uint8)
    raw[:4096] = np.arange(4096) % 251
    p = raw.ctypes.data
    out["register"] = s.register_buffer(p, raw.nbytes)
    # upserts
    out["put"] = s.put("u-k1", b"hello")
    out["upsert_existing"] = s.upsert("u-k1", b"world!")
    out["get_after_upsert"] = s.get("u-k1").decode()
    out["upsert_new"] = s.upsert("u-k2", b"abc")
    out["upsert_parts"] = s.upsert_parts("u-k2", b"x", b"yz")
    out["get_k2"] = s.get("u-k2").decode()
    out["upsert_batch"] = s.upsert_batch(["u-k1", "u-k3"], [b"111", b"333"])
    out["get_batch"] = [v.decode() for v in s.get_batch(["u-k1", "u-k3", "u-nope"])]
    out["put_empty"] = s.put("u-e", b"")
    # buffers
    b = s.get_buffer("u-k1")
    out["get_buffer"] = [b.size(), len(b), b.ptr() != 0, bytes(memoryview(b)).decode()]
    out["get_buffer_missing"] = s.get_buffer("u-nope")
    out["get_buffer_empty_key"] = s.get_buffer("")
    out["batch_get_buffer"] = [None if x is None else bytes(memoryview(x)).decode()
                               for x in s.batch_get_buffer(["u-k1", "u-nope", "u-k3"])]
    # replicas
    d = s.get_replica_desc("u-k3")
    out["replica_desc"] = [(r.is_memory_replica(), r.is_disk_replica(), int(r.status),
                            r.get_memory_descriptor().buffer_descriptor.size) for r in d]
    out["replica_desc_missing"] = s.get_replica_desc("u-nope")
    out["batch_replica_desc"] = {k: len(v) for k, v in s.batch_get_replica_desc(["u-k3", "u-nope"]).items()}
    s.put("u-c1", b"v" * 10)
    s.put("u-c2", b"v" * 10)
    s.get("u-c1")  # leased now
    out["batch_replica_clear"] = s.batch_replica_clear(["u-c1", "u-c2", "u-nope"])
    out["exists_after_clear"] = s.batch_is_exist(["u-c1", "u-c2"])
    # zero-copy upserts, metadata puts
    out["put_from"] = s.put_from("u-r1", p, 1000)
    out["upsert_from"] = s.upsert_from("u-r1", p + 1, 500)
    out["size_r1"] = s.get_size("u-r1")
    out["batch_upsert_from"] = s.batch_upsert_from(["u-r1", "u-r2"], [p, p + 10], [100, 200])
    out["sizes"] = [s.get_size("u-r1"), s.get_size("u-r2")]
    out["put_from_meta"] = s.put_from_with_metadata("u-r3", p, p + 2000, 100, 50)
    out["get_r3"] = list(s.get("u-r3")[:8])
    out["size_r3"] = s.get_size("u-r3")
    # ranged reads
    out["get_into_ranges"] = s.get_into_ranges(
        [p + 8192, p + 16384], [["u-r1", "u-r2"], ["u-nope"]], [[[0, 10], [0]], [[0]]],
        [[[0, 5], [3]], [[0]]], [[[5, 5], [7]], [[4]]])
    out["gir_data"] = raw[8192:8202].tolist()
    out["gir_oob"] = s.get_into_ranges([p + 8192], [["u-r1"]], [[[0]]], [[[95]]], [[[10]]])
    out["gir_mismatch"] = s.get_into_ranges([p + 8192], [["u-r1", "u-r2"]], [[[0]]], [[[0]]], [[[10]]])
    out["gir_unregistered"] = s.get_into_ranges([12345], [["u-r1"]], [[[0]]], [[[0]]], [[[10]]])
    # tensors
    t23 = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out["put_tensor"] = s.put_tensor("u-t1", t23)
    out["get_tensor"] = tensor_json(s.get_tensor("u-t1"))
    out["tensor_bytes"] = list(s.get("u-t1"))
    out["get_tensor_missing"] = s.get_tensor("u-nope")
    out["get_tensor_not_tensor"] = tensor_json(s.get_tensor("u-r2"))
    out["put_tensor_dup"] = s.put_tensor("u-t1", torch.zeros(2))
    out["upsert_tensor"] = s.upsert_tensor("u-t1", torch.zeros(2))
    out["get_tensor_after"] = tensor_json(s.get_tensor("u-t1"))
    out["batch_put_tensor"] = s.batch_put_tensor(
        ["u-t3", "u-t4"], [torch.ones(2, dtype=torch.int8), torch.ones(3, dtype=torch.bfloat16)])
    out["batch_get_tensor"] = [tensor_json(t) for t in s.batch_get_tensor(["u-t3", "u-t4", "u-nope"])]
    out["pub_tensor"] = s.pub_tensor("u-pt", torch.ones(2))
    out["upsert_pub_tensor"] = s.upsert_pub_tensor("u-pt", torch.zeros(3))
    out["get_pt"] = tensor_json(s.get_tensor("u-pt"))
    t43 = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    out["put_tp"] = s.put_tensor_with_tp("u-tp", t43, 0, 2, 0)
    out["tp_exist"] = s.batch_is_exist(["u-tp", "u-tp_tp_0", "u-tp_tp_1"])
    out["tp_shard_bytes"] = [list(s.get("u-tp_tp_0")), list(s.get("u-tp_tp_1"))]
    out["get_tp1"] = tensor_json(s.get_tensor_with_tp("u-tp", 1, 2, 0))
    out["put_tp_dim1"] = s.put_tensor_with_tp("u-tq", t43, 0, 3, 1)
    out["tq_shard_bytes"] = list(s.get("u-tq_tp_2"))
    out["tp_uneven"] = s.put_tensor_with_tp("u-tu", torch.arange(5, dtype=torch.float32), 0, 2, 0)
    out["tp_bad_dim"] = s.put_tensor_with_tp("u-tb", torch.arange(4, dtype=torch.float32), 0, 2, 3)
    out["get_tp_size1"] = tensor_json(s.get_tensor_with_tp("u-t3", 0, 1, 0))
    out["get_tp_unsharded"] = tensor_json(s.get_tensor_with_tp("u-pt", 1, 2, 0))
    out["batch_put_tp"] = s.batch_put_tensor_with_tp(["u-bt"], [torch.arange(4.0)], 0, 2, 0)
    out["batch_get_tp"] = [tensor_json(t) for t in s.batch_get_tensor_with_tp(["u-bt", "u-nope"], 1, 2)]
    out["get_tensor_into"] = tensor_json(s.get_tensor_into("u-t3", p + 32768, 1000))
    out["get_tensor_into_small"] = tensor_json(s.get_tensor_into("u-t3", p + 32768, 100))
    # Mooncake's test_dummy_client: lists of different lengths are INVALID_PARAMS per key
    out["batch_get_tensor_into_mismatch"] = s.batch_get_tensor_into(["u-t3", "u-t3x"], [p + 32768], [1000])
    out["put_tensor_from"] = s.put_tensor_from("u-tf", p + 32768, 306)
    out["get_tf"] = tensor_json(s.get_tensor("u-tf"))
    out["put_tensor_from_garbage"] = s.put_tensor_from("u-tg", p, 400)
    out["put_with_parallelism"] = s.put_tensor_with_parallelism("u-pp", torch.arange(4.0))
    out["get_with_parallelism"] = tensor_json(s.get_tensor_with_parallelism("u-pp"))
    out["remove_all"] = s.remove_all(True)
    # remove_by_regex on an emptied store (no get/is_exist before a removal: Mooncake's
    # ExistKey leases the object, kvtier's does not)
    for k in ["rx-a1", "rx-a2", "x-rx-a3", "RX-A4", "rx-b1", "rx-lease"]:
        s.put(k, k.encode())
    s.get("rx-lease")  # a read lease: kept unless forced
    out["regex_search"] = s.remove_by_regex("rx-a")
    out["regex_invalid"] = [s.remove_by_regex(p) for p in ["(", "[a-", "a{2,1}", "*a", "(?<=a)b", "(?i)rx"]]
    out["regex_leased"] = s.remove_by_regex("^rx-lease$")
    out["regex_leased_force"] = s.remove_by_regex("^rx-lease$", True)
    out["regex_class_anchor"] = s.remove_by_regex(r"^RX-[A-Z]\d$")
    out["regex_none"] = s.remove_by_regex("zzz")
    out["regex_empty"] = s.remove_by_regex("")
    out["regex_left"] = s.batch_is_exist(["rx-a1", "rx-a2", "x-rx-a3", "RX-A4", "rx-b1", "rx-lease"])
    try:
        s.remove_by_regex(5)
        out["regex_not_str"] = "no error"
    except TypeError:
        out["regex_not_str"] = "TypeError"
    out.update(replica_tasks(s, setup_store, master))
    s.unregister_buffer(p)
    # setup semantics
    for v in ["16MB", "16 MB", "16M", "1gb", "1.5GB", " 16MB", "50%", "16MiB", "abc", "", "-16MB", -5]:
        x = setup_store()
        out[f"size {v!r}"] = x.setup(dict(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE",
                                          protocol="tcp", master_server_addr=master, global_segment_size=v,
                                          local_buffer_size="1MB"))
        x.close()
    x = setup_store()
    rc = x.setup(dict(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="tcp",
                      master_server_addr=master, local_buffer_size=0))
    y = np.zeros(4096, dtype=np.uint8)
    out["no_local_buffer"] = [rc, x.put("u-lb", b"abc"), x.register_buffer(y.ctypes.data, 4096),
                              x.put_from("u-lbf", y.ctypes.data, 100), x.get("u-lbf").decode(),
                              x.get_buffer("u-lbf") is None]
    host, _, port = x.get_hostname().rpartition(":")
    out["hostname_host_port"] = [host, port.isdigit()]
    x.remove_all(True)
    out["close"] = x.close()
    out["health_after_close"] = x.health_check()
    c = mod.ReplicateConfig()
    out["replicate_config_default"] = str(c)
    c.soft_pin_action = mod.SoftPinAction.ENABLE
    c.soft_pin_ttl_ms = 1000
    c.preferred_segments = ["a"]
    out["replicate_config_set"] = str(c)
    out["soft_pin_actions"] = [(k, int(v)) for k, v in mod.SoftPinAction.__members__.items()]
    c0 = mod.ReplicateConfig()
    c0.replica_num = 0
    out["put_replica_num_0"] = s.put("u-rc0", b"x", c0)
    return out
