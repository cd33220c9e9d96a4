"""G.711 (ITU-T): μ-law (`audio/pcmu`) and A-law (`audio/pcma`) bytes to float32, by a
256-entry table each (the standard's expansion, as audioop's ulaw2lin / alaw2lin compute it:
audioop is gone from Python 3.13)."""

from __future__ import annotations

import numpy as np

RATE = 8000  # G.711 is 8 kHz, one byte per sample


def _ulaw_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent = (code >> 4) & 0x07
    magnitude = (((code & 0x0F) << 3) + 0x84) << exponent
    value = np.where(code & 0x80, 0x84 - magnitude, magnitude - 0x84)
    return (value / 32768.0).astype(np.float32)


def _alaw_table() -> np.ndarray:
    code = np.arange(256, dtype=np.int32) ^ 0x55
    exponent = (code & 0x70) >> 4
    mantissa = (code & 0x0F) << 4
    value = np.where(exponent == 0, mantissa + 8, (mantissa + 0x108) << np.maximum(exponent - 1, 0))
    value = np.where(code & 0x80, value, -value)
    return (value / 32768.0).astype(np.float32)


TABLES = {"audio/pcmu": _ulaw_table(), "audio/pcma": _alaw_table()}


def decode(data: bytes, encoding: str) -> np.ndarray:
    """G.711 bytes (`audio/pcmu` or `audio/pcma`) as float32 samples in [-1, 1)."""
    return TABLES[encoding][np.frombuffer(data, dtype=np.uint8)]


def encode(samples: np.ndarray, encoding: str) -> bytes:
    """float32 samples as G.711 bytes: the code whose expansion is nearest (for tests and
    clients; the gateway only decodes)."""
    table = TABLES[encoding]
    order = np.argsort(table)
    ranked = table[order]
    clipped = np.clip(samples, -1.0, 1.0)
    index = np.clip(np.searchsorted(ranked, clipped), 1, 255)
    nearer_low = (clipped - ranked[index - 1]) < (ranked[index] - clipped)
    return order[np.where(nearer_low, index - 1, index)].astype(np.uint8).tobytes()
