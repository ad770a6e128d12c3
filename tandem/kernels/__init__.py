"""GPU kernels (Triton), each with a plain-PyTorch reference beside it.

Every kernel module exposes the kernel's entry point and a ``*_reference`` function computing
the same thing in plain PyTorch; tests compare the two (on CPU through Triton's interpreter,
``TRITON_INTERPRET=1``, with tiny shapes; on a GPU with ``pytest -m gpu``). Model code calls the
kernels on CUDA tensors and the references elsewhere.
"""
