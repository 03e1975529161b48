"""Frontends: bring a model in as a standard ONNX training model."""
