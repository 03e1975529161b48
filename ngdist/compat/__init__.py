"""Framework-compatibility surfaces: Ray SGD (DistributedSGD), MXNet's KVStore, the ONNX backend."""
