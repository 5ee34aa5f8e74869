"""The engine integrations' configuration (kvtier.sglang's extra_config, kvtier.vllm's
ec_connector_extra_config): their defaults overlaid with what the engine was given, each value
checked, a bad one refused with a ValueError naming the key."""

import os

DEFAULT_ENDPOINT = "ipc:///run/kvtier/kvtier.sock"


def checked(extra, defaults, ints, strs, bools=(), where="kvtier", field="extra config"):
    """`defaults` overlaid with the non-None values of `extra` (other keys are ignored):
    ints {key: lowest value}, strs (non-empty strings or None), bools, and heartbeat_ms
    (None or an integer >= 0) when it is a key. endpoint None becomes $KVTIER_ENDPOINT or
    DEFAULT_ENDPOINT."""
    if not isinstance(extra, dict):
        raise ValueError("%s: %s must be a dict, not %r" % (where, field, extra))
    cfg = dict(defaults)
    for k in defaults:
        if extra.get(k) is not None:
            cfg[k] = extra[k]
    for k, low in ints.items():
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError("%s: %s must be an integer >= %d, not %r" % (where, k, low, v))
    hb = cfg.get("heartbeat_ms")
    if hb is not None and (isinstance(hb, bool) or not isinstance(hb, int) or hb < 0):
        raise ValueError("%s: heartbeat_ms must be an integer >= 0, not %r" % (where, hb))
    for k in bools:
        if not isinstance(cfg[k], bool):
            raise ValueError("%s: %s must be true or false, not %r" % (where, k, cfg[k]))
    for k in strs:
        if cfg[k] is not None and (not isinstance(cfg[k], str) or not cfg[k]):
            raise ValueError("%s: %s must be a non-empty string, not %r" % (where, k, cfg[k]))
    if "endpoint" in cfg and cfg["endpoint"] is None:
        cfg["endpoint"] = os.environ.get("KVTIER_ENDPOINT") or DEFAULT_ENDPOINT
    return cfg
