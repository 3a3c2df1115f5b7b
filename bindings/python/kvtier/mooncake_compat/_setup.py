"""``setup``'s arguments as Mooncake 0.3.13 reads them.

Measured against a real client (bindings/tests/test_mooncake_real.py): the dict form takes
sizes as ints or as text ("16MB", "16 MB", "16M", "1gb", "1.5GB"; spaces around are
ignored); text it cannot read ("50%", "16MiB", "abc", "", "-16MB") makes ``setup`` return
-600, not raise. The positional form takes ints only (a str is a TypeError, from pybind11).
"""

from __future__ import annotations

import os
import random
import re
import socket
from typing import Any, Dict, Optional, Tuple

from ._types import ErrorCode

SETUP_FIELDS = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
)
SETUP_EXTRA = (
    "engine",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
)
DEFAULT_SIZE = 16 << 20

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)b?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(v: Any) -> Optional[int]:
    """Bytes from an int or a text size; None if unreadable or negative."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v >= 0 else None
    if isinstance(v, str):
        m = _SIZE.match(v)
        if not m:
            return None
        return int(float(m.group(1)) * _UNIT[m.group(2).lower()])
    if hasattr(v, "__index__"):
        return parse_size(int(v.__index__()))
    return None


def check_str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected str, got {type(v).__name__}")
    return v


def check_int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if hasattr(v, "__index__") and not isinstance(v, bool):
            return int(v.__index__())
        raise TypeError(f"{name}: expected int, got {type(v).__name__}")
    return v


def read_args(args: tuple, kwargs: dict) -> Tuple[Optional[Dict[str, Any]], int]:
    """(config, 0) or (None, code) from either ``setup`` form; TypeError for wrong types in
    the positional form."""
    if len(args) == 1 and not kwargs and isinstance(args[0], dict):
        cfg: Dict[str, Any] = dict(args[0])
        if "local_hostname" not in cfg or "metadata_server" not in cfg:
            return None, int(ErrorCode.INVALID_PARAMS)
    else:
        names = SETUP_FIELDS + SETUP_EXTRA
        if len(args) > len(names):
            raise TypeError("setup(): too many positional arguments")
        cfg = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in cfg:
                raise TypeError(f"setup(): {k} given twice")
            cfg[k] = v
        missing = [n for n in SETUP_FIELDS if n not in cfg]
        if missing:
            raise TypeError(f"setup(): missing arguments {missing}")
        for n in ("local_hostname", "metadata_server", "protocol", "rdma_devices", "master_server_addr"):
            check_str(cfg[n], n)
        for n in ("global_segment_size", "local_buffer_size"):
            check_int(cfg[n], n)
    for n in ("global_segment_size", "local_buffer_size"):
        size = parse_size(cfg.get(n, DEFAULT_SIZE))
        if size is None:
            return None, int(ErrorCode.INVALID_PARAMS)
        cfg[n] = size
    return cfg, 0


# Mooncake's handshake listener takes a random free port in this range when the hostname
# names none (its test_basic_get_hostname checks 12300 ..= 14300).
HANDSHAKE_PORTS = (12300, 14300)

# Names picked for live clients of this process: Mooncake's listener holds its port, so two
# clients never share a name; ours binds only to test the port, so it remembers them (a
# segment is found by its client's name: two clients of one name would mix their segments).
TAKEN: set = set()


def hostname_with_port(local_hostname: str) -> str:
    """``host:port`` as Mooncake's ``get_hostname`` reports it: the given hostname with a
    free port of Mooncake's handshake range (tried from a random start), not one a live
    client of this process has; a hostname that already names a port is kept."""
    host = local_hostname or "127.0.0.1"
    if host.count(":") == 1 and host.rsplit(":", 1)[1].isdigit():
        return host
    lo, hi = HANDSHAKE_PORTS
    start = random.randint(lo, hi)
    for i in range(hi - lo + 1):
        port = lo + (start - lo + i) % (hi - lo + 1)
        if f"{host}:{port}" in TAKEN:
            continue
        for h in (host, "127.0.0.1"):
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((h, port))
                    return f"{host}:{port}"
            except (OSError, UnicodeError):
                continue
    return f"{host}:{start}"


def resolve(master: str) -> Tuple[Optional[str], int]:
    """A ``kvtier-l3`` server address ("IP:PORT") from ``HOST:PORT`` or
    ``kvtier://HOST:PORT``, or an etcd HA locator passed on as given
    (``etcd://HOST:PORT;HOST:PORT``, Mooncake's form; the cluster is ``/NAME`` after the
    members, else ``MC_STORE_CLUSTER_ID`` as in Mooncake, else ``default``); (None, code)
    if it cannot be read or resolved."""
    if master.startswith("etcd://"):
        cluster = os.environ.get("MC_STORE_CLUSTER_ID")
        if "/" not in master[len("etcd://"):] and cluster:
            master = f"{master}/{cluster}"
        return master, 0
    if master.startswith("kvtier://"):
        master = master[len("kvtier://"):]
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        return None, int(ErrorCode.INVALID_PARAMS)
    host = host.strip("[]")
    try:
        # an AF_INET/AF_INET6 sockaddr's first item is the address text
        ip = str(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError):
        return None, int(ErrorCode.RPC_FAIL)
    return (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"), 0


def embedded_name(master: str) -> Optional[str]:
    """The embedded store's name if ``master`` names one ("", "local", "embedded",
    "embedded://NAME"), else None."""
    if master in ("", "local", "embedded"):
        return "default"
    if master.startswith("embedded://"):
        return master[len("embedded://"):] or "default"
    return None
