"""Client instances against a hostile or unlucky neighbour (issue #13, items 1, 5 and 9).

An instance belongs to the connections that said HELLO as it: BYE and the lease-taking requests
act only for the connection's own instances; a second connection joins an instance only with
the token its first HELLO returned; a routing id reused by another connection is another
connection. Instances are capped per connection and in total, expire on time however many
there are, and /status stays bounded. A connection whose instance was dropped learns it from
a distinct error code, instance_dropped (also on PING with `instance`)."""

import json
import time

import pytest
import zmq

from kvtest import (assert_error, BYE, HELLO, PING, MiB, PAGE, Arena, key, metric_value, pattern,
                    wait_until)

NS = "instances-test/kv"
KVT_DAEMON_ARGS = ("--l2", "none")


def hello_body(instance, token=None):
    body = {"version": 1, "client": "pytest", "instance": instance}
    if token is not None:
        body["token"] = token
    return body


def leases_active(d):
    return d.l1_metrics()["kvtier_leases_active"]


def test_bye_from_another_connection_releases_nothing(daemon):
    d = daemon
    victim = d.dealer()
    h = d.hello(victim, "victim")
    arena = Arena(h["shm"])
    try:
        k_read, k_write = key(1, b"bye"), key(2, b"bye")
        d.store(victim, arena, NS, [k_read], [pattern(k_read, PAGE)])
        read = d.acquire(victim, NS, [k_read])
        write = d.reserve(victim, NS, [k_write], size=PAGE)
        assert leases_active(d) == 2

        # a connection that never said HELLO names the victim (names are on /status)
        spy = d.dealer()
        names = [c["instance"] for c in d.http_json("GET", "/status")["clients"]]
        assert "victim" in names
        assert_error(d.call(spy, BYE, {"instance": "victim"}), "bad_request", "victim")
        # nor can it take the name over without the token, or with a wrong one
        assert_error(d.call(spy, HELLO, hello_body("victim")), "bad_request", "token")
        assert_error(d.call(spy, HELLO, hello_body("victim", "0" * 32)), "bad_request")
        assert_error(d.call(spy, BYE, {"instance": "victim"}), "bad_request")
        # a connection that has an instance of its own cannot end another one either
        d.hello(spy, "spy")
        assert_error(d.call(spy, BYE, {"instance": "victim"}), "bad_request")
        assert_error(d.release(spy, read["lease"], check=False), "unknown_lease")

        assert leases_active(d) == 2, "the victim's leases must survive"
        arena.write(write["slots"][0]["offset"], pattern(k_write, PAGE))
        assert d.commit(victim, write["lease"])["stored"] == 1
        d.release(victim, read["lease"])
        assert d.fetch(victim, arena, NS, [k_write]) == [pattern(k_write, PAGE)]
        # the victim's own BYE still works
        assert d.ok(victim, BYE, {"instance": "victim"})["released"] == 0
    finally:
        arena.close()


def test_token_lets_a_second_connection_share_the_instance(daemon):
    d = daemon
    a = d.dealer()
    tok = d.hello(a, "shared", token=False)["token"]
    assert isinstance(tok, str) and len(tok) == 32
    b = d.dealer()
    assert_error(d.call(b, HELLO, hello_body("shared")), "bad_request", "token")
    assert d.ok(b, HELLO, hello_body("shared", tok))["token"] == tok
    assert d.stats(a)["clients_connected"] == 1
    w = d.reserve(a, NS, [key(1, b"tok")], size=PAGE)
    # b acts for the same instance: it may release a's lease, and a re-HELLO keeps the token
    d.release(b, w["lease"])
    assert d.ok(a, HELLO, hello_body("shared"))["token"] == tok
    # BYE from either ends it for both
    assert d.ok(b, BYE, {"instance": "shared"})["ok"] is True
    assert_error(d.reserve(a, NS, [key(2, b"tok")], size=PAGE, check=False),
                 "instance_dropped", "HELLO")
    # a name whose instance ended is free again, with a new token
    assert d.ok(a, HELLO, hello_body("shared"))["token"] != tok


def test_reused_routing_id_is_another_connection(daemon):
    """A client may choose its routing id; once the victim's connection is gone, a newcomer
    with the same id must not inherit the victim's instance."""
    d = daemon
    victim = d.dealer(identity=b"engine-0")
    d.hello(victim, "victim-rid", token=False)
    w = d.reserve(victim, NS, [key(1, b"rid")], size=PAGE)
    victim.close(linger=0)
    time.sleep(0.5)  # its connection closes (the daemon's monitor reports it)
    thief = d.dealer(identity=b"engine-0")
    assert_error(d.reserve(thief, NS, [key(2, b"rid")], size=PAGE, check=False),
                 "instance_dropped")
    assert_error(d.release(thief, w["lease"], check=False), "unknown_lease")
    assert_error(d.call(thief, BYE, {"instance": "victim-rid"}), "bad_request")
    assert leases_active(d) == 1


def test_instances_are_capped_per_connection_and_in_total(daemon_factory):
    d = daemon_factory("--max-instances", "12", "--max-instances-per-connection", "4")
    s = d.dealer()
    for i in range(4):
        d.hello(s, "cap-%d" % i)
    assert_error(d.call(s, HELLO, hello_body("cap-4")), "bad_request",
                 "max_instances_per_connection")
    # re-saying HELLO as one of its own is fine, and BYE makes room
    d.hello(s, "cap-0")
    d.ok(s, BYE, {"instance": "cap-0"})
    d.hello(s, "cap-4")
    others = [d.dealer() for _ in range(3)]
    n = 4
    for j, o in enumerate(others):
        for i in range(4):
            reply = d.call(o, HELLO, hello_body("cap-%d-%d" % (j, i)))
            if n < 12:
                assert reply["ok"], reply
                n += 1
            else:
                assert_error(reply, "busy", "max_instances")
    assert d.stats(s)["clients_connected"] == 12
    # the refused connections still work for everything that needs no instance
    d.ping(others[-1])


def test_silent_instances_expire_on_time_whatever_their_number(daemon_factory):
    """1 000 silent instances (some holding a reservation) are all dropped about lease_ms after
    their last request — not 64 per sweep."""
    lease_s = 1.5  # longer than the HELLOs take under ASan on a slow machine
    d = daemon_factory("--lease-ms", str(int(lease_s * 1000)))
    conns = [d.dealer(track=True) for _ in range(63)]
    sent = []
    for c in conns:  # pipelined: the first instances must not expire before the last HELLO
        for i in range(16):
            if len(sent) == 1000:
                break
            sent.append(c)
            d.send(c, d.next_uid(), HELLO, hello_body("many-%d" % len(sent)))
    for c in conns:
        for _ in range(sent.count(c)):
            assert d.recv(c).body["ok"] is True
    holder = conns[-1]  # its current instance reserves a quarter of L1
    w = d.reserve(holder, NS, [key(1, b"exp")], size=16 * MiB)
    assert w["slots"][0] is not None
    t_last = time.monotonic()
    assert d.stats()["clients_connected"] == 1000
    wait_until(lambda: d.stats()["clients_connected"] == 0, timeout=10, interval=0.05,
               what="every silent instance to be dropped")
    took = time.monotonic() - t_last
    # 64 per 100 ms sweep would take 1.6 s past the lease
    assert took < lease_s + 0.9, "1000 instances took %.2f s to expire (lease_ms %.1f s)" % (
        took, lease_s)
    assert d.l1_metrics()["kvtier_l1_reserved_objects"] == 0


def test_status_stays_bounded_with_many_instances(daemon_factory):
    d = daemon_factory()
    conns = [d.dealer() for _ in range(20)]
    for j, c in enumerate(conns):
        for i in range(16):
            d.hello(c, "status-%02d-%02d-%s" % (j, i, "x" * 200))   # long names: 320 of them
    status, _, body = d.http("GET", "/status")
    assert status == 200
    st = json.loads(body)
    assert st["clients_total"] == 320
    assert len(st["clients"]) == 100, len(st["clients"])
    assert len(body) < 96 * 1024, "GET /status is %d bytes" % len(body)
    # PING is not held up while /status is built
    t0 = time.monotonic()
    for _ in range(50):
        d.ping(conns[0])
    assert time.monotonic() - t0 < 2.0


def test_dropped_instance_answers_instance_dropped_and_ping_tells(daemon_factory):
    d = daemon_factory("--lease-ms", "300")
    s = d.dealer()
    tok = d.hello(s, "idle-engine", token=False)["token"]
    assert d.ok(s, PING, {"instance": "idle-engine"})["ok"] is True
    time.sleep(0.8)  # silent past lease_ms
    wait_until(lambda: d.stats()["clients_connected"] == 0, 3, what="the drop")
    reply = d.call(s, PING, {"instance": "idle-engine"})
    assert_error(reply, "instance_dropped", "idle-engine")
    assert d.ok(s, PING, {})["ok"] is True       # a plain PING checks nothing
    assert_error(d.reserve(s, NS, [key(1, b"idle")], size=PAGE, check=False),
                 "instance_dropped", "idle-engine", "HELLO")
    assert_error(d.call(s, BYE, {"instance": "idle-engine"}), "instance_dropped")
    # HELLO again (with the old token or none): a new instance, a new token
    h = d.ok(s, HELLO, hello_body("idle-engine", tok))
    assert h["token"] != tok
    d.release(s, d.reserve(s, NS, [key(1, b"idle")], size=PAGE)["lease"])
    # a connection that never said HELLO: PING with an instance name is not "alive"
    assert_error(d.call(d.dealer(), PING, {"instance": "idle-engine"}), "instance_dropped")


def test_pinging_keeps_an_idle_instance_alive(daemon_factory):
    """What a client heartbeat does: a helper connection that joined with the token pings;
    the main connection stays idle for several lease_ms and its next RESERVE works."""
    d = daemon_factory("--lease-ms", "300")
    main = d.dealer()
    tok = d.hello(main, "engine", token=False)["token"]
    beat = d.dealer()
    d.ok(beat, HELLO, hello_body("engine", tok))
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        d.ok(beat, PING, {"instance": "engine"})
        time.sleep(0.1)
    d.release(main, d.reserve(main, NS, [key(1, b"beat")], size=PAGE)["lease"])


def test_status_shows_the_bytes_each_instance_holds(daemon):
    d = daemon
    s = d.dealer()
    d.hello(s, "holder")

    def held():
        return {c["instance"]: c["leased_bytes"]
                for c in d.http_json("GET", "/status")["clients"]}["holder"]
    assert held() == 0
    w = d.reserve(s, NS, [key(i, b"held") for i in range(3)], size=PAGE + 1)
    assert held() == 3 * 2 * PAGE            # page-rounded sizes
    d.release(s, w["lease"])
    assert held() == 0
