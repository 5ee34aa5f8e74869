/* Unit tests of daemon/kvt_session.c: who may act for an instance (HELLO, tokens, BYE,
 * PING's check), the caps, connection identity (routing id + descriptor, close reports by
 * generation), expiry of every silent instance in one sweep, reply accounting and the cut of
 * a connection that stopped reading (observed on a real socketpair), the bounded /status, and
 * many routing ids that a string key would merge. */
#include "kvt_error.h"
#include "kvt_session.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

typedef struct {
    int calls, expired;
    uint64_t last_owner;
} gone_t;

static uint64_t s_on_gone(void *ctx, uint64_t owner, bool expired)
{
    gone_t *g = ctx;
    g->calls++;
    g->expired += expired;
    g->last_owner = owner;
    return 3; /* leases "released" */
}

static kvt_session_limits_t s_lim = {.lease_ms = 1000,
                                     .max_instances_per_conn = 4,
                                     .reply_timeout_ms = 500,
                                     .max_reply_backlog = 1 << 20};

static kvt_conn_t *conn(kvt_sessions_t *s, const char *rid, int fd, uint32_t gen, uint64_t now)
{
    return kvt_sessions_conn(s, (const uint8_t *)rid, strlen(rid), fd, gen, now);
}

static int hello(kvt_sessions_t *s, kvt_conn_t *c, const char *inst, const char *token,
                 uint64_t now, char *tok_out)
{
    char err[256], tok[KVT_TOKEN_HEX + 1];
    uint64_t owner = 0;
    bool created;
    int rc = kvt_sessions_hello(s, c, inst, "test", token, now, &owner, tok_out ? tok_out : tok,
                                &created, err, sizeof err);
    if (rc == 0)
        assert_int_equal(kvt_conn_owner(c), owner);
    return rc;
}

static void test_hello_token_and_bye(void **state)
{
    (void)state;
    gone_t g = {0};
    kvt_sessions_t *s = kvt_sessions_new(&s_lim, NULL, s_on_gone, &g);
    kvt_conn_t *a = conn(s, "rid-a", 10, 1, 0), *b = conn(s, "rid-b", 11, 1, 0);
    char tok[KVT_TOKEN_HEX + 1], tok2[KVT_TOKEN_HEX + 1], err[256];
    assert_int_equal(kvt_conn_owner(a), 0);
    assert_int_equal(hello(s, a, "eng", NULL, 0, tok), 0);
    assert_int_equal(strlen(tok), KVT_TOKEN_HEX);
    uint64_t owner = kvt_conn_owner(a);
    assert_true(owner > 0);
    /* the name is taken without the token, or with a wrong one */
    assert_int_equal(hello(s, b, "eng", NULL, 0, NULL), KVT_EBADREQ);
    assert_int_equal(hello(s, b, "eng", "00000000000000000000000000000000", 0, NULL), KVT_EBADREQ);
    assert_int_equal(kvt_conn_owner(b), 0);
    /* BYE and PING's check act only for the connection's own instances */
    uint64_t released = 99;
    assert_int_equal(kvt_sessions_bye(s, b, "eng", &released, err, sizeof err), KVT_EBADREQ);
    assert_int_equal(released, 0);
    assert_int_equal(g.calls, 0);
    assert_int_equal(kvt_sessions_check(s, b, "eng", err, sizeof err), KVT_ENOINST);
    assert_int_equal(kvt_sessions_check(s, a, "eng", err, sizeof err), 0);
    /* with the token b joins: same owner, same token */
    assert_int_equal(hello(s, b, "eng", tok, 0, tok2), 0);
    assert_string_equal(tok, tok2);
    assert_int_equal(kvt_conn_owner(b), owner);
    /* BYE from b ends it for a too */
    assert_int_equal(kvt_sessions_bye(s, b, "eng", &released, err, sizeof err), 0);
    assert_int_equal(released, 3);
    assert_int_equal(g.calls, 1);
    assert_int_equal(g.expired, 0);
    assert_int_equal(g.last_owner, owner);
    assert_int_equal(kvt_conn_owner(a), 0);
    assert_int_equal(kvt_sessions_count(s), 0);
    /* the name is free again: a new owner and token */
    assert_int_equal(hello(s, a, "eng", tok, 0, tok2), 0);
    assert_string_not_equal(tok, tok2);
    assert_true(kvt_conn_owner(a) > owner);
    kvt_conn_unref(&a);
    kvt_conn_unref(&b);
    kvt_sessions_destroy(&s);
}

/* The owner registry's side of HELLO and BYE (the cache service's in the daemon): ids from a
 * counter, at most `cap` open. */
typedef struct {
    uint64_t next;
    uint32_t open, cap;
} caps_t;

static int caps_new(void *ctx, uint64_t *owner, char *err, size_t errlen)
{
    caps_t *c = ctx;
    if (c->open >= c->cap) {
        snprintf(err, errlen, "max_instances (%u)", c->cap);
        return KVT_EBUSY;
    }
    c->open++;
    *owner = ++c->next;
    return 0;
}

static uint64_t caps_gone(void *ctx, uint64_t owner, bool expired)
{
    (void)owner;
    (void)expired;
    ((caps_t *)ctx)->open--;
    return 0;
}

static void test_caps(void **state)
{
    (void)state;
    caps_t caps = {.cap = 6};
    kvt_sessions_t *s = kvt_sessions_new(&s_lim, caps_new, caps_gone, &caps);
    kvt_conn_t *a = conn(s, "a", 10, 1, 0), *b = conn(s, "b", 11, 1, 0);
    char name[32], err[256];
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof name, "a-%d", i);
        assert_int_equal(hello(s, a, name, NULL, 0, NULL), 0);
    }
    assert_int_equal(hello(s, a, "a-4", NULL, 0, NULL), KVT_EBADREQ); /* per connection */
    assert_int_equal(hello(s, a, "a-1", NULL, 0, NULL), 0);           /* its own: fine */
    uint64_t released;
    assert_int_equal(kvt_sessions_bye(s, a, "a-0", &released, err, sizeof err), 0);
    assert_int_equal(hello(s, a, "a-4", NULL, 0, NULL), 0);
    assert_int_equal(hello(s, b, "b-0", NULL, 0, NULL), 0);
    assert_int_equal(hello(s, b, "b-1", NULL, 0, NULL), 0);
    assert_int_equal(kvt_sessions_count(s), 6);
    assert_int_equal(hello(s, b, "b-2", NULL, 0, NULL), KVT_EBUSY); /* in total */
    kvt_conn_unref(&a);
    kvt_conn_unref(&b);
    kvt_sessions_destroy(&s);
}

static void test_connection_identity(void **state)
{
    (void)state;
    kvt_sessions_t *s = kvt_sessions_new(&s_lim, NULL, NULL, NULL);
    kvt_conn_t *a = conn(s, "engine-0", 20, 1, 0);
    assert_int_equal(hello(s, a, "victim", NULL, 0, NULL), 0);
    /* the same routing id on another descriptor is another connection */
    kvt_conn_t *t = conn(s, "engine-0", 21, 1, 0);
    assert_ptr_not_equal(t, a);
    assert_int_equal(kvt_conn_owner(t), 0);
    assert_int_equal(kvt_conn_owner(a), 0); /* the old one was retired */
    kvt_conn_unref(&t);
    /* a close report about an earlier connection on a descriptor leaves the current one */
    kvt_conn_t *c = conn(s, "x", 30, 2, 0);
    assert_int_equal(hello(s, c, "mine", NULL, 0, NULL), 0);
    kvt_sessions_on_disconnect(s, 30, 1);
    kvt_conn_t *again = conn(s, "x", 30, 2, 0);
    assert_ptr_equal(again, c);
    assert_true(kvt_conn_owner(again) > 0);
    kvt_conn_unref(&again);
    /* the report about its own generation retires it; its instance stays until it expires */
    kvt_sessions_on_disconnect(s, 30, 2);
    assert_int_equal(kvt_conn_owner(c), 0);
    assert_int_equal(kvt_sessions_count(s), 2);
    /* a descriptor reused by another routing id: the stale connection is retired */
    kvt_conn_t *d = conn(s, "y", 40, 1, 0);
    assert_int_equal(hello(s, d, "d-inst", NULL, 0, NULL), 0);
    kvt_conn_t *e = conn(s, "z", 40, 2, 0);
    assert_int_equal(kvt_conn_owner(d), 0);
    kvt_conn_unref(&a);
    kvt_conn_unref(&c);
    kvt_conn_unref(&d);
    kvt_conn_unref(&e);
    kvt_sessions_destroy(&s);
}

static void test_every_silent_instance_expires_in_one_sweep(void **state)
{
    (void)state;
    gone_t g = {0};
    kvt_session_limits_t lim = s_lim;
    lim.max_instances_per_conn = 16;
    kvt_sessions_t *s = kvt_sessions_new(&lim, NULL, s_on_gone, &g);
    kvt_conn_t *conns[150];
    char name[32];
    for (int i = 0; i < 150; i++) {
        snprintf(name, sizeof name, "r%d", i);
        conns[i] = conn(s, name, 100 + i, 1, 0);
        for (int j = 0; j < 10; j++) {
            snprintf(name, sizeof name, "i-%d-%d", i, j);
            assert_int_equal(hello(s, conns[i], name, NULL, 0, NULL), 0);
        }
    }
    assert_int_equal(kvt_sessions_count(s), 1500);
    /* a bounded /status */
    json_t *st = kvt_sessions_json(s, 0, NULL, NULL);
    assert_int_equal(json_array_size(json_object_get(st, "clients")), 100);
    assert_int_equal(json_integer_value(json_object_get(st, "clients_total")), 1500);
    json_decref(st);
    /* conns[0] keeps talking, the rest go silent */
    kvt_conn_t *again = conn(s, "r0", 100, 1, 900);
    kvt_conn_unref(&again);
    assert_int_equal(kvt_sessions_sweep(s, 1000), 0);
    assert_int_equal(kvt_sessions_sweep(s, 1500), 1490);
    assert_int_equal(g.calls, 1490);
    assert_int_equal(g.expired, 1490);
    assert_int_equal(kvt_sessions_count(s), 10);
    char why[256];
    kvt_conn_why_no_instance(conns[7], "reserve", why, sizeof why);
    assert_non_null(strstr(why, "'i-7-")); /* one of its instances, by name */
    assert_non_null(strstr(why, "HELLO"));
    for (int i = 0; i < 150; i++)
        kvt_conn_unref(&conns[i]);
    kvt_sessions_destroy(&s);
}

static void test_stalled_replies_cut_the_connection(void **state)
{
    (void)state;
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    kvt_sessions_t *s = kvt_sessions_new(&s_lim, NULL, NULL, NULL);
    kvt_conn_t *c = conn(s, "slow", sv[0], 1, 0);
    kvt_conn_reply_start(c, 100, 4096, 1000);
    kvt_conn_reply_start(c, 100, 0, 1100);
    assert_int_equal(kvt_conn_pinned(c), 4096);
    kvt_sessions_sweep(s, 1400); /* 400 ms without progress: not yet */
    char buf[8];
    assert_int_equal(send(sv[1], "x", 1, MSG_DONTWAIT), 1);
    assert_int_equal(recv(sv[0], buf, sizeof buf, MSG_DONTWAIT), 1); /* still open */
    kvt_sessions_sweep(s, 1600);
    /* shut down: the daemon's end reads end-of-stream (libzmq then closes it) */
    assert_int_equal(recv(sv[0], buf, sizeof buf, MSG_DONTWAIT), 0);
    json_t *st = kvt_sessions_json(s, 1600, NULL, NULL);
    json_t *cs = json_object_get(st, "connections");
    assert_int_equal(json_integer_value(json_object_get(cs, "replies_pending")), 2);
    assert_int_equal(json_integer_value(json_object_get(cs, "pinned_bytes")), 4096);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(cs, "cut"), "replies_stalled")), 1);
    json_decref(st);
    /* the replies end (libzmq frees them): counters back to 0, the connection freed last */
    kvt_sessions_on_disconnect(s, sv[0], 1);
    kvt_conn_reply_end(c, 100, 4096);
    assert_int_equal(kvt_conn_pinned(c), 0);
    kvt_conn_t *in_flight = c;
    kvt_conn_unref(&c); /* the request's reference; the other reply still holds one */
    kvt_sessions_destroy(&s);
    kvt_conn_reply_end(in_flight, 100, 0); /* freed by the last reply, after the table */
    close(sv[0]);
    close(sv[1]);
}

static void test_backlog_over_the_limit_cuts(void **state)
{
    (void)state;
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    kvt_sessions_t *s = kvt_sessions_new(&s_lim, NULL, NULL, NULL);
    kvt_conn_t *c = conn(s, "flood", sv[0], 1, 0);
    for (int i = 0; i < 11; i++)
        kvt_conn_reply_start(c, 100000, 0, 1000);
    kvt_sessions_sweep(s, 1001);
    char buf[8];
    assert_int_equal(recv(sv[0], buf, sizeof buf, MSG_DONTWAIT), 0);
    for (int i = 0; i < 11; i++)
        kvt_conn_reply_end(c, 100000, 0);
    kvt_conn_unref(&c);
    kvt_sessions_destroy(&s);
    close(sv[0]);
    close(sv[1]);
}

/* Routing ids are bytes, not strings: ids that a C-string or a truncated key would merge
 * ("\0a" and "\0b", "ab" and "ab\0", one byte apart in 255) are separate connections, each
 * found again by its own bytes among many, and retiring some leaves the others. */
static kvt_conn_t *conn_bytes(kvt_sessions_t *s, const uint8_t *rid, size_t len, int fd)
{
    return kvt_sessions_conn(s, rid, len, fd, 1, 0);
}

static void test_many_routing_ids(void **state)
{
    (void)state;
    enum { N = 2000, FD0 = 100 };
    kvt_session_limits_t lim = s_lim;
    kvt_sessions_t *s = kvt_sessions_new(&lim, NULL, NULL, NULL);
    static uint8_t rids[N][255];
    static size_t lens[N];
    static kvt_conn_t *conns[N];
    static uint64_t owners[N];
    for (int i = 0; i < N; i++) {
        memset(rids[i], 0, sizeof rids[i]);
        switch (i % 4) {
        case 0: /* NUL first, then the index: all empty as C strings */
            rids[i][1] = (uint8_t)i;
            rids[i][2] = (uint8_t)(i >> 8);
            lens[i] = 3;
            break;
        case 1: /* "ab", NULs, a last byte: many are prefixes of others */
            rids[i][0] = 'a';
            rids[i][1] = 'b';
            lens[i] = 2 + (size_t)i / 4 % 200;
            rids[i][lens[i] - 1] = (uint8_t)(i / 800); /* keeps same-length ones apart */
            break;
        case 2: /* 255 bytes differing only in the last two */
            memset(rids[i], 0x5a, 255);
            rids[i][253] = (uint8_t)i;
            rids[i][254] = (uint8_t)(i >> 8);
            lens[i] = 255;
            break;
        default: /* 5-byte ids as ZMQ makes them, counting up */
            rids[i][1] = (uint8_t)i;
            rids[i][2] = (uint8_t)(i >> 8);
            lens[i] = 5;
            break;
        }
    }
    for (int i = 0; i < N; i++) {
        conns[i] = conn_bytes(s, rids[i], lens[i], FD0 + i);
        assert_int_equal(kvt_conn_owner(conns[i]), 0); /* new: no other id's connection */
        char inst[32];
        snprintf(inst, sizeof inst, "inst-%d", i);
        assert_int_equal(hello(s, conns[i], inst, NULL, 0, NULL), 0);
        owners[i] = kvt_conn_owner(conns[i]);
    }
    assert_int_equal(kvt_sessions_count(s), N);
    /* each id finds its own connection, acting for its own instance */
    for (int i = 0; i < N; i++) {
        kvt_conn_t *again = conn_bytes(s, rids[i], lens[i], FD0 + i);
        assert_ptr_equal(again, conns[i]);
        assert_true(kvt_conn_owner(again) == owners[i]);
        kvt_conn_unref(&again);
    }
    /* the odd ones close: the even ones are still found */
    for (int i = 1; i < N; i += 2)
        kvt_sessions_on_disconnect(s, FD0 + i, 1);
    for (int i = 0; i < N; i++) {
        kvt_conn_t *again = conn_bytes(s, rids[i], lens[i], FD0 + i);
        if (i % 2)
            assert_ptr_not_equal(again, conns[i]); /* a new connection for that id */
        else
            assert_ptr_equal(again, conns[i]);
        kvt_conn_unref(&again);
        kvt_conn_unref(&conns[i]);
    }
    kvt_sessions_destroy(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_token_and_bye),
        cmocka_unit_test(test_caps),
        cmocka_unit_test(test_connection_identity),
        cmocka_unit_test(test_every_silent_instance_expires_in_one_sweep),
        cmocka_unit_test(test_stalled_replies_cut_the_connection),
        cmocka_unit_test(test_backlog_over_the_limit_cuts),
        cmocka_unit_test(test_many_routing_ids),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
