/* kvt_key: the identity of a stored object below the wire: a 16-byte key inside a namespace
 * (a name and an optional salt). Shared by protocol/, storage/, l2/ and the daemon, so the
 * lengths are spelled once. Pure data; any thread. */
#ifndef KVT_KEY_H
#define KVT_KEY_H

#define KVT_KEY_LEN 16   /* bytes of a key (the wire's bin16) */
#define KVT_MAX_NS 256   /* bytes of a namespace name */
#define KVT_MAX_SALT 128 /* bytes of a salt */

#endif
