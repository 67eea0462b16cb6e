"""Generate the Python stubs for everything under proto/ into the llmserve_proto package.

protoc emits absolute imports that mirror the proto paths (``from llmserve.v1 import x_pb2``);
they are rewritten to live under ``llmserve_proto`` so that the generated tree is a single package
and claims no generic top-level names such as ``engine``.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "proto"
OUT = ROOT / "llmserve_proto"


def main() -> int:
    protos = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.proto"))
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    if protos:
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "protoc",
            f"-I{SRC}",
            f"-I{include}",
            f"--python_out={OUT}",
            f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}",
            *protos,
        ]
        if protoc.main(args) != 0:
            print("protoc failed", file=sys.stderr)
            return 1
    top_packages = sorted({p.split("/")[0] for p in protos})
    pattern = re.compile(rf"^(from|import) ({'|'.join(map(re.escape, top_packages)) or '$^'})(\.|\s)", re.M)
    for path in OUT.rglob("*.py*"):
        text = path.read_text()
        path.write_text(pattern.sub(r"\1 llmserve_proto.\2\3", text))
    for d in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    print(f"generated {len(protos)} proto file(s) into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
