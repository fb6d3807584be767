"""The object codec of the object collectives: safe, typed, never pickle.

``broadcast_object``, ``all_gather_object``, ``gather_object`` and ``scatter_object`` move
Python values as bytes made by :func:`encode` and read back by :func:`decode`. Only data is
encoded, never code, so decoding what a peer sent cannot run anything:

- JSON's values: ``None``, ``bool``, ``int`` (any size), ``float`` (NaN and infinities too),
  ``str``, ``list`` and ``dict``;
- and, beyond JSON: ``tuple`` (comes back a tuple), ``bytes``, dict keys that are ``int``
  (JSON would turn them into strings), NumPy arrays of every dtype gpucoll moves (integers,
  float16/32/64, bfloat16, complex, bool; any shape, 0-d included) and NumPy scalars of those
  dtypes, framed as dtype, shape and raw little-endian bytes.

Subclasses come back as their base type (an ``OrderedDict`` as a ``dict``, a ``np.str_`` as a
``str``, a memmap as an ``ndarray``). Anything else (sets, objects of your own classes,
object-dtype arrays, device arrays) raises ``TypeError`` naming the type and where it sits
inside the value, e.g. ``obj['optim'][2]``, before anything is sent; so do a value that
contains itself and one nested deeper than :data:`MAX_DEPTH` levels (``ValueError``).

Format: ``GCO1``, then one tagged value. Tags (one byte) and what follows them, all integers
little-endian::

    N / T / F       None / True / False
    i <i8>          int in int64 range          J <u8 n> <n bytes>   bigger int (two's complement)
    f <f8>          float                       s <u8 n> <utf-8>     str
    b <u8 n> <n>    bytes                       l / t <u8 n> values  list / tuple
    d <u8 n> (key value)*n                      dict (keys: str or int)
    a <u1 dtype> <u1 ndim> <u8 dim>*ndim data   ndarray (dtype: gpucoll's wire code)
    g <u1 dtype> data                           NumPy scalar
"""

from __future__ import annotations

import struct
import sys
from typing import Any, List, Tuple

import numpy as np

from .types import DTYPES, dtype_from_code

__all__ = ["encode", "decode", "MAX_DEPTH"]

MAGIC = b"GCO1"
MAX_DEPTH = 200  # nesting levels of lists, tuples and dicts

_U8 = struct.Struct("<Q")
_I8 = struct.Struct("<q")
_F8 = struct.Struct("<d")
_TAG_INT, _TAG_FLOAT, _TAG_STR = b"i", b"f", b"s"
_SUPPORTED = ("dict (str or int keys), list, tuple, str, int, float, bool, None, bytes, NumPy "
              "arrays and scalars of numeric or bool dtypes")


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # only arrays of this dtype need it

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _array_code(dtype: np.dtype) -> int:
    """gpucoll's wire code of ``dtype``, or -1 when the codec does not carry it."""
    entry = DTYPES.get(dtype.name)
    return -1 if entry is None else entry[0]


def _raw(array: np.ndarray) -> np.ndarray:
    """The little-endian bytes of ``array`` as a flat uint8 array (a view when it can be)."""
    array = np.ascontiguousarray(array).reshape(-1)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.view(np.uint8)


class _Unencodable(Exception):
    """Raised inside the encoder; each container level adds its key on the way out."""

    def __init__(self, kind: type, message: str):
        super().__init__(message)
        self.kind, self.message, self.keys = kind, message, []
        self.in_this_container = False  # the error is about the container itself (a key)


class _Encoder:
    def __init__(self) -> None:
        self.out = bytearray(MAGIC)  # small values are appended here
        self.parts: List[Any] = []   # earlier bytearrays and array data, in order
        self.size = 0  # bytes in self.parts
        self.open: set = set()  # ids of the containers on the current path (cycle check)

    def put(self, data: Any) -> None:
        self.out += data

    def put_array(self, data: np.ndarray) -> None:
        """Append array bytes without copying them here (``encode`` copies them once)."""
        self.size += len(self.out) + len(data)
        self.parts.append(self.out)
        self.parts.append(data)
        self.out = bytearray()

    def finish(self) -> List[Any]:
        self.size += len(self.out)
        self.parts.append(self.out)
        return self.parts

    def value(self, value: Any, depth: int) -> None:
        kind = type(value)  # the common exact types first
        if kind is int and -(1 << 63) <= value < (1 << 63):
            self.out += _TAG_INT + _I8.pack(value)
        elif kind is float:
            self.out += _TAG_FLOAT + _F8.pack(value)
        elif kind is str and value.isascii():
            self.out += _TAG_STR + _U8.pack(len(value))
            self.out += value.encode("ascii")
        elif value is None:
            self.put(b"N")
        elif value is True or value is False:
            self.put(b"T" if value else b"F")
        elif isinstance(value, np.generic) and _array_code(value.dtype) >= 0:
            self.put(bytes((ord("g"), _array_code(value.dtype))))
            self.put(_raw(np.asarray(value)).tobytes())
        elif isinstance(value, np.ndarray):
            self.array(value)
        elif isinstance(value, int):
            value = int(value)
            if -(1 << 63) <= value < (1 << 63):
                self.put(b"i" + _I8.pack(value))
            else:
                raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
                self.put(b"J" + _U8.pack(len(raw)))
                self.put(raw)
        elif isinstance(value, float):
            self.put(b"f" + _F8.pack(float(value)))
        elif isinstance(value, str):
            try:
                raw = str(value).encode("utf-8")
            except UnicodeEncodeError as exc:  # lone surrogates
                raise _Unencodable(ValueError, f"cannot encode the str at {{path}}: {exc}") from None
            self.put(b"s" + _U8.pack(len(raw)))
            self.put(raw)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            self.put(b"b" + _U8.pack(len(raw)))
            if len(raw) >= 1 << 16:
                self.put_array(np.frombuffer(raw, dtype=np.uint8))
            else:
                self.put(raw)
        elif isinstance(value, (list, tuple, dict)):
            self.container(value, depth)
        else:
            raise _Unencodable(TypeError, f"cannot send a value of type {_type_name(value)} at "
                                          f"{{path}}: object collectives carry {_SUPPORTED} "
                                          f"(gpucoll never pickles)")

    def array(self, array: np.ndarray) -> None:
        code = _array_code(array.dtype)
        if code < 0:
            raise _Unencodable(TypeError, f"cannot send a NumPy array of dtype {array.dtype} at "
                                          f"{{path}}: arrays must have a numeric or bool dtype "
                                          f"({', '.join(DTYPES)})")
        if array.ndim > 255:
            raise _Unencodable(ValueError, f"the array at {{path}} has {array.ndim} dimensions "
                                           f"(at most 255)")
        self.put(bytes((ord("a"), code, array.ndim)))
        self.put(b"".join(_U8.pack(int(d)) for d in array.shape))
        if array.nbytes:
            self.put_array(_raw(array))

    def container(self, value: Any, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise _Unencodable(ValueError, f"the value at {{path}} is nested deeper than "
                                           f"{MAX_DEPTH} levels")
        if id(value) in self.open:
            raise _Unencodable(ValueError, "the value at {path} contains itself (a reference "
                                           "cycle)")
        self.open.add(id(value))
        key: Any = None
        try:
            if isinstance(value, dict):
                self.put(b"d" + _U8.pack(len(value)))
                for key, item in value.items():
                    if isinstance(key, bool) or not isinstance(key, (str, int)):
                        error = _Unencodable(TypeError, f"cannot send a dict key of type "
                                                        f"{_type_name(key)} ({key!r:.40}) in the "
                                                        f"dict at {{path}}: keys must be str or "
                                                        f"int")
                        error.in_this_container = True
                        raise error
                    self.value(key, depth + 1)
                    self.value(item, depth + 1)
            else:
                self.put((b"l" if isinstance(value, list) else b"t") + _U8.pack(len(value)))
                for key, item in enumerate(value):
                    self.value(item, depth + 1)
        except _Unencodable as exc:
            if exc.in_this_container:
                exc.in_this_container = False
            else:
                exc.keys.append(key)
            raise
        finally:
            self.open.discard(id(value))


def _render_path(name: str, keys: List[Any]) -> str:
    """``name['a'][3]`` from the keys collected innermost first (long paths elided)."""
    parts = [f"[{key!r}]" for key in reversed(keys)]
    if len(parts) > 16:
        parts = parts[:8] + [f"...({len(parts) - 12} more)..."] + parts[-4:]
    return name + "".join(parts)


def _type_name(value: Any) -> str:
    kind = type(value)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def encode(obj: Any, name: str = "obj") -> np.ndarray:
    """The bytes of ``obj`` as a new, writable uint8 array.

    Args:
        obj: the value (see the module docstring for what it may contain).
        name: what to call the value in error messages (``obj``, ``objs[2]``...).

    Raises:
        TypeError: a part of ``obj`` has a type the codec does not carry; the message names
            the type and its path, e.g. ``obj['layers'][3]``.
        ValueError: ``obj`` contains itself, is nested too deeply, or holds a str that is
            not valid Unicode.
    """
    encoder = _Encoder()
    try:
        encoder.value(obj, 0)
    except _Unencodable as exc:
        raise exc.kind(exc.message.replace("{path}", _render_path(name, exc.keys))) from None
    parts = encoder.finish()
    out = np.empty(encoder.size, dtype=np.uint8)
    position = 0
    for part in parts:
        size = len(part)
        out[position:position + size] = part if isinstance(part, np.ndarray) else \
            np.frombuffer(part, dtype=np.uint8)
        position += size
    return out


class _Decoder:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.position = 0

    def take(self, count: int) -> memoryview:
        end = self.position + count
        if count < 0 or end > len(self.data):
            raise ValueError(f"object data is truncated: {count} bytes needed at offset "
                             f"{self.position} of {len(self.data)}")
        chunk = self.data[self.position:end]
        self.position = end
        return chunk

    def u8(self) -> int:
        return _U8.unpack(self.take(8))[0]

    def count(self, minimum_bytes_each: int) -> int:
        count = self.u8()
        if count * minimum_bytes_each > len(self.data) - self.position:
            raise ValueError(f"object data is corrupt: a count of {count} at offset "
                             f"{self.position - 8} exceeds the data")
        return count

    def dtype(self) -> np.dtype:
        code = self.take(1)[0]
        try:
            return _numpy_dtype(dtype_from_code(code))
        except KeyError:
            raise ValueError(f"object data is corrupt: unknown dtype code {code}") from None

    def value(self, depth: int) -> Any:
        data, position = self.data, self.position
        if position + 9 <= len(data):  # the common scalars, without bounds checks per field
            tag = data[position]
            if tag == 0x69:  # i
                self.position = position + 9
                return _I8.unpack_from(data, position + 1)[0]
            if tag == 0x66:  # f
                self.position = position + 9
                return _F8.unpack_from(data, position + 1)[0]
            if tag == 0x73:  # s
                end = position + 9 + _U8.unpack_from(data, position + 1)[0]
                if end <= len(data):
                    self.position = end
                    try:
                        return str(data[position + 9:end], "utf-8")
                    except UnicodeDecodeError as exc:
                        raise ValueError(f"object data is corrupt: {exc}") from None
        if position >= len(data):
            raise ValueError(f"object data is truncated at offset {position}")
        tag = data[position]
        self.position = position + 1
        if tag == 0x69:  # i
            return _I8.unpack(self.take(8))[0]
        if tag == 0x66:  # f
            return _F8.unpack(self.take(8))[0]
        if tag == 0x73:  # s
            try:
                return str(self.take(self.u8()), "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"object data is corrupt: {exc}") from None
        if tag == 0x4E:  # N
            return None
        if tag == 0x54:  # T
            return True
        if tag == 0x46:  # F
            return False
        if depth >= MAX_DEPTH and tag in (0x6C, 0x74, 0x64):
            raise ValueError(f"object data is nested deeper than {MAX_DEPTH} levels")
        if tag == 0x6C or tag == 0x74:  # l, t
            count = self.count(1)
            items = [self.value(depth + 1) for _ in range(count)]
            return items if tag == 0x6C else tuple(items)
        if tag == 0x64:  # d
            result = {}
            for _ in range(self.count(2)):
                key = self.value(depth + 1)
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise ValueError(f"object data is corrupt: a dict key of type "
                                     f"{type(key).__name__}")
                result[key] = self.value(depth + 1)
            return result
        if tag == 0x4A:  # J
            return int.from_bytes(self.take(self.u8()), "little", signed=True)
        if tag == 0x62:  # b
            return bytes(self.take(self.u8()))
        if tag == 0x61:  # a
            dtype = self.dtype()
            ndim = self.take(1)[0]
            shape = tuple(self.u8() for _ in range(ndim))
            count = 1
            for dim in shape:
                count *= dim
            raw = self.take(count * dtype.itemsize)
            return _from_little_endian(raw, dtype).reshape(shape)
        if tag == 0x67:  # g
            dtype = self.dtype()
            return _from_little_endian(self.take(dtype.itemsize), dtype)[0]
        raise ValueError(f"object data is corrupt: unknown tag {bytes((tag,))!r} at offset "
                         f"{position}")


def _from_little_endian(raw: memoryview, dtype: np.dtype) -> np.ndarray:
    """A new array (its own memory, writable) from little-endian bytes."""
    wire = dtype.newbyteorder("<") if dtype.byteorder in ("=", ">") else dtype
    return np.frombuffer(raw, dtype=wire).astype(dtype, copy=True)


def decode(data: Any) -> Any:
    """The value :func:`encode` made ``data`` (a uint8 array, bytes or memoryview) from.

    Raises:
        ValueError: the data is not a complete encoded value (wrong magic, truncated,
            unknown tag or dtype, bytes left over).
    """
    view = memoryview(np.ascontiguousarray(data, dtype=np.uint8)).cast("B") \
        if isinstance(data, np.ndarray) else memoryview(data).cast("B")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError(f"not gpucoll object data (starts with {bytes(view[:8])!r}, expected "
                         f"{MAGIC!r})")
    decoder = _Decoder(view)
    decoder.position = len(MAGIC)
    value = decoder.value(0)
    if decoder.position != len(view):
        raise ValueError(f"object data is corrupt: {len(view) - decoder.position} bytes left "
                         f"over after the value")
    return value


def split_lengths(lengths: Any) -> List[Tuple[int, int]]:
    """(start, stop) of each rank's part in a concatenation of parts of ``lengths`` bytes."""
    spans, start = [], 0
    for length in lengths:
        spans.append((start, start + int(length)))
        start += int(length)
    return spans
