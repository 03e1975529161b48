"""Graph passes over the step graph (onnx_ir). See ``pipeline`` for the named strategies."""
