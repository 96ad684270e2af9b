"""An address check for Triton kernels run by the interpreter (``TRITON_INTERPRET=1``): compute-sanitizer's
memcheck, on the CPU.

The interpreter executes a kernel's loads, stores and atomics as numpy reads and writes at raw host addresses
and checks none of them: a kernel whose masks or clamps are wrong passes its CPU tests by reading whatever lies
beside a tensor, and faults on the GPU. Inside ``AddressCheck`` every address a kernel touches with its lane
enabled (mask true, or an unmasked access) must lie, whole, inside the storage of one of that launch's tensor
arguments; each access that does not is recorded (kernel, operation, count, first address, the launch's
tensors). Storage, not the view: a kernel may legitimately address its argument's whole storage.

The hooks sit on the interpreter's own entry points (``GridExecutor._init_args_hst`` for the launch's tensors,
``InterpreterBuilder.create_masked_load/store`` and ``create_atomic_*`` for the accesses); ``AddressCheck``
refuses to start where a Triton release lacks one, instead of checking nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# builder method -> (position of the pointer argument, position of the mask argument or None); the unmasked
# create_load / create_store hand on to the masked ones with an all-true mask, so these see every access once
_ACCESSES = {
    "create_masked_load": (0, 1),
    "create_masked_store": (0, 2),
    "create_atomic_rmw": (1, 3),
    "create_atomic_cas": (0, None),
}


class AddressCheck:
    """Context manager: records every out-of-bounds access of the interpreted kernels launched inside it."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.violations: list[dict[str, Any]] = []
        self.count = 0  # accesses that were out of bounds (each a vector of lanes)
        self.checked = 0  # accesses checked
        self._ranges: list[tuple[int, int, tuple[int, ...]]] = []
        self._kernel = "?"
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> AddressCheck:
        import triton.runtime.interpreter as interp

        missing = [name for name in _ACCESSES if not hasattr(interp.InterpreterBuilder, name)] + [
            name for name in ("_init_args_hst",) if not hasattr(interp.GridExecutor, name)
        ]
        if missing:
            raise RuntimeError(
                f"this Triton's interpreter has no {', '.join(missing)}: AddressCheck cannot hook it (update "
                "tests/triton_memcheck.py for this Triton release)"
            )
        check = self
        original_init = interp.GridExecutor._init_args_hst

        def init_args(executor: Any, args_dev: Any, kwargs: Any) -> Any:
            args_hst, kwargs_hst = original_init(executor, args_dev, kwargs)
            check._ranges = [
                (arg.untyped_storage().data_ptr(), arg.untyped_storage().nbytes(), tuple(arg.shape))
                for arg in [*args_hst, *kwargs_hst.values()]
                if hasattr(arg, "untyped_storage")
            ]
            check._kernel = getattr(executor.fn, "__name__", repr(executor.fn))
            return args_hst, kwargs_hst

        self._patch(interp.GridExecutor, "_init_args_hst", init_args)
        for name, (ptr_at, mask_at) in _ACCESSES.items():
            original = getattr(interp.InterpreterBuilder, name)

            def hooked(builder: Any, *args: Any, _original: Any = original, _name: str = name,
                       _ptr_at: int = ptr_at, _mask_at: int | None = mask_at, **kwargs: Any) -> Any:  # fmt: skip
                mask = args[_mask_at] if _mask_at is not None else None
                check._check(_name, args[_ptr_at], mask)
                return _original(builder, *args, **kwargs)

            self._patch(interp.InterpreterBuilder, name, hooked)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _check(self, operation: str, ptrs: Any, mask: Any) -> None:
        self.checked += 1
        addresses = np.asarray(ptrs.data).reshape(-1).astype(np.uint64)
        if mask is not None:
            enabled = np.broadcast_to(np.asarray(mask.data).astype(bool), np.asarray(ptrs.data).shape).reshape(-1)
            addresses = addresses[enabled]
        if addresses.size == 0:
            return
        width = _element_bytes(ptrs)
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, nbytes, _shape in self._ranges:
            inside |= (addresses >= start) & (addresses + np.uint64(width) <= np.uint64(start + nbytes))
        if inside.all():
            return
        self.count += 1
        if len(self.violations) < self.keep:
            outside = addresses[~inside]
            self.violations.append(
                {
                    "kernel": self._kernel,
                    "operation": operation,
                    "lanes_out_of_bounds": int(outside.size),
                    "first_address": hex(int(outside[0])),
                    "tensors": [
                        {"start": hex(start), "bytes": nbytes, "shape": list(shape)}
                        for start, nbytes, shape in self._ranges
                    ],  # fmt: skip
                }
            )


def _element_bytes(ptrs: Any) -> int:
    """Bytes one lane of a pointer tensor handle accesses."""
    return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)


def self_test() -> dict[str, int]:
    """The check's own teeth: one kernel that stays inside its tensor and one that reads past it. Returns the
    violations counted for each (expected: 0 and 1)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def copy16(src_ptr, dst_ptr, shift):
        offs = tl.arange(0, 16)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs + shift, mask=offs < 16 - shift, other=0.0))

    @triton.jit
    def copy16_unmasked(src_ptr, dst_ptr, shift):
        offs = tl.arange(0, 16)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs + shift))

    src, dst = torch.arange(16, dtype=torch.float32), torch.zeros(16)
    found = {}
    for name, kernel in (("masked", copy16), ("unmasked", copy16_unmasked)):
        with AddressCheck() as check:
            kernel[(1,)](src, dst, 4)
        found[name] = check.count
    return found
