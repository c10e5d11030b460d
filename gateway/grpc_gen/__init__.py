"""Generated code of the gRPC contract (proto/fraud/v1/fraud.proto): do not edit, run ``make proto``.

Committed rather than built at install time, so installing needs no protoc and a
contract change is reviewed as code (tools/protogen.py says more).
"""
