"""The scoring models: the XGBoost ensemble, its registry and its training."""
