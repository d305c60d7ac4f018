"""The module name FlashAttention-3 users import, holding the functions of it that dash_attn offers, so that a port
changes one import line:

    from flash_attn_interface import flash_attn_func  ->  from dash_attn.flash_attn_interface import flash_attn_func
    import flash_attn_interface                       ->  from dash_attn import flash_attn_interface

The signatures are FA3's (dash_attn/api.py). FA3's decoding and split-KV helpers (flash_attn_with_kvcache,
flash_attn_combine, get_scheduler_metadata) have no counterpart here.
"""
from .api import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"]
