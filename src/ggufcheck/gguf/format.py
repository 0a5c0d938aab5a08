"""Constants of the GGUF container format that the validated reader needs.

Kept apart from the reader so the fuzz tools and the test-model builders can share them.
Quant block geometry comes from the official ``gguf`` package (``GGML_QUANT_SIZES``), so a
type is "known" exactly when gguf-py knows it.
"""

from __future__ import annotations

import enum

import gguf

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME = 63  # GGML_MAX_NAME is 64 including the terminating NUL
MAX_ARRAY_NESTING = 4
INT64_MAX = 2**63 - 1


class ValueType(enum.IntEnum):
    """GGUF metadata value types (the numbers are the on-disk codes)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format and byte size of each fixed-size value type (little-endian)
SCALAR_FORMATS: dict[ValueType, tuple[str, int]] = {
    ValueType.UINT8: ("<B", 1),
    ValueType.INT8: ("<b", 1),
    ValueType.UINT16: ("<H", 2),
    ValueType.INT16: ("<h", 2),
    ValueType.UINT32: ("<I", 4),
    ValueType.INT32: ("<i", 4),
    ValueType.FLOAT32: ("<f", 4),
    ValueType.BOOL: ("<?", 1),
    ValueType.UINT64: ("<Q", 8),
    ValueType.INT64: ("<q", 8),
    ValueType.FLOAT64: ("<d", 8),
}

NUMPY_DTYPES: dict[ValueType, str] = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}


def quant_geometry(type_code: int) -> tuple[gguf.GGMLQuantizationType, int, int] | None:
    """(type, elements per block, bytes per block) for a tensor type code, or None."""
    try:
        qtype = gguf.GGMLQuantizationType(type_code)
    except ValueError:
        return None
    sizes = gguf.GGML_QUANT_SIZES.get(qtype)
    if sizes is None:
        return None
    block_size, type_size = sizes
    return qtype, block_size, type_size
