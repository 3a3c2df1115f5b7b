"""register_buffer refuses memory that is not mapped readable and writable (issue 19, item 6).

Before the check, ``register_buffer(0x1000, 4096)`` returned 0 and the next ``get_into``
into it killed the process with SIGSEGV. The crashing sequence runs in a child process, so
a crash fails the test instead of killing pytest. The other cases only register (a call
that never touches the memory) and use only ranges that were accepted and are mapped.
"""

import ctypes
import itertools
import mmap
import subprocess
import sys
import textwrap

import numpy as np

from kvtier.mooncake_compat import ErrorCode, MooncakeDistributedStore

PAGE = mmap.PAGESIZE
_names = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTFORK = 10


def new_store():
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 24, 1 << 20, "tcp", "",
                   f"embedded://reg-{next(_names)}") == 0
    return s


def anon_pages(n):
    """``n`` fresh anonymous read-write pages (their own mapping): their address."""
    p = _libc.mmap(None, n * PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert p not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    return p


def test_a_wild_pointer_is_refused_and_a_get_into_it_does_not_crash():
    child = textwrap.dedent("""
        from kvtier.mooncake_compat import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 24, 1 << 20, "tcp", "",
                       "embedded://wild") == 0
        assert s.put("k", b"x" * 4096) == 0
        print("register", s.register_buffer(0x1000, 4096), flush=True)
        print("get_into", s.get_into("k", 0x1000, 4096), flush=True)
        print("batch_get_into", s.batch_get_into(["k"], [0x1000], [4096]), flush=True)
        print("put_from", s.put_from("k2", 0x1000, 4096), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (
        f"the child died (returncode {r.returncode}; -11 is SIGSEGV): "
        f"stdout {r.stdout!r} stderr {r.stderr[-2000:]!r}")
    assert r.stdout.split("\n")[:4] == [
        "register -600", "get_into -600", "batch_get_into [-600]", "put_from -600"]


def test_only_ranges_covered_by_read_write_mappings_register():
    s = new_store()
    p = anon_pages(4)
    try:
        assert s.register_buffer(0x1000, PAGE) == ErrorCode.INVALID_PARAMS  # never mapped
        # Page 1 gets other flags (its own mapping, still rw-): a range over several
        # adjacent read-write mappings is fine, and reads and writes work across them.
        assert _libc.madvise(p + PAGE, PAGE, MADV_DONTFORK) == 0
        assert s.register_buffer(p, 4 * PAGE) == 0
        src = np.arange(4 * PAGE, dtype=np.uint64).astype(np.uint8)
        ctypes.memmove(p, src.ctypes.data, 4 * PAGE)
        assert s.put_from("span", p, 4 * PAGE) == 0
        ctypes.memset(p, 0, 4 * PAGE)
        assert s.get_into("span", p, 4 * PAGE) == 4 * PAGE
        assert ctypes.string_at(p, 4 * PAGE) == src.tobytes()
        assert s.unregister_buffer(p) == 0
        # A read-only page inside the range: refused; the writable part alone is fine.
        assert _libc.mprotect(p + 2 * PAGE, PAGE, mmap.PROT_READ) == 0
        assert s.register_buffer(p, 4 * PAGE) == ErrorCode.INVALID_PARAMS
        assert s.register_buffer(p + 2 * PAGE, 1) == ErrorCode.INVALID_PARAMS
        assert s.register_buffer(p, 2 * PAGE) == 0
        assert s.unregister_buffer(p) == 0
        # An unmapped page (a hole) inside or at the end of the range: refused.
        assert _libc.munmap(p + 3 * PAGE, PAGE) == 0
        assert s.register_buffer(p + 3 * PAGE, PAGE) == ErrorCode.INVALID_PARAMS
        assert _libc.mprotect(p + 2 * PAGE, PAGE, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        assert s.register_buffer(p, 4 * PAGE) == ErrorCode.INVALID_PARAMS
        assert s.register_buffer(p, 3 * PAGE) == 0
        assert s.get_into("span", p, 3 * PAGE) == ErrorCode.INVALID_PARAMS  # too small: as before
    finally:
        s.close()
        _libc.munmap(p, 3 * PAGE)


def test_ordinary_buffers_still_register():
    s = new_store()
    a = np.zeros(1 << 20, dtype=np.uint8)  # heap or its own mmap
    b = bytearray(100)
    c = np.zeros(10, dtype=np.float32)
    assert s.register_buffer(a.ctypes.data, a.nbytes) == 0
    assert s.register_buffer(ctypes.addressof(ctypes.c_char.from_buffer(b)), len(b)) == 0
    assert s.register_buffer(c.ctypes.data, c.nbytes) == 0
    gone = anon_pages(1)  # a buffer freed (unmapped) before it was registered
    assert _libc.munmap(gone, PAGE) == 0
    assert s.register_buffer(gone, 16) == ErrorCode.INVALID_PARAMS
    s.close()
