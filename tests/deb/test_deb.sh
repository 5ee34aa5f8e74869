#!/bin/bash
# tests/deb/test_deb.sh [DEB_DIR]: `make deb-test`, the packages `make deb` built (default
# build/deb), checked as an operator gets them.
#  (a) Without installing: each .deb's exact file list; the paths the unit names (ExecStart, its
#      --config, User=) are in the kvtier package; the packaged config's run_dir and data_dir are
#      the unit's RuntimeDirectory and StateDirectory; kvtierd, the CLI and libkvtier carry no
#      RPATH/RUNPATH, do not link libcudart, and got dpkg-buildflags' hardening.
#  (b) As root, on this machine: dpkg -i; the unit where systemd looks and `systemd-analyze
#      verify`; the daemon at ExecStart's path (--version; --check-config on the conffile, as
#      the kvtier user in a /var/lib/kvtier made as StateDirectory= makes it); the kvtier user
#      (made by systemd-sysusers in postinst); the conffile; both man pages; a client built with
#      pkg-config against libkvtier-dev (shared and static) and the CLI (with no -e: its default
#      endpoint) talking to the installed daemon, started briefly in the installed layout's run
#      dir /run/kvtier with a private data dir and a free loopback port; /healthz; an upgrade
#      (dpkg -i over the daemon running as kvtier with l1.adopt) keeps its cache: the new
#      binary adopts the arena and serves what was stored; then dpkg --purge and nothing left,
#      /var/lib/kvtier, /run/kvtier and the kept arena included (the postrm). The
#      packages are purged on any exit (trap), and the kvtier user removed if this test made it
#      (purge keeps it, as Debian packages do).
# Part (b) changes machine-wide state: it holds /run/lock/kvtier-deb-test.lock (one run at a
# time), waits for a dpkg lock another apt/dpkg holds (bookworm's dpkg has no lock timeout of
# its own: it is retried), refuses to run where kvtier is installed or /var/lib/kvtier or
# /run/kvtier exist (a `make install`ed service's: the purge would delete them), and on a host
# running systemd masks kvtier.service (--runtime) for the install, so that the postinst does
# not start it (without systemd as PID 1 the postinst starts nothing).
# A failed check prints FAIL and the script exits 1 after the rest have run.
set -u
cd "$(dirname "$0")/../.." || exit 1
DEB_DIR=${1:-build/deb}
VERSION=$(cat VERSION)
MA=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
PKGS=(kvtier libkvtier0 libkvtier-dev)
failures=0
ok() { echo "ok: $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
check() { # check DESCRIPTION COMMAND...: ok when COMMAND exits 0
    local what=$1; shift
    if "$@" >/dev/null; then ok "$what"; else fail "$what"; fi
}
finish() {
    if [ "$failures" = 0 ]; then echo "deb-test: passed"; exit 0; fi
    echo "deb-test: $failures check(s) failed"; exit 1
}

T=$(mktemp -d /tmp/kvtier-deb-test.XXXXXX)
daemon_pid=""   # the `timeout` wrapper around the test's kvtierd
daemon_rc=""
installed=0
made_mask=0
made_user=0
made_state=0
# running PID: PID exists and is not a zombie (kill -0 is true for a zombie)
running() {
    local st
    st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$st" ] && [ "${st%% *}" != Z ]
}
# stop_daemon: SIGTERM to kvtierd through its timeout wrapper (which passes it on); whatever is
# left after 5 s is killed, kvtierd (the wrapper's child) first. Sets daemon_rc (kvtierd's
# status, as the wrapper returns it).
stop_daemon() {
    [ -n "$daemon_pid" ] || return 0
    kill -TERM "$daemon_pid" 2>/dev/null
    for _ in $(seq 50); do running "$daemon_pid" || break; sleep 0.1; done
    if running "$daemon_pid"; then
        echo "deb-test: kvtierd did not stop within 5 s of SIGTERM: SIGKILL"
        pkill -KILL -P "$daemon_pid"; kill -KILL "$daemon_pid" 2>/dev/null
    fi
    wait "$daemon_pid"; daemon_rc=$?
    daemon_pid=""
}
# dpkg_do LOG ARGS...: dpkg ARGS, output to LOG; while another apt or dpkg holds dpkg's lock
# (bookworm's dpkg cannot wait for it itself), retried every 5 s for up to 2 minutes.
dpkg_do() {
    local log=$1 try; shift
    for try in $(seq 24); do
        DEBIAN_FRONTEND=noninteractive dpkg "$@" </dev/null >"$log" 2>&1 && return 0
        grep -q 'locked by another process' "$log" || return 1
        echo "deb-test: dpkg's lock is held by another process (apt?): waiting ($try/24)"
        sleep 5
    done
    return 1
}
cleanup() {
    stop_daemon
    if [ "$installed" = 1 ]; then
        echo "deb-test: cleanup: dpkg --purge ${PKGS[*]}"
        dpkg_do "$T/cleanup.log" --purge "${PKGS[@]}" || cat "$T/cleanup.log"
    fi
    [ "$made_mask" = 0 ] || systemctl unmask --runtime --quiet kvtier.service
    if [ "$made_user" = 1 ] && getent passwd kvtier >/dev/null; then
        echo "deb-test: removing the kvtier user and group this test created"
        userdel kvtier 2>/dev/null; getent group kvtier >/dev/null && groupdel kvtier 2>/dev/null
    fi
    # the purge removes them (postrm); not where it failed, or the test stopped before it
    [ "$made_state" = 0 ] || rm -rf /var/lib/kvtier /run/kvtier
    rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

declare -A DEB
for p in "${PKGS[@]}"; do
    f=("$DEB_DIR/${p}_${VERSION}"-*.deb)
    if [ ${#f[@]} != 1 ] || [ ! -f "${f[0]}" ]; then
        echo "FAIL: no single ${p}_${VERSION}-*.deb in $DEB_DIR (make deb)"; exit 1
    fi
    DEB[$p]=${f[0]}
done

# ---- (a) the .debs --------------------------------------------------------------------------
# Every file and symlink of each package (directories aside); links as "path -> target".
declare -A EXPECT
EXPECT[kvtier]="etc/kvtier/kvtier.json
lib/systemd/system/kvtier.service
usr/bin/kvtier
usr/bin/kvtierd
usr/lib/sysusers.d/kvtier.conf
usr/share/doc/kvtier/changelog.Debian.gz
usr/share/doc/kvtier/copyright
usr/share/doc/kvtier/examples/kvtier.service.d/gpu.conf
usr/share/man/man1/kvtier.1.gz
usr/share/man/man8/kvtierd.8.gz"
EXPECT[libkvtier0]="usr/lib/$MA/libkvtier.so.$VERSION
usr/lib/$MA/libkvtier.so.0 -> libkvtier.so.$VERSION
usr/share/doc/libkvtier0/changelog.Debian.gz
usr/share/doc/libkvtier0/copyright"
EXPECT[libkvtier-dev]="usr/include/kvtier.h
usr/lib/$MA/libkvtier.a
usr/lib/$MA/libkvtier.so -> libkvtier.so.0
usr/lib/$MA/pkgconfig/kvtier.pc
usr/share/doc/libkvtier-dev/changelog.Debian.gz
usr/share/doc/libkvtier-dev/copyright"
contents() {
    dpkg-deb -c "$1" |
        awk '$1 !~ /^d/ { sub("^\\./", "", $6); print $6 ($7 == "->" ? " -> " $8 : "") }' | sort
}
for p in "${PKGS[@]}"; do
    got=$(contents "${DEB[$p]}")
    want=$(sort <<<"${EXPECT[$p]}")
    if [ "$got" = "$want" ]; then ok "$p: file list"; else
        fail "$p: file list differs (< expected, > in the .deb):"
        diff <(echo "$want") <(echo "$got")
    fi
done
check "kvtier: /etc/kvtier/kvtier.json is a conffile" \
    grep -qx /etc/kvtier/kvtier.json <(dpkg-deb -I "${DEB[kvtier]}" conffiles)
check "kvtier: postinst creates the user with systemd-sysusers" \
    grep -q 'systemd-sysusers .*kvtier.conf' <(dpkg-deb -I "${DEB[kvtier]}" postinst)

X=$T/x
if ! dpkg-deb -x "${DEB[kvtier]}" "$X" || ! dpkg-deb -x "${DEB[libkvtier0]}" "$X"; then
    fail "dpkg-deb -x"
fi
UNIT=lib/systemd/system/kvtier.service
directive() { sed -n "s/^$1=//p" "$2" | tail -n 1; }
exec_start=$(directive ExecStart "$X/$UNIT")
BIN=${exec_start%% *}
CONF=$(sed -n 's/.*--config \([^ ]*\).*/\1/p' <<<"$exec_start")
check "unit: ExecStart's binary $BIN is in the package" test -x "$X$BIN"
check "unit: ExecStart's --config $CONF is in the package" test -n "$CONF" -a -f "$X$CONF"
user=$(directive User "$X/$UNIT")
check "unit: User=$user is defined by the package's sysusers.d file" \
    grep -q "^u $user " "$X/usr/lib/sysusers.d/kvtier.conf"
cfg_dir() {
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$X$CONF" "$1"
}
check "config: run_dir is the unit's RuntimeDirectory" \
    test "$(cfg_dir run_dir)" = "/run/$(directive RuntimeDirectory "$X/$UNIT")"
check "config: data_dir is the unit's StateDirectory" \
    test "$(cfg_dir data_dir)" = "/var/lib/$(directive StateDirectory "$X/$UNIT")"

for elf in usr/bin/kvtierd usr/bin/kvtier "usr/lib/$MA/libkvtier.so.$VERSION"; do
    dyn=$(readelf -dW "$X/$elf")
    check "$elf: no RPATH/RUNPATH" bash -c '! grep -qE "\((RPATH|RUNPATH)\)" <<<"$1"' _ "$dyn"
    check "$elf: does not link libcudart" bash -c '! grep -q "NEEDED.*libcudart" <<<"$1"' _ "$dyn"
    check "$elf: full RELRO (relro + bind-now)" bash -c 'grep -q "BIND_NOW\|Flags: NOW" <<<"$1" &&
        readelf -lW "$2" | grep -q GNU_RELRO' _ "$dyn" "$X/$elf"
done
check "kvtierd: PIE" bash -c 'readelf -hW "$1" | grep -q "Type:.*DYN"' _ "$X/usr/bin/kvtierd"
check "kvtierd: fortified (_FORTIFY_SOURCE) and stack protector" bash -c \
    'syms=$(readelf --dyn-syms -W "$1"); grep -qE " __[a-z_]+_chk(@|$)" <<<"$syms" &&
     grep -q __stack_chk_fail <<<"$syms"' _ "$X/usr/bin/kvtierd"

# ---- (b) installed on this machine ----------------------------------------------------------
if [ "$(id -u)" != 0 ]; then
    echo "deb-test: not root: skipped installing the packages (dpkg -i); the .debs were checked"
    finish
fi
mkdir -p /run/lock
exec 9>/run/lock/kvtier-deb-test.lock
if ! flock -n 9; then
    echo "FAIL: another deb-test holds /run/lock/kvtier-deb-test.lock (one at a time)"; exit 1
fi
for p in "${PKGS[@]}"; do
    st=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)
    if [ -n "$st" ] && [ "$st" != not-installed ]; then
        echo "FAIL: $p is already on this machine ($st): deb-test would replace and purge it;" \
             "dpkg --purge ${PKGS[*]} first"
        exit 1
    fi
done
for p in "${PKGS[@]}"; do
    while read -r f _; do
        if [ -e "/$f" ] || [ -L "/$f" ]; then
            echo "FAIL: /$f exists and no package owns it (make install PREFIX=/usr?):" \
                 "deb-test would overwrite it"
            exit 1
        fi
    done <<<"${EXPECT[$p]}"
done
# The package's state directories: the purge deletes them (postrm), so they must not be some
# other kvtier's (make install PREFIX=/usr/local and its running service).
# An unused /var/lib/kvtier with no file but an empty fs L2's unlocked .lock is what `kvtierd
# --check-config` run as root on the default config leaves (it opens fs:/var/lib/kvtier/l2):
# nothing is lost when the test removes that first.
empty_l2_only() {
    [ -d /var/lib/kvtier ] && [ ! -L /var/lib/kvtier ] &&
        [ -z "$(find /var/lib/kvtier ! -type d ! -path /var/lib/kvtier/l2/.lock)" ] &&
        { [ ! -e /var/lib/kvtier/l2/.lock ] || flock -n /var/lib/kvtier/l2/.lock true; }
}
for d in /var/lib/kvtier /run/kvtier; do
    if [ -e "$d" ] || [ -L "$d" ]; then
        if [ "$d" = /var/lib/kvtier ] && empty_l2_only; then
            echo "note: /var/lib/kvtier holds nothing but an empty, unused fs L2 (a kvtierd" \
                 "--check-config run as root?): removed"
            rm -rf /var/lib/kvtier; continue
        fi
        echo "FAIL: $d exists (a make install'ed kvtier's state?): deb-test's purge would" \
             "delete it; stop that service and remove $d first"
        exit 1
    fi
done
getent passwd kvtier >/dev/null || made_user=1
made_state=1
# On a host running systemd the postinst would start kvtier.service (a 1 GiB locked arena, port
# 8080); the test starts its own daemon instead. A runtime mask (in /run, gone at reboot) makes
# that start a no-op; it is lifted as soon as dpkg -i is done. Without systemd as PID 1 the
# postinst starts nothing (its start is inside `if [ -d /run/systemd/system ]`).
if [ -d /run/systemd/system ]; then
    if systemctl mask --runtime --quiet kvtier.service; then made_mask=1
    else echo "FAIL: systemctl mask --runtime kvtier.service"; exit 1; fi
fi

installed=1
if ! dpkg_do "$T/dpkg.log" -i "${DEB[@]}"; then
    cat "$T/dpkg.log"; fail "dpkg -i"; finish
fi
ok "dpkg -i ${DEB[*]##*/}"
if [ "$made_mask" = 1 ]; then
    systemctl unmask --runtime --quiet kvtier.service && made_mask=0
    check "kvtier.service was not started by the postinst (masked during dpkg -i)" \
        bash -c '! systemctl --quiet is-active kvtier.service'
fi
for p in "${PKGS[@]}"; do
    check "$p: installed" test "$(dpkg-query -W -f='${Status}' "$p")" = "install ok installed"
done

found=""
for d in $(systemd-analyze --system unit-paths 2>/dev/null); do
    [ -f "$d/kvtier.service" ] && found=$d && break
done
check "kvtier.service is on systemd's unit path (${found:-not found})" test -n "$found"
verify=$(SYSTEMD_LOG_COLOR=0 timeout 60 systemd-analyze verify "/$UNIT" 2>&1); rc=$?
if [ $rc = 0 ] && [ -z "$verify" ]; then ok "systemd-analyze verify /$UNIT (man:kvtierd(8) found)"
else fail "systemd-analyze verify /$UNIT (status $rc): $verify"; fi
check "the unit's ExecStart binary $BIN --version says $VERSION" \
    grep -qF "$VERSION" <(timeout 10 "$BIN" --version 2>&1)
# As the service runs it: user kvtier, /var/lib/kvtier made as the unit's StateDirectory= makes
# it. --check-config opens the fs L2 (fs:/var/lib/kvtier/l2), creating it: as root it would
# leave root-owned state behind; here it is kvtier's, and the purge must remove it.
sd_mode=$(directive StateDirectoryMode "$X/$UNIT")
install -d -o kvtier -g kvtier -m "${sd_mode:-0755}" /var/lib/kvtier
check "$BIN --check-config --config $CONF (as kvtier)" \
    bash -c 'timeout 30 runuser -u kvtier -- "$1" --check-config --config "$2" >"$3" 2>&1 ||
        { cat "$3"; false; }' _ "$BIN" "$CONF" "$T/check-config.log"
check "--check-config made the fs L2 /var/lib/kvtier/l2, owned by kvtier" \
    test "$(stat -c %U /var/lib/kvtier/l2 2>/dev/null)" = kvtier
if [ "$made_user" = 1 ]; then
    check "the kvtier user was created (systemd-sysusers)" getent passwd kvtier
else
    echo "note: the kvtier user existed before the install: its creation is not tested here"
fi
check "the kvtier group exists" getent group kvtier
check "$CONF is a conffile of kvtier" \
    grep -q " $CONF " <(dpkg-query -W -f='${Conffiles}\n' kvtier)
check "the unit is enabled (deb-systemd-helper)" \
    test -L /etc/systemd/system/multi-user.target.wants/kvtier.service
# Slim images (docker's debian "minimal" setups) tell dpkg not to unpack man pages at all.
man_excluded=$(grep -lsE '^[[:space:]]*path-exclude[[:space:]=]+/usr/share/man' \
    /etc/dpkg/dpkg.cfg.d/* 2>/dev/null | head -n 1)
if [ -n "$man_excluded" ]; then
    echo "skip: man pages: dpkg does not install /usr/share/man here (path-exclude in $man_excluded)"
elif ! command -v man >/dev/null; then
    fail "man pages: no man (man-db) on this machine (make deps-deb installs it)"
else
    check "man kvtierd" test "$(man -w 8 kvtierd 2>/dev/null)" = /usr/share/man/man8/kvtierd.8.gz
    check "man kvtier" test "$(man -w 1 kvtier 2>/dev/null)" = /usr/share/man/man1/kvtier.1.gz
fi
# /lib is /usr/lib on bookworm (merged /usr): the loader may name either
check "ldconfig knows libkvtier.so.0" grep -qE "libkvtier.so.0 .*=> (/usr)?/lib/$MA/" <(ldconfig -p)

# A client of the installed library, as an engine builder compiles one.
export -n PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_LIBDIR
cat >"$T/client.c" <<'EOF'
#include <kvtier.h>

#include <stdio.h>

int main(int argc, char **argv)
{
    char err[256] = "";
    kvtier_t *kv = kvtier_connect(argv[argc - 1], "deb-test", NULL, 5000, err, sizeof err);
    if (!kv) {
        fprintf(stderr, "connect: %s\n", err);
        return 1;
    }
    int rc = kvtier_ping(kv);
    printf("server %s ping %d\n", kvtier_info(kv)->server, rc);
    kvtier_close(&kv);
    return rc == 0 ? 0 : 1;
}
EOF
check "pkg-config kvtier: libdir /usr/lib/$MA, version $VERSION" \
    test "$(pkg-config --variable=libdir kvtier) $(pkg-config --modversion kvtier)" \
    = "/usr/lib/$MA $VERSION"
check "cc client.c \$(pkg-config --cflags --libs kvtier)" bash -c \
    'cc -o "$1/client" "$1/client.c" $(pkg-config --cflags --libs kvtier)' _ "$T"
check "the client loads the installed libkvtier.so.0" \
    grep -qE "libkvtier.so.0 => (/usr)?/lib/$MA/libkvtier.so.0" <(ldd "$T/client" 2>&1)
check "cc client.c libkvtier.a (static)" bash -c \
    'cc -o "$1/client-static" "$1/client.c" $(pkg-config --cflags kvtier) "$2" \
        $(pkg-config --libs libzmq msgpack jansson libxxhash)' _ "$T" "/usr/lib/$MA/libkvtier.a"

# The installed daemon on the installed config, in the installed layout's run dir and socket
# (/run/kvtier: the service is not running, and the test refused to start where it existed),
# with its data dir in $T, a smaller arena and HTTP on a free loopback port, for a few seconds
# (--l1-adopt=false: it runs as root, so no arena of its may stay in /dev/shm after the test).
# env -i: no KVTIER_* of the caller's applies. `timeout 120` bounds its life should this script
# be killed; stop_daemon stops it.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
sock=ipc:///run/kvtier/kvtier.sock
check "the config's endpoint is $sock (the CLI's default below)" \
    test "$(cfg_dir listen)" = "['$sock']"
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin timeout 120 "$BIN" --config "$CONF" \
    --run-dir /run/kvtier --listen "$sock" --data-dir "$T/data" --l2 "fs:$T/data/l2" \
    --http "127.0.0.1:$port" --l1-size 64M --l1-adopt=false >"$T/daemon.log" 2>&1 &
daemon_pid=$!
healthy=0
for _ in $(seq 100); do
    curl -fsS --max-time 2 "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && { healthy=1; break; }
    running "$daemon_pid" || break
    sleep 0.2
done
check "installed kvtierd answers /healthz on 127.0.0.1:$port" test $healthy = 1
check "the installed CLI's usage names its default endpoint $sock" \
    grep -qF "else $sock" <(env -i /usr/bin/kvtier --help 2>&1)
if [ $healthy = 1 ]; then
    for c in client client-static; do
        check "$c: HELLO and PING to the installed daemon" \
            bash -c 'env -i timeout 30 "$1" "$2" >/dev/null' _ "$T/$c" "$sock"
    done
    check "the installed CLI, no -e: kvtier ping reaches $sock" \
        grep -q "^pong from" <(env -i timeout 30 /usr/bin/kvtier ping 2>&1)
fi
stop_daemon
if [ "$daemon_rc" = 0 ]; then ok "kvtierd stopped cleanly on SIGTERM"
else fail "kvtierd exit status $daemon_rc; its log:"; tail -n 30 "$T/daemon.log"; fi

# ---- an upgrade keeps the cache (issue 30) -------------------------------------------------
# The daemon as the service runs it (user kvtier, /run/kvtier as RuntimeDirectory= makes it,
# l1.adopt on) stores an object; `dpkg -i` of the packages over it (what an upgrade does; the
# same version here: prerm/postrm "upgrade", the binary replaced under the running daemon) must
# keep the arena and the journal; the daemon the package put in place, started after the old one
# stopped, serves the object byte-exact. The purge below then removes the kept arena (postrm).
rd_mode=$(directive RuntimeDirectoryMode "$X/$UNIT")
rm -rf /run/kvtier # the root-run daemon's above (the test made it: it did not exist before)
install -d -o kvtier -g kvtier -m "${rd_mode:-0755}" /run/kvtier
port2=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
start_as_service() { # start_as_service LOG: the installed daemon, as kvtier, l1.adopt on
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin setpriv --reuid=kvtier --regid=kvtier \
        --init-groups timeout 120 "$BIN" --config "$CONF" --run-dir /run/kvtier \
        --listen "$sock" --data-dir /var/lib/kvtier --l2 none --http "127.0.0.1:$port2" \
        --l1-size 64M --l1-adopt --allow-unpinned >"$1" 2>&1 &
    daemon_pid=$!
    for _ in $(seq 100); do
        curl -fsS --max-time 2 "http://127.0.0.1:$port2/readyz" >/dev/null 2>&1 && return 0
        running "$daemon_pid" || return 1
        sleep 0.2
    done
    return 1
}
head -c 300000 /dev/urandom >"$T/object"
if start_as_service "$T/up1.log"; then
    ok "the installed kvtierd runs as kvtier with l1.adopt (run dir /run/kvtier)"
    key=$(env -i timeout 30 /usr/bin/kvtier put --ns upgrade "$T/object" 2>&1 | grep -oE '[0-9a-f]{32}' | head -n 1)
    check "kvtier put stored an object (key ${key:-none})" test -n "$key"
    [ "$made_mask" = 1 ] || { [ -d /run/systemd/system ] &&
        systemctl mask --runtime --quiet kvtier.service && made_mask=1; }
    if dpkg_do "$T/dpkg-up.log" -i "${DEB[@]}"; then ok "dpkg -i over the running daemon"
    else cat "$T/dpkg-up.log"; fail "dpkg -i over the running daemon"; fi
    if [ "$made_mask" = 1 ]; then systemctl unmask --runtime --quiet kvtier.service && made_mask=0; fi
    check "the daemon still runs after dpkg -i" running "$daemon_pid"
    stop_daemon
    check "kvtierd (as kvtier) stopped cleanly on SIGTERM" test "$daemon_rc" = 0
    check "the journal /run/kvtier/kvtier-l1.journal is kept" test -s /run/kvtier/kvtier-l1.journal
    kept=$(find /dev/shm -maxdepth 1 -type f -name 'kvtier-*-l1' -user kvtier | head -n 1)
    check "the arena is kept for the next daemon (${kept:-none})" test -n "$kept"
    if start_as_service "$T/up2.log"; then
        ok "the upgraded kvtierd started on the kept arena"
        check "/status: l1 adopted" grep -q '"adopted": *true' \
            <(curl -fsS --max-time 5 "http://127.0.0.1:$port2/status" 2>/dev/null |
              python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["l1"]["adopt"]))')
        env -i timeout 30 /usr/bin/kvtier get --ns upgrade -o "$T/object.back" "$key" >/dev/null 2>&1
        check "the object stored before the upgrade is read back byte-exact" \
            cmp -s "$T/object" "$T/object.back"
    else
        fail "the upgraded kvtierd did not start; its log:"; tail -n 30 "$T/up2.log"
    fi
    stop_daemon
else
    fail "the installed kvtierd as kvtier did not start; its log:"; tail -n 30 "$T/up1.log"
    stop_daemon
fi

# ---- purge ----------------------------------------------------------------------------------
if dpkg_do "$T/dpkg.log" --purge "${PKGS[@]}"; then
    installed=0; ok "dpkg --purge ${PKGS[*]}"
else
    cat "$T/dpkg.log"; fail "dpkg --purge"
fi
left=""
for p in "${PKGS[@]}"; do
    while read -r f _; do
        if [ -e "/$f" ] || [ -L "/$f" ]; then left="$left /$f"; fi
    done <<<"${EXPECT[$p]}"
done
for f in /etc/kvtier /etc/systemd/system/multi-user.target.wants/kvtier.service \
    /var/lib/kvtier /run/kvtier; do
    if [ -e "$f" ] || [ -L "$f" ]; then left="$left $f"; fi
done
left_arena=$(find /dev/shm -maxdepth 1 -type f -name 'kvtier-*-l1' -user kvtier 2>/dev/null)
[ -z "$left_arena" ] || left="$left $left_arena"
check "nothing left after the purge${left:+:$left}" test -z "$left"
if getent passwd kvtier >/dev/null; then
    echo "note: the purge keeps the kvtier user (Debian keeps system users)"
fi
finish
