"""The gateway's OpenAPI 3.1 document, built from the contract (:mod:`app.contract`).

Field lists, currencies, actions and error codes come from the modules that
define them, so the document cannot drift from what the gateway validates.
"""

from __future__ import annotations

from typing import Any

from app.contract import ACTIONS, CURRENCY_TO_USD, REQUIRED_FIELDS
from pipeline.labels import LABELS
from pipeline.validate import ERROR_CODES, MAX_AMOUNT, MAX_ID_LEN

__all__ = ["GATEWAY_ERROR_CODES", "openapi_document"]

#: Error codes of the gateway itself, besides the transaction validation codes;
#: ``internal_error`` is the pipeline's (a reject decision when scoring failed).
GATEWAY_ERROR_CODES: tuple[str, ...] = (
    "unauthenticated", "rate_limited", "decision_timeout", "dead_lettered", "broker_unavailable", "bad_label",
    "internal_error",
)  # fmt: skip

_ID = {"type": "string", "minLength": 1, "maxLength": MAX_ID_LEN}
_STR = {"type": "string"}
_NUM = {"type": "number"}


def _transaction_schema() -> dict[str, Any]:
    properties: dict[str, Any] = {
        "transaction_id": {**_ID, "description": "Idempotency key: a resend gets the same decision."},
        "user_id": {**_ID, "description": "The card or account; also the Kafka message key."},
        "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_AMOUNT},
        "merchant_id": _ID,
        "timestamp": {
            "type": "string", "format": "date-time",
            "description": "ISO-8601 with a time zone; at most 5 min in the future and 24 h in the past.",
        },  # fmt: skip
        "currency": {"type": "string", "enum": sorted(CURRENCY_TO_USD), "default": "USD"},
        "merchant_category": _STR,
        "device_id": _STR,
        "lat": {"type": "number", "minimum": -90, "maximum": 90, "description": "With lon, or neither."},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
        "country": _STR,
    }
    return {"type": "object", "required": list(REQUIRED_FIELDS), "properties": properties}


def _decision_schema() -> dict[str, Any]:
    nullable_num = {"type": ["number", "null"]}
    nullable_str = {"type": ["string", "null"]}
    return {
        "type": "object",
        "required": ["transaction_id", "fraud_score", "action", "explanation"],
        "properties": {
            "transaction_id": _STR,
            "user_id": nullable_str,
            "fraud_score": {"type": "number", "minimum": 0, "maximum": 1},
            "action": {"type": "string", "enum": list(ACTIONS)},
            "explanation": {
                "type": "array", "items": _STR,
                "description": "The reasons, in words: the deciding rule, then the model's top reasons; a degraded "
                "decision adds `degraded: <why>`, and a provisional one then adds `provisional: ...` as the last line.",
            },  # fmt: skip
            "model_version": nullable_str,
            "rules_version": nullable_str,
            "cached": {"type": "boolean", "description": "Answered from the decision cache (a resend)."},
            "degraded": {"type": "boolean", "description": "Rules only: model over budget or features unavailable."},
            "provisional": {
                "type": "boolean",
                "description": "The decision cache could not be read, so a resend could not be ruled out: never approves.",
            },
            "feature_age_s": nullable_num,
            "latency_ms": {"type": "object", "additionalProperties": _NUM},
            "correlation_id": nullable_str,
            "decided_at": {**_NUM, "description": "Epoch seconds."},
            "error": {"oneOf": [{"type": "null"}, {"$ref": "#/components/schemas/ErrorDetail"}]},
        },
    }


def _error_schemas() -> dict[str, Any]:
    detail = {
        "type": "object",
        "required": ["code", "reason"],
        "properties": {
            "code": {"type": "string", "enum": [*ERROR_CODES, *GATEWAY_ERROR_CODES]},
            "field": nullable_field(),
            "reason": _STR,
        },
    }
    return {
        "ErrorDetail": detail,
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {"$ref": "#/components/schemas/ErrorDetail"},
                "transaction_id": nullable_field(),
                "correlation_id": nullable_field(),
            },
        },
    }


def nullable_field() -> dict[str, Any]:
    return {"type": ["string", "null"]}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    if headers:
        response["headers"] = headers
    return response


def _served_transaction_schema() -> dict[str, Any]:
    """The transaction as the worker validated it (the review items' ``transaction``):
    NOTE: not the request schema: ``timestamp`` is epoch seconds and every
    optional field is present, ``null`` when it was not sent."""
    request = _transaction_schema()["properties"]
    properties = {
        name: ({**schema, "type": [schema["type"], "null"]} if name not in REQUIRED_FIELDS else dict(schema))
        for name, schema in request.items()
    }
    properties["timestamp"] = {"type": "number", "description": "Epoch seconds (UTC)."}
    properties["currency"] = {"type": "string", "enum": sorted(CURRENCY_TO_USD)}
    for schema in properties.values():
        schema.pop("default", None)
    return {"type": "object", "required": list(properties), "properties": properties}


def _review_item_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["transaction_id", "decided_at", "fraud_score", "explanation", "transaction", "features", "label"],
        "properties": {
            "transaction_id": _STR,
            "decided_at": {**_NUM, "description": "Epoch seconds."},
            "fraud_score": _NUM,
            "explanation": {"type": "array", "items": _STR},
            "degraded": {"type": "boolean"},
            "model_version": nullable_field(),
            "rules_version": nullable_field(),
            "transaction": {"$ref": "#/components/schemas/ServedTransaction"},
            "features": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
            "reason_features": {
                "type": "array", "items": _STR,
                "description": "The features whose values the explanation's reasons put in words.",
            },  # fmt: skip
            "label": {
                "oneOf": [
                    {"type": "null"},
                    {"type": "object", "properties": {"label": {"enum": list(LABELS)}, "source": _STR, "labeled_at": _NUM}},
                ]
            },
        },
    }


def _review_page_schema() -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0}
    return {
        "type": "object",
        "required": ["items", "matching", "total", "offset", "limit"],
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/components/schemas/ReviewItem"}},
            "matching": {**count, "description": "Decisions that pass the filters (items is one page of them)."},
            "total": {**count, "description": "Decisions the gateway keeps in review (FRAUD_GATEWAY_REVIEW_LIMIT)."},
            "offset": count,
            "limit": count,
        },
    }


def openapi_document(server_url: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": _info(),
        "components": _components(),
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": {**_decision_paths(), **_review_paths(), **_service_paths()},
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc


def _info() -> dict[str, Any]:
    return {
        "title": "fraud-pipeline gateway",
        "version": "1",
        "description": (
            "Real-time fraud decisions over HTTP. The gateway validates a transaction, produces it "
            "(signed) to the `transactions` topic and answers with the decision the scoring workers "
            "write to `decisions`. A resend of the same transaction_id gets the same decision (cached)."
        ),
    }


def _components() -> dict[str, Any]:
    return {
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        },
        "schemas": {
            "Transaction": _transaction_schema(),
            "Decision": _decision_schema(),
            "ServedTransaction": _served_transaction_schema(),
            "ReviewItem": _review_item_schema(),
            "ReviewPage": _review_page_schema(),
            **_error_schemas(),
        },
    }


def _unauthorized() -> dict[str, Any]:
    return _error("No API key, or not a known one.", {"WWW-Authenticate": {"schema": _STR}})


def _decision_paths() -> dict[str, Any]:
    retry_after = {"Retry-After": {"description": "Seconds until a retry would pass.", "schema": {"type": "integer"}}}
    return {
        "/v1/transactions": {
            "post": {
                "summary": "Score one transaction and return its decision",
                "operationId": "decideTransaction",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Transaction"}}},
                },
                "responses": {
                    "200": {
                        "description": "The decision (action reject: the worker refused it, `error` says why).",
                        "headers": {"X-Correlation-Id": {"schema": _STR}},
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Decision"}}},
                    },
                    "400": _error("The transaction is invalid; `error.code` is one of the validation codes."),
                    "401": _unauthorized(),
                    "429": _error("The API client or the user is over its rate limit.", retry_after),
                    "502": _error("The pipeline dead-lettered the message (see `error`)."),
                    "503": _error("The broker did not accept the message."),
                    "504": _error(
                        "No decision within the gateway's timeout. The transaction may still be decided: "
                        "resend it (same transaction_id) to get that decision."
                    ),
                },
            }
        },
    }


def _review_paths() -> dict[str, Any]:
    return {
        "/v1/review/decisions": {
            "get": {
                "summary": "Decisions in review, newest first, a page at a time (analyst key)",
                "operationId": "listReview",
                "parameters": [
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "default": 100}},
                    {"name": "offset", "in": "query", "schema": {"type": "integer", "minimum": 0, "default": 0}},
                    {"name": "min_score", "in": "query", "schema": {"type": "number", "minimum": 0, "maximum": 1}},
                    {"name": "max_age_s", "in": "query", "schema": {"type": "number", "exclusiveMinimum": 0},
                     "description": "Only decisions made at most this many seconds ago."},
                ],  # fmt: skip
                "responses": {
                    "200": {
                        "description": "One page of the review queue, with how many match and how many are kept.",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReviewPage"}}},
                    },
                    "400": _error("A parameter is not a number."),
                    "401": _unauthorized(),
                },
            }
        },
        "/v1/review/{transaction_id}/label": {
            "post": {
                "summary": "Label a transaction fraud or legit (produced to `labels`, source analyst)",
                "operationId": "labelTransaction",
                "parameters": [{"name": "transaction_id", "in": "path", "required": True, "schema": _ID}],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {
                        "type": "object", "required": ["label"],
                        "properties": {"label": {"type": "string", "enum": list(LABELS)}},
                    }}},
                },  # fmt: skip
                "responses": {
                    "200": {"description": "The label as produced to `labels`."},
                    "400": _error("The label is not fraud or legit."),
                    "401": _unauthorized(),
                    "503": _error("The broker did not accept the label."),
                },
            }
        },
    }


def _service_paths() -> dict[str, Any]:
    """Health, this document and the review page: no API key needed."""
    return {
        "/healthz": {
            "get": {
                "summary": "Liveness: the broker connection and the reply reader",
                "security": [],
                "responses": {"200": {"description": "ok"}, "503": {"description": "not ready"}},
            }
        },
        "/v1/keys": {
            "get": {
                "summary": "The public keys decisions are signed with (Ed25519; SECURITY.md, Decision signatures)",
                "security": [],
                "responses": {"200": {
                    "description": "Every key whose decisions the gateway accepts (two during a rotation).",
                    "content": {"application/json": {"schema": {
                        "type": "object", "required": ["keys"],
                        "properties": {"keys": {"type": "array", "items": {
                            "type": "object", "required": ["key_id", "public_key"],
                            "properties": {
                                "key_id": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                                "public_key": {"type": "string", "description": "base64 of the raw 32-byte key"},
                            },
                        }}},
                    }}},
                }},
            }
        },
        "/openapi.json": {
            "get": {"summary": "This document", "security": [], "responses": {"200": {"description": "OpenAPI 3.1"}}}
        },
        "/review": {
            "get": {
                "summary": "The analyst review page (HTML; its calls need an analyst key)",
                "security": [],
                "responses": {"200": {"description": "text/html"}},
            }
        },
    }
