"""FP8 E4M3 weight quantization in the layouts vLLM's Fp8LinearMethod loads, and its error against BF16.

Two scale layouts, both dequantized as ``weight_fp8.float() * scale``:

- ``block``: one float32 scale per 128x128 weight block, stored as ``weight_scale_inv`` of shape
  ``[ceil(out/128), ceil(in/128)]`` (the name is historical: it is the dequantization multiplier). This is
  the layout of the official FP8 releases (DeepSeek-V3, Qwen3/Qwen3.5 FP8) and of ``weight_block_size:
  [128, 128]`` in vLLM.
- ``tensor``: one float32 ``weight_scale`` for the whole matrix (shape ``[]``).

Each scale is ``amax / 448`` over its block (448 is E4M3's largest finite value), so the largest
magnitude maps to +-448 and nothing saturates; values are rounded to nearest-even by torch's cast.

torch is imported when a function runs, never at import time, so the rest of sparkfleet works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128
SCALE_FORMS = ("block", "tensor")
# safetensors dtype name -> torch dtype attribute
_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}


def require_torch() -> Any:
    """Import torch, or fail with a one-line error saying how to get it."""
    try:
        import torch
    except ModuleNotFoundError as error:
        raise RuntimeError(
            "FP8 quantization and the error report need torch; run sparkfleet with a Python that has it "
            "(e.g. the vLLM venv's), or pass --no-error-report with a --donor to copy the donor's tensors only"
        ) from error
    return torch


def tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor over a copy of `data` (safetensors dtype name, little-endian)."""
    torch = require_torch()
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype {dtype} is not a float dtype this tool handles ({', '.join(_TORCH_DTYPES)})")
    target = getattr(torch, _TORCH_DTYPES[dtype])
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(target).reshape(shape)


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    torch = require_torch()
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def quantize(weight: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weight and its float32 scale (``weight_scale_inv`` blocks or ``weight_scale``)."""
    torch = require_torch()
    if form not in SCALE_FORMS:
        raise ValueError(f"scale form {form!r} is not one of {', '.join(SCALE_FORMS)}")
    if weight.dim() != 2:
        raise ValueError(f"FP8 quantization takes 2-D weights, got shape {list(weight.shape)}")
    w = weight.to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("weight holds NaN or Inf values; it cannot be quantized")
    if form == "tensor":
        scale = (w.abs().max() / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return q, scale.reshape(())
    rows, cols = w.shape
    block_rows, block_cols = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(block_rows * FP8_BLOCK, block_cols * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(block_rows, FP8_BLOCK, block_cols, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = (amax / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(block_rows * FP8_BLOCK, block_cols * FP8_BLOCK)[:rows, :cols]
    return q.contiguous().to(torch.float8_e4m3fn), scale.contiguous()


def dequantize(weight_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix an FP8 weight and its scale stand for (block or per-tensor, by the scale's shape)."""
    torch = require_torch()
    w = weight_fp8.to(torch.float32)
    if scale.numel() == 1:
        return w * scale.reshape(()).to(torch.float32)
    rows, cols = w.shape
    expected = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scale shape {list(scale.shape)} does not match a {[rows, cols]} weight")
    expanded = scale.to(torch.float32).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return w * expanded[:rows, :cols]


def relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> dict[str, float]:
    """||approx - ref||_F / ||ref||_F, and the largest elementwise error relative to max |ref|."""
    torch = require_torch()
    ref = reference.to(torch.float32)
    diff = approximation.to(torch.float32) - ref
    norm = float(ref.norm())
    peak = float(ref.abs().max())
    return {
        "rel_fro": float(diff.norm()) / norm if norm else float(diff.norm()),
        "max_abs_over_max_ref": float(diff.abs().max()) / peak if peak else float(diff.abs().max()),
    }
