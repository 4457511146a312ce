"""What "dequantizing a GGUF file" means, for the block format of the book's real model (Q4_1).

SmolLM2-135M-Instruct ships as `SmolLM2-135M-Instruct.Q4_1.gguf`: every linear weight of its 30 layers is
stored in blocks of 32 consecutive weights of a row, each block 20 bytes (5 bits a weight):

    bytes 0-1   d   (fp16)   the step between two levels
    bytes 2-3   m   (fp16)   the smallest value of the block
    bytes 4-19  16 bytes of 4-bit codes q: byte j holds weight j in its low nibble, weight j + 16 in its high one

    w[j] = d · q[j] + m,   q[j] ∈ {0, …, 15}

so a block represents 16 evenly spaced values from m to m + 15·d (chosen by the quantizer to cover the block's
minimum and maximum). Dequantizing computes these floats once; training then runs on an ordinary fp32 model
(which the stages may quantize again, to NF4, for QLoRA: a second, different 4-bit format).

Taught in chapter 13.
"""

from __future__ import annotations

import numpy as np

#: Weights per block and bytes per block of GGUF's Q4_1 type.
Q4_1_BLOCK, Q4_1_BYTES = 32, 20


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Float32 weights of Q4_1 data: `raw` is uint8 of shape (..., n_blocks · 20), as `gguf.GGUFReader` returns
    a tensor's data; the result has shape (..., n_blocks · 32)."""
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.shape[-1] % Q4_1_BYTES:
        raise ValueError(f"dequantize_q4_1: last dimension {raw.shape[-1]} is not a multiple of {Q4_1_BYTES} bytes")
    blocks = raw.reshape(*raw.shape[:-1], -1, Q4_1_BYTES)  # (..., n_blocks, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (..., n_blocks, 1)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[..., 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)  # (..., n_blocks, 32)
    return (d * q + m).reshape(*raw.shape[:-1], -1)
