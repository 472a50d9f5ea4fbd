"""The kind vocabulary: every fact about an element kind, in one table.

One frozen :class:`Kind` per element kind (the SKU element kinds of docs/api.md: ``f16 bf16 f32 f64 s8 u8 s4 u4 fp8_e4m3
fp8_e5m2 e8m0 i32 u32``, plus ``i64``, which arrays may carry but no SKU names). Every other table
of the project (the generator's C types and sizes, the runtime's dtype spellings, quantization
ranges, fp8 formats, the groups the ops accept) is derived from :data:`ALL`. Adding a dtype is one
entry here, one in a block of the matrix (``codegen/families/<family>/blocks.py``) and the tests that list the matrix
(docs/decisions.md, "The kind vocabulary").

Dependency-light on purpose: the generator imports it too, and importing it imports neither
NumPy nor torch (dtype objects are made lazily by ``runtime.arrays``).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional, Tuple

from .errors import InvalidProblemError


@dataclass(frozen=True)
class Kind:
    """Everything skuforge knows about one element kind."""

    name: str                       # the SKU spelling
    spellings: Tuple[str, ...]      # other spellings users may pass (lower case; dtype names included)
    ctype: str                      # C storage type in generated code (templates/common/prelude.cuh)
    size: int                       # bytes of one element; packed kinds: of the container byte
    numpy: Optional[str]            # NumPy / ml_dtypes dtype name of an array of this kind; None: none exists
    torch: Optional[str]            # torch dtype attribute name; None: none exists
    is_float: bool                  # a floating-point encoding (fp8 and e8m0 included)
    pack: int = 1                   # elements per container (packed int4: two per byte)
    qrange: Optional[Tuple[int, int]] = None   # integer code kinds: full (qmin, qmax)
    max: Optional[float] = None     # fp8: largest finite value (satfinite clamps to ±max)
    mbits: Optional[int] = None     # fp8: mantissa bits
    emin: Optional[int] = None      # fp8: exponent of the smallest normal
    emax: Optional[int] = None      # fp8: exponent of the largest normal (OCP MX "emax_elem")
    container: Optional[str] = None  # the kind whose storage holds it (s4 / u4 / e8m0 -> u8)
    sku: bool = True                # a SKU element kind (docs/api.md)
    tma: Optional[int] = None       # the driver's CUtensorMapDataType (runtime/tma.py); None: no tensor maps

    @property
    def has_zero_point(self) -> bool:
        """Integer codes carry a zero point; fp8 (and floats) do not."""
        return self.qrange is not None

    @property
    def storage_numpy(self) -> Optional[str]:
        """NumPy dtype of the buffer holding it: the container's for packed int4 and e8m0 codes."""
        return BY_NAME[self.container].numpy if self.container else self.numpy


# Table order is the SKU listing order (docs/api.md); groups below keep the order their users list.
ALL: Tuple[Kind, ...] = (
    Kind("f16", ("float16", "half", "fp16"), "f16_t", 2, "float16", "float16", True, tma=6),
    Kind("bf16", ("bfloat16",), "bf16_t", 2, "bfloat16", "bfloat16", True, tma=9),
    Kind("f32", ("float32", "float", "fp32"), "float", 4, "float32", "float32", True, tma=7),
    Kind("f64", ("float64", "double", "fp64"), "double", 8, "float64", "float64", True),
    Kind("s8", ("int8",), "s8_t", 1, "int8", "int8", False, qrange=(-128, 127)),
    Kind("u8", ("uint8",), "u8_t", 1, "uint8", "uint8", False, qrange=(0, 255)),
    Kind("s4", ("int4",), "u8_t", 1, None, None, False, pack=2, qrange=(-8, 7), container="u8"),
    Kind("u4", ("uint4",), "u8_t", 1, None, None, False, pack=2, qrange=(0, 15), container="u8"),
    Kind("fp8_e4m3", ("float8_e4m3fn", "float8_e4m3", "e4m3"), "u8_t", 1, "float8_e4m3fn", "float8_e4m3fn", True,
         max=448.0, mbits=3, emin=-6, emax=8),
    Kind("fp8_e5m2", ("float8_e5m2", "e5m2"), "u8_t", 1, "float8_e5m2", "float8_e5m2", True,
         max=57344.0, mbits=2, emin=-14, emax=15),
    Kind("e8m0", ("float8_e8m0fnu",), "u8_t", 1, "float8_e8m0fnu", "float8_e8m0fnu", True, container="u8"),
    Kind("i32", ("int32", "int", "s32"), "i32_t", 4, "int32", "int32", False),
    Kind("u32", ("uint32",), "u32_t", 4, "uint32", "uint32", False),
    Kind("i64", ("int64",), "i64_t", 8, "int64", "int64", False, sku=False),
)

BY_NAME = MappingProxyType({k.name: k for k in ALL})
# every accepted spelling (the SKU names included) -> kind name
SPELLINGS = MappingProxyType({s: k.name for k in ALL for s in (k.name,) + k.spellings})


def kind(name: str) -> Kind:
    """The :class:`Kind` of a SKU spelling (``"s8"``); ``KeyError`` for anything else."""
    return BY_NAME[name]


def _group(pred, order: Optional[tuple] = None) -> tuple:
    """Names of the kinds ``pred`` selects: table order, or ``order`` (checked to be the same set)."""
    names = tuple(k.name for k in ALL if pred(k))
    if order is not None:
        assert sorted(order) == sorted(names), (order, names)
        return order
    return names


# -- named groups ---------------------------------------------------------------------------
ELEMENTS = _group(lambda k: k.sku)                                      # KernelSku.element / aux_element
MATH = _group(lambda k: k.is_float and k.size >= 2)                     # Precision.math / accumulator
FLOAT = _group(lambda k: k.is_float and k.size >= 2, ("f32", "f64", "f16", "bf16"))   # what quantize takes
HALF = _group(lambda k: k.is_float and k.size == 2)                     # 16-bit floats (mma.sync operands)
INT8 = _group(lambda k: k.qrange is not None and k.pack == 1)           # int8 codes
INT4 = _group(lambda k: k.qrange is not None and k.pack == 2)           # packed int4 codes
FP8 = _group(lambda k: k.max is not None)                               # fp8 codes
LOW_BIT = INT4 + FP8                                                    # docs/lowbit.md
CODES = INT8 + INT4 + FP8                                               # what quantize produces
E8M0 = "e8m0"                                                           # OCP MX block-scale kind

# -- derived tables -------------------------------------------------------------------------
CTYPE = MappingProxyType({k.name: k.ctype for k in ALL})
SIZE = MappingProxyType({k.name: k.size for k in ALL})
QRANGE = MappingProxyType({k.name: k.qrange for k in ALL if k.qrange is not None})


def math_kind(float_kind: str) -> str:
    """All math in float32 after upcasting f16/bf16 (float64 for f64): docs/numerics.md."""
    return "f64" if float_kind == "f64" else "f32"


# -- user spellings -------------------------------------------------------------------------
_OF_CACHE: dict = {}


def of(dtype, arg: str = "dtype") -> str:
    """Normalise a dtype spelling (``"int8"``, ``"s8"``, ``numpy.int8``, ``torch.int8``) to a kind name."""
    try:
        return _OF_CACHE[dtype]
    except (KeyError, TypeError):
        pass
    name = _of(dtype, arg)
    try:
        _OF_CACHE[dtype] = name
    except TypeError:
        pass
    return name


def _of(dtype, arg: str) -> str:
    if isinstance(dtype, str):
        name = dtype.lower()
    elif isinstance(dtype, type) and dtype.__module__.partition(".")[0] in ("numpy", "ml_dtypes"):
        name = dtype.__name__          # a scalar type: numpy.int8, ml_dtypes.bfloat16
    else:
        name = str(getattr(dtype, "name", None) or dtype).replace("torch.", "")
        if "bfloat16" in name:
            name = "bfloat16"
        name = {"float": "float32", "half": "float16", "double": "float64"}.get(name, name)
    if name in SPELLINGS:
        return SPELLINGS[name]
    raise InvalidProblemError(f"{arg}={dtype!r} is not a dtype skuforge knows; known: "
                              + ", ".join(sorted(k.numpy for k in ALL if k.numpy)))
