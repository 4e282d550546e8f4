"""Random protobuf messages for the fuzz campaign (``stress.fuzz.cases``' "random"
family): every field of a request type drawn from edge values, read off its descriptor,
so every method and field is covered without a generator per message.
"""

from __future__ import annotations

import math
import random
import string

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F

from stress.fuzz.pool import LAYOUT

U64, U32 = (1 << 64) - 1, (1 << 32) - 1
INTS = {F.TYPE_UINT64: (0, 1, 2, 127, 128, U32, 1 << 32, 1 << 63, U64),
        F.TYPE_UINT32: (0, 1, 2, 127, 128, 129, 1 << 16, 1 << 31, U32),
        F.TYPE_INT32: (0, 1, -1, 1 << 30, -(1 << 31), (1 << 31) - 1),
        F.TYPE_FIXED64: (0, 1, U64), F.TYPE_ENUM: (0, 1, 2, 3, 99, -1)}
DOUBLES = (0.0, -0.0, 1e-300, 0.001, 1.0, -1.0, 1e9, 1e300, math.inf, -math.inf, math.nan)
STRINGS = ("", "acme", "victim", "evil", "f1", "s1", ".", "..", "/", "../../etc/passwd",
           "/dev/shm", "kvtier-x/../..", "kvtier-bundled", LAYOUT.layout_id,
           "kvtier-bundled@0000", "deepseek-v3", "host", "disk", "object", "hbm", "A" * 129,
           "a" * 65, "x" * 20_000, "\u00e9t\u00e9", "nul\x00byte", "acme/f1", "UPPER")


def random_message(rng: random.Random, descriptor, depth: int = 0):
    """A message of ``descriptor`` with fields drawn from edge values (oneofs respected)."""
    message = message_factory.GetMessageClass(descriptor)()
    chosen = {o.name: rng.choice(o.fields) for o in descriptor.oneofs}
    for f in descriptor.fields:
        oneof = f.containing_oneof
        if (oneof is not None and chosen[oneof.name] is not f) or \
                (oneof is None and rng.random() < 0.4):
            continue
        if f.type == F.TYPE_MESSAGE:
            if depth > 3:
                continue
            if f.is_repeated:
                for _ in range(rng.randint(0, 2)):
                    getattr(message, f.name).add().CopyFrom(
                        random_message(rng, f.message_type, depth + 1))
            else:
                getattr(message, f.name).CopyFrom(random_message(rng, f.message_type, depth + 1))
        elif f.is_repeated:
            getattr(message, f.name).extend(_scalar(rng, f)
                                            for _ in range(rng.choice((0, 1, 2, 3, 50))))
        else:
            setattr(message, f.name, _scalar(rng, f))
    return message


def _scalar(rng: random.Random, f):
    if f.type == F.TYPE_STRING:
        if rng.random() < 0.2:
            return "".join(rng.choices(string.printable, k=rng.randint(1, 40)))
        return rng.choice(STRINGS)
    if f.type == F.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 3, 4, 32, 33, 400, 4096)))
    if f.type == F.TYPE_BOOL:
        return rng.random() < 0.5
    if f.type == F.TYPE_DOUBLE:
        return rng.choice(DOUBLES)
    return rng.choice(INTS[f.type])
