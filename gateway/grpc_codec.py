"""Between the protobuf messages (proto/fraud/v1/fraud.proto) and the JSON contract.

A gRPC :class:`Transaction` becomes the JSON body a REST client would have
posted (set fields only), so it is validated, rate-limited, signed and produced
by the same code, and a worker cannot tell the two apart. A decision record
(JSON, as the worker wrote it) becomes a :class:`Decision` field by field; a
JSON ``null`` is an unset field.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from google.protobuf.descriptor import FieldDescriptor

from gateway.grpc_gen.fraud.v1 import fraud_pb2

__all__ = ["action_of", "decision_dict", "decision_message", "transaction_json", "transaction_message"]

_ACTION_PREFIX = "ACTION_"


def transaction_json(message: fraud_pb2.Transaction) -> bytes | tuple[str, str]:
    """The JSON body of a transaction, or ``(field, reason)`` for a number JSON cannot carry.

    NaN and infinities are not JSON (a REST body with them is ``bad_json``); here
    the field is known, so the caller answers ``out_of_range`` for it."""
    doc: dict[str, Any] = {}
    for field, value in message.ListFields():  # set fields only: an unset one is absent, as in JSON
        if isinstance(value, float) and not math.isfinite(value):
            return field.name, f"{field.name} must be a finite number, got {value}"
        doc[field.name] = value
    return orjson.dumps(doc)


def transaction_message(doc: dict[str, Any]) -> fraud_pb2.Transaction:
    """A JSON transaction as a message (clients, tests, the benchmark)."""
    return fraud_pb2.Transaction(**{k: v for k, v in doc.items() if v is not None})


def action_of(name: str) -> int:
    """``"approve"`` → ``ACTION_APPROVE``."""
    value: int = fraud_pb2.Action.Value(_ACTION_PREFIX + name.upper())  # protobuf ships no types here
    return value


def decision_message(record: dict[str, Any]) -> fraud_pb2.Decision:
    """The worker's JSON decision as a :class:`Decision`. Keys the message does not
    have are left out: a newer worker's extra field must not fail an older gateway."""
    message = fraud_pb2.Decision()
    fields = fraud_pb2.Decision.DESCRIPTOR.fields_by_name
    for name, value in record.items():
        field = fields.get(name)
        if field is None or value is None:
            continue
        if name == "action":
            message.action = action_of(value)  # type: ignore[assignment]
        elif name == "explanation":
            message.explanation.extend(str(v) for v in value)
        elif name == "latency_ms":
            message.latency_ms.update({str(k): float(v) for k, v in value.items() if v is not None})
        elif name == "error":
            message.error.CopyFrom(fraud_pb2.ErrorDetail(**{k: v for k, v in value.items() if v is not None}))
        elif field.type == FieldDescriptor.TYPE_DOUBLE:
            setattr(message, name, float(value))
        else:
            setattr(message, name, value)
    return message


def decision_dict(message: fraud_pb2.Decision) -> dict[str, Any]:
    """A :class:`Decision` as the JSON decision (every key; unset optional fields are ``None``)."""
    doc: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        name = field.name
        if field.has_presence and not message.HasField(name):
            doc[name] = None
        elif name == "action":
            doc[name] = fraud_pb2.Action.Name(message.action).removeprefix(_ACTION_PREFIX).lower()
        elif name == "explanation":
            doc[name] = list(message.explanation)
        elif name == "latency_ms":
            doc[name] = dict(message.latency_ms)
        elif name == "error":
            error = message.error
            doc[name] = {"code": error.code, "field": error.field if error.HasField("field") else None,
                         "reason": error.reason}  # fmt: skip
        else:
            doc[name] = getattr(message, name)
    return doc
