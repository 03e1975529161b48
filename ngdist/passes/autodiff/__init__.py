"""Reverse-mode autodiff on ONNX graphs: a driver and a registry of gradient rules."""
from ngdist.passes.autodiff.driver import AutodiffPass, differentiate
from ngdist.passes.autodiff.registry import GradContext, register, registered_ops

__all__ = ["AutodiffPass", "GradContext", "differentiate", "register", "registered_ops"]
