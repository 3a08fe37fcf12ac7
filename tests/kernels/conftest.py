"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

The variable must be set before triton is first imported, so it is set here, at collection.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
