"""A cheaper host path for launching the engine's Triton kernels (the plan's `launch=fast`).

Steps with prefill run eagerly, and their pace is the host's: the offline workload's typical
step (211 decodes + 8 new 1000-token prompts) launches ~500 Triton kernels and ~1,000 other
kernels, and its host time to enqueue the forward (~79 ms) was level with the GPU's span
(~83 ms) on the H200 (RESULTS.md). `kernel[grid](*args)` costs the host 18 µs with 3 arguments
and 34 µs with 33, of which the compiled kernel's own launcher takes 12-14
(`scripts/bench_launch.py`, H200, Triton 3.6): the rest is Triton binding each argument, building
its specialization and cache key, checking globals and formatting launch metadata, every call.

`fast_launch(kernel)` wraps a `@triton.jit` kernel. `wrapped[grid](*args, **kwargs)` computes a
key that determines Triton's specialization of the call: per tensor its dtype and whether its
address is 16-byte aligned; per int whether it is 1, whether it is a multiple of 16, and its
integer width class; floats by type; other values (constexprs, launch options such as num_warps)
as they are; and the current device. The first call with a key goes through `kernel[grid]`
(which compiles if needed and launches), and the compiled kernel it returns is kept under the
key; later calls with the key launch that compiled kernel directly, on the current stream, with
the arguments in the kernel's parameter order (keyword and default ones appended). The key is
finer than Triton's specialization (an int's class is keyed even where Triton does not
specialize it), never coarser, so a kept kernel is the one Triton would pick. A grid given as a
callable, or a key that cannot be hashed, takes `kernel[grid]` every time.

Launch hooks (`triton.knobs.runtime.launch_enter_hook`, e.g. proton's) are not called on the
direct path: `--kernels ...,launch=triton` restores Triton's own launch for every kernel.

Off by default (kernels called directly, as in tests and benchmarks, launch as Triton does); a
worker turns it on from its plan (`use_fast_launch`). Never under the interpreter, where there
is nothing compiled to launch.
"""

from __future__ import annotations

import inspect

import torch

from common.launch_settings import interpreting

_fast = False


def fast_launching() -> bool:
    return _fast


def use_fast_launch(on: bool) -> None:
    """The process setting, from the plan's `launch` (worker start-up)."""
    global _fast
    _fast = on and not interpreting()


_Tensor = torch.Tensor


def _arg_key(a):
    """What of `a` Triton's specialization reads (jit.py's specialize_impl): for an int whether
    it is 1 (+1), a multiple of 16 (+2), outside int32 (+4) and past int64 (+8: u64); for a tensor
    its dtype and whether its address is 16-byte aligned; for a float only the type; other
    values as they are. `_keys` is the same, inlined for a whole argument list."""
    return _keys((a,))[0]


def _keys(args) -> tuple:
    # one comprehension, no call per argument: ~0.1 µs an int, ~0.2 µs a tensor (host CPU)
    return tuple([(a == 1) + (not a & 15) * 2 + (a > 2147483647 or a < -2147483648) * 4
                  + (a > 9223372036854775807) * 8 if a.__class__ is int
                  else (a.dtype, not a.data_ptr() & 15) if isinstance(a, _Tensor)
                  else float if a.__class__ is float else a for a in args])


class _Entry:
    """A compiled kernel kept under a key: its launcher, function handle, packed metadata, and
    how to complete the argument list (keyword or default values of the parameters past the
    positional ones)."""
    __slots__ = ("compiled", "run", "function", "metadata", "tail")

    def __init__(self, compiled, tail):
        self.compiled = compiled
        self.run = compiled.run  # initialises the handles (module load) on first access
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.tail = tail


class FastKernel:
    """A `@triton.jit` kernel whose `[grid](...)` launches go through the cache described in the
    module docstring when `use_fast_launch(True)`; otherwise exactly `kernel[grid](...)`. Other
    attributes are the kernel's (`fn`, `cache`, `run`, ...)."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = list(inspect.signature(kernel.fn).parameters.values())
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        constexpr = {p.name for p in getattr(kernel, "params", ()) if getattr(p, "is_constexpr", False)}
        # parameters whose values are runtime arguments (keyed by _arg_key); constexprs by value
        self._runtime = frozenset(n for n in self._names if n not in constexpr)
        self._ce_mask = tuple(n in constexpr for n in self._names)
        self._first_ce = self._ce_mask.index(True) if True in self._ce_mask else len(self._names)
        self._entries: dict = {}

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        if not _fast or callable(grid):
            return self.kernel[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _key(self, args, kwargs):
        if len(args) <= self._first_ce:
            pos = _keys(args)
        else:  # constexprs among the positional arguments: keyed by value
            pos = tuple([a if ce else _arg_key(a) for a, ce in zip(args, self._ce_mask)])
        if self._runtime.isdisjoint(kwargs):  # constexprs and launch options only: by value
            kw = tuple(kwargs.items())
        else:
            kw = tuple([(k, _arg_key(v) if k in self._runtime else v) for k, v in kwargs.items()])
        return (torch.cuda.current_device(), pos, kw)

    def _launch(self, grid, args, kwargs):
        key = self._key(args, kwargs)
        try:
            entry = self._entries.get(key)
        except TypeError:  # an unhashable constexpr: Triton's own launch, every time
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)  # compiles if needed, and launches
            tail = tuple((n, n in kwargs) for n in self._names[len(args):])
            for n, given in tail:
                if not given and n not in self._defaults:
                    raise TypeError(f"{self.kernel.fn.__name__}: missing argument {n!r}")
            self._entries[key] = _Entry(compiled, tail)
            return compiled
        full = args + tuple([kwargs[n] if given else self._defaults[n] for n, given in entry.tail])
        n = len(grid)
        device = key[0]
        try:
            entry.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(device), entry.function,
                      entry.metadata, None, None, None, *full)
        except Exception as e:  # the direct launch itself failed: the plan's message names launch=triton
            e.plan_key = "launch"
            raise
        return entry.compiled


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def fast_launch(kernel) -> FastKernel:
    """Wrap a `@triton.jit` kernel (use under it: `@fast_launch` above `@triton.jit`)."""
    return FastKernel(kernel)
