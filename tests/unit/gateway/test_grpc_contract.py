"""The gRPC contract (proto/fraud/v1/fraud.proto) against the JSON contract, which is the source.

Field by field, names and types: the protobuf messages against the OpenAPI
schemas the gateway serves (built from app/contract.py) and against the
contract's dataclasses. Then: the committed generated code is what protoc
makes of the .proto, and a decision survives JSON → protobuf → JSON.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from app.contract import ACTIONS, OPTIONAL_FIELDS, REQUIRED_FIELDS, Decision, Transaction
from gateway.grpc_codec import decision_dict, decision_message, transaction_json, transaction_message
from gateway.grpc_gen.fraud.v1 import fraud_pb2
from gateway.openapi import openapi_document
from pipeline.validate import Rejection
from tools import protogen

SCHEMAS = openapi_document()["components"]["schemas"]
F = FieldDescriptor


def json_type(prop: dict[str, Any]) -> tuple[str, bool]:
    """(the JSON type, whether null is allowed) of an OpenAPI property."""
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1], False
    if "oneOf" in prop:
        types = [json_type(p) for p in prop["oneOf"]]
        kinds = [t for t, _ in types if t != "null"]
        assert len(kinds) == 1, prop
        return kinds[0], len(kinds) < len(types)
    kind = prop["type"]
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        assert len(kinds) == 1, prop
        return kinds[0], len(kinds) < len(kind)
    return kind, False


def check_field(field: F, prop: dict[str, Any], where: str) -> None:
    kind, nullable = json_type(prop)
    if kind == "array":
        assert field.is_repeated and field.type == F.TYPE_STRING and prop["items"]["type"] == "string", where
        return
    assert not field.is_repeated or kind == "object", f"{where}: repeated, JSON has {kind}"
    if kind == "object":  # a map of numbers
        entry = field.message_type
        assert entry is not None and entry.GetOptions().map_entry, f"{where}: JSON object, not a proto map"
        assert prop["additionalProperties"]["type"] == "number", where
        key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
        assert (key.type, value.type) == (F.TYPE_STRING, F.TYPE_DOUBLE), where
        return
    if "enum" in prop and field.type == F.TYPE_ENUM:
        names = [v.name for v in field.enum_type.values if v.number != 0]
        assert names == [f"ACTION_{a.upper()}" for a in prop["enum"]], f"{where}: {names}"
        assert field.enum_type.values_by_number[0].name.endswith("_UNSPECIFIED"), where
        return
    if kind in SCHEMAS:  # a nested object: the same check, one level down
        assert field.type == F.TYPE_MESSAGE and field.message_type.name == kind, where
        check_message(field.message_type, SCHEMAS[kind])
        return
    expected = {"string": F.TYPE_STRING, "number": F.TYPE_DOUBLE, "boolean": F.TYPE_BOOL}[kind]
    assert field.type == expected, f"{where}: proto type {field.type}, JSON {kind}"
    assert field.has_presence == nullable, f"{where}: JSON nullable={nullable}, proto presence={field.has_presence}"


def check_message(message: Descriptor, schema: dict[str, Any]) -> None:
    props = schema["properties"]
    assert set(message.fields_by_name) == set(props), (message.name, set(message.fields_by_name) ^ set(props))
    for name, prop in props.items():
        check_field(message.fields_by_name[name], prop, f"{message.name}.{name}")


def test_transaction_fields_match_the_json_contract() -> None:
    message = fraud_pb2.Transaction.DESCRIPTOR
    schema = SCHEMAS["Transaction"]
    assert set(message.fields_by_name) == {f.name for f in dataclasses.fields(Transaction)}
    assert set(message.fields_by_name) == set(REQUIRED_FIELDS) | set(OPTIONAL_FIELDS)
    for name, prop in schema["properties"].items():
        field = message.fields_by_name[name]
        kind, _ = json_type(prop)
        expected = {"string": F.TYPE_STRING, "number": F.TYPE_DOUBLE}[kind]
        assert field.type == expected and not field.is_repeated, name
        # Every field has presence: what is required is the JSON contract's to say
        # (validation answers missing_field), and 0 or "" must not read as absent.
        assert field.has_presence, name


def test_decision_fields_match_the_json_contract() -> None:
    message = fraud_pb2.Decision.DESCRIPTOR
    assert set(message.fields_by_name) == {f.name for f in dataclasses.fields(Decision)}
    check_message(message, SCHEMAS["Decision"])
    action = message.fields_by_name["action"]
    assert [v.name for v in action.enum_type.values][1:] == [f"ACTION_{a.upper()}" for a in ACTIONS]


def test_error_detail_matches_the_contract_error() -> None:
    check_message(fraud_pb2.ErrorDetail.DESCRIPTOR, SCHEMAS["ErrorDetail"])
    assert set(fraud_pb2.ErrorDetail.DESCRIPTOR.fields_by_name) == set(Rejection("c", None, "r").to_dict())


def test_generated_code_is_what_protoc_makes(tmp_path: Path) -> None:
    """Committed generated code must be reproducible: regenerate and compare byte for byte
    (a .proto edit without `make proto`, or a hand edit of the generated code, fails here)."""
    written = protogen.generate(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(protogen.GENERATED)
    produced = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert produced == set(protogen.GENERATED), "protoc wrote files the generator does not list"
    for name in protogen.GENERATED:
        committed = protogen.OUT / name
        assert committed.is_file(), f"{committed} is not committed: run `make proto`"
        assert (tmp_path / name).read_bytes() == committed.read_bytes(), f"{name} differs: run `make proto`"


FULL_DECISION = Decision(
    transaction_id="t-1", user_id="u-1", fraud_score=0.8125, action="review",
    explanation=["amount 12000 USD over 10000", "new device"], model_version="m-3", rules_version="r-2",
    cached=True, degraded=False, feature_age_s=3.5,
    latency_ms={"queue_wait": 1.25, "validate": 0.01, "cache": 0.3, "features": 1.0, "model": 2.0, "rules": 0.1,
                "total": 4.66},
    correlation_id="c0ffee", decided_at=1_767_000_000.125, provisional=True,
)  # fmt: skip
REJECT = Decision(
    transaction_id="t-2", user_id=None, fraud_score=0.0, action="reject", explanation=["bad"], model_version=None,
    rules_version="r-2", error={"code": "missing_field", "field": "user_id", "reason": "required"},
)  # fmt: skip


@pytest.mark.parametrize("decision", [FULL_DECISION, REJECT], ids=["every-field", "reject"])
def test_a_decision_survives_json_to_protobuf_and_back(decision: Decision) -> None:
    record = decision.to_dict()
    message = decision_message(record)
    assert decision_dict(fraud_pb2.Decision.FromString(message.SerializeToString())) == record


def test_a_decision_with_a_field_the_message_lacks_still_converts() -> None:
    record = {**FULL_DECISION.to_dict(), "added_by_a_newer_worker": 1}
    assert decision_dict(decision_message(record)) == FULL_DECISION.to_dict()


def test_a_transaction_message_is_the_json_body_of_its_set_fields() -> None:
    doc = {"transaction_id": "t-1", "user_id": "u-1", "amount": 12.5, "merchant_id": "m-1",
           "timestamp": "2026-01-31T12:00:00.000Z", "lat": 0.0, "lon": 0.0}  # fmt: skip
    import orjson

    assert orjson.loads(transaction_json(transaction_message(doc))) == doc  # 0.0 is kept: it is set
    assert orjson.loads(transaction_json(fraud_pb2.Transaction(user_id="u"))) == {"user_id": "u"}
    assert transaction_json(fraud_pb2.Transaction(amount=float("nan")))[0] == "amount"
