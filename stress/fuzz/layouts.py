"""RegisterLayout bodies for the fuzz campaign (``stress.fuzz.cases``): layout JSON from a
seeded ``random.Random``, by family.

- ``honest``: small valid layouts under a few names, so the same name comes back with
  the same shape (OK, created false) and with another (INVALID_ARGUMENT);
- ``builtin``: a shipped preset's canonical JSON (OK, created false), or its name with
  another shape (INVALID_ARGUMENT);
- ``flood``: valid layouts, each under a new name, small ones and wide ones (thousands
  of layer modes, near 64 KiB), until the server's bounds on registered layouts (their
  count, their JSON in all) answer RESOURCE_EXHAUSTED;
- ``hostile``: JSON that must be INVALID_ARGUMENT: nesting past the recursion limit, over
  64 KiB, floats, NaN, non-ASCII, NUL and newline names, integers of thousands of
  digits, huge and many dimensions, duplicate and too many streams, repeated keys,
  wrong types, chunks bigger than a message.

Registered names are noted in ``State.layouts`` (whatever the server answered), so
Lookup and Spill cases name them too: one-token-chunk layouts with huge token arrays.
"""

from __future__ import annotations

import json
import random

import numpy as np
from google.protobuf.descriptor import FieldDescriptor as F

from kvstore.format.layout import layout_to_json
from kvstore.format.presets import SHIPPED
from proto import kvtier_pb2 as pb
from stress.fuzz.messages import INTS, STRINGS, U64
from stress.fuzz.pool import LAYOUT
from stress.fuzz.state import SESSIONS, TENANTS, Case, State, ser

HONEST_NAMES = tuple(f"fz-{i}" for i in range(6))
HUGE_TOKENS = (1 << 20, 1 << 22, (60 << 20) // 4)  # the last: near a 64 MiB message
MODES = 3000  # a flood layout's layer modes: about 55 KiB of JSON
MAX_JSON_BYTES = 64 << 10


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _stream(rng: random.Random, name: str = "a", **fields) -> dict:
    bits = rng.choice((4, 8, 16))
    last = rng.choice((2, 8, 64))
    out = {"name": name, "entry_shape": [last] if rng.random() < 0.7 else [2, last],
           "bits": bits}
    if bits != 16:
        out["group_size"] = rng.choice([g for g in (2, 8, 64) if last % g == 0])
    return {**out, **fields}


def honest(rng: random.Random) -> dict:
    chunk = rng.choice((1, 4, 16, 512))
    layout = {"name": rng.choice(HONEST_NAMES), "chunk_tokens": chunk,
              "streams": [_stream(rng, layers=rng.choice((1, 2)))]}
    if rng.random() < 0.3:
        layout["streams"].append(_stream(rng, "w", persistent=False))
        layout["window_tokens"] = rng.choice((16, 128))
        layout["replayer"] = rng.choice(("none", "bundled"))
    if rng.random() < 0.2:
        layout["vocab_size"] = rng.choice((256, 129_280, 1 << 32))
    return layout


def builtin(rng: random.Random) -> str:
    spec = rng.choice(SHIPPED)
    if rng.random() < 0.5:
        return layout_to_json(spec)
    return _dumps({**honest(rng), "name": spec.name})


def flood(rng: random.Random, serial: int) -> str:
    """One in three wide (for the bound on their JSON), the others small (for the count)."""
    wide = rng.random() < 1 / 3
    modes = {"layer_modes": [f"m{serial:04d}{i:09d}" for i in range(MODES)]} if wide else {}
    return _dumps({"name": f"flood-{serial}", "chunk_tokens": rng.choice((1, 16)),
                   "streams": [_stream(rng)], **modes})


def hostile(rng: random.Random) -> tuple[str, str]:
    """(what it is, the JSON); only the one drawn is built (each draw costs Hypothesis's
    random source bytes: stress/fuzz/test_fuzz.py hands it in)."""
    base = honest(rng)
    s = base["streams"][0]
    one = rng.choice
    chunk = f'"chunk_tokens":{base["chunk_tokens"]}'

    def with_(**fields) -> str:
        return _dumps({**base, **fields})

    def stream_with(**fields) -> str:
        return with_(streams=[{**s, **fields}])

    def deep(depth: int) -> str:  # 20,000: past the parser's recursion limit, in 64 KiB
        half = depth // 2
        return one(("[" * depth + "]" * depth, '{"a":' * half + "1" + "}" * half))

    cases = {
        "deep": lambda: deep(one((1000, 20_000))),
        "over_64k": lambda: with_(notes="x" * MAX_JSON_BYTES),
        "float": lambda: _dumps(base).replace(chunk, chunk + ".0"),
        "nan": lambda: _dumps(base).replace(
            chunk, '"chunk_tokens":' + one(("NaN", "Infinity", "1e3", "-0.0"))),
        "non_ascii": lambda: with_(name=one(("l\u00e9", "\u5c42", "a\U0001f600"))),
        "control_name": lambda: with_(name=one(("nl\n", "a\x00", "tab\t", "x\r"))),
        "path_name": lambda: with_(name=one(("../x", "/etc/passwd", "a@b", ""))),
        "long_name": lambda: with_(name="n" * one((65, 5000))),
        "digits": lambda: _dumps(base).replace(
            chunk, '"chunk_tokens":' + "9" * one((30, 5000))),
        "huge_dim": lambda: stream_with(entry_shape=[10 ** 30, 2]),
        "many_dims": lambda: stream_with(entry_shape=[2] * 5000),
        "zero_dim": lambda: stream_with(entry_shape=one(([0], [], [-2]))),
        "huge_layers": lambda: stream_with(layers=1 << 40),
        "dup_streams": lambda: with_(streams=[s, s]),
        "many_streams": lambda: with_(streams=[{**s, "name": f"s{i}"} for i in range(65)]),
        "no_streams": lambda: with_(streams=[]),
        "pending_persistent": lambda: stream_with(pending=True),
        "repeated_key": lambda: _dumps(base)[:-1] + f',"name":"{base["name"]}x"}}',
        "wrong_types": lambda: with_(**{one(("streams", "chunk_tokens", "vocab_size",
                                             "layer_modes", "baseline")): "abc"}),
        "bool_int": lambda: stream_with(bits=True),
        "unknown_key": lambda: with_(color="red"),
        "not_an_object": lambda: one(("null", '"x"', "[]", "1", "", "\ufffd",
                                      _dumps([base]))),
        "window_without_w": lambda: _dumps({
            **{k: v for k, v in base.items() if k not in ("window_tokens", "replayer")},
            "streams": [s, {**s, "name": "w", "persistent": False}]}),
        "bad_replayer": lambda: with_(replayer=one(("evil", "../bundled", ""))),
        "vocab": lambda: with_(vocab_size=one((0, -1, (1 << 32) + 1))),
        "chunk_tokens": lambda: with_(chunk_tokens=one((0, -16, 1 << 17))),
        "over_a_message": lambda: with_(chunk_tokens=1 << 16, streams=[
            {**s, "entry_shape": [1 << 20], "bits": 16, "group_size": 0}]),
        "layer_modes": lambda: with_(layer_modes=one(([1, 2], ["a@b"], ["m"] * 4097))),
    }
    name = one(sorted(cases))
    return name, cases[name]()


def layout_body(rng: random.Random, serial: int) -> tuple[str, str, str | None]:
    """(family, layout_json, the name a valid one registers under, else None)."""
    roll = rng.random()  # floods often enough that a 10,000-request run meets both bounds
    if roll < 0.2:
        layout = honest(rng)
        return "honest", _dumps(layout), layout["name"]
    if roll < 0.3:
        return "builtin", builtin(rng), None
    if roll < 0.8:
        return "flood", flood(rng, serial), f"flood-{serial}"
    what, text = hostile(rng)
    return f"hostile:{what}", text, None


class LayoutCases:
    """The adversarial cases of RegisterLayout, ListLayouts, Lookup and Fork, for
    ``stress.fuzz.cases.CaseGenerator`` (its ``rng``, ``state``, ``_ref`` and ``_tenant``)."""

    rng: random.Random
    state: State
    _floods: int = 0

    def _layout_name(self) -> str:
        """A layout a Lookup or Spill names: registered by the fuzzer, shipped, or not one."""
        rng, names = self.rng, self.state.layouts[-30:]
        if names and rng.random() < 0.5:
            return rng.choice(names)
        return rng.choice((LAYOUT.name, LAYOUT.layout_id, "deepseek-v3", *STRINGS))

    def adv_Lookup(self) -> Case:
        rng = self.rng
        kind = rng.choice(("plain", "plain", "huge", "unaligned", "domain", "foreign_prefix"))
        if kind == "foreign_prefix" and self.state.secret is not None:
            owner, secret = self.state.secret
            tenant = rng.choice([t for t in TENANTS if t != owner])
            request = pb.LookupRequest(tenant=tenant, layout_id=LAYOUT.name, token_ids=secret)
            return Case("Lookup", "lookup:foreign_prefix", ser([request]), check="no_prefix")
        count = rng.choice((0, 1, LAYOUT.chunk_tokens, 3 * LAYOUT.chunk_tokens))
        if kind == "huge":
            count = rng.choice(HUGE_TOKENS)
        tokens = np.arange(count, dtype="<u4").tobytes()
        if kind == "unaligned":
            tokens += b"\x01" * rng.choice((1, 2, 3))
        request = pb.LookupRequest(
            tenant=self._tenant(), layout_id=self._layout_name(),
            model_fingerprint=rng.choice(("", "", *STRINGS)), token_ids=tokens,
            dedupe_domain=rng.choice(("", *TENANTS, "public", "x" * 300)) if kind == "domain"
            else "")
        return Case("Lookup", f"lookup:{kind}", ser([request]))

    def adv_Fork(self) -> Case:
        """Past the source's length, onto itself, onto a protected session (refused: it
        exists), from a protected one, from another tenant's, of a missing one."""
        rng = self.rng
        source = self._ref(readonly=True)
        kind = rng.choice(("any", "past", "self", "onto_protected", "cross_tenant"))
        new = rng.choice(("fork1", "fork2", *SESSIONS, *STRINGS))
        upto = rng.choice(INTS[F.TYPE_UINT64] + (LAYOUT.chunk_tokens, 2 * LAYOUT.chunk_tokens))
        if kind == "past":
            upto = rng.choice((3 * LAYOUT.chunk_tokens, 1 << 40, U64))
        elif kind == "self":
            new = source.session_id
        elif kind == "onto_protected" and self.state.protected:
            tenant, new = rng.choice(sorted(self.state.protected))
            source = pb.SessionRef(tenant=tenant, session_id=rng.choice(SESSIONS))
        elif kind == "cross_tenant":
            source.tenant = rng.choice([t for t in TENANTS if t != source.tenant] or TENANTS)
        request = pb.ForkRequest(source=source, new_session_id=new, upto_tokens=upto)
        return Case("Fork", f"fork:{kind}", ser([request]))

    def adv_RegisterLayout(self) -> Case:
        self._floods += 1
        family, text, name = layout_body(self.rng, self._floods)
        if name is not None:
            self.state.layouts.append(name)
        request = pb.RegisterLayoutRequest(layout_json=text)
        return Case("RegisterLayout", f"layout:{family}", ser([request]))

    def adv_ListLayouts(self) -> Case:
        return Case("ListLayouts", "list_layouts", ser([pb.ListLayoutsRequest()]))
