"""Model identity: the fingerprint that says which weights a session's KV came from, and
the one check of a stated fingerprint against a session's (docs/wire-format.md "Model
identity").

A fingerprint is any string of at most ``kvstore.format.keys.MAX_FINGERPRINT_BYTES`` bytes; ""
states none. ``weights_fingerprint`` is the one computed from weights, which replayers
serve and the transformers integration states by default:

    "weights-b2:" + hex BLAKE2b-256(person "kvtier-weights1", for every tensor of the
        state dict in order of its name's UTF-8 bytes: u32le len + name,
        u32le len + dtype name (torch's, e.g. "float32", "bfloat16"), u32le ndim,
        u64le per dimension, u64le byte length + the values' bytes, C order, little-endian)

so the same weights in the same dtype give the same fingerprint on every machine, and a
weight changed in any bit, renamed, reshaped or cast gives another.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvstore.format.errors import ModelMismatch, shown

if TYPE_CHECKING:  # a hint only: checking a fingerprint must not import torch
    import torch

PREFIX = "weights-b2:"
PERSON = b"kvtier-weights1"


def weights_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of ``state`` (a state dict: name -> tensor, on any device)."""
    import torch

    digest = hashlib.blake2b(digest_size=32, person=PERSON)
    for name in sorted(state, key=lambda n: n.encode()):
        tensor = state[name].detach()
        raw_name, dtype = name.encode(), str(tensor.dtype).removeprefix("torch.").encode()
        # (numel * itemsize,) uint8: the values' bytes (bfloat16 has no numpy dtype)
        values = tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        digest.update(struct.pack("<I", len(raw_name)) + raw_name
                      + struct.pack("<I", len(dtype)) + dtype
                      + struct.pack(f"<I{tensor.dim()}Q", tensor.dim(), *tensor.shape)
                      + struct.pack("<Q", values.nbytes))
        digest.update(memoryview(values))
    return PREFIX + digest.hexdigest()


def module_fingerprint(module: torch.nn.Module) -> str:
    """``weights_fingerprint`` of a module's state dict (parameters and persistent buffers)."""
    return weights_fingerprint(module.state_dict())


def check_model(stated: str, stored: str, what: str) -> None:
    """ModelMismatch unless ``stated`` is "" (not checked) or ``stored`` itself; ``what``
    names the session (and who stated it) in the message."""
    if not stated or stated == stored:
        return
    if not stored:
        raise ModelMismatch(f"{what}: the session was spilled without a model fingerprint "
                            f"and {_shown(stated)} was stated; state none to take it "
                            "unchecked")
    raise ModelMismatch(f"{what}: the session was spilled by model {_shown(stored)}, not "
                        f"{_shown(stated)}")


def check_replayer(session: str, replayer: str, what: str) -> None:
    """ModelMismatch unless a session of fingerprint ``session`` may have its window
    rebuilt by a replayer whose weights' fingerprint is ``replayer``: the same, or ""
    (a session that states no model is rebuilt by the weights serving its layout)."""
    if session and session != replayer:
        raise ModelMismatch(f"{what} was spilled by model {_shown(session)}; this replayer's "
                            f"weights are {_shown(replayer)}: it would rebuild the window "
                            "with other weights")


def _shown(fingerprint: str) -> str:
    return shown(fingerprint, 80)
