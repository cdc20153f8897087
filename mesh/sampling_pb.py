"""mesh/sampling.py's Sampling <-> meshpb.v1 SamplingParams, field by field by name: the doors' one conversion
(the router client, the router's and the engine's servers).  A field of Sampling travels when the message has a
field of its name; `unset_zero` fields come back as their default when the message holds 0."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from mesh.constraints import Constraint
from mesh.errors import InvalidArgument
from mesh.sampling import SPECS, Sampling
from meshpb.v1 import common_pb2

S = TypeVar("S", bound=Sampling)
_MESSAGE_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
_CARRIED = tuple(f.name for f in dataclasses.fields(Sampling) if f.name in _MESSAGE_FIELDS)


def to_pb(s: Sampling) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for name in _CARRIED:
        value = getattr(s, name)
        if value is None:
            continue                                     # optional (seed) or unset (constraint)
        kind = SPECS[name].kind if name in SPECS else ""
        if kind == "bias":
            msg.logit_bias.update(dict(value))
        elif kind == "id_lists":
            getattr(msg, name).extend(common_pb2.TokenIdList(ids=ids) for ids in value)
        elif name == "constraint":
            _constraint_to_pb(value, msg.constraint)
        elif isinstance(value, tuple):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def from_pb(msg: common_pb2.SamplingParams, cls: type[S] = Sampling) -> S:     # type: ignore[assignment]
    """`cls` (Sampling or a subclass) from the message; its own limits are not checked here."""
    values: dict[str, Any] = {}
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name in _CARRIED:
        spec = SPECS.get(name)
        kind = spec.kind if spec else ""
        if kind == "bias":
            value: Any = tuple(sorted(msg.logit_bias.items()))
        elif kind == "id_lists":
            value = tuple(tuple(entry.ids) for entry in getattr(msg, name))
        elif name == "constraint":
            value = constraint_from_pb(msg.constraint) if msg.HasField("constraint") else None
        elif name == "seed":
            value = msg.seed if msg.HasField("seed") else None
        else:
            value = getattr(msg, name)
            if not isinstance(value, (int, float, str, bool)):
                value = tuple(value)                    # a repeated field
        if spec is not None and spec.unset_zero and value == 0:
            value = defaults[name]
        values[name] = value
    return cls(**values)


def _constraint_to_pb(c: Constraint, out: common_pb2.Constraint) -> None:
    out.prefix, out.suffix = c.prefix, c.suffix
    if c.kind == "json_object":
        out.json_object = True
    else:
        setattr(out, c.kind, c.text)


def constraint_from_pb(c: common_pb2.Constraint) -> Constraint:
    """The native request's Constraint message (meshpb.v1 SamplingParams.constraint)."""
    kind = c.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("constraint names no kind: set json_schema, json_object, regex, grammar or tool_calls")
    return Constraint(kind, "" if kind == "json_object" else getattr(c, kind), c.prefix, c.suffix)
