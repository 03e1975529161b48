"""Communication kernels, looked up by (op, backend). Importing this package registers all."""
from ngdist.kernels.base import KERNELS, CommNode, get_kernel, register_kernel
from ngdist.kernels import local, mpi, pushsum  # noqa: F401,E402  (registration)
from ngdist.kernels import ps, simple  # noqa: F401,E402  (registration)

__all__ = ["KERNELS", "CommNode", "get_kernel", "register_kernel"]
