from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_APPROVE: _ClassVar[Action]
    ACTION_REVIEW: _ClassVar[Action]
    ACTION_DECLINE: _ClassVar[Action]
    ACTION_REJECT: _ClassVar[Action]
ACTION_UNSPECIFIED: Action
ACTION_APPROVE: Action
ACTION_REVIEW: Action
ACTION_DECLINE: Action
ACTION_REJECT: Action

class Transaction(_message.Message):
    __slots__ = ("transaction_id", "user_id", "amount", "merchant_id", "timestamp", "currency", "merchant_category", "device_id", "lat", "lon", "country")
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    MERCHANT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    MERCHANT_CATEGORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    LAT_FIELD_NUMBER: _ClassVar[int]
    LON_FIELD_NUMBER: _ClassVar[int]
    COUNTRY_FIELD_NUMBER: _ClassVar[int]
    transaction_id: str
    user_id: str
    amount: float
    merchant_id: str
    timestamp: str
    currency: str
    merchant_category: str
    device_id: str
    lat: float
    lon: float
    country: str
    def __init__(self, transaction_id: _Optional[str] = ..., user_id: _Optional[str] = ..., amount: _Optional[float] = ..., merchant_id: _Optional[str] = ..., timestamp: _Optional[str] = ..., currency: _Optional[str] = ..., merchant_category: _Optional[str] = ..., device_id: _Optional[str] = ..., lat: _Optional[float] = ..., lon: _Optional[float] = ..., country: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("transaction_id", "user_id", "fraud_score", "action", "explanation", "model_version", "rules_version", "cached", "degraded", "feature_age_s", "latency_ms", "correlation_id", "decided_at", "error", "provisional")
    class LatencyMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAUD_SCORE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RULES_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    FEATURE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    transaction_id: str
    user_id: str
    fraud_score: float
    action: Action
    explanation: _containers.RepeatedScalarFieldContainer[str]
    model_version: str
    rules_version: str
    cached: bool
    degraded: bool
    feature_age_s: float
    latency_ms: _containers.ScalarMap[str, float]
    correlation_id: str
    decided_at: float
    error: ErrorDetail
    provisional: bool
    def __init__(self, transaction_id: _Optional[str] = ..., user_id: _Optional[str] = ..., fraud_score: _Optional[float] = ..., action: _Optional[_Union[Action, str]] = ..., explanation: _Optional[_Iterable[str]] = ..., model_version: _Optional[str] = ..., rules_version: _Optional[str] = ..., cached: _Optional[bool] = ..., degraded: _Optional[bool] = ..., feature_age_s: _Optional[float] = ..., latency_ms: _Optional[_Mapping[str, float]] = ..., correlation_id: _Optional[str] = ..., decided_at: _Optional[float] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., provisional: _Optional[bool] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("code", "field", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: str
    field: str
    reason: str
    def __init__(self, code: _Optional[str] = ..., field: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("transaction_id", "decision", "error", "sequence")
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    transaction_id: str
    decision: Decision
    error: _status_pb2.Status
    sequence: int
    def __init__(self, transaction_id: _Optional[str] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., sequence: _Optional[int] = ...) -> None: ...
