"""The L1 arena on 2 MiB pages (l1.hugepages, docs/operations.md "Huge pages").

Without root (or when the kernel will not reserve pages) only the refusals that need no pool
run: `on` with no hugetlbfs names the reason, bad values are rejected. As root the module
reserves 2 MiB pages (vm.nr_hugepages, the previous value restored afterwards) and mounts a
private hugetlbfs (unmounted afterwards); then `on` puts the arena there (/status page_size
2097152, huge_pages true, the start-up log says so), the Python and C clients store and read
back byte-exact through it, lazily, with MAP_POPULATE and with the background fault-in, and an
arena bigger than the pool is refused by `on` (saying how many pages it needs) and falls back
to 4 KiB pages in /dev/shm with `auto`.
"""

import contextlib
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import pytest  # noqa: E402

import kvtier  # noqa: E402
from kvtest import MiB, run_kvtierd, wait_until  # noqa: E402
from test_c_client import Scenario, needs_client_test  # noqa: E402

HUGE = 2 * MiB
POOL = "/proc/sys/vm/nr_hugepages"
FREE = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages"
ARENA = 32 * MiB                  # what the tests put on huge pages
PAGES = ARENA // HUGE + 2         # the pool reserved: the arena and a little slack
# the arena alone (test_fast_path_on_2m_pages adds the fast path's rings to it)
KVT_DAEMON_ARGS = ("--l2", "none", "--fastpath-enabled=false")


def _read_int(path):
    with open(path) as f:
        return int(f.read().split()[0])


def _write_int(path, v):
    with open(path, "w") as f:
        f.write("%d\n" % v)


@pytest.fixture(scope="module")
def hugetlbfs():
    """A private hugetlbfs mount with PAGES free 2 MiB pages, as root; skips otherwise."""
    if os.geteuid() != 0:
        pytest.skip("huge pages: not root, cannot reserve 2 MiB pages or mount hugetlbfs")
    try:
        before = _read_int(POOL)
        free0 = _read_int(FREE)
    except OSError as e:
        pytest.skip("huge pages: no 2 MiB pool on this kernel (%s)" % e)
    mnt = tempfile.mkdtemp(prefix="kvt-huge-", dir=os.environ.get("KVT_TMPDIR", "/tmp"))
    mounted = False
    try:
        try:
            _write_int(POOL, before + PAGES)
        except OSError as e:
            pytest.skip("huge pages: cannot reserve %d pages (%s)" % (PAGES, e))
        if _read_int(FREE) < free0 + PAGES:
            pytest.skip("huge pages: the kernel reserved %d of %d pages (memory fragmented?)"
                        % (_read_int(FREE) - free0, PAGES))
        cp = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", mnt],
                            capture_output=True, text=True)
        if cp.returncode != 0:
            pytest.skip("huge pages: cannot mount hugetlbfs: %s" % cp.stderr.strip())
        mounted = True
        yield mnt
    finally:
        if mounted:
            subprocess.run(["umount", mnt], check=False)
        with contextlib.suppress(OSError):
            _write_int(POOL, before)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


def _dev_shm_huge():
    """The huge= option of the /dev/shm mount ("never" when absent)."""
    opt = "never"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 3 and parts[1] == "/dev/shm":
                for o in parts[3].split(","):
                    if o.startswith("huge="):
                        opt = o[5:]
    return opt


def _status_l1(d):
    return d.http_json("GET", "/status")["l1"]


def _arena_line(d):
    return [ln for ln in d.stderr_text().splitlines() if "bytes of shared memory at" in ln][-1]


def test_bad_values_are_refused():
    cp = run_kvtierd(["--check-config", "--l1-hugepages", "maybe"])
    assert cp.returncode == 2 and "l1.hugepages" in cp.stderr and "auto, on, off" in cp.stderr
    cp = run_kvtierd(["--check-config", "--l1-hugepages", "on", "--lmcache-listen",
                      "tcp://127.0.0.1:%d" % 5999])
    assert cp.returncode == 2 and "lmcache.listen" in cp.stderr, cp.stderr


def test_on_without_hugetlbfs_refuses_to_start(daemon_factory, tmp_path):
    d = daemon_factory("--l1-hugepages", "on", "--l1-hugepages-dir", str(tmp_path), start=False)
    d.start(wait=False)
    assert d.wait(30) != 0
    assert ("l1.hugepages is on but l1.hugepages_dir %s is not a hugetlbfs mount with 2 MiB pages"
            % tmp_path) in d.stderr_text(), d.stderr_tail()


def test_off_is_4k_in_dev_shm(daemon_factory):
    d = daemon_factory("--l1-hugepages", "off")
    l1 = _status_l1(d)
    assert l1["shm_path"].startswith("/dev/shm/kvtier-")
    # the background thread reads every page once after the start (kvt_arena: l1.warm)
    wait_until(lambda: _status_l1(d)["warm"] is True, 30, what="/status l1.warm")
    if _dev_shm_huge() in ("always", "within_size"):
        pytest.skip("/dev/shm is mounted huge=%s: its pages are huge whatever the daemon asks"
                    % _dev_shm_huge())
    assert l1["page_size"] == 4096 and l1["huge_pages"] is False
    assert "4 KiB pages)" in _arena_line(d)
    assert "kvtier_l1_page_size_bytes 4096" in d.http("GET", "/metrics")[2].decode()


def test_on_puts_the_arena_on_2m_pages(daemon_factory, hugetlbfs, monkeypatch):
    # an l1_size that is not a multiple of 2 MiB is rounded up, and HELLO says so
    d = daemon_factory("--l1-size", str(ARENA - MiB), "--l1-hugepages", "on",
                       "--l1-hugepages-dir", hugetlbfs)
    l1 = _status_l1(d)
    assert l1["page_size"] == HUGE and l1["huge_pages"] is True and l1["pinned"] is True
    assert os.path.dirname(l1["shm_path"]) == hugetlbfs
    assert os.path.basename(l1["shm_path"]).startswith("kvtier-")
    assert l1["capacity"] == ARENA
    st = os.stat(l1["shm_path"])
    assert st.st_mode & 0o777 == 0o600 and st.st_size == ARENA
    assert "(pinned, 2 MiB pages, hugetlbfs)" in _arena_line(d), _arena_line(d)
    assert ("kvtier_l1_page_size_bytes %d" % HUGE) in d.http("GET", "/metrics")[2].decode()

    keys = [bytes([0x51, i]) * 8 for i in range(5)]
    size = MiB + 3 * 4096 + 5                          # objects straddle 2 MiB pages
    datas = [bytes((b * 13 + i) & 0xff for b in range(size)) for i in range(len(keys))]
    for mode in ("0", "1", "background"):
        monkeypatch.setenv("KVTIER_MAP_POPULATE", mode)
        with kvtier.Client(d.ipc) as c:
            assert c.info["shm"] == {"path": l1["shm_path"], "size": ARENA, "map_size": ARENA,
                                     "page_size": HUGE}
            assert c.arena is not None and len(c.arena) == ARENA
            ns = "huge-%s" % mode
            r = c.reserve(ns, keys, size)
            for view, data in zip(r.slots, datas):
                view[:] = data
            assert c.commit(r.lease) == len(keys)
            assert c.get(ns, keys) == datas
            a = c.acquire(ns, keys)
            assert [bytes(v) for v in a.views] == datas
            c.release(a.lease)
    d.stop()
    assert os.listdir(hugetlbfs) == []                  # the segment goes with its daemon


@needs_client_test
def test_c_client_on_2m_pages(daemon_factory, hugetlbfs):
    d = daemon_factory("--l1-size", str(ARENA), "--l1-hugepages", "on",
                       "--l1-hugepages-dir", hugetlbfs)
    assert _status_l1(d)["huge_pages"] is True
    for mode in ("0", "1", "background"):
        out = Scenario(d.ipc, "arena", env={"KVTIER_MAP_POPULATE": mode}).finish(d)
        assert "round-tripped" in out


def test_short_pool_on_refuses_auto_falls_back(daemon_factory, hugetlbfs):
    big = ARENA * 4
    need = big // HUGE
    d = daemon_factory("--l1-size", str(big), "--l1-hugepages", "on",
                       "--l1-hugepages-dir", hugetlbfs, start=False)
    d.start(wait=False)
    assert d.wait(30) != 0
    err = d.stderr_text()
    assert "l1.hugepages is on but %s has" % hugetlbfs in err, d.stderr_tail()
    assert "the arena needs %d (reserve them: sysctl vm.nr_hugepages=" % need in err
    d = daemon_factory("--l1-size", str(big), "--l1-hugepages", "auto",
                       "--l1-hugepages-dir", hugetlbfs)
    l1 = _status_l1(d)
    assert l1["shm_path"].startswith("/dev/shm/") and l1["capacity"] == big
    assert "the arena goes to /dev/shm: %s has" % hugetlbfs in d.stderr_text()
    # /dev/shm's own huge= mount option decides whether the THP request is granted
    if l1["page_size"] == HUGE:
        assert l1["huge_pages"] is True and "transparent huge pages" in _arena_line(d)
    else:
        assert l1["page_size"] == 4096 and l1["huge_pages"] is False
        assert "4 KiB pages" in _arena_line(d)
    with kvtier.Client(d.ipc) as c:
        assert c.info["shm"]["page_size"] == l1["page_size"]


def test_killed_daemon_leaves_no_pages_behind_the_next_start(daemon_factory, hugetlbfs):
    """SIGKILL leaves the hugetlbfs file holding its pages; the next daemon of the same run dir
    removes it before counting free pages, so `on` starts again on the same pool."""
    import signal
    d = daemon_factory("--l1-size", str(ARENA), "--l1-hugepages", "on",
                       "--l1-hugepages-dir", hugetlbfs)
    stale = _status_l1(d)["shm_path"]
    d.stop(signal.SIGKILL)
    assert os.path.exists(stale) and _read_int(FREE) < ARENA // HUGE
    d2 = daemon_factory(start=False)
    d2.args = ["--run-dir", d.run_dir, "--data-dir", d2.data_dir, "--listen", d2.ipc,
               "--http", d2.http_addr, "--l2", "none", "--fastpath-enabled=false",
               "--l1-size", str(ARENA), "--l1-hugepages", "on", "--l1-hugepages-dir", hugetlbfs]
    d2.start()
    l1 = _status_l1(d2)
    assert l1["huge_pages"] is True and l1["shm_path"] != stale
    assert not os.path.exists(stale)
