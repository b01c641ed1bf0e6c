"""The `gguf` package's own dequantizer (NumPy, independent of Hearth and of ggml's C), for
the quant kernels' test: reads raw GGUF blocks of TYPE from IN, writes float32 values to OUT.
Usage: gguf_dequantize.py TYPE IN OUT"""
import sys

import numpy as np
from gguf import GGMLQuantizationType, quants

ty = GGMLQuantizationType[sys.argv[1]]
data = np.fromfile(sys.argv[2], dtype=np.uint8)
quants.dequantize(data, ty).astype(np.float32).tofile(sys.argv[3])
