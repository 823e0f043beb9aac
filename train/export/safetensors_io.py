"""The safetensors file format, read and written with torch alone.

``export --safetensors`` writes any model's weights this way, and ``load_model`` reads
them (and the files transformers' ``save_pretrained`` writes), with or without the
``safetensors`` package: it comes with transformers (the hf extra), and a plain gpt or a
user's model must not need that extra for a format this simple. The layout (the
format's specification, huggingface/safetensors): an 8-byte little-endian header length
N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`` (padded with spaces to a multiple of 8), then the tensors'
raw little-endian bytes, offsets counted from the end of the header. Nothing in the file
is code: reading it runs nothing, unlike a pickle.

Reading maps the file (``torch.frombuffer`` over an mmap): a tensor costs no memory
until it is used.
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 << 20  # the reference implementation's limit


class FormatError(ValueError):
    """Not a safetensors file, or one this reader cannot map to torch tensors."""


def _raw(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in memory order (little-endian on every platform torch runs)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write(tensors: dict[str, torch.Tensor], file, metadata: dict[str, str] | None = None
          ) -> None:
    """``tensors`` into the open binary ``file``. Tensors sharing memory (tied weights)
    are written once each under every name: the format has no aliases."""
    if sys.byteorder != "little":
        raise FormatError("safetensors is little-endian; this machine is not")
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in NAMES:
            raise FormatError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write(struct.pack("<Q", len(text)))
    file.write(text)
    for tensor in tensors.values():
        file.write(_raw(tensor))


def read(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file at ``path``, mapped rather than read (FormatError when
    the file is no safetensors file or is cut short)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise FormatError("shorter than a header")
        # copy-on-write: torch.frombuffer wants a writable buffer; the file never changes
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (length,) = struct.unpack("<Q", mapped[:8])
    if not 2 <= length <= min(MAX_HEADER, size - 8):
        raise FormatError(f"header length {length} does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(mapped[8:8 + length]))
    except ValueError as exc:
        raise FormatError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object")
    start = 8 + length
    return {name: _tensor(name, entry, mapped, start, size)
            for name, entry in header.items() if name != "__metadata__"}


def _tensor(name: str, entry, mapped: mmap.mmap, start: int, size: int) -> torch.Tensor:
    try:
        dtype, shape = DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{name}: not a tensor entry (dtype, shape, data_offsets)") from None
    count = 1
    for n in shape:
        count *= n
    if begin < 0 or end - begin != count * dtype.itemsize or start + end > size:
        raise FormatError(f"{name}: its bytes [{begin}, {end}) do not fit its shape "
                          f"{shape} or the file")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapped, dtype=dtype, count=count,
                            offset=start + begin).reshape(shape)
