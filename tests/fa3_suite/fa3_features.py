"""What FlashAttention-3's own test file (hopper/test_flash_attn.py) asks of dash_attn, and which of its cases the
suite leaves out and why. FEATURES is the one table of what dash_attn does not offer (the README's "Not offered"
list, in its words); Scope adds what a given build or run leaves out (head dims, dtypes, softcap kernels).

Pure data and functions, no pytest hooks: fa3_plugin.py applies them, tests/test_fa3_suite.py checks them on the CPU.

Every left-out case or sub-case carries a key:
  "feature:<key>"         a FEATURES row: dash_attn does not offer it
  "not built: <what>"     this build of dash_attn._C lacks the kernel (DASH_ATTN_HDIMS/DTYPES/SOFTCAP)
  "not selected: <what>"  built, but outside the head dims / dtypes / shard this run was asked to cover
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Mapping, Optional, Tuple

import torch

from dash_attn import validation

@functools.lru_cache(maxsize=None)
def head_dim_offered(head_dim: int) -> bool:
    """Whether the API takes `head_dim`, whatever the build: asked of its own input check (validation.check_qkv
    reads only metadata, so meta tensors do), which is where the rule is defined."""
    q = torch.empty(1, 1, 1, head_dim, dtype=validation.KERNEL_DTYPES[0], device="meta")
    try:
        validation.check_qkv(q, q, q, varlen=False)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Feature:
    """A feature FA3's test file exercises and dash_attn does not offer.

    tests: FA3 test functions that test nothing but this feature: left out whole.
    names: flash_attn_interface names FA3 has for it and dash_attn lacks: stand-ins that skip the calling test.
    switches: FA3's own FLASH_ATTENTION_DISABLE_* variables for it, set to TRUE before its file is imported. They are
      the only way to drop the feature's iterations inside a test's loops (num_splits=3 runs after num_splits=1 in
      one test case), and they shrink collection (the kvcache grid is 50k cases without them).
    asks: whether a parametrization (FA3's parameter names -> values) asks for the feature.
    """
    key: str
    reason: str
    tests: Tuple[str, ...] = ()
    names: Tuple[str, ...] = ()
    switches: Tuple[str, ...] = ()
    asks: Optional[Callable[[Mapping], bool]] = None


FEATURES = (
    Feature("kvcache", "paged KV and the kvcache functions (flash_attn_with_kvcache and its helpers)",
            tests=("test_flash_attn_kvcache",), names=("flash_attn_with_kvcache", "get_scheduler_metadata"),
            switches=("FLASH_ATTENTION_DISABLE_PAGEDKV", "FLASH_ATTENTION_DISABLE_APPENDKV")),
    Feature("split_kv", "num_splits > 1 (FA3's split-KV forward) and its flash_attn_combine",
            tests=("test_flash_attn_combine", "test_flash_attn_varlen_combine_linearize"),
            names=("flash_attn_combine",), switches=("FLASH_ATTENTION_DISABLE_SPLIT",)),
    Feature("fp8", "FP8 inputs and the q/k/v descales (the kernels take fp16 and bf16)",
            switches=("FLASH_ATTENTION_DISABLE_FP8",),
            asks=lambda params: "dtype" in params and params["dtype"] not in validation.KERNEL_DTYPES),
    Feature("qv", "qv (the extra query-value product)", asks=lambda params: params.get("has_qv") is True),
    Feature("head_dim", f"head dims its input checks refuse (above {validation.MAX_HEADDIM}: "
                        "validation.check_qkv)",
            asks=lambda params: "d" in params and not head_dim_offered(params["d"])),
    Feature("fa3_ops", "FA3's registered custom ops (torch.ops.flash_attn_3 and their schemas)",
            tests=("test_flash3_bw_compatibility",)),
)
FEATURE_BY_KEY = {feature.key: feature for feature in FEATURES}
SWITCHES = tuple(switch for feature in FEATURES for switch in feature.switches)
STANDINS = {name: feature for feature in FEATURES for name in feature.names}


def feature_asked(test: str, params: Mapping) -> Optional[Feature]:
    """The first FEATURES row a test case asks for, or None."""
    for feature in FEATURES:
        if test in feature.tests or (feature.asks is not None and feature.asks(params)):
            return feature
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Skip messages: the key in brackets at the end, so the summary counts skips by key whatever the wording.
# ----------------------------------------------------------------------------------------------------------------------

_KEY_AT_END = re.compile(r"\[([^\[\]]+)\]$")


def skip_message(key: str, text: str) -> str:
    return f"{text} [{key}]"


def feature_skip_message(feature: Feature) -> str:
    return skip_message(f"feature:{feature.key}", f"dash_attn does not offer {feature.reason}")


def skip_key(message: str) -> str:
    """The key of a skip_message; a skip of FA3's own (no key) is counted under its text."""
    message = message.strip()
    if message.startswith("Skipped:"):
        message = message[len("Skipped:"):].strip()
    found = _KEY_AT_END.search(message)
    return found.group(1) if found else f"FA3's own skip: {message or '(no reason given)'}"


# ----------------------------------------------------------------------------------------------------------------------
# What a build and a run cover
# ----------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Build:
    """What dash_attn._C was compiled with (without a GPU: what the suite assumes it was)."""
    head_dims: Tuple[int, ...]
    dtypes: Tuple[str, ...]
    softcap: bool


@dataclasses.dataclass(frozen=True)
class Scope:
    """A build and the part of it one run covers: kernel head dims and dtype names, subsets of the build's."""
    build: Build
    head_dims: Tuple[int, ...]
    dtypes: Tuple[str, ...]

    def __post_init__(self):
        for what, chosen, built in (("head dims", self.head_dims, self.build.head_dims),
                                    ("dtypes", self.dtypes, self.build.dtypes)):
            missing = [x for x in chosen if x not in built]
            if missing:
                raise ValueError(f"{what} {missing} are not built into this dash_attn (built: {list(built)})")

    def head_dim_left_out(self, head_dim: int) -> Optional[str]:
        """Why a call holding `head_dim` (max of q's and v's) does not run in this scope; None if it does. The
        kernel that runs it is the one dash_attn picks (validation.kernel_head_dim), so --hdims 128 covers 96."""
        if not head_dim_offered(head_dim):
            return "feature:head_dim"
        try:
            kernel = validation.kernel_head_dim(head_dim, self.build.head_dims)
        except ValueError:
            return f"not built: head dims above {max(self.build.head_dims)}"
        return None if kernel in self.head_dims else f"not selected: head dim {kernel} kernel"

    def dtype_left_out(self, dtype: torch.dtype) -> Optional[str]:
        name = validation.DTYPE_KERNEL_NAMES[dtype]
        if name not in self.build.dtypes:
            return f"not built: {name}"
        return None if name in self.dtypes else f"not selected: {name}"

    def case_left_out(self, test: str, params: Mapping) -> Optional[str]:
        """Why a test case (test function name, its parametrization) does not run; None if it does."""
        feature = feature_asked(test, params)
        if feature is not None:
            return f"feature:{feature.key}"
        if "d" in params:
            why = self.head_dim_left_out(params["d"])
            if why:
                return why
        if "dtype" in params:
            why = self.dtype_left_out(params["dtype"])
            if why:
                return why
        if params.get("softcap", 0.0) > 0.0 and not self.build.softcap:
            return "not built: softcap kernels"
        return None

    def subcase_left_out(self, d: int, dv: int) -> Optional[str]:
        """Why a sub-case with v's head dim dv (FA3 loops over several inside one case) does not run."""
        if not head_dim_offered(dv):
            return "feature:head_dim"
        return self.head_dim_left_out(max(d, dv))


@dataclasses.dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (--shard K/N): the cases a run keeps after the scope are dealt round robin in
    collection order, so that runs of a time budget cover the suite between them, each a spread of its cases."""
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError:
            raise ValueError(f"a shard is K/N with integers 0 <= K < N, got {text!r}") from None
        if not 0 <= index < count:
            raise ValueError(f"a shard is K/N with integers 0 <= K < N, got {text!r}")
        return cls(index, count)

    def keeps(self, position: int) -> bool:
        """Whether the case at `position` among those the scope keeps is this shard's."""
        return position % self.count == self.index

    @property
    def key(self) -> str:
        return f"not selected: shard {self.index}/{self.count}"
