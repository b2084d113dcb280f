"""Triton kernels: the GPU fast path. Only this package holds Triton code.

Each kernel module pairs every launcher with a torch reference of the same signature (named
`*_reference`), and tests run the kernels under `TRITON_INTERPRET=1` on CPU tensors against those
references. Nothing here is imported unless the triton backend is chosen, so moerun runs without
triton installed.
"""
