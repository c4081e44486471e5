"""Test checkpoints rewritten: a GGUF copied with some metadata or tensors changed, and a safetensors file split
into its header and body (what the fuzz and error tests mutate)."""
import json
import pathlib
import struct

import gguf
import numpy as np


def rewrite_gguf(src, dst, metadata: dict | None = None, tensors=None) -> pathlib.Path:
    """src (a path or an open GGUFReader) written to dst, returned. metadata: key -> (value, value type, item
    type or None) in the key's place (appended when src lacks it), or None to drop the key. tensors: a function
    of src's {name: ReaderTensor} giving the {name: (numpy data, ggml type)} to write instead of src's."""
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
    metadata = metadata or {}
    writer = gguf.GGUFWriter(dst, "qwen35")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in metadata:
            if metadata[key] is not None:
                writer.add_key_value(key, *metadata[key])
            continue
        value_type = field.types[0]
        writer.add_key_value(key, field.contents(), value_type,
                             field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None)
    for key, change in metadata.items():
        if key not in reader.fields and change is not None:
            writer.add_key_value(key, *change)
    written = (tensors({t.name: t for t in reader.tensors}) if tensors is not None else
               {t.name: (np.asarray(t.data), t.tensor_type) for t in reader.tensors})
    for name, (data, data_type) in written.items():
        writer.add_tensor(name, data, raw_dtype=data_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(dst)


def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join_safetensors(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body
