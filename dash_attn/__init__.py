"""dash_attn: Hopper attention kernels whose deterministic backward is as fast as the non-deterministic one.

CPU tensors run a pure-PyTorch reference with the same semantics; CUDA tensors need an sm90 GPU and the compiled
extension dash_attn._C.
"""
from .api import (NONDETERMINISTIC_SCHEDULES, SCHEDULES, flash_attn_func, flash_attn_kvpacked_func,
                  flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                  flash_attn_varlen_qkvpacked_func)

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "SCHEDULES",
           "NONDETERMINISTIC_SCHEDULES", "__version__"]
