"""The byte format of namespace deltas and snapshots: a versioned container around a JSON header
and a payload of pickles.

Contract
--------
    pack(kind, header, payload) -> bytes    # kind: KIND_DELTA or KIND_SNAPSHOT
    unpack(data) -> (header, payload)       # header gains "kind": "delta" | "snapshot";
                                            # payload is a memoryview into data.
                                            # DeltaFormatError for anything else.
    describe(data) -> header                # plus "payload_bytes"

Layout (little endian)
----------------------
    offset 0   4 bytes  magic b"NBSD"
    offset 4   1 byte   format version (FORMAT_VERSION); other versions are rejected
    offset 5   1 byte   kind: b"D" delta, b"S" snapshot
    offset 6   u32      header length H
    offset 10  H bytes  UTF-8 JSON header:
                 {"set": [names carried in the payload, in payload order],
                  "types": [type name of each of them],
                  "offsets": [byte offset in the payload of each name's pickle],
                  "oob_index": [index in "oob" of each name's first out-of-band buffer],
                  "del": [names to delete],
                  "bad": [[name, type name, reason], ...]   (bind a NotReplicated placeholder),
                  "blobs": [[token or null, key], ...]      (tracked buffers in the store),
                  "oob": [key, ...]                         (pickle-5 out-of-band buffers,
                                                             in buffer order),
                  "origin": replica id or null,
                  "payload": key                            (only when the payload is in the
                                                             store: over payload_threshold)}
    offset 10+H        payload: the protocol-5 pickles of the values of "set", concatenated,
                       written by one pickler (later ones refer to objects of earlier ones
                       through the shared memo: load them in order with one unpickler); empty
                       when "payload" names its blob

Names in "set" that start with "nbos:" carry what is not a namespace binding (is_pseudo_name):
"nbos:process:X" is the value of process-state entry X (nbos_state_process), "nbos:module:M" the
source of the notebook-local module M and "nbos:module-state:M" its data (nbos_state_modules),
"nbos:output" the value the cell's display hook showed (Out[N] on every replica).
readable_name() says any name as a user reads it.
"""

import json

__all__ = ["FORMAT_VERSION", "MAGIC", "KIND_DELTA", "KIND_SNAPSHOT", "DeltaFormatError", "pack",
           "unpack", "describe", "PROCESS_PREFIX", "MODULE_PREFIX", "MODULE_STATE_PREFIX",
           "OUTPUT_NAME", "is_pseudo_name", "readable_name"]

FORMAT_VERSION = 1
MAGIC = b"NBSD"
KIND_DELTA = ord("D")
KIND_SNAPSHOT = ord("S")

PROCESS_PREFIX = "nbos:process:"
MODULE_PREFIX = "nbos:module:"
MODULE_STATE_PREFIX = "nbos:module-state:"
OUTPUT_NAME = "nbos:output"


def is_pseudo_name(name):
    return name.startswith("nbos:")


def readable_name(name):
    """'x' for a namespace name; "the numpy.random state", "module utils", "the data of module
    utils" for pseudo-names."""
    if name.startswith(PROCESS_PREFIX):
        return f"the {name[len(PROCESS_PREFIX):]} state"
    if name.startswith(MODULE_STATE_PREFIX):
        return f"the data of module {name[len(MODULE_STATE_PREFIX):]}"
    if name.startswith(MODULE_PREFIX):
        return f"module {name[len(MODULE_PREFIX):]}"
    if name == OUTPUT_NAME:
        return "the cell's output (Out)"
    return repr(name)


class DeltaFormatError(ValueError):
    """The bytes are not a delta/snapshot this version of nbos_state can read."""


def pack(kind, header, payload):
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return b"".join([MAGIC, bytes([FORMAT_VERSION, kind]), len(h).to_bytes(4, "little"), h,
                     payload])


def unpack(data):
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if len(mv) < 10 or bytes(mv[:4]) != MAGIC:
        raise DeltaFormatError("not an nbos state delta/snapshot (bad magic)")
    version = mv[4]
    if version != FORMAT_VERSION:
        raise DeltaFormatError(
            f"unsupported nbos state format version {version}: this replica reads version "
            f"{FORMAT_VERSION} (replicas must run the same nbos build)")
    kind = mv[5]
    if kind not in (KIND_DELTA, KIND_SNAPSHOT):
        raise DeltaFormatError(f"unknown nbos state blob kind {kind!r}")
    hlen = int.from_bytes(mv[6:10], "little")
    if 10 + hlen > len(mv):
        raise DeltaFormatError("truncated nbos state header")
    try:
        header = json.loads(bytes(mv[10:10 + hlen]).decode("utf-8"))
    except ValueError as e:
        raise DeltaFormatError(f"corrupt nbos state header: {e}") from None
    if not isinstance(header, dict):
        raise DeltaFormatError("corrupt nbos state header: not an object")
    header["kind"] = "delta" if kind == KIND_DELTA else "snapshot"
    return header, mv[10 + hlen:]


def describe(data):
    """The header of a delta or snapshot: {"kind", "set", "del", "bad", "blobs", "oob",
    "origin"}, plus "payload_bytes"."""
    header, payload = unpack(data)
    header["payload_bytes"] = len(payload)
    return header
