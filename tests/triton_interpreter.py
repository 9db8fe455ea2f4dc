"""Make Triton's CPU interpreter usable for our kernels (triton 3.6, NumPy 2).

Two gaps of the interpreter, both outside compiled kernels (a GPU never goes through this):

* it holds every scalar as a one-element array and converts it with `int(array)`, which NumPy
  ≥ 2.4 refuses for arrays of rank 1, so a loop bound computed in a kernel
  (`range(0, tl.cdiv(K, BLOCK))`) fails;
* it keeps bf16 values as their raw uint16 bits (NumPy has no bf16) and `tl.dot` multiplies those
  bits as integers; here bf16 operands are widened to fp32 first, which is what the tensor cores'
  fp32 accumulation of exact bf16 products computes anyway;
* its float narrowing (fp32 → bf16 / e4m3) truncates or rounds without carrying into the
  exponent; here it goes through torch's conversions, which round to nearest even like the GPU.

`install()` patches both, once.
"""

from __future__ import annotations


def install() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original_patch = interpreter._patch_lang_tensor
    if getattr(original_patch, "_v4serve_shim", False):
        return

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    original_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)

        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    import torch

    torch_dtypes = {tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float16: torch.float16,
                    tl.float32: torch.float32}
    original_cast, original_fp_to_fp = interpreter.InterpreterBuilder.cast_impl, \
        interpreter.InterpreterBuilder.create_fp_to_fp

    def narrow(src, dst_type):
        """torch conversion for float → narrower float, else None."""
        s, d = src.dtype.scalar, dst_type.scalar
        if s not in torch_dtypes or d not in torch_dtypes or d.primitive_bitwidth >= s.primitive_bitwidth:
            return None
        data = np.asarray(src.data)
        if s == tl.float32:  # real values, though NumPy may have promoted them to float64
            wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32).copy())
        else:  # 16-bit floats are held as their bits
            bits = torch.from_numpy(np.ascontiguousarray(data).astype(np.uint16).copy())
            wide = bits.view(torch.bfloat16 if s == tl.bfloat16 else torch.float16)
        out = wide.to(torch_dtypes[d]).view({16: torch.uint16, 8: torch.uint8}[d.primitive_bitwidth]).numpy()
        return interpreter.TensorHandle(out.view(interpreter._get_np_dtype(dst_type)), d)

    # `is None`, not `or`: a TensorHandle is falsy when any element is zero
    def cast_impl(self, src, dst_type):
        out = narrow(src, dst_type)
        return original_cast(self, src, dst_type) if out is None else out

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = narrow(src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    patch_lang_tensor._v4serve_shim = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter.InterpreterBuilder.create_dot = create_dot
