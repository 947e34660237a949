"""Out-of-memory you can act on: who holds the memory, what leaks, and the
largest batch that fits.

- Attribution: enable_tagging(), tag(name), attribute(model) record a tag
  for every live allocation; report() sums live bytes by tag and by
  tensor size, with fragmentation and memory pending on other streams.
- On out-of-memory, torch.cuda.OutOfMemoryError's message ends with the
  top holders, the fragmentation and one suggestion; last_oom_report()
  returns the same as a dict.
- watch(steps=N) flags tags (and call sites, with memory history on) whose
  live bytes grow in every one of N consecutive steps.
- max_batch_size(step_fn, low, high) predicts the largest batch within the
  memory limit from two small steps and checks it with one real step.

Importing this module does not import torch; every function does, when
called. Design notes: docs/diagnosis.md.
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional

from ._diagnosis_logic import (
    BatchSizeResult,
    LeakDetector,
    LeakFinding,
    Trial,
    build_report,
    call_sites_from_snapshot,
    format_report,
    search_max_batch,
)

__all__ = [
    "BatchSizeResult",
    "LeakFinding",
    "LeakWarning",
    "attribute",
    "disable_tagging",
    "enable_tagging",
    "last_oom_report",
    "max_batch_size",
    "report",
    "tag",
    "tagging_enabled",
    "watch",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _ext():
    from . import _extension

    return _extension()


def _device_index(device) -> int:
    from . import _device_index as index

    return index(device)


class LeakWarning(UserWarning):
    """Issued by watch() for a tag or call site that grows every step."""


# --------------------------------------------------------------------------
# Tagging


def enable_tagging(sample_every: int = 1, always_record_bytes: int = 1 << 20) -> None:
    """Records a tag for every allocation from now on (the current tag of
    the allocating thread, "untagged" when none). With sample_every=N > 1,
    one in N allocations smaller than always_record_bytes is recorded and
    counted N times: report() then gives estimates, at a fraction of the
    cost. Called again while on, it changes only the sampling."""
    _ext().enable_tagging(int(sample_every), int(always_record_bytes))


def disable_tagging() -> None:
    """Stops recording and forgets every record."""
    _ext().disable_tagging()


def tagging_enabled() -> bool:
    """Whether allocation tags are being recorded (enable_tagging, or a
    tag(), attribute() or watch() that turned them on)."""
    return _ext().tagging_options() is not None


_interned: Dict[str, int] = {}


def _tag_id(name: str) -> int:
    tag_id = _interned.get(name)
    if tag_id is None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tag name must be a non-empty string, got {name!r}")
        tag_id = _interned[name] = _ext().intern_tag(name)
    return tag_id


def _ensure_tagging(extension) -> None:
    if extension.tagging_options() is None:
        extension.enable_tagging(1, 1 << 20)


class _TagScope:
    def __init__(self, name: str, inherit: bool):
        self._name = name
        self._inherit = inherit
        self._saved: List[tuple] = []

    def __enter__(self):
        extension = _ext()
        _ensure_tagging(extension)
        tag_id = _tag_id(self._name)
        previous = extension.set_thread_tag(tag_id)
        inherited = extension.set_inherited_tag(tag_id) if self._inherit else None
        self._saved.append((tag_id, previous, inherited))
        return self

    def __exit__(self, *exc_info):
        extension = _ext()
        tag_id, previous, inherited = self._saved.pop()
        extension.set_thread_tag(previous)
        if inherited is not None:
            extension.restore_inherited_tag(tag_id, inherited)
        return False


def tag(name: str, inherit: bool = True) -> _TagScope:
    """Context manager: allocations made inside it are recorded under
    `name`. Scopes nest (the innermost wins) and are per thread; with
    inherit=True (the default) threads that have no tag of their own, such
    as the threads autograd runs backward on, record under it too. Turns
    tagging on if it is off::

        with streamalloc.tag("optimizer"):
            optimizer.step()
    """
    return _TagScope(name, inherit)


class _Attribution:
    """The hooks attribute() installed; remove() takes them out (also on
    leaving a `with` block). With sample_passes > 1, `passes` counts the
    calls of the model and `sampled_passes` those attributed."""

    def __init__(self, module_hooks: List[tuple], sample_passes: int):
        self._handles: List[Any] = []
        self._pass_handles: List[Any] = []  # the submodules' hooks of the sampled pass running now
        self._every = sample_passes
        self._sampling_thread: Optional[int] = None
        self._depth = 0  # calls of the model running inside the sampled pass
        self.passes = 0
        self.sampled_passes = 0
        if sample_passes == 1:
            for module, pre_hook, post_hook in module_hooks:
                self._handles += _register(module, pre_hook, post_hook)
            return
        (model, self._root_pre_hook, self._root_post_hook), *self._submodule_hooks = module_hooks
        self._handles.append(model.register_forward_pre_hook(self._start_pass, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._end_pass, with_kwargs=True, always_call=True))

    def _start_pass(self, model, args, kwargs):
        if self._sampling_thread == threading.get_ident():
            self._depth += 1  # the model called again inside its own sampled pass
        else:
            self.passes += 1
            if self._sampling_thread is not None or (self.passes - 1) % self._every:
                return None
            self.sampled_passes += 1
            self._sampling_thread = threading.get_ident()
            self._depth = 1
            for module, pre_hook, post_hook in self._submodule_hooks:
                self._pass_handles += _register(module, pre_hook, post_hook)
        # This call read the model's pre-hooks before this one ran: the
        # model's own attribution hook is called here.
        self._root_pre_hook(model, args, kwargs)
        return None

    def _end_pass(self, model, args, kwargs, output):
        if self._sampling_thread != threading.get_ident():
            return None
        self._root_post_hook(model, args, kwargs, output)
        self._depth -= 1
        if not self._depth:
            # Backward needs no module hook: the autograd nodes carry its hooks.
            self._remove_pass_hooks()
        return None

    def _remove_pass_hooks(self) -> None:
        for handle in self._pass_handles:
            handle.remove()
        self._pass_handles.clear()
        self._sampling_thread = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remove_pass_hooks()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.remove()
        return False


def _register(module, pre_hook, post_hook) -> List[Any]:
    return [module.register_forward_pre_hook(pre_hook, with_kwargs=True),
            module.register_forward_hook(post_hook, with_kwargs=True, always_call=True)]


_attribution_state = threading.local()
# Tags attribute() gave modules: what _reset_after_backward may clear.
_module_tag_ids = set()
_reset_queued = [False]


def _reset_after_backward(torch, extension) -> None:
    """Once per backward pass, from its first module hook: queue a callback
    for the end of the pass that clears a module tag left on the thread
    that finishes it (for CUDA work, autograd's device thread, whose tag
    would otherwise hang over the start of the next pass: the loss's
    backward). A thread whose tag is not a module's keeps it."""
    if _reset_queued[0]:
        return
    _reset_queued[0] = True

    def reset():
        _reset_queued[0] = False
        if extension.thread_tag() in _module_tag_ids:
            extension.set_thread_tag(0)

    try:
        torch.autograd.Variable._execution_engine.queue_callback(reset)
    except RuntimeError:  # not inside a backward pass after all
        _reset_queued[0] = False


def _thread_state():
    state = _attribution_state
    if not hasattr(state, "stack"):
        state.stack = []             # (tag to restore, inputs need grad) per module being run
        state.claimed_outputs = {}   # outputs whose node has an entry hook: id -> weakref
        state.claimed_inputs = {}    # inputs with an exit hook: id -> weakref
    return state


def _claim(claimed: Dict[int, Any], t) -> bool:
    """Marks tensor `t` in `claimed`; False if it already was. Weak
    references: an intermediate freed during the forward must not live on
    (ids alone could be reused by a new tensor)."""
    ref = claimed.get(id(t))
    if ref is not None and ref() is t:
        return False
    claimed[id(t)] = weakref.ref(t)
    return True


def _tensors(value, depth: int = 0):
    """The tensors in a module's inputs or outputs (nested tuples, lists
    and dicts such as Hugging Face ModelOutput)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4:
        if isinstance(value, (tuple, list)):
            for item in value:
                yield from _tensors(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                yield from _tensors(item, depth + 1)


def attribute(model, prefix: Optional[str] = None, sample_passes: int = 1) -> _Attribution:
    """Tags what every submodule of `model` allocates with its qualified
    name ("blocks.3.mlp", as in model.named_modules(); the model itself
    with its class name), in the forward pass and in the backward pass.
    `prefix` ("student") is put in front of every name, to tell two models
    apart. Turns tagging on if it is off. Returns a handle: .remove() (or
    leaving a `with` block) takes the hooks out.

    sample_passes=N > 1 attributes one pass in N: the first, then every
    N-th (a pass is one call of `model` and the backward of its result).
    The other passes run no per-module hook, only a counter on the model,
    and what they allocate is recorded under the thread's current tag (the
    enclosing tag() scope, else "untagged"), so report() still sums to
    memory_allocated() without allocation sampling. Module names then hold
    what sampled passes allocated and is still alive: the breakdown by
    module of the last sampled pass, not of the pass running now; a leak
    grows under the outer tag (Note [sampled passes] in docs/diagnosis.md).

    Forward: a pre-hook sets the module's tag and a post-hook puts back the
    one before. Backward (Note [backward attribution] in docs/diagnosis.md):
    a hook on the autograd node that produced an output sets the module's
    tag when the backward pass reaches it, and a hook on an input's
    gradient (or, for a module whose inputs need no gradient, after its
    output nodes) sets the parent's tag when it leaves. Module
    full-backward hooks are not used: they wrap outputs in a custom
    autograd Function, and an in-place operation on such an output (a
    ReLU(inplace=True) after a BatchNorm) then fails."""
    import torch

    if not isinstance(sample_passes, int) or sample_passes < 1:
        raise ValueError(f"sample_passes must be a positive integer, got {sample_passes!r}")
    extension = _ext()
    _ensure_tagging(extension)
    names: Dict[int, str] = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)
    root_name = type(model).__name__

    def full_name(name: str) -> str:
        base = name or root_name
        return f"{prefix}.{base}" if prefix else base

    modules = dict(model.named_modules())

    def parent_of(name: str) -> Optional[str]:
        """The nearest enclosing module that runs a forward of its own
        (ModuleList and ModuleDict only hold modules); None for the model."""
        while name:
            name = name.rpartition(".")[0]
            if not isinstance(modules.get(name), (torch.nn.ModuleList, torch.nn.ModuleDict)):
                return name
        return None

    module_hooks = []  # (module, pre-hook, post-hook), the model first
    for module in model.modules():
        name = names[id(module)]
        tag_id = _tag_id(full_name(name))
        _module_tag_ids.add(tag_id)
        parent = parent_of(name)
        # Leaving the model goes back to the thread's own or inherited tag.
        parent_id = _tag_id(full_name(parent)) if parent is not None else 0
        leaf = next(module.children(), None) is None

        def enter_backward(*_args, _id=tag_id):
            extension.set_thread_tag(_id)
            _reset_after_backward(torch, extension)

        def leave_backward(*_args, _id=parent_id):
            extension.set_thread_tag(_id)

        def pre_hook(_module, args, kwargs, _id=tag_id, _leave=leave_backward):
            state = _thread_state()
            grad_inputs = False
            if torch.is_grad_enabled():
                for t in _tensors((args, kwargs)):
                    if t.requires_grad:
                        grad_inputs = True
                        # The outermost module reading a tensor leaves last.
                        if t.grad_fn is not None and _claim(state.claimed_inputs, t):
                            t.register_hook(_leave)
            state.stack.append((extension.set_thread_tag(_id), grad_inputs))
            return None

        def post_hook(_module, _args, _kwargs, output, _enter=enter_backward, _leave=leave_backward, _leaf=leaf):
            state = _thread_state()
            grad_inputs = True
            if state.stack:
                previous, grad_inputs = state.stack.pop()
                extension.set_thread_tag(previous)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    node = t.grad_fn
                    if node is None:
                        continue
                    # The innermost module producing an output enters first
                    # (an outer module returning it as is sees the same tensor).
                    if _claim(state.claimed_outputs, t):
                        node.register_prehook(_enter)
                    if not grad_inputs and _leaf:
                        # No input gradient marks the end: a module without
                        # children (an embedding) leaves once its output's
                        # node ran. A module with children is left when the
                        # backward pass ends (_reset_after_backward).
                        node.register_hook(_leave)
            if not state.stack:
                # The outermost module returned: the graph keeps what it needs.
                state.claimed_outputs.clear()
                state.claimed_inputs.clear()
            return None

        module_hooks.append((module, pre_hook, post_hook))
    return _Attribution(module_hooks, sample_passes)


# --------------------------------------------------------------------------
# Reports


def _history_enabled(torch) -> bool:
    check = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def _skip_dirs(torch) -> List[str]:
    return [os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _PACKAGE_DIR + os.sep]


def _call_sites(torch, index: int) -> Optional[List[Dict[str, Any]]]:
    """Live bytes by allocating Python frame, from torch's snapshot, while
    memory history records stacks; None otherwise."""
    if not _history_enabled(torch):
        return None
    return call_sites_from_snapshot(torch.cuda.memory._snapshot(), index, _skip_dirs(torch))


def report(device=None, top: int = 10, print_report: bool = True) -> Dict[str, Any]:
    """Live memory of `device` (default: the current one) by tag and by
    tensor size, the fragmentation, and the memory freed but still awaited
    by other streams; by call site too while torch's memory history is
    recording. Prints it (unless print_report=False) and returns it as a
    dict. Without sampling, by_tag sums to torch.cuda.memory_allocated();
    allocations made before tagging began count as "before_tagging"."""
    from . import _installed_extension

    extension = _installed_extension()
    import torch

    index = _device_index(device)
    stats = extension.stats(index)
    summary = extension.tag_summary(index) if extension.tagging_options() is not None else None
    data = build_report(index, stats, summary, _call_sites(torch, index))
    if print_report:
        print(format_report(data, top), end="")
    return data


def last_oom_report() -> Optional[Dict[str, Any]]:
    """The newest out-of-memory error's report as a dict (None before any):
    the error's figures, "holders" (top tags), "processes" (pid and
    used_bytes of each process on the device, as the driver lists them;
    empty where it cannot), "case" and "suggestion", and "text", the lines
    appended to the error message."""
    return _ext().last_oom_report()


# --------------------------------------------------------------------------
# Leak watch


class LeakWatch:
    """Per-step leak detection; see watch()."""

    def __init__(self, steps: int, device, call_sites: Optional[bool], warn: bool, min_growth_bytes: int):
        from . import _installed_extension

        self._extension = _installed_extension()
        import torch

        self._torch = torch
        self._device = _device_index(device)
        self._warn = warn
        self._enabled_here = self._extension.tagging_options() is None
        if self._enabled_here:
            self._extension.enable_tagging(1, 1 << 20)
        self._call_sites = _history_enabled(torch) if call_sites is None else call_sites
        self._tags = LeakDetector(steps, "tag", min_growth_bytes)
        self._sites = LeakDetector(steps, "call_site", min_growth_bytes) if self._call_sites else None
        self._closed = False
        self._observe()  # the baseline: N steps later a leak can be flagged

    @property
    def findings(self) -> List[LeakFinding]:
        """Every tag and call site flagged so far, updated while it grows."""
        found = self._tags.findings
        if self._sites is not None:
            found += self._sites.findings
        return sorted(found, key=lambda f: -f.growth_bytes)

    def _observe(self) -> List[LeakFinding]:
        summary = self._extension.tag_summary(self._device)
        new = self._tags.observe({name: nbytes for name, nbytes, _ in summary["by_tag"]})
        if self._sites is not None:
            sites = call_sites_from_snapshot(self._torch.cuda.memory._snapshot(), self._device,
                                             _skip_dirs(self._torch))
            new += self._sites.observe({e["call_site"]: e["bytes"] for e in sites})
        return new

    def step(self) -> List[LeakFinding]:
        """Call at the end of every step; returns what is flagged for the
        first time (and warns about it with LeakWarning)."""
        if self._closed:
            raise RuntimeError("streamalloc.watch: step() after the watch was closed")
        new = self._observe()
        if self._warn:
            for finding in new:
                warnings.warn(finding.message(), LeakWarning, stacklevel=2)
        return new

    def close(self) -> None:
        """Ends the watch; turns tagging off again if the watch turned it on."""
        if not self._closed and self._enabled_here:
            self._extension.disable_tagging()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False


def watch(steps: int = 5, device=None, call_sites: Optional[bool] = None, warn: bool = True,
          min_growth_bytes: int = 1) -> LeakWatch:
    """Leak watch: call .step() at the end of every training step. A tag
    whose live bytes grow in each of `steps` consecutive steps is flagged
    (a LeakWarning, and in .findings with the sizes); steady loops stay
    silent. With torch's memory history recording stacks (or
    call_sites=True), allocating Python frames are watched too, at the
    cost of one snapshot per step. Turns tagging on if it is off, and off
    again on close()::

        with streamalloc.watch(steps=5) as w:
            for batch in loader:
                train_step(batch)
                w.step()
    """
    return LeakWatch(steps, device, call_sites, warn, min_growth_bytes)


# --------------------------------------------------------------------------
# The largest batch that fits


def _memory_limit(torch, index: int) -> int:
    """What streamalloc may reserve on the device: the memory fraction's
    share of its total, or what it holds plus what is free when that is
    less (other processes and the CUDA context use the rest)."""
    free, total = torch.cuda.mem_get_info(index)
    fraction = 1.0
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        fraction = float(getter(index))
    return int(min(fraction * total, torch.cuda.memory_reserved(index) + free))


def max_batch_size(step_fn: Callable[[int], Any], low: int, high: int, device=None, *, multiple_of: int = 1,
                   warmup: bool = True, max_steps: int = 12, limit_bytes: Optional[int] = None) -> BatchSizeResult:
    """The largest batch in [low, high] for which `step_fn(batch)` (one
    full training step, keeping nothing alive afterwards; start it with
    optimizer.zero_grad(set_to_none=True)) fits in memory.

    Runs the step at two small batches (after one warm-up step), fits peak
    allocated = a + b * batch, predicts the largest batch within the
    memory limit (the device's total times the memory fraction, less what
    other processes use) divided by the measured fragmentation (peak
    reserved / peak allocated), and checks it with one real step; on
    out-of-memory, one step a little below. A bisection, capped at
    `max_steps` steps in all, runs only when both fail. Returns a
    BatchSizeResult (.batch, .predicted_batch, predicted and measured
    peaks, .steps, .trials; .as_dict())."""
    import torch

    index = _device_index(device)

    def settle():
        gc.collect()
        torch.cuda.synchronize(index)
        torch.cuda.empty_cache()

    settle()
    limit = int(limit_bytes) if limit_bytes is not None else _memory_limit(torch, index)

    def measure(batch: int) -> Trial:
        settle()
        torch.cuda.reset_peak_memory_stats(index)
        ok = True
        try:
            step_fn(batch)
            torch.cuda.synchronize(index)
        except torch.cuda.OutOfMemoryError:
            ok = False  # leaving the handler drops the traceback and the tensors its frames held
        peak_allocated = torch.cuda.max_memory_allocated(index)
        peak_reserved = torch.cuda.max_memory_reserved(index)
        settle()
        return Trial(batch, ok, int(peak_allocated), int(peak_reserved))

    return search_max_batch(measure, int(low), int(high), limit, multiple_of=multiple_of, warmup=warmup,
                            max_steps=max_steps)
