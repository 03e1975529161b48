"""Communication kernels, one per comm op, written against comm.ProcessGroup only.
Importing this package registers all of them."""
from ngdist.kernels.base import (KERNELS, CommFacts, CommNode, KernelSpec, get_kernel,
                                 register_kernel)
from ngdist.kernels import central, collectives, ps, pushsum  # noqa: F401,E402  (registration)
from ngdist.kernels import host_staged  # noqa: F401,E402  (an AllReduce implementation)
from ngdist.kernels import nccl_allreduce  # noqa: F401,E402  (device groups: NCCL)

__all__ = ["KERNELS", "CommFacts", "CommNode", "KernelSpec", "get_kernel", "register_kernel"]
