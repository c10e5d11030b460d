"""fraud-pipeline: real-time fraud scoring on Kafka."""

__version__ = "0.1.0"
