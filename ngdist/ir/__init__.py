"""The ngdist op domain and the training-model file format (load, save, split, assemble)."""
from ngdist.ir.domain import COMM_OPS, DOMAIN
from ngdist.ir.model import (assemble_training_model, load_proto, save_proto,
                             split_training_model)

__all__ = ["COMM_OPS", "DOMAIN", "assemble_training_model", "load_proto", "save_proto",
           "split_training_model"]
