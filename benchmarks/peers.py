"""Adapters that give every attention implementation the same shape for the benchmark runner.

Every adapter takes q (batch, seqlen_q, nheads, headdim) and k/v (batch, seqlen_k, nheads_k, headdim) in the same
memory layout, so no implementation is timed on a friendlier layout than another; adapters that want
(batch, heads, seqlen, headdim) take transposed views (last dimension still contiguous).

An adapter answers three questions: is it usable here (`unavailable_reason`), what does one forward call look like
(`forward`), and what closure should be timed for the backward (`make_bwd`). Determinism is a property of the adapter,
applied through `context()` around both graph building and timing, because PyTorch reads its global deterministic
flag when the backward runs, not when the forward records it.
"""
import contextlib
import importlib
import os

import torch

from dash_attn import schedules_table

# dash_attn's schedule names (dash_attn/schedules_table.py): every deterministic one, then `auto`.
DASH_SCHEDULES = schedules_table.DETERMINISTIC_SCHEDULES + (schedules_table.AUTO,)
# Visit orders the non-deterministic backward can be asked for beside `auto` (--nondet-schedules).
DASH_NONDET_SCHEDULES = schedules_table.DETERMINISTIC_SCHEDULES + schedules_table.NONDETERMINISTIC_SCHEDULES
SCHEDULE_SHORT = schedules_table.SHORT_NAMES
PEER_KEYS = ("cudnn", "fa2", "fa2_det", "efficient", "flex", "fa3", "fa3_det")

# torch.compile recompiles flex_attention for every new shape of the grid; the default limit (8) would silently
# drop it to eager mode, which materialises the whole score matrix and measures something else.
FLEX_RECOMPILE_LIMIT = 256


def _first(out):
    """Implementations return either the output or (output, lse, ...)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _bhsd(t):
    return t.transpose(1, 2)


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the block, previous settings restored after.

    fill_uninitialized_memory is switched off inside: it NaN-fills every torch.empty, a debugging aid whose cost
    would land inside the timed region and be charged to the peer's kernel.
    """
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    det_utils = getattr(torch.utils, "deterministic", None)
    had_fill = det_utils is not None and hasattr(det_utils, "fill_uninitialized_memory")
    was_fill = det_utils.fill_uninitialized_memory if had_fill else None
    torch.use_deterministic_algorithms(True)
    if had_fill:
        det_utils.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
        if had_fill:
            det_utils.fill_uninitialized_memory = was_fill


class Impl:
    """One column of the result tables."""

    key = ""            # stable id used in CSV/JSON
    label = ""          # short column header
    family = "peer"     # "dash" or "peer"
    deterministic = False
    schedule = None     # dash_attn backward schedule name, else None
    time_fwd = True     # False when the forward is the same kernel as another column's
    note = ""           # caveat printed under the tables

    def unavailable_reason(self, problem):
        """None when this implementation can run `problem` here, else a short reason."""
        return None

    def context(self):
        return contextlib.nullcontext()

    def forward(self, q, k, v, problem):
        raise NotImplementedError

    def make_fwd(self, q, k, v, problem):
        return lambda: self.forward(q, k, v, problem)

    def make_bwd(self, q, k, v, dout, problem):
        """Forward once with a retained graph; the closure runs only the backward."""
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = self.forward(q, k, v, problem)

        def run():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        return run


class DashImpl(Impl):
    family = "dash"

    def __init__(self, deterministic, schedule, sm_margin=0, sink=False):
        self.deterministic = deterministic
        self.schedule = schedule
        self.sm_margin = sm_margin
        self.sink = sink  # with a learnable sink per query head (gpt-oss), to price it against the same call without
        self._sinks = {}
        if sink:
            self.key = f"dash_{'det' if deterministic else 'nondet'}_sink"
            self.label = f"dash {'det' if deterministic else 'nd'}+sink"
            self.time_fwd = not deterministic
        elif deterministic:
            self.key = f"dash_det_{schedule}"
            self.label = f"dash det:{SCHEDULE_SHORT.get(schedule, schedule)}"
            self.time_fwd = False  # the forward has no schedule; the non-deterministic column times it
        elif schedule == schedules_table.AUTO:
            self.key = "dash_nondet"  # the reference of the det/non-det ratios
            self.label = "dash nd"
        else:
            self.key = f"dash_nondet_{schedule}"
            self.label = f"dash nd:{SCHEDULE_SHORT.get(schedule, schedule)}"
            self.time_fwd = False
        self._module = None
        self._reason = None

    def _load(self):
        if self._module is not None or self._reason is not None:
            return
        try:
            module = importlib.import_module("dash_attn")
            importlib.import_module("dash_attn._C")
        except ImportError as exc:
            self._reason = f"dash_attn._C is not built ({exc})"
            return
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) != (9, 0):
            self._reason = f"dash_attn kernels need an sm90 GPU, this one is sm{major}{minor}"
            return
        self._module = module

    def unavailable_reason(self, problem):
        self._load()
        return self._reason

    def _sink_for(self, nheads):
        if not self.sink:
            return None
        if nheads not in self._sinks:
            gen = torch.Generator(device="cuda").manual_seed(nheads)
            self._sinks[nheads] = torch.randn(nheads, generator=gen, device="cuda").requires_grad_()
        return self._sinks[nheads]

    def forward(self, q, k, v, problem):
        return _first(self._module.flash_attn_func(
            q, k, v, causal=problem.causal, window_size=tuple(problem.window), softcap=problem.softcap,
            deterministic=self.deterministic, schedule=self.schedule, sm_margin=self.sm_margin,
            return_attn_probs=False, learnable_sink=self._sink_for(q.shape[2])))


class SdpaImpl(Impl):
    _BACKENDS = {"cudnn": "CUDNN_ATTENTION", "fa2": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
    _LABELS = {"cudnn": "cuDNN", "fa2": "FA2", "efficient": "mem-eff"}

    def __init__(self, backend, deterministic=False):
        self.backend = backend
        self.deterministic = deterministic
        self.key = f"{backend}_det" if deterministic else backend
        self.label = self._LABELS[backend] + (" det" if deterministic else "")
        self.time_fwd = not deterministic

    def unavailable_reason(self, problem):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as exc:
            return f"torch.nn.attention.sdpa_kernel missing ({exc})"
        if not hasattr(SDPBackend, self._BACKENDS[self.backend]):
            return f"this torch has no SDPBackend.{self._BACKENDS[self.backend]}"
        if problem.windowed:
            return "SDPA has no sliding-window mask (an explicit attn_mask would pick another kernel)"
        if problem.softcap > 0:
            return "SDPA has no soft-capping"
        if problem.causal and problem.seqlen_q != problem.seqlen_k:
            return "SDPA is_causal is top-left aligned; dash_attn's causal mask is bottom-right"
        return None

    def context(self):
        return deterministic_algorithms() if self.deterministic else contextlib.nullcontext()

    def forward(self, q, k, v, problem):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kwargs = {"enable_gqa": True} if problem.nheads != problem.nheads_k else {}
        with sdpa_kernel([getattr(SDPBackend, self._BACKENDS[self.backend])]):
            out = torch.nn.functional.scaled_dot_product_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), is_causal=problem.causal, **kwargs)
        return _bhsd(out)


class FlexImpl(Impl):
    key = "flex"
    label = "Flex"
    deterministic = True  # no atomics in its backward; RESULTS.md reports it as PyTorch's deterministic option
    note = ("FlexAttention backward = forward + backward time: its compiled backward cannot retain the graph, so the "
            "timed closure recomputes the forward; nothing is subtracted.")

    def __init__(self):
        self._compiled = None
        self._masks = {}
        self._score_mods = {}
        self._reason = None

    def _load(self):
        if self._compiled is not None or self._reason is not None:
            return
        try:
            from torch.nn.attention import flex_attention as flex_module
        except ImportError as exc:
            self._reason = f"FlexAttention missing ({exc})"
            return
        import torch._dynamo
        dynamo_config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), FLEX_RECOMPILE_LIMIT))
        self._flex = flex_module
        self._compiled = torch.compile(flex_module.flex_attention, dynamic=False)

    def unavailable_reason(self, problem):
        self._load()
        return self._reason

    def _block_mask(self, problem, device):
        if not problem.causal and not problem.windowed:
            return None
        left, right = tuple(problem.window) if problem.windowed else (-1, 0)
        key = (problem.seqlen_q, problem.seqlen_k, left, right)
        if key not in self._masks:
            offset = problem.seqlen_k - problem.seqlen_q

            def bottom_right_band(b, h, q_idx, kv_idx):
                visible = q_idx >= 0  # all-true of the right shape
                if right >= 0:
                    visible = visible & (kv_idx <= q_idx + offset + right)
                if left >= 0:
                    visible = visible & (kv_idx >= q_idx + offset - left)
                return visible

            self._masks[key] = self._flex.create_block_mask(
                bottom_right_band, None, None, problem.seqlen_q, problem.seqlen_k, device=device)
        return self._masks[key]

    def _score_mod(self, softcap):
        """Soft-capping as a score_mod (its score is already scaled); one function per softcap, so that the
        compiled kernel is reused."""
        if softcap <= 0:
            return None
        if softcap not in self._score_mods:
            def capped(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)

            self._score_mods[softcap] = capped
        return self._score_mods[softcap]

    def forward(self, q, k, v, problem):
        self._load()
        kwargs = {"enable_gqa": True} if problem.nheads != problem.nheads_k else {}
        out = self._compiled(_bhsd(q), _bhsd(k), _bhsd(v), score_mod=self._score_mod(problem.softcap),
                             block_mask=self._block_mask(problem, q.device), **kwargs)
        return _bhsd(out)

    def make_bwd(self, q, k, v, dout, problem):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

        def run():
            out = self.forward(q, k, v, problem)
            return torch.autograd.grad(out, (q, k, v), dout)

        return run


# What the measurement build of FlashAttention-3 holds (../shared/tools/peers/build_fa3.py: bf16, head dims 64 and
# 128, dense, no soft-capping or local windows). A call outside it reaches a kernel that was never compiled and
# crashes the process (a segmentation fault at head dim 256), so those cells say n/a. A build with more head dims
# names them in DASH_BENCH_FA3_HDIMS (comma list).
FA3_BUILT_HDIMS = tuple(int(h) for h in os.environ.get("DASH_BENCH_FA3_HDIMS", "64,128").split(","))


class Fa3Impl(Impl):
    def __init__(self, deterministic):
        self.deterministic = deterministic
        self.key = "fa3_det" if deterministic else "fa3"
        self.label = "FA3 det" if deterministic else "FA3"
        self.time_fwd = not deterministic
        self._module = None
        self._reason = None

    def unavailable_reason(self, problem):
        if self._module is None and self._reason is None:
            try:
                self._module = importlib.import_module("flash_attn_interface")
            except ImportError as exc:
                self._reason = f"flash_attn_interface (FlashAttention-3) not importable ({exc})"
        if self._reason is not None:
            return self._reason
        if problem.headdim not in FA3_BUILT_HDIMS:
            return f"FA3's measurement build holds head dims {FA3_BUILT_HDIMS} (DASH_BENCH_FA3_HDIMS)"
        if problem.softcap > 0 or problem.windowed:
            return "FA3's measurement build has no soft-capping or local windows"
        return None

    def forward(self, q, k, v, problem):
        return _first(self._module.flash_attn_func(q, k, v, causal=problem.causal, window_size=tuple(problem.window),
                                                   softcap=problem.softcap, deterministic=self.deterministic))


def build_impls(schedules, peer_keys, with_dash=True, sm_margin=0, nondet_schedules=(), sink=False):
    """Columns in table order: dash non-det (auto, then any requested visit orders), dash det per schedule, with
    `sink` the non-det and det (auto) calls with a learnable sink, then the requested peers."""
    impls = []
    if with_dash:
        impls.append(DashImpl(False, schedules_table.AUTO, sm_margin))
        impls.extend(DashImpl(False, s, sm_margin) for s in nondet_schedules)
        impls.extend(DashImpl(True, s, sm_margin) for s in schedules)
        if sink:
            impls.extend(DashImpl(det, schedules_table.AUTO, sm_margin, sink=True) for det in (False, True))
    makers = {
        "cudnn": lambda: SdpaImpl("cudnn"),
        "fa2": lambda: SdpaImpl("fa2"),
        "fa2_det": lambda: SdpaImpl("fa2", deterministic=True),
        "efficient": lambda: SdpaImpl("efficient"),
        "flex": FlexImpl,
        "fa3": lambda: Fa3Impl(False),
        "fa3_det": lambda: Fa3Impl(True),
    }
    impls.extend(makers[key]() for key in PEER_KEYS if key in peer_keys)
    return impls
