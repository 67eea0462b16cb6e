"""A GGUF file's weights written again in another quantized type, for the benchmarks that compare
formats on the same weights (issue: "a Q8_0 file made from the same weights with the `gguf`
package's quantizer").

Each quantized tensor is dequantized and quantized again with ``gguf.quants``, the reference
quantizer llama.cpp's own Python tools use (``--type F32``: the dequantized values themselves, the
fp32 model the quality benchmark's peer reference runs on; ``F16``: them rounded to fp16); float
tensors (norms) are kept as they are, and so is the metadata (tokenizer, chat template,
hyperparameters). The result is cached beside the source,
keyed by its name, so that benchmark runs reuse it.

    python -m benchmarks.requantize_gguf models/default --type Q8_0 [--out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from engine_svc.models.model_path import resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".cache"


def requantized_path(src: Path, qtype: str) -> Path:
    return CACHE / f"{src.stem.split('.')[0]}.{qtype}-from-{src.stem.split('.')[-1]}.gguf"


def requantize(src: Path, qtype: str, out: Path | None = None) -> Path:
    """``src`` with every quantized tensor in ``qtype``; written once, then reused."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import dequantize, quantize

    target = GGMLQuantizationType[qtype]
    out = out or requantized_path(src, qtype)
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(src))
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    for t in reader.tensors:
        if t.tensor_type in floats:
            writer.add_tensor(t.name, np.array(t.data))
            continue
        weights = dequantize(np.array(t.data), t.tensor_type)
        if target in floats:  # written as a float array: the dequantized values, exactly in F32
            writer.add_tensor(t.name, quantize(weights, target))
        else:
            writer.add_tensor(t.name, quantize(weights, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .gguf file, or a directory holding one")
    ap.add_argument(
        "--type",
        default="Q8_0",
        help="a type gguf.quants writes: Q8_0, Q4_0, Q4_1, ..., or F32 / F16",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    src = resolve_model_path(args.model).gguf
    if src is None:
        raise SystemExit(f"{args.model}: no .gguf file there")
    print(requantize(src, args.type, args.out))


if __name__ == "__main__":
    main()
