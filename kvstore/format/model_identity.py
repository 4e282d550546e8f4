"""Model identity: the fingerprint that says which model a session's KV came from, and
the one check of a stated fingerprint against a session's (docs/wire-format.md "Model
identity").

A fingerprint is any string of at most ``kvstore.format.keys.MAX_FINGERPRINT_BYTES`` bytes; ""
states none. ``model_fingerprint`` is the one computed from a model, which replayers
serve and the transformers integration states by default. It covers everything that
changes the model's KV: every tensor (parameters, persistent buffers, and the
non-persistent ones a state dict leaves out, such as rotary ``inv_freq``) and the
config (``config_identity``: every field but those that never enter the computation,
``INERT_FIELDS``; rotary base and scaling, window and layer types, head shapes and
attention scaling all enter):

    "model-b2:" + hex BLAKE2b-256(person "kvtier-model1",
        for every tensor in order of its name's UTF-8 bytes: u32le len + name,
        u32le len + dtype name (torch's, e.g. "float32", "bfloat16"), u32le ndim,
        u64le per dimension, u64le byte length + the values' bytes, C order, little-endian;
        then u64le len + the config's canonical JSON: UTF-8, keys sorted, no spaces)

so the same model in the same dtype gives the same fingerprint on every machine, and a
weight changed in any bit, renamed, reshaped or cast, or a config field that enters the
computation changed, gives another. A buffer that a device computes differently (a
rotary table built on another device) gives another too: a mismatch, never a silent
resume.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

from kvstore.format.errors import ModelMismatch, shown

if TYPE_CHECKING:  # a hint only: checking a fingerprint must not import torch
    import torch

PREFIX = "model-b2:"
PERSON = b"kvtier-model1"
# Config fields that never enter a forward pass's values: bookkeeping, outputs asked
# for, token ids of generation, training-only settings, the dtype (the tensors state
# theirs). Any other field (a new one included) is part of the identity.
INERT_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "architectures", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "dtype", "torch_dtype", "output_hidden_states", "output_attentions", "return_dict",
    "use_return_dict", "output_router_logits", "use_cache", "torchscript",
    "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params",
    "tokenizer_class", "prefix", "pad_token_id", "bos_token_id", "eos_token_id",
    "sep_token_id", "decoder_start_token_id", "initializer_range", "router_aux_loss_coef",
    "router_jitter_noise", "chunk_size_feed_forward",
})


def config_identity(config: object) -> dict[str, Any]:
    """The fields of ``config`` that are part of a model's identity: a transformers
    config's ``to_dict()`` (sub-configs nested), a dataclass's fields, or a mapping, less
    ``INERT_FIELDS`` at every depth."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    elif is_dataclass(config) and not isinstance(config, type):
        config = asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"a model config is a mapping, a dataclass or has to_dict(), "
                        f"got {type(config).__name__}")
    return {str(key): _kept(item) for key, item in config.items()
            if str(key) not in INERT_FIELDS}


def _kept(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(key): _kept(item) for key, item in value.items()
                if str(key) not in INERT_FIELDS}
    if isinstance(value, (list, tuple)):
        return [_kept(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # a torch.dtype or an enum: its name


def model_fingerprint(tensors: Mapping[str, torch.Tensor], config: object) -> str:
    """The fingerprint of a model of these ``tensors`` (name -> tensor, on any device)
    and ``config`` (``config_identity``)."""
    import torch

    digest = hashlib.blake2b(digest_size=32, person=PERSON)
    for name in sorted(tensors, key=lambda n: n.encode()):
        tensor = tensors[name].detach()
        raw_name, dtype = name.encode(), str(tensor.dtype).removeprefix("torch.").encode()
        # (numel * itemsize,) uint8: the values' bytes (bfloat16 has no numpy dtype)
        values = tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        digest.update(struct.pack("<I", len(raw_name)) + raw_name
                      + struct.pack("<I", len(dtype)) + dtype
                      + struct.pack(f"<I{tensor.dim()}Q", tensor.dim(), *tensor.shape)
                      + struct.pack("<Q", values.nbytes))
        digest.update(values.data)
    text = json.dumps(config_identity(config), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()
    digest.update(struct.pack("<Q", len(text)) + text)
    return PREFIX + digest.hexdigest()


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``module`` that shapes its output: the state dict (parameters,
    persistent buffers) and the non-persistent buffers it leaves out."""
    tensors = dict(module.state_dict())
    for name, buffer in module.named_buffers():
        tensors.setdefault(name, buffer)
    return tensors


def module_fingerprint(module: torch.nn.Module, config: object) -> str:
    """``model_fingerprint`` of a module's tensors (``module_tensors``) and ``config``."""
    return model_fingerprint(module_tensors(module), config)


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
    rebuilt by a replayer whose model's fingerprint is ``replayer``: the same, or ""
    (a session that states no model is rebuilt by the model serving its layout)."""
    if session and session != replayer:
        raise ModelMismatch(f"{what} was spilled by model {_shown(session)}; this replayer's "
                            f"model is {_shown(replayer)}: it would rebuild the window "
                            "with other weights or another config")


def _shown(fingerprint: str) -> str:
    return shown(fingerprint, 80)
